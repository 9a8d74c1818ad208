// Launch form: choosing a preset fills the YAML editor with that preset's config,
// unless the user has edited the text (then ask first).
(function () {
  "use strict";
  var presets = JSON.parse(document.getElementById("preset-yaml").textContent);
  var select = document.getElementById("id_preset");
  var editor = document.getElementById("id_config_yaml");
  if (!select || !editor) return;
  var loaded = editor.value;
  select.addEventListener("change", function () {
    var yaml = presets[select.value];
    if (yaml === undefined) return;
    if (editor.value !== loaded && !window.confirm("Replace your edited config with the preset?")) return;
    editor.value = yaml;
    loaded = yaml;
  });
  // Tab inserts two spaces in the YAML editor instead of leaving the field.
  editor.addEventListener("keydown", function (e) {
    if (e.key !== "Tab" || e.shiftKey) return;
    e.preventDefault();
    var s = editor.selectionStart;
    editor.setRangeText("  ", s, editor.selectionEnd, "end");
  });
})();
