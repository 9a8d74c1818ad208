// Run list: the filters and sort live in the URL (the server renders the first rows from them);
// this polls the runs API with the same query string (every 5 s while the tab is visible, 30 s
// when hidden) and redraws the rows, keeping the boxes ticked for "Compare selected".
(function () {
  "use strict";
  var table = document.getElementById("run-table");
  var body = document.getElementById("run-rows");
  var compare = document.getElementById("compare-button");
  var note = document.getElementById("live-note");
  var apiUrl = table.dataset.apiUrl;
  var columns = table.tHead.rows[0].cells.length;
  var timer = null;

  // Filters change the URL at once (no "Filter" click needed): the same query string the page
  // was rendered from, so a bookmark or a reload keeps them.
  var filters = document.getElementById("run-filters");
  Array.prototype.forEach.call(filters.querySelectorAll("select"), function (el) {
    el.addEventListener("change", function () { filters.submit(); });
  });

  function duration(s) {
    if (s === null || s === undefined) return "—";
    s = Math.round(s);
    if (s < 60) return s + "s";
    var pad = function (n) { return (n < 10 ? "0" : "") + n; };
    if (s < 3600) return Math.floor(s / 60) + "m " + pad(s % 60) + "s";
    return Math.floor(s / 3600) + "h " + pad(Math.floor((s % 3600) / 60)) + "m";
  }
  function num(v, digits) { return v === null || v === undefined ? "—" : v.toFixed(digits); }
  function cell(tr, text, cls) {
    var td = document.createElement("td");
    if (cls) td.className = cls;
    if (text !== undefined && text !== null) td.textContent = text;
    tr.appendChild(td);
    return td;
  }
  function ago(iso) {
    var s = (Date.now() - Date.parse(iso)) / 1000;
    if (s < 60) return "just now";
    if (s < 3600) return Math.floor(s / 60) + " minutes ago";
    if (s < 86400) return Math.floor(s / 3600) + " hours ago";
    return Math.floor(s / 86400) + " days ago";
  }

  function row(run, checked) {
    var tr = document.createElement("tr");
    tr.dataset.run = run.id;
    var box = document.createElement("input");
    box.type = "checkbox"; box.name = "run"; box.value = run.id; box.checked = checked;
    box.setAttribute("aria-label", "compare " + run.name);
    cell(tr).appendChild(box);
    var link = document.createElement("a");
    link.href = run.url; link.textContent = run.name;
    var nameCell = cell(tr);
    nameCell.appendChild(link);
    if (run.alerts) {
      var badge = document.createElement("span");
      badge.className = "badge alert-badge"; badge.title = "alerts on this run (see its page)";
      badge.textContent = "⚠ " + run.alerts;
      nameCell.appendChild(document.createTextNode(" "));
      nameCell.appendChild(badge);
    }
    var state = document.createElement("span");
    state.className = "state state-" + run.state;
    state.textContent = run.state.charAt(0).toUpperCase() + run.state.slice(1);
    cell(tr).appendChild(state);
    cell(tr, run.step === null ? "—" : run.step + (run.steps_total ? "/" + run.steps_total : ""), "c-progress");
    cell(tr, run.phase + (run.phase_fraction !== null ? " · " + Math.round(100 * run.phase_fraction) + "%" : ""), "c-phase");
    cell(tr, duration(run.duration_s), "c-duration");
    cell(tr, num(run.reward, 3), "c-reward");
    cell(tr, num(run.acceptance, 2), "c-acceptance");
    var speedup = cell(tr, run.tlt_speedup === null ? "—" : "", "c-speedup");
    if (run.tlt_speedup !== null) {
      var pair = document.createElement("a");
      pair.href = run.url + "pair"; pair.title = "its A/B pair"; pair.textContent = run.tlt_speedup.toFixed(2) + "×";
      speedup.appendChild(pair);
    }
    cell(tr, run.team_name);
    cell(tr, run.creator || "—");
    cell(tr, run.preset || "custom");
    var tags = cell(tr);
    run.tags.forEach(function (t) {
      var a = document.createElement("a");
      a.className = "tag"; a.href = "?tag=" + encodeURIComponent(t); a.textContent = t;
      tags.appendChild(a);
    });
    cell(tr, ago(run.created_at)).title = run.created_at;
    return tr;
  }

  function render(runs) {
    var checked = {};
    Array.prototype.forEach.call(body.querySelectorAll("input[name=run]:checked"), function (b) { checked[b.value] = true; });
    var frag = document.createDocumentFragment();
    runs.forEach(function (run) { frag.appendChild(row(run, !!checked[run.id])); });
    if (!runs.length) {
      var tr = document.createElement("tr");
      tr.className = "empty";
      var td = cell(tr, "No runs match.", "muted");
      td.colSpan = columns;
      frag.appendChild(tr);
    }
    body.textContent = "";
    body.appendChild(frag);
    compare.hidden = !runs.length;
  }

  function poll() {
    var params = new URLSearchParams(window.location.search);
    params.set("sort", table.dataset.sort);  // the page's own (a bad ?sort= falls back to -created)
    fetch(apiUrl + "?" + params.toString(), { credentials: "same-origin" })
      .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); })
      .then(function (data) {
        render(data.runs);
        note.textContent = "live · updated " + new Date().toLocaleTimeString();
        table.dataset.polls = String((parseInt(table.dataset.polls || "0", 10)) + 1);
        schedule();
      })
      .catch(function () { note.textContent = "live · retrying"; schedule(); });
  }
  function schedule() {
    window.clearTimeout(timer);
    timer = window.setTimeout(poll, document.hidden ? 30000 : 5000);
  }
  document.addEventListener("visibilitychange", function () { if (!document.hidden) poll(); });
  schedule();
})();
