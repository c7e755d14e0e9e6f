// The live part of `ledger serve page`: the run's state and record now, and the Server-Sent Events
// of /runs/<run>/events drawn onto the charts report.js drew. Every ledger text goes in with
// textContent (or, in chart tooltips, through report.js's esc), never as markup.
// window.__live tells a test (or a curious reader) what arrived: every event id, in order.
// Live as well: the per-layer drop heatmap (new step buckets), the attempts timeline (a launch adds
// a row, a crash or finish ends one) and superseded steps (a resume from step S greys every earlier
// attempt's points, markers and event rows after S, as the report draws them).
// It starts when report.js has drawn every chart (it draws the first screen first, the rest after).
(function () {
  "use strict";
  if (window.__report && !window.__report.complete) document.addEventListener("report-complete", start, { once: true });
  else start();
  function start() {
    var live = JSON.parse(document.getElementById("live-data").textContent);
    var data = JSON.parse(document.getElementById("report-data").textContent);
    var KINDS = data.kinds;
    var report = window.__report || { charts: [] };
    var state = { ids: [], last: live.after, duplicates: 0, gaps: 0, points: 0, markers: 0, connected: false,
      ledgerOk: true, record: live.record, state: live.state, opened: 0, heatSteps: 0, superseded: [],
      drawn: [] };  // [last id drawn, Date.now()] per redraw (the newest 1,000): the bench's commit → point
    window.__live = state;
    var statusEl = document.getElementById("live-status");
    var run = live.run_id;
    var hi = data.runs.length ? data.runs[0].range[1] : 0;

    function el(tag, attrs, children) {
      var node = document.createElement(tag);
      Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
      (children || []).forEach(function (c) {
        node.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
      });
      return node;
    }
    function text(v) { return v === null || v === undefined ? "" : typeof v === "object" ? JSON.stringify(v) : String(v); }
    function setStatus(message, stale) {
      statusEl.textContent = message;
      statusEl.className = stale ? "stale" : "live";
      document.body.classList.toggle("stale", !!stale);
    }
    function since() { return new Date().toISOString().replace(/\.\d+Z$/, "Z"); }

    // ------------------------------------------------------------------------------ state and record now
    var now = document.getElementById("now");
    function rowsTable(id, rows) {
      return el("table", { id: id }, [el("tbody", {}, rows.map(function (r) {
        return el("tr", {}, [el("th", {}, [r[0]]), el("td", r[2] ? { class: r[2] } : {}, [text(r[1])])]);
      }))]);
    }
    function drawNow() {
      var s = state.state || {}, r = state.record || {}, ck = s.last_checkpoint;
      now.textContent = "";
      now.appendChild(el("h2", {}, ["State now"]));
      now.appendChild(rowsTable("state-now", [
        ["step", s.step], ["attempt", s.attempt + " of " + s.attempts],
        ["commit", text(s.git_commit) + (s.git_dirty ? " (dirty)" : ""), "mono"],
        ["config hash", s.config_hash, "mono"],
        ["last checkpoint", ck ? "step " + ck.step + " (attempt " + ck.attempt + ", " + text(ck.reason) + "): " + text(ck.path) : "none"],
        ["crashes", s.crashes], ["config changes", s.config_changes]
      ]));
      var details = el("details", {}, [el("summary", {}, ["config"]), el("pre", { id: "config" }, [JSON.stringify(s.config, null, 2)])]);
      now.appendChild(details);
      now.appendChild(el("h2", {}, ["The record this page answers from"]));
      var cls = /^FAILS/.test(r.checkpoint || "") ? "bad" : /^signed/.test(r.checkpoint || "") ? "ok" : "";
      now.appendChild(rowsTable("record-now", [
        ["stream", r.stream], ["events (leaves)", r.size], ["latest signed checkpoint", r.checkpoint, cls],
        ["signed root (RFC 6962)", r.root, "mono"], ["signed by", (r.signers || []).join(", ") || "–"]
      ].concat(cosignedRows("witness cosignatures", r.cosigned))
        .concat(r.newer ? [["newer checkpoint", r.newer, "bad"]] : [])
        .concat(publishedRows(r.published))
        .concat([["live from leaf", live.after + 1]])));
    }
    // Which witnesses' cosignatures verified (checked by the server against its --witness keys), and the quorum.
    function cosignedRows(label, c) {
      if (!c) return [[label, "none on this checkpoint (witnesses cosign the published log)"]];
      var rows = [[label, c.summary, c.witnesses.length && c.quorum && !c.quorum_met ? "bad" : c.quorum && c.quorum_met ? "ok" : ""]];
      c.witnesses.forEach(function (w) {
        rows.push(["  witness " + w.name, w.verified ? "cosignature verified" : "no valid cosignature", w.verified ? "ok" : "bad"]);
      });
      return rows;
    }
    function publishedRows(p) {
      if (!p) return [];
      return [["published checkpoint", "size " + p.size + " · " + p.dest + " · signed by " + (p.signers || []).join(", ")]]
        .concat(cosignedRows("its cosignatures", p.cosigned));
    }
    drawNow();

    // ------------------------------------------------------------------------------ points onto the charts
    function chartNamed(name) {
      for (var i = 0; i < report.charts.length; i++) if (report.charts[i].name === name) return report.charts[i].chart;
      return null;
    }
    var series = {};  // chart name + "\u0000" + series name → { chart, name, data, style, dirty }
    var pending = false;
    function seriesOf(chartName, name, style) {
      var key = chartName + "\u0000" + name;
      if (series[key]) return series[key];
      var chart = chartNamed(chartName);
      if (!chart) return null;
      var found = null;
      (chart.getOption().series || []).forEach(function (s) { if (s.name === name) found = s; });
      // A series made here gets an id: ECharts merges an option without a known id or name into the
      // chart's series by index, which would overwrite one of the report's.
      series[key] = { chart: chart, name: name, data: found ? (found.data || []).slice() : [], style: found ? null : style,
        id: found ? null : "live\u0000" + name, dirty: false };
      return series[key];
    }
    function append(chartName, name, style, point, x) {
      var s = seriesOf(chartName, name, style);
      if (!s) return false;
      var lastX = s.data.length ? (Array.isArray(s.data[s.data.length - 1]) ? s.data[s.data.length - 1][0] : s.data[s.data.length - 1].value[0]) : -Infinity;
      if (style && style.type === "line" && lastX >= x) return false;  // drawn already: the page was built after it
      s.data.push(point);
      s.dirty = true;
      if (!pending) { pending = true; setTimeout(flush, 100); }
      return true;
    }
    function stepCharts() {
      return report.charts.filter(function (c) { return /^curve:|^mean-drop$|^imbalance$|^attempts$/.test(c.name); });
    }
    var axisHi = hi;
    function flush() {
      pending = false;
      state.drawn.push([state.last, Date.now()]);
      if (state.drawn.length > 1000) state.drawn.shift();
      Object.keys(series).forEach(function (key) {
        var s = series[key];
        if (!s.dirty) return;
        s.dirty = false;
        var opt = Object.assign(s.id ? { id: s.id } : {}, { name: s.name, data: s.data }, s.style || {});
        s.style = null;  // created: merged by name from now on
        s.chart.setOption({ series: [opt] });
      });
      heatFlush();
      attemptsFlush();
      if (hi > axisHi) {
        axisHi = hi;
        stepCharts().forEach(function (c) {
          var axes = (c.chart.getOption().xAxis || []).map(function () { return { max: hi }; });
          c.chart.setOption({ xAxis: axes });
        });
      }
    }
    function lineStyle() {
      return { type: "line", showSymbol: false, sampling: "none", z: 2, lineStyle: { color: "#2f6fde", width: 1.5 }, itemStyle: { color: "#2f6fde" } };
    }
    function onStep(m) {
      if (m.step === null || m.step === undefined) return;
      hi = Math.max(hi, m.step);
      attemptReached(m.attempt, m.step);
      live.curves.forEach(function (curve) {
        var v = m.values[curve.name];
        if (v === undefined || v === null) return;
        if (append("curve:" + curve.name, run + " · attempt " + m.attempt + " · " + curve.label, lineStyle(), [m.step, v], m.step)) state.points++;
      });
    }
    function onRouter(m) {
      if (m.step === null) return;
      hi = Math.max(hi, m.step);
      heatStep(m.step, m.attempt, m.layers);
      if (m.mean_drop !== null) append("mean-drop", run + " · mean drop rate", lineStyle(), [m.step, m.mean_drop], m.step);
    }

    // ------------------------------------------------------------------------------ the drop heatmap, live
    // Buckets the page was built with stay as built; steps after them go to new buckets of the same
    // width (doubled when there are more than HEAT_MAX_LIVE), each the mean of its steps per layer, a
    // superseded step (an earlier attempt's, after a later one's resume) left out, as the report does.
    var HEAT_MAX_LIVE = 500;
    var router = data.runs.length ? data.runs[0].router : null;
    var heat = (function () {
      if (!router) return null;
      var built = router.heat_bucket_steps.slice(), lo = data.runs[0].range[0];
      var span = data.runs[0].range[1] - lo + 1;
      var width = built.length ? Math.max(1, Math.round(span / built.length)) : 1;
      return { chart: chartNamed("drop-heatmap:" + run), built: built, first: built.length ? data.runs[0].range[1] + 1 : null,
        width: width, layers: router.layers.slice(), steps: {}, dirty: false, max: 0,
        cells: router.drop_cells.map(function (c) { return [c[0], c[1], c[2]]; }) };
    })();
    if (heat) heat.cells.forEach(function (c) { if (c[2] > heat.max) heat.max = c[2]; });
    function heatStep(step, attempt, layers) {
      if (!heat || !heat.chart) return;
      if (heat.first === null) heat.first = step;  // the page had no router rows: live buckets from here
      if (step < heat.first) return;  // inside the buckets the page was built with (a reload redraws them)
      heat.steps[step] = { attempt: attempt, layers: layers };
      state.heatSteps = Object.keys(heat.steps).length;
      heat.dirty = true;
      if (!pending) { pending = true; setTimeout(flush, 100); }
    }
    function heatFlush() {
      if (!heat || !heat.dirty) return;
      heat.dirty = false;
      var steps = Object.keys(heat.steps).map(Number), top = Math.max.apply(null, steps);
      while ((top - heat.first) / heat.width >= HEAT_MAX_LIVE) heat.width *= 2;
      var sums = {}, layerSet = {};
      heat.layers.forEach(function (l) { layerSet[l] = true; });
      steps.forEach(function (st) {
        var b = Math.floor((st - heat.first) / heat.width), row = heat.steps[st];
        Object.keys(row.layers).forEach(function (l) {
          var v = row.layers[l];
          if (v === null || v === undefined) return;
          layerSet[l] = true;
          var key = b + ":" + l;
          sums[key] = sums[key] || [b, Number(l), 0, 0];
          sums[key][2] += v; sums[key][3] += 1;
        });
      });
      heat.layers = Object.keys(layerSet).map(Number).sort(function (a, b) { return a - b; });
      var index = {};
      heat.layers.forEach(function (l, i) { index[l] = i; });
      var liveCount = Math.floor((top - heat.first) / heat.width) + 1, labels = heat.built.slice();
      for (var b = 0; b < liveCount; b++) labels.push(heat.first + b * heat.width);
      var cells = heat.cells.map(function (c) { return [c[0], index[c[1]], c[2]]; });
      Object.keys(sums).forEach(function (k) {
        var c = sums[k], v = c[2] / c[3];
        if (v > heat.max) heat.max = v;
        cells.push([heat.built.length + c[0], index[c[1]], v]);
      });
      heat.labels = labels;
      heat.chart.setOption({
        xAxis: { data: labels, axisLabel: { interval: Math.max(0, Math.floor(labels.length / 8) - 1) } },
        yAxis: { data: heat.layers }, visualMap: { max: heat.max || 1 },
        tooltip: { formatter: function (p) { return "layer " + heat.layers[p.value[1]] + ", steps from " + heat.labels[p.value[0]] + ": drop rate " + p.value[2]; } },
        series: [{ data: cells }]
      });
    }

    // ------------------------------------------------------------------------------ attempts, live
    var attempts = data.runs.length ? data.runs[0].attempts.map(function (a) { return Object.assign({}, a); }) : [];
    var attemptsDirty = false;
    function attemptOf(n) {
      for (var i = 0; i < attempts.length; i++) if (attempts[i].attempt === n) return attempts[i];
      return null;
    }
    function attemptReached(n, step) {
      var a = attemptOf(n);
      if (!a || step <= a.end_step) return;
      a.end_step = step;
      attemptsDirty = true;
    }
    function attemptsFlush() {
      if (!attemptsDirty) return;
      attemptsDirty = false;
      var chart = chartNamed("attempts");
      if (!chart) return;
      var labels = attempts.map(function (a) { return run + " #" + a.attempt; });
      chart.setOption({
        yAxis: { data: labels },
        series: [{ data: attempts.map(function (a, j) {
          var liveTo = a.superseded_after === null ? a.end_step : Math.min(a.end_step, a.superseded_after);
          return [j, a.start_step, a.end_step, liveTo, 0, /crash/.test(a.ended) ? 1 : 0];
        }) }]
      });
    }
    function onLaunch(a, time) {
      if (attemptOf(a.attempt)) return;
      attempts.forEach(function (b) {  // the report's attempts.superseded_after: the earliest later resume's step
        if (b.attempt < a.attempt && a.kind === "resume") {
          b.superseded_after = b.superseded_after === null ? a.start_step : Math.min(b.superseded_after, a.start_step);
        }
      });
      attempts.push(a);
      attemptsDirty = true;
      var table = document.querySelector('[data-chart="attempts"] + table tbody');
      if (table) {
        table.appendChild(el("tr", { "data-live": "1" }, [run, a.attempt, a.kind, a.start_step, a.end_step, a.started_at, a.ended_at,
          a.ended, a.commit, a.host, a.job].map(function (v, i) { return el("td", i === 8 ? { class: "mono" } : {}, [text(v)]); })));
      }
      if (a.kind === "resume") supersede(a.attempt, a.start_step);
    }
    function onEnded(n, how) {
      var a = attemptOf(n);
      if (!a) return;
      a.ended = how;
      attemptsDirty = true;
    }

    // ------------------------------------------------------------------------------ superseded, live
    function xOf(p) { return Array.isArray(p) ? p[0] : p.value[0]; }
    function supersededStyle() {
      return { type: "line", showSymbol: false, sampling: "none", z: 1, lineStyle: { color: data.superseded_color, type: "dashed", width: 1 },
        itemStyle: { color: data.superseded_color } };
    }
    // Attempt `attempt` resumed from step `from`: every earlier attempt's steps after it are superseded.
    function supersede(attempt, from) {
      state.superseded.push([attempt, from]);
      report.charts.forEach(function (c) {
        if (!/^curve:/.test(c.name)) return;
        var label = null;
        live.curves.forEach(function (cv) { if ("curve:" + cv.name === c.name) label = cv.label; });
        var names = (c.chart.getOption().series || []).map(function (s) { return s.name; });
        for (var a = 1; a < attempt; a++) {
          var name = run + " · attempt " + a + " · " + label;
          if (names.indexOf(name) < 0 && !series[c.name + "\u0000" + name]) continue;
          var s = seriesOf(c.name, name, lineStyle());
          var keep = s.data.filter(function (p) { return xOf(p) <= from; });
          var moved = s.data.filter(function (p) { return xOf(p) > from; });
          if (!moved.length) continue;
          s.data = keep; s.dirty = true;
          var g = seriesOf(c.name, run + " · attempt " + a + " (superseded) · " + label, supersededStyle());
          g.data = g.data.concat(moved).sort(function (p, q) { return xOf(p) - xOf(q); });
          g.dirty = true;
        }
      });
      // The mean drop rate is of the final lineage only: the superseded steps' points leave it.
      var md = seriesOf("mean-drop", run + " · mean drop rate", lineStyle());
      if (md) {
        md.data = md.data.filter(function (p) { return xOf(p) <= from; });
        md.dirty = true;
      }
      if (heat) {
        Object.keys(heat.steps).forEach(function (st) {
          if (Number(st) > from && heat.steps[st].attempt < attempt) delete heat.steps[st];
        });
        heat.dirty = true;
      }
      report.charts.forEach(function (c) {
        if (!/^curve:|^mean-drop$|^imbalance$/.test(c.name)) return;
        var names = (c.chart.getOption().series || []).map(function (s) { return s.name; });
        if (names.indexOf("events · " + run) < 0 && !series[c.name + "\u0000events · " + run]) return;
        var m = seriesOf(c.name, "events · " + run, null);
        m.data = m.data.map(function (p) {
          var mk = p.marker;
          if (!mk || mk.superseded || mk.attempt === null || mk.attempt >= attempt || mk.step <= from) return p;
          var copy = Object.assign({}, p, { marker: Object.assign({}, mk, { superseded: true }),
            itemStyle: Object.assign({}, p.itemStyle || {}, { opacity: 0.55 }) });
          return copy;
        });
        m.dirty = true;
      });
      Array.prototype.forEach.call(document.querySelectorAll("#events tbody tr"), function (tr) {
        var cells = tr.children, step = Number(cells[1].textContent), att = Number(cells[2].textContent);
        if (cells[2].textContent !== "" && att < attempt && step > from) tr.className = "superseded";
      });
      if (!pending) { pending = true; setTimeout(flush, 100); }
    }
    var eventsBody = null;
    function onMarker(m) {
      var mk = m.marker, k = KINDS[mk.kind] || { label: mk.kind, color: "#667085", symbol: "circle", row: 0.7 };
      hi = Math.max(hi, mk.step);
      var point = { value: [mk.step, k.row], symbol: k.symbol, run: run, marker: mk, itemStyle: { color: k.color } };
      report.charts.forEach(function (c) {
        if (/^curve:|^mean-drop$|^imbalance$/.test(c.name)) append(c.name, "events · " + run, null, point, mk.step);
      });
      eventsBody = eventsBody || document.querySelector("#events tbody");
      if (eventsBody) {
        eventsBody.appendChild(el("tr", { "data-live": "1" }, [run, String(mk.step), text(mk.attempt), k.label, text(mk.text), text(mk.time)].map(function (v) {
          return el("td", {}, [v]);
        })));
      }
      state.markers++;
      if (m.launch) onLaunch(m.launch, mk.time);
      else if (m.ended) onEnded(mk.attempt, m.ended);
      if (mk.attempt !== null) attemptReached(mk.attempt, mk.step);
    }

    // ------------------------------------------------------------------------------ the stream
    var source = null;
    function took(e) {
      var id = Number(e.lastEventId);
      if (id <= state.last) { state.duplicates++; return false; }  // never drawn twice
      if (id !== state.last + 1) state.gaps++;
      state.ids.push(id);
      state.last = id;
      return true;
    }
    function handler(draw) {
      return function (e) {
        if (!took(e)) return;
        try { draw(JSON.parse(e.data)); } catch (err) { state.error = String(err); }
      };
    }
    function connect() {
      state.opened++;
      source = new EventSource(live.events_url + "?after=" + state.last);
      source.onopen = function () { state.connected = true; if (state.ledgerOk) setStatus("live · following the ledger as it commits · from leaf " + (live.after + 1), false); };
      source.onerror = function () {
        state.connected = false;
        setStatus("disconnected from the server at " + since() + ": what this page shows is as of then, not current; reconnecting…", true);
        if (source.readyState === EventSource.CLOSED) {  // refused (a 503: full, or the ledger gone): try again later
          setTimeout(connect, 3000);
        }
      };
      source.addEventListener("step", handler(onStep));
      source.addEventListener("router", handler(onRouter));
      source.addEventListener("marker", handler(onMarker));
      source.addEventListener("other", handler(function () {}));
      source.addEventListener("state", function (e) { state.state = JSON.parse(e.data); drawNow(); });
      source.addEventListener("record", function (e) { state.record = JSON.parse(e.data); drawNow(); });
      source.addEventListener("ledger", function (e) {
        var m = JSON.parse(e.data);
        state.ledgerOk = m.ok;
        if (m.ok) setStatus("live · following the ledger as it commits", false);
        else setStatus("the ledger is unavailable (" + m.message + ") since " + since() + ": what this page shows is as of then, not current", true);
      });
    }
    connect();
    window.addEventListener("pagehide", function () { if (source) source.close(); });
  }
})();
