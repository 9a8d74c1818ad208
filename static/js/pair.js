// A/B pair page: polls the pair endpoint (2 s while visible and a run is active, 15 s hidden) and
// overlays the TLT run and its baseline by step and by wall-clock (summed step times).
(function () {
  "use strict";
  var root = document.getElementById("pair");
  var url = root.dataset.pairUrl;
  var timer = null;
  var CONFIG = { responsive: true, displaylogo: false };
  var COLOR = { tlt: "#2f5fd0", baseline: "#8a8f98" };
  var METRICS = [["reward", "Reward"], ["accuracy", "Accuracy"], ["length", "Mean response length (tokens)"]];

  function ratio(v) { return v === null || v === undefined ? "—" : v.toFixed(2) + "×"; }
  function pct(v) { return v === null || v === undefined ? "—" : Math.round(100 * v) + "%"; }
  function sci(v) { return v === null || v === undefined ? "—" : v.toExponential(2); }
  function state(id, s) {
    var el = document.querySelector("#" + id + " .state");
    if (el) { el.className = "state state-" + s; el.textContent = s.charAt(0).toUpperCase() + s.slice(1); }
  }
  function set(id, text) { var el = document.getElementById(id); if (el) el.textContent = text; }

  function traces(data, key, xkey) {
    return ["tlt", "baseline"].map(function (side) {
      var c = data[side];
      return { type: "scatter", mode: "lines+markers", connectgaps: false, name: (side === "tlt" ? "TLT · " : "baseline · ") + c.name,
        x: c[xkey], y: c[key], line: { color: COLOR[side] } };
    });
  }

  function render(data) {
    METRICS.forEach(function (m) {
      ["step", "wall"].forEach(function (x) {
        var xkey = x === "step" ? "step" : "wall_s";
        Plotly.react("chart-pair-" + m[0] + "-" + x, traces(data, m[0], xkey), {
          title: { text: m[1] + (x === "step" ? " by step" : " by wall-clock"), font: { size: 14 } },
          margin: { t: 44, r: 30, b: 70, l: 50 }, legend: { orientation: "h", y: -0.3 }, font: { size: 11 },
          xaxis: x === "step" ? { title: { text: "step" }, dtick: data.tlt.step.length <= 12 ? 1 : undefined }
            : { title: { text: "seconds of training" } }
        }, CONFIG);
      });
    });
    set("fig-e2e", ratio(data.e2e_speedup));
    set("fig-steps", String(data.steps_compared));
    set("fig-mismatch-tlt", sci(data.logprob_mismatch_max.tlt));
    set("fig-mismatch-base", sci(data.logprob_mismatch_max.baseline));
    state("pair-tlt-state", data.tlt.state);
    state("pair-base-state", data.baseline.state);
    set("fig-rollout", ratio(data.rollout_speedup));
    set("fig-bound", ratio(data.amdahl_bound));
    set("fig-share", pct(data.rollout_share));
    set("fig-efficiency", pct(data.e2e_efficiency));
    set("fig-idle", data.idle_reclaimed_s.toFixed(1) + " s");
    set("fig-idle-total", data.idle_worker_s.toFixed(1));
    var p = data.reward_parity;
    set("fig-parity", p.verdict);
    document.getElementById("fig-parity").className = p.within_noise === true ? "verdict-within" : p.within_noise === false ? "verdict-differs" : "";
    set("fig-parity-p", p.p_value === null ? "—" : p.p_value.toFixed(3));
    set("fig-parity-n", String(p.steps));
    var active = ["queued", "running"];
    return active.indexOf(data.tlt.state) >= 0 || active.indexOf(data.baseline.state) >= 0;
  }

  function poll() {
    fetch(url, { credentials: "same-origin" })
      .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); })
      .then(function (data) { schedule(render(data)); })
      .catch(function () { schedule(true); });
  }
  function schedule(active) {
    window.clearTimeout(timer);
    if (!active) return;
    timer = window.setTimeout(poll, document.hidden ? 15000 : 2000);
  }
  document.addEventListener("visibilitychange", function () { if (!document.hidden) poll(); });
  poll();
})();
