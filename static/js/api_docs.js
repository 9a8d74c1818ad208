// API docs: Swagger UI on /api/openapi.json. "Try it out" uses the browser session, so unsafe
// methods carry the CSRF token (or paste a personal API token under "Authorize").
(function () {
  "use strict";
  var root = document.getElementById("swagger-ui");
  function cookie(name) {
    var m = document.cookie.match(new RegExp("(?:^|; )" + name + "=([^;]*)"));
    return m ? decodeURIComponent(m[1]) : "";
  }
  window.ui = SwaggerUIBundle({
    url: root.dataset.openapiUrl,
    dom_id: "#swagger-ui",
    deepLinking: true,
    layout: "BaseLayout",
    requestInterceptor: function (req) {
      if (!/^(GET|HEAD|OPTIONS)$/i.test(req.method || "GET")) { req.headers["X-CSRFToken"] = cookie("csrftoken"); }
      return req;
    }
  });
})();
