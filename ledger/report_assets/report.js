// The report page: reads the JSON that `ledger report` embedded and draws it with ECharts (inlined).
// window.__report tells a test (or a curious reader) what was drawn: the charts, when the first screen is
// drawn (ready) and when every chart is (complete), and what each draw took (timings).
(function () {
  "use strict";
  // timings: [what, ms]: the data's parse, the page's layout, each chart's draw, the first frame (for the bench).
  var t0 = performance.now();
  var data = JSON.parse(document.getElementById("report-data").textContent);
  var app = document.getElementById("app");
  var state = { charts: [], ready: false, complete: false, markers: 0, timings: [["parse", performance.now() - t0]],
    ready_ms: null, complete_ms: null };  // performance.now() (ms since navigation) of each moment
  window.__report = state;
  // mark(what): the milliseconds since the previous mark, under what.
  var lastMark = performance.now();
  function mark(what) {
    var now = performance.now();
    state.timings.push([what, Math.round((now - lastMark) * 10) / 10]);
    lastMark = now;
  }

  var KINDS = data.kinds;  // one definition, in ledger.report.MARKER_KINDS
  var RUN_COLORS = ["#2f6fde", "#e04f5f", "#12a594", "#f08c00", "#7048e8", "#475467"];
  var SUPERSEDED = data.superseded_color;

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    (children || []).forEach(function (c) {
      node.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    });
    return node;
  }
  function esc(text) {
    return String(text).replace(/[&<>"]/g, function (ch) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[ch];
    });
  }
  function kindOf(kind) { return KINDS[kind] || { label: kind, color: "#667085", symbol: "circle", row: 0.7 }; }
  function fmt(v) {
    if (v === null || v === undefined) return "–";
    if (typeof v !== "number") return String(v);
    var a = Math.abs(v);
    return a !== 0 && (a < 1e-3 || a >= 1e6) ? v.toExponential(3) : String(+v.toPrecision(5));
  }
  function section(title, note) {
    app.appendChild(el("h2", {}, [title]));
    if (note) app.appendChild(el("p", { class: "note" }, [note]));
  }
  // Drawing is queued: the page is laid out first, then the charts on the first screen are drawn (ready),
  // then the others one per task, so the page opens and answers input while the rest is drawn (complete;
  // live.js starts then). Each queued draw is [box, fn].
  var queued = [];
  function later(chart, fn) {
    var entry = state.charts.filter(function (c) { return c.chart === chart; })[0];
    queued.push([chart.getDom(), fn, entry ? entry.name : "?"]);
  }
  function drawQueued(q) {
    var t = performance.now();
    q[1]();
    state.timings.push([q[2], Math.round((performance.now() - t) * 10) / 10]);
  }
  function chartBox(name, cls) {
    var box = el("div", { class: "chart" + (cls ? " " + cls : ""), "data-chart": name });
    app.appendChild(box);
    var chart = echarts.init(box, null, { renderer: "canvas" });
    state.charts.push({ name: name, chart: chart, el: box });
    return chart;
  }
  function table(columns, rows, rowClass) {
    var head = el("tr", {}, columns.map(function (c) { return el("th", {}, [c[1]]); }));
    var body = rows.map(function (r) {
      var tr = el("tr", rowClass ? { class: rowClass(r) } : {}, columns.map(function (c) {
        var v = r[c[0]];
        return el("td", c[2] ? { class: c[2] } : {}, [v === null || v === undefined ? "" : String(v)]);
      }));
      return tr;
    });
    var t = el("table", {}, [el("thead", {}, [head]), el("tbody", {}, body)]);
    app.appendChild(t);
    return t;
  }
  function markerHtml(run, m) {
    var k = kindOf(m.kind);
    return "<b style='color:" + k.color + "'>" + esc(k.label) + "</b> · " + esc(run) + " · step " + m.step +
      (m.attempt ? " · attempt " + m.attempt : "") + (m.superseded ? " (superseded)" : "") +
      "<br><span style='white-space:normal'>" + esc(m.text) + "</span><br><span style='color:#667085'>" +
      esc(m.time) + "</span>";
  }

  var lo = Math.min.apply(null, data.runs.map(function (r) { return r.range[0]; }));
  var hi = Math.max.apply(null, data.runs.map(function (r) { return r.range[1]; }));
  var tooltip = {
    trigger: "item", confine: true, extraCssText: "max-width:520px",
    formatter: function (p) {
      if (p.data && p.data.marker) return markerHtml(p.data.run, p.data.marker);
      if (p.componentType === "markLine") return esc(p.name);
      if (Array.isArray(p.value)) return esc(p.seriesName) + "<br>step " + p.value[0] + ": " + fmt(p.value[1]);
      return esc(p.seriesName || p.name);
    }
  };
  function stepAxis(gridIndex) {
    return { type: "value", min: lo, max: hi, gridIndex: gridIndex || 0, name: "step", nameGap: 4,
      axisPointer: { show: true, type: "line", label: { show: true } },
      axisLabel: { formatter: function (v) { return v >= 10000 ? (v / 1000) + "k" : v; } } };
  }
  function zoom(axes) {
    return [{ type: "inside", xAxisIndex: axes, filterMode: "none" },
      { type: "slider", xAxisIndex: axes, filterMode: "none", height: 14, bottom: 4 }];
  }
  // The markers of every run: a symbol on a hidden 0..1 axis at the top of the plot, a vertical line through it.
  function markerSeries(yAxisIndex, xAxisIndex) {
    return data.runs.map(function (run) {
      return {
        type: "scatter", name: "events · " + run.run_id, xAxisIndex: xAxisIndex || 0, yAxisIndex: yAxisIndex,
        symbolSize: 11, z: 5,
        data: run.markers.map(function (m) {
          var k = kindOf(m.kind);
          return { value: [m.step, k.row], symbol: k.symbol, run: run.run_id, marker: m,
            itemStyle: { color: k.color, opacity: m.superseded ? 0.55 : 1 } };
        }),
        markLine: { silent: false, symbol: "none", label: { show: false }, animation: false,
          data: run.markers.filter(function (m) { return kindOf(m.kind).line !== false; }).map(function (m) {
            var k = kindOf(m.kind);
            return { xAxis: m.step, name: k.label + " at step " + m.step + ": " + m.text,
              lineStyle: { color: m.superseded ? SUPERSEDED : k.color, width: 1, opacity: 0.55,
                type: m.superseded ? "dotted" : "solid" } };
          }) }
      };
    });
  }
  function lineSeries(run, runIndex, segments, labelFor) {
    return segments.map(function (seg) {
      return {
        type: "line", name: labelFor(seg), showSymbol: false, sampling: "none", triggerLineEvent: true,
        z: seg.superseded ? 1 : 2,
        lineStyle: seg.superseded ? { color: SUPERSEDED, type: "dashed", width: 1 } : { color: RUN_COLORS[runIndex % RUN_COLORS.length], width: 1.5 },
        itemStyle: { color: seg.superseded ? SUPERSEDED : RUN_COLORS[runIndex % RUN_COLORS.length] },
        data: seg.x.map(function (x, i) { return [x, seg.y[i]]; })
      };
    });
  }

  // -------------------------------------------------------------------------------------- header
  document.getElementById("subtitle").textContent = "steps " + lo.toLocaleString() + "–" + hi.toLocaleString() +
    " · curves reduced to the min and max of " + data.buckets.toLocaleString() + " step buckets, every event kept exactly · generated " +
    data.generated_at;
  var legend = el("p", { class: "legend" }, Object.keys(KINDS).map(function (k) {
    return el("span", {}, [el("i", { style: "background:" + KINDS[k].color }), KINDS[k].label]);
  }).concat([el("span", {}, [el("i", { style: "background:" + SUPERSEDED }), "superseded (earlier attempt, dashed)"])]));
  app.appendChild(legend);
  if (data.runs.length > 1) {
    app.appendChild(el("p", { class: "legend" }, data.runs.map(function (run, i) {
      return el("span", {}, [el("i", { style: "background:" + RUN_COLORS[i % RUN_COLORS.length] }), run.run_id]);
    })));
  }

  // -------------------------------------------------------------------------------------- curves
  section("Training curves", "Hover a marker for what happened; drag or scroll to zoom (all curves follow).");
  var curveCharts = [];
  data.curves.forEach(function (curve) {
    var series = [];
    data.runs.forEach(function (run, i) {
      series = series.concat(lineSeries(run, i, run.series[curve.name] || [], function (seg) {
        return run.run_id + " · attempt " + seg.attempt + (seg.superseded ? " (superseded)" : "") + " · " + curve.label;
      }));
    });
    var chart = chartBox("curve:" + curve.name);
    later(chart, function () { chart.setOption({
      animation: false, tooltip: tooltip,
      title: { text: curve.label, left: 8, top: 4, textStyle: { fontSize: 13 } },
      grid: { left: 64, right: 24, top: 30, bottom: 44 },
      xAxis: stepAxis(), yAxis: [{ type: "value", scale: true }, { type: "value", min: 0, max: 1, show: false }],
      dataZoom: zoom([0]), series: series.concat(markerSeries(1))
    }); });
    curveCharts.push(chart);
  });

  // -------------------------------------------------------------------------------------- router
  section("Token dropping", "Per-layer drop rate (mean per step bucket), and the mean over layers with the capacity factor live at each step under it.");
  data.runs.forEach(function (run) {
    var r = run.router;
    var chart = chartBox("drop-heatmap:" + run.run_id, "tall");
    var max = 0;
    r.drop_cells.forEach(function (c) { if (c[2] > max) max = c[2]; });
    var layerIndex = {};
    r.layers.forEach(function (l, i) { layerIndex[l] = i; });
    later(chart, function () { chart.setOption({
      animation: false,
      title: { text: "drop rate by layer · " + run.run_id + (r.layers.length ? "" : " (no router statistics)"), left: 8, top: 4, textStyle: { fontSize: 13 } },
      tooltip: { confine: true, formatter: function (p) { return "layer " + r.layers[p.value[1]] + ", steps from " + r.heat_bucket_steps[p.value[0]] + ": drop rate " + fmt(p.value[2]); } },
      grid: { left: 64, right: 90, top: 30, bottom: 30 },
      xAxis: { type: "category", data: r.heat_bucket_steps, name: "step", axisLabel: { interval: Math.max(0, Math.floor(r.heat_bucket_steps.length / 8) - 1) } },
      yAxis: { type: "category", data: r.layers, name: "layer", nameLocation: "middle", nameGap: 40 },
      visualMap: { min: 0, max: max || 1, calculable: true, precision: 3, orient: "vertical", right: 4, top: 30, itemHeight: 120, inRange: { color: ["#f7fbff", "#fdae6b", "#e6550d", "#7f2704"] } },
      series: [{ type: "heatmap", data: r.drop_cells.map(function (c) { return [c[0], layerIndex[c[1]], c[2]]; }), progressive: 0 }]
    }); });
  });
  (function () {
    var chart = chartBox("mean-drop", "tall");
    var series = [];
    data.runs.forEach(function (run, i) {
      var color = RUN_COLORS[i % RUN_COLORS.length];
      series.push({ type: "line", name: run.run_id + " · mean drop rate", showSymbol: false, sampling: "none", triggerLineEvent: true,
        lineStyle: { color: color }, itemStyle: { color: color },
        data: run.router.mean_drop.x.map(function (x, j) { return [x, run.router.mean_drop.y[j]]; }) });
      var cap = run.router.capacity;
      series.push({ type: "line", name: run.run_id + " · capacity factor", step: "end", xAxisIndex: 1, yAxisIndex: 2,
        showSymbol: true, symbolSize: 5, lineStyle: { color: color, width: 2 }, itemStyle: { color: color },
        label: { show: true, position: "top", fontSize: 10, formatter: function (p) {
          var j = p.dataIndex; return j > 0 && j === cap.x.length - 1 ? "" : "cf " + fmt(p.value[1]) + " · " + (cap.dispatcher[j] || "");
        } },
        data: cap.x.map(function (x, j) { return [x, cap.capacity_factor[j]]; }) });
    });
    var markers = markerSeries(1);
    later(chart, function () { chart.setOption({
      animation: false, tooltip: tooltip,
      title: { text: "mean token-drop rate, and capacity factor / dispatcher (step function)", left: 8, top: 4, textStyle: { fontSize: 13 } },
      grid: [{ left: 64, right: 24, top: 30, height: "52%" }, { left: 64, right: 24, top: "72%", bottom: 40 }],
      xAxis: [stepAxis(0), stepAxis(1)],
      yAxis: [{ type: "value", scale: true, gridIndex: 0 }, { type: "value", min: 0, max: 1, show: false, gridIndex: 0 },
        { type: "value", scale: true, gridIndex: 1, splitNumber: 2 }],
      dataZoom: zoom([0, 1]), series: series.concat(markers)
    }); });
    curveCharts.push(chart);
  })();

  // -------------------------------------------------------------------------------------- experts
  section("Expert load", "Tokens routed to each expert of each layer at a logged step, and the load imbalance (max/mean over experts, averaged over layers) over time.");
  data.runs.forEach(function (run) {
    var r = run.router;
    var pick = el("select", { "data-run": run.run_id }, r.expert_steps.map(function (s) {
      var o = el("option", { value: String(s) }, ["step " + s]);
      if (s === r.expert_step) o.selected = true;
      return o;
    }));
    app.appendChild(el("p", { class: "note" }, [run.run_id + ": " + r.logged_expert_steps + " logged steps; showing ", pick]));
    var chart = chartBox("expert-load:" + run.run_id, "tall");
    function draw(step) {
      var rows = r.expert_load[String(step)] || [];
      var cells = [], max = 0, experts = 0;
      rows.forEach(function (row, li) {
        experts = Math.max(experts, row.length - 1);
        for (var e = 1; e < row.length; e++) { cells.push([e - 1, li, row[e]]); if (row[e] > max) max = row[e]; }
      });
      var xs = [];
      for (var e2 = 0; e2 < experts; e2++) xs.push(e2);
      chart.setOption({
        animation: false,
        title: { text: "expert load · " + run.run_id + (step !== null && step !== undefined ? " · step " + step : " (no expert counts logged)"), left: 8, top: 4, textStyle: { fontSize: 13 } },
        tooltip: { confine: true, formatter: function (p) { return "layer " + rows[p.value[1]][0] + ", expert " + p.value[0] + ": " + p.value[2] + " tokens"; } },
        grid: { left: 64, right: 90, top: 30, bottom: 30 },
        xAxis: { type: "category", data: xs, name: "expert" },
        yAxis: { type: "category", data: rows.map(function (row) { return row[0]; }), name: "layer", nameLocation: "middle", nameGap: 40 },
        visualMap: { min: 0, max: max || 1, calculable: true, right: 4, top: 30, itemHeight: 120, inRange: { color: ["#f7fcf5", "#74c476", "#238b45", "#00441b"] } },
        series: [{ type: "heatmap", data: cells, progressive: 0 }]
      }, true);
    }
    later(chart, function () { draw(r.expert_step); });
    pick.addEventListener("change", function () { draw(Number(pick.value)); });
  });
  (function () {
    var chart = chartBox("imbalance");
    var series = [];
    data.runs.forEach(function (run, i) {
      var color = RUN_COLORS[i % RUN_COLORS.length];
      // A symbol per logged step while there are few (thousands of them cost a draw and add nothing).
      series.push({ type: "line", name: run.run_id + " · imbalance (max/mean)", showSymbol: run.router.imbalance.x.length <= 400, symbolSize: 3, sampling: "none",
        lineStyle: { color: color }, itemStyle: { color: color },
        data: run.router.imbalance.x.map(function (x, j) { return [x, run.router.imbalance.y[j]]; }) });
    });
    later(chart, function () { chart.setOption({
      animation: false, tooltip: tooltip,
      title: { text: "expert load imbalance (max/mean)", left: 8, top: 4, textStyle: { fontSize: 13 } },
      grid: { left: 64, right: 24, top: 30, bottom: 44 },
      xAxis: stepAxis(), yAxis: [{ type: "value", scale: true }, { type: "value", min: 0, max: 1, show: false }],
      dataZoom: zoom([0]), series: series.concat(markerSeries(1))
    }); });
    curveCharts.push(chart);
  })();
  // Zoom follows across the step charts (tooltips stay on the chart the pointer is on).
  curveCharts.forEach(function (source) {
    source.on("datazoom", function () {
      var z = source.getOption().dataZoom[0];
      curveCharts.forEach(function (other) {
        if (other !== source) other.dispatchAction({ type: "dataZoom", start: z.start, end: z.end }, { silent: true });
      });
    });
  });

  // -------------------------------------------------------------------------------------- attempts
  section("Attempts", "Each launch or resume, the steps it ran (grey: steps a later attempt replaced), how it ended.");
  (function () {
    var rows = [];
    data.runs.forEach(function (run, i) {
      run.attempts.forEach(function (a) { rows.push({ run: run.run_id, runIndex: i, a: a }); });
    });
    var labels = rows.map(function (x) { return x.run + " #" + x.a.attempt; });
    var chart = chartBox("attempts", "short");
    later(chart, function () { chart.setOption({
      animation: false,
      tooltip: { confine: true, formatter: function (p) {
        var a = rows[p.dataIndex].a;
        return esc(labels[p.dataIndex]) + " (" + a.kind + ")<br>steps " + a.start_step + "–" + a.end_step + "<br>" + esc(a.ended) +
          "<br>commit " + esc(a.commit) + " · host " + esc(a.host || "?") + (a.job ? " · job " + esc(a.job) : "") + "<br>" + esc(a.started_at || "") + " → " + esc(a.ended_at || "");
      } },
      grid: { left: 140, right: 24, top: 14, bottom: 30 },
      xAxis: stepAxis(), yAxis: { type: "category", data: labels, inverse: true },
      series: [{
        type: "custom", encode: { x: [1, 2], y: 0 },
        data: rows.map(function (x, j) {
          var a = x.a, live = a.superseded_after === null ? a.end_step : Math.min(a.end_step, a.superseded_after);
          return [j, a.start_step, a.end_step, live, x.runIndex, /crash/.test(a.ended) ? 1 : 0];
        }),
        renderItem: function (params, api) {
          var y = api.value(0), start = api.coord([api.value(1), y]), end = api.coord([api.value(2), y]), live = api.coord([api.value(3), y]);
          var h = api.size([0, 1])[1] * 0.5, color = RUN_COLORS[api.value(4) % RUN_COLORS.length];
          var children = [
            { type: "rect", shape: { x: start[0], y: start[1] - h / 2, width: Math.max(live[0] - start[0], 2), height: h }, style: { fill: color } },
            { type: "rect", shape: { x: live[0], y: start[1] - h / 2, width: Math.max(end[0] - live[0], 0), height: h }, style: { fill: SUPERSEDED } }
          ];
          if (api.value(5)) children.push({ type: "rect", shape: { x: end[0] - 2, y: start[1] - h / 2 - 3, width: 4, height: h + 6 }, style: { fill: KINDS["run.crashed"].color } });
          return { type: "group", children: children };
        }
      }]
    }); });
    table([["run", "run"], ["attempt", "attempt"], ["kind", "kind"], ["start_step", "start step"], ["end_step", "last step"],
      ["started_at", "started"], ["ended_at", "last event"], ["ended", "how it ended"], ["commit", "commit", "mono"], ["host", "host"], ["job", "job"]],
      rows.map(function (x) { return Object.assign({ run: x.run }, x.a); }));
  })();

  // -------------------------------------------------------------------------------------- lineage
  var lineage = [];
  data.runs.forEach(function (run) {
    if ((run.lineage || []).length > 1) {
      run.lineage.forEach(function (m) { lineage.push(Object.assign({ run: run.run_id }, m)); });
    }
  });
  if (lineage.length) {
    section("Lineage", "The run across run ids, eldest first: each relaunch under a new id goes on from its parent at a step; " +
      "each step comes from the run id that supplies it (the lineage view).");
    table([["run", "run"], ["run_id", "run id"], ["parent_run", "goes on from"], ["fork_step", "at step"],
      ["from_step", "supplies from"], ["to_step", "to"], ["started_at", "started"]], lineage);
  }

  // -------------------------------------------------------------------------------------- changes, events
  section("Config changes", "Live changes, accepted or refused, with their RFC 6902 patch and cause.");
  var changes = [];
  data.runs.forEach(function (run) {
    run.config_changes.forEach(function (c) { changes.push(Object.assign({ run: run.run_id }, c)); });
  });
  table([["run", "run"], ["step", "step"], ["attempt", "attempt"], ["accepted", "accepted"], ["patch", "patch", "mono"],
    ["cause_kind", "cause"], ["cause_detail", "detail"], ["actor", "person"], ["commit_sha", "commit", "mono"], ["reason", "refused because"]], changes);

  section("Events", "Every event in the range, exactly (never reduced): these are the markers on the curves.");
  var events = [];
  data.runs.forEach(function (run) {
    run.markers.forEach(function (m) { events.push(Object.assign({ run: run.run_id, what: kindOf(m.kind).label }, m)); });
  });
  state.markers = events.length;
  var eventsTable = table([["run", "run"], ["step", "step"], ["attempt", "attempt"], ["what", "what"], ["text", "detail"], ["time", "time"]],
    events, function (m) { return m.superseded ? "superseded" : ""; });
  eventsTable.setAttribute("id", "events");

  // -------------------------------------------------------------------------------------- record
  section("The record", "Each stream's size and Merkle root, and whether its latest signed checkpoint matches what is on disk.");
  var rec = data.record;
  table([["stream", "stream"], ["size", "events"], ["root", "Merkle root (RFC 6962)", "mono"], ["signed_size", "signed size"], ["checkpoint", "latest signed checkpoint"]],
    rec.streams);
  Array.prototype.forEach.call(app.querySelectorAll("table:last-of-type td:last-child"), function (td) {
    td.className = /^FAILS/.test(td.textContent) ? "bad" : /^matches/.test(td.textContent) ? "ok" : "";
  });
  app.appendChild(el("p", { class: "note" }, ["Check it yourself (every event, every table, every signature):"]));
  app.appendChild(el("pre", { class: "cmd", id: "verify-command" }, [rec.command + "\n" + rec.verifier]));
  var raw = data.runs.map(function (run) {
    return run.run_id + ": " + run.raw_points.metric_rows.toLocaleString() + " curve points and " +
      run.raw_points.layer_rows.toLocaleString() + " router rows reduced for this page";
  }).join("; ");
  app.appendChild(el("p", { class: "note" }, [raw]));

  window.addEventListener("resize", function () { state.charts.forEach(function (c) { c.chart.resize(); }); });
  // The first screen's charts now, then a frame (ready), then the rest one per task (complete).
  var firstScreen = queued.filter(function (q) { return q[0].getBoundingClientRect().top < window.innerHeight; });
  var rest = queued.filter(function (q) { return firstScreen.indexOf(q) < 0; });
  mark("layout");
  firstScreen.forEach(drawQueued);
  mark("first screen");
  requestAnimationFrame(function () {
    mark("first frame");
    state.ready_ms = performance.now();
    state.ready = true;
    (function next() {
      if (!rest.length) {
        state.complete_ms = performance.now();
        state.complete = true;
        document.dispatchEvent(new Event("report-complete"));
        return;
      }
      drawQueued(rest.shift());
      setTimeout(next, 0);
    })();
  });
})();
