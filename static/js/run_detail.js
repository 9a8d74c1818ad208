// Run page: polls the metrics endpoint (every 2 s while the tab is visible, 15 s when hidden),
// extends the over-steps charts, draws the per-step charts for the step chosen on the slider,
// shows the trainer's setup progress (phase, done/total, ETA), and asks before cancelling.
(function () {
  "use strict";
  var root = document.getElementById("dashboard");
  var metricsUrl = root.dataset.metricsUrl;
  var stepUrl = root.dataset.stepUrl;
  var artifactsUrl = root.dataset.artifactsUrl;
  var artifactCount = document.querySelectorAll("#artifact-rows a.download").length;
  var wasActive = root.dataset.active === "1";
  var slider = document.getElementById("step-slider");
  var stepLabel = document.getElementById("step-label");
  var summary = document.getElementById("summary");

  var steps = [];            // [{step, scalars}] in step order
  var lastStep = -1;
  var follow = true;         // slider follows the newest step until the user moves it
  var shownStep = null;
  var seriesCache = {};
  var timer = null;
  var COLORS = { generate: "#2f5fd0", idle: "#c9ced6", drafter: "#1b8a4b", pack: "#e0a030" };
  var CONFIG = { responsive: true, displaylogo: false };

  function layout(title, extra) {
    var base = {
      title: { text: title, font: { size: 14 } }, margin: { t: 44, r: 40, b: 70, l: 50 },
      legend: { orientation: "h", y: -0.3 }, font: { size: 11 },
      xaxis: { title: { text: "step" }, dtick: steps.length <= 12 ? 1 : undefined }  // whole steps only
    };
    return Object.assign(base, extra || {});
  }
  // Every step on x; a step that did not measure `key` is null there, drawn as a gap (never a zero,
  // never a line bridging the steps around it).
  function col(key) {
    return {
      x: steps.map(function (r) { return r.step; }),
      y: steps.map(function (r) { var v = r.scalars[key]; return v === undefined ? null : v; })
    };
  }
  function line(key, name, extra) {
    var c = col(key);
    return Object.assign({ type: "scatter", mode: "lines+markers", connectgaps: false, name: name || key, x: c.x, y: c.y }, extra || {});
  }
  function bar(key, name, extra) {
    var c = col(key);
    return Object.assign({ type: "bar", name: name || key, x: c.x, y: c.y }, extra || {});
  }
  function sum(key) {
    return steps.reduce(function (a, r) { return a + (r.scalars[key] || 0); }, 0);
  }
  function draw(id, traces, lay) { Plotly.react(id, traces, lay, CONFIG); }

  function drawOverSteps() {
    draw("chart-reward", [line("reward/mean", "reward"), line("reward/accuracy", "accuracy")], layout("Reward & accuracy"));
    draw("chart-mismatch", [line("rollout/logprob_mismatch", "mean |Δ log-prob|"), line("rollout/logprob_mismatch_max", "max |Δ log-prob|")],
      layout("Rollout vs learner log-prob mismatch", { yaxis: { title: { text: "|Δ log-prob|" }, exponentformat: "e" } }));
    draw("chart-audit", [line("audit/greedy_identical", "greedy SD = plain", { line: { shape: "hv" } }),
      line("audit/acceptance_length", "acceptance on held-out prompts", { yaxis: "y2" })],
      layout("Greedy spot check at checkpoints", { yaxis: { range: [0, 1.05], title: { text: "share identical" } },
        yaxis2: { overlaying: "y", side: "right", title: { text: "acceptance" } } }));
    draw("chart-tail-frac", [bar("rollout/tail_time_frac", "after 90% finished", { marker: { color: "#c2362b" } })],
      layout("Share of rollout time in the long tail", { yaxis: { range: [0, 1], tickformat: ".0%" } }));
    draw("chart-lengths", [line("rollout/len_p50", "p50"), line("rollout/len_p90", "p90"),
      line("rollout/len_p99", "p99"), line("rollout/len_max", "max")], layout("Response length (tokens)"));
    // the arms the bandit picks move acceptance_length; the 4-deep chain figure holds the arm fixed;
    // per kind of draft, which drafter the picks relied on (a kind that never ran has no points)
    draw("chart-accept", [line("spec/acceptance_length", "acceptance length (arms as picked)"),
      line("spec/chain4_acceptance", "4-deep chain (arm fixed)"), line("spec/acceptance_chain", "drafter chains"),
      line("spec/acceptance_tree", "drafter trees"), line("spec/acceptance_ngram", "n-gram drafts"),
      line("spec/acceptance_hybrid", "n-gram, else drafter")],
      layout("Acceptance length (tokens / verify pass)"));
    draw("chart-drafter", [line("drafter/loss", "loss"), line("drafter/accuracy", "accuracy", { yaxis: "y2" })],
      layout("Drafter spot training", { yaxis: { title: { text: "loss" } }, yaxis2: { overlaying: "y", side: "right", range: [0, 1] } }));
    var idle = sum("idle/worker_s"), rec = sum("idle/reclaimed_s");
    draw("chart-idle", [bar("idle/worker_s", "idle", { marker: { color: COLORS.idle } }),
      bar("idle/reclaimed_s", "reclaimed for drafter", { marker: { color: COLORS.drafter } })],
      layout("Idle vs reclaimed worker-seconds<br><sub>total " + idle.toFixed(1) + " s idle, " + rec.toFixed(1) +
        " s reclaimed" + (idle > 0 ? " (" + Math.round(100 * rec / idle) + "%)" : "") + "</sub>", { barmode: "group" }));
    draw("chart-timing", ["rollout", "reward", "learner", "sync"].map(function (k) { return bar("timing_s/" + k, k); }),
      layout("Step time breakdown (s)", { barmode: "stack" }));
    draw("chart-tail", [line("rollout/tail_tokens_per_s_sd", "with SD"), line("rollout/tail_tokens_per_s_no_sd", "without SD")],
      layout("Tail tokens/s"));
  }

  function drawStep(rec) {
    var s = rec.series || {}, sc = rec.scalars || {};
    var label = " · step " + rec.step;
    draw("chart-lengths-hist", [{ type: "histogram", x: s["rollout/lengths"] || [], marker: { color: "#2f5fd0" } }],
      layout("Response lengths" + label, { xaxis: { title: { text: "tokens" } }, bargap: 0.05 }));

    var run = s["rollout/running"] || { t: [], running: [], sd: [] };
    var shapes = [], switchAt = sc["spec/switch_on_s"];
    if (switchAt === undefined || switchAt === null || switchAt < 0) {
      var i = (run.sd || []).indexOf(1);
      switchAt = i >= 0 ? run.t[i] : null;
    }
    if (switchAt !== null && switchAt >= 0) {
      shapes.push({ type: "line", x0: switchAt, x1: switchAt, yref: "paper", y0: 0, y1: 1, line: { color: "#c2362b", dash: "dot" } });
    }
    draw("chart-running", [{ type: "scatter", mode: "lines", line: { shape: "hv" }, name: "running", x: run.t, y: run.running }],
      layout("Running sequences over rollout time" + label, {
        xaxis: { title: { text: "seconds" } }, shapes: shapes,
        annotations: shapes.length ? [{ x: switchAt, yref: "paper", y: 1, text: "SD on", showarrow: false, xanchor: "left", font: { color: "#c2362b" } }] : []
      }));

    var pos = s["spec/accept_by_position"] || [];
    draw("chart-accept-pos", [{ type: "bar", x: pos.map(function (_, i) { return i + 1; }), y: pos }],
      layout("Acceptance by draft position" + label, { xaxis: { title: { text: "draft position" } }, yaxis: { range: [0, 1] } }));

    var strat = s["spec/strategy"] || {}, buckets = Object.keys(strat), arms = {};
    buckets.forEach(function (b) { Object.keys(strat[b]).forEach(function (a) { arms[a] = true; }); });
    draw("chart-strategy", Object.keys(arms).map(function (a) {
      return { type: "bar", name: a, x: buckets, y: buckets.map(function (b) { return strat[b][a] || 0; }) };
    }), layout("Strategy choices per batch-size bucket" + label, { barmode: "stack", xaxis: { title: { text: "batch-size bucket" }, type: "category" } }));

    // SD arm in force over rollout time, one step line per worker (OFF: no SD)
    var armNames = {};
    (s["spec/arm_timeline"] || []).forEach(function (w) { (w.arm || []).forEach(function (a) { armNames[a] = true; }); });
    var armList = Object.keys(armNames).sort(function (a, b) { return a === "off" ? -1 : b === "off" ? 1 : a < b ? -1 : 1; });
    var end = (run.t || []).length ? run.t[run.t.length - 1] : null;
    draw("chart-arms", (s["spec/arm_timeline"] || []).map(function (w) {
      var t = (w.t || []).slice(), a = (w.arm || []).slice();
      if (t.length && end !== null && end > t[t.length - 1]) { t.push(end); a.push(a[a.length - 1]); }
      return { type: "scatter", mode: "lines", line: { shape: "hv" }, name: "worker " + w.worker, x: t, y: a };
    }), layout("SD on/off and strategy over rollout time" + label, { xaxis: { title: { text: "seconds" } },
      yaxis: { type: "category", categoryorder: "array", categoryarray: armList } }));

    var mh = s["rollout/logprob_mismatch_hist"] || { edges: [], counts: [] };
    var binLabels = (mh.counts || []).map(function (_, i) {
      var lo = mh.edges[i], hi = mh.edges[i + 1];
      return (lo === 0 ? "0" : lo.toExponential(0)) + "–" + (hi === null || hi === undefined ? "∞" : hi.toExponential(0));
    });
    draw("chart-mismatch-hist", [{ type: "bar", x: binLabels, y: mh.counts || [], marker: { color: "#6b4fbb" } }],
      layout("|rollout − learner log-prob| per token" + label + (sc["spec/acceptance_length"] !== undefined ? " (SD on)" : " (SD off)"),
        { xaxis: { title: { text: "|Δ log-prob|" }, type: "category" }, yaxis: { title: { text: "tokens" } } }));

    var kinds = { generate: { x: [], y: [], base: [] }, idle: { x: [], y: [], base: [] }, pack: { x: [], y: [], base: [] },
      drafter: { x: [], y: [], base: [] } };
    (s["idle/timeline"] || []).forEach(function (w) {
      (w.segments || []).forEach(function (seg) {
        var k = kinds[seg[0]] || (kinds[seg[0]] = { x: [], y: [], base: [] });
        k.x.push(seg[2] - seg[1]); k.base.push(seg[1]); k.y.push("worker " + w.worker);
      });
    });
    draw("chart-timeline", Object.keys(kinds).map(function (k) {
      return { type: "bar", orientation: "h", name: k, x: kinds[k].x, y: kinds[k].y, base: kinds[k].base,
        marker: { color: COLORS[k] } };
    }), layout("Per-worker timeline" + label, { barmode: "overlay", xaxis: { title: { text: "seconds" } } }));
  }

  function showStep(step) {
    shownStep = step;
    stepLabel.textContent = follow ? step + " (latest)" : String(step);
    if (seriesCache[step]) { drawStep(seriesCache[step]); return; }
    fetch(stepUrl + step, { credentials: "same-origin" }).then(function (r) { return r.ok ? r.json() : null; })
      .then(function (rec) { if (rec) { seriesCache[step] = rec; if (shownStep === step) drawStep(rec); } });
  }

  function humanSize(n) {
    var units = ["bytes", "KB", "MB", "GB", "TB"], i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : n) + " " + units[i];
  }

  // New checkpoints (drafter, policy) appear in the table while the run goes on.
  function refreshArtifacts() {
    fetch(artifactsUrl, { credentials: "same-origin" }).then(function (r) { return r.ok ? r.json() : null; })
      .then(function (data) {
        if (!data || data.artifacts.length === artifactCount) return;
        artifactCount = data.artifacts.length;
        var body = document.getElementById("artifact-rows");
        body.textContent = "";
        data.artifacts.forEach(function (a) {
          var tr = document.createElement("tr");
          [a.kind, a.step, null, humanSize(a.size), null].forEach(function (v, i) {
            var td = document.createElement("td");
            if (i === 2) {
              var link = document.createElement("a");
              link.className = "download"; link.href = a.download_url; link.dataset.kind = a.kind; link.textContent = a.filename;
              td.appendChild(link);
            } else if (i === 4) {
              var code = document.createElement("code");
              code.className = "hash"; code.textContent = a.sha256;
              td.appendChild(code);
            } else {
              td.textContent = v;
            }
            tr.appendChild(td);
          });
          body.appendChild(tr);
        });
      });
  }

  var progressBox = document.getElementById("progress");
  var samplesLink = document.getElementById("samples-link");
  function duration(s) {
    s = Math.round(s);
    var pad = function (n) { return (n < 10 ? "0" : "") + n; };
    if (s < 60) return s + "s";
    if (s < 3600) return Math.floor(s / 60) + "m " + pad(s % 60) + "s";
    return Math.floor(s / 3600) + "h " + pad(Math.floor((s % 3600) / 60)) + "m";
  }
  function showProgress(p, active) {
    if (!p || !active) { progressBox.hidden = true; return; }
    progressBox.hidden = false;
    document.getElementById("progress-phase").textContent = p.phase === "rl" ? "RL step " + p.done + " of " + p.total : p.label;
    document.getElementById("progress-count").textContent = p.done + "/" + p.total;
    document.getElementById("progress-eta").textContent = p.eta_s !== null ? "ETA " + duration(p.eta_s) : "";
    document.getElementById("progress-bar").value = p.fraction !== null ? p.fraction : 0;
    document.getElementById("progress-message").textContent = p.message;
    var list = document.getElementById("progress-phases");
    list.textContent = "";
    p.history.forEach(function (h) {
      var li = document.createElement("li");
      li.textContent = h.label + " · " + duration(h.seconds);
      list.appendChild(li);
    });
  }

  var cancelForm = document.getElementById("cancel-form");
  if (cancelForm) {
    cancelForm.addEventListener("submit", function (e) {
      if (!window.confirm(cancelForm.dataset.confirm)) e.preventDefault();
    });
  }

  function updateState(data) {
    var el = document.querySelector("#run-state .state");
    if (el && !el.classList.contains("state-" + data.state)) {
      el.className = "state state-" + data.state;
      el.textContent = data.state.charAt(0).toUpperCase() + data.state.slice(1);
    }
    var attempt = String(data.attempt === undefined ? root.dataset.attempt : data.attempt);
    if ((wasActive && !data.active) || attempt !== root.dataset.attempt) {
      wasActive = false;  // ended, or resumed as a new attempt: the server renders the new state
      window.setTimeout(function () { window.location.reload(); }, 500);  // show artifacts, logs
    } else if (!data.active && !steps.length) {
      // Ended before its first step: say why instead of waiting for a step that will never come.
      summary.textContent = "No steps: the run " + data.state + " before its first step" +
        (data.error ? " (see the error above)" : "") + ".";
    }
  }

  // Alerts raised while the page is open join the banner (the server renders those raised before).
  var alertBox = document.getElementById("alert-banner");
  function showAlerts(alerts) {
    if (!alerts || alerts.length === document.querySelectorAll("#alert-list li").length) return;
    var list = document.getElementById("alert-list");
    list.textContent = "";
    alerts.forEach(function (a) {
      var li = document.createElement("li"), title = document.createElement("strong");
      li.dataset.alert = a.kind; title.textContent = a.title;
      li.appendChild(title); li.appendChild(document.createTextNode(" — " + a.message));
      list.appendChild(li);
    });
    document.getElementById("alert-count").textContent = alerts.length + " alert" + (alerts.length === 1 ? "" : "s") + " on this run";
    alertBox.hidden = alerts.length === 0;
  }

  function poll() {
    fetch(metricsUrl + "?since=" + lastStep, { credentials: "same-origin" })
      .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); })
      .then(function (data) {
        if (data.steps.length) {
          steps = steps.concat(data.steps);
          lastStep = data.last_step;
          drawOverSteps();
          slider.disabled = false;
          slider.min = steps[0].step;
          slider.max = lastStep;
          if (follow) { slider.value = lastStep; showStep(lastStep); }
          summary.textContent = steps.length + " steps · last " + lastStep;
          samplesLink.hidden = false;
          refreshArtifacts();
        }
        showProgress(data.progress, data.active);
        showAlerts(data.alerts);
        updateState(data);
        schedule(data.active);
      })
      .catch(function () { schedule(wasActive); });
  }

  function schedule(active) {
    window.clearTimeout(timer);
    if (!active) return;  // ended (with or without steps): nothing more will arrive
    timer = window.setTimeout(poll, document.hidden ? 15000 : 2000);
  }

  slider.addEventListener("input", function () {
    var v = parseInt(slider.value, 10);
    follow = v === lastStep;
    showStep(v);
  });
  document.addEventListener("visibilitychange", function () { if (!document.hidden) { poll(); } });
  drawOverSteps();
  poll();
})();
