// Compare page: overlay one scalar metric of every selected run.
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("compare-data").textContent);
  var select = document.getElementById("metric-select");
  function draw() {
    var key = select.value;
    var traces = Object.keys(data).map(function (id) {
      var rows = data[id].steps.filter(function (r) { return r.scalars[key] !== undefined && r.scalars[key] !== null; });
      return {
        name: data[id].name, mode: "lines+markers", type: "scatter",
        x: rows.map(function (r) { return r.step; }), y: rows.map(function (r) { return r.scalars[key]; })
      };
    });
    Plotly.react("chart-compare", traces, {
      title: { text: key }, xaxis: { title: { text: "step" }, tickformat: "d" }, margin: { t: 40, r: 10, b: 40, l: 50 }
    }, { responsive: true, displaylogo: false });
    var url = new URL(window.location.href);
    url.searchParams.set("metric", key);
    window.history.replaceState(null, "", url);
  }
  select.addEventListener("change", draw);
  draw();
})();
