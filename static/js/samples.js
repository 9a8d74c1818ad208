// Sample viewer: picking a step shows it at once (the filters stay in the URL).
(function () {
  "use strict";
  var select = document.getElementById("step-select");
  if (!select) return;
  select.addEventListener("change", function () { select.form.submit(); });
})();
