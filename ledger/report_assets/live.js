// The live part of `ledger serve page`: the run's state and record now, and the Server-Sent Events
// of /runs/<run>/events drawn onto the charts report.js drew. Every ledger text goes in with
// textContent (or, in chart tooltips, through report.js's esc), never as markup.
// window.__live tells a test (or a curious reader) what arrived: every event id, in order.
(function () {
  "use strict";
  var live = JSON.parse(document.getElementById("live-data").textContent);
  var data = JSON.parse(document.getElementById("report-data").textContent);
  var KINDS = data.kinds;
  var report = window.__report || { charts: [] };
  var state = { ids: [], last: live.after, duplicates: 0, gaps: 0, points: 0, markers: 0, connected: false,
    ledgerOk: true, record: live.record, state: live.state, opened: 0 };
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
      ["signed root (RFC 6962)", r.root, "mono"], ["signed by", (r.signers || []).join(", ") || "–"],
      ["witness cosignatures", (r.signers || []).length > 1 ? (r.signers.length - 1) + " besides the ledger's" : "none"],
      ["live from leaf", state.last + 1]
    ]));
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
    series[key] = { chart: chart, name: name, data: found ? (found.data || []).slice() : [], style: found ? null : style, dirty: false };
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
    Object.keys(series).forEach(function (key) {
      var s = series[key];
      if (!s.dirty) return;
      s.dirty = false;
      var opt = Object.assign({ name: s.name, data: s.data }, s.style || {});
      s.style = null;  // created: merged by name from now on
      s.chart.setOption({ series: [opt] });
    });
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
    live.curves.forEach(function (curve) {
      var v = m.values[curve.name];
      if (v === undefined || v === null) return;
      if (append("curve:" + curve.name, run + " · attempt " + m.attempt + " · " + curve.label, lineStyle(), [m.step, v], m.step)) state.points++;
    });
  }
  function onRouter(m) {
    if (m.step === null || m.mean_drop === null) return;
    hi = Math.max(hi, m.step);
    append("mean-drop", run + " · mean drop rate", lineStyle(), [m.step, m.mean_drop], m.step);
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
})();
