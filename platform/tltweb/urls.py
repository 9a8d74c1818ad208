from django.conf import settings
from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path, re_path
from django.views.generic import RedirectView
from django.contrib.staticfiles.views import serve as static_serve
from django.templatetags.static import static

from tltweb import health
from tltweb.accounts import views as accounts
from tltweb.runs import views as runs

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="run-list"), name="home"),
    path("healthz", health.healthz, name="healthz"),
    # browsers ask for /favicon.ico before reading the page's <link rel="icon">
    path("favicon.ico", RedirectView.as_view(url=static("img/favicon.svg"), permanent=True), name="favicon"),
    path("login/", auth_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("runs/", runs.run_list, name="run-list"),
    path("runs/new", runs.run_launch, name="run-launch"),
    path("runs/compare", runs.run_compare, name="run-compare"),
    path("runs/<uuid:run_id>/", runs.run_detail, name="run-detail"),
    path("runs/<uuid:run_id>/cancel", runs.run_cancel, name="run-cancel"),
    path("runs/<uuid:run_id>/clone", runs.run_clone, name="run-clone"),
    path("runs/<uuid:run_id>/resume", runs.run_resume, name="run-resume"),
    path("runs/<uuid:run_id>/edit", runs.run_edit, name="run-edit"),
    path("runs/<uuid:run_id>/artifacts/<int:artifact_id>/download", runs.artifact_download, name="artifact-download"),
    path("runs/<uuid:run_id>/log", runs.run_log_download, name="run-log"),
    path("runs/<uuid:run_id>/samples", runs.run_samples, name="run-samples"),
    path("runs/<uuid:run_id>/ab", runs.run_ab_launch, name="run-ab-launch"),
    path("runs/<uuid:run_id>/pair", runs.run_pair, name="run-pair"),
    path("runs/<uuid:run_id>/drafter/latest", runs.run_drafter_latest, name="run-drafter-latest"),
    path("teams/", accounts.team_list, name="team-list"),
    path("teams/new", accounts.team_create, name="team-create"),
    path("teams/<int:team_id>/", accounts.team_detail, name="team-detail"),
    path("teams/<int:team_id>/members", accounts.team_member_save, name="team-member-save"),
    path("teams/<int:team_id>/members/remove", accounts.team_member_remove, name="team-member-remove"),
    path("teams/<int:team_id>/drafters", runs.team_drafters, name="team-drafters"),
    path("teams/<int:team_id>/webhook", runs.team_webhook, name="team-webhook"),
    path("account/tokens/", accounts.tokens, name="tokens"),
    path("api/", include("tltweb.api.urls")),
    path("admin/", admin.site.urls),
]

if settings.SERVE_STATIC and not settings.DEBUG:
    # runserver serves static files when DEBUG is on; gunicorn (compose) has no static server in
    # front, so Django serves the few files of static/ itself (no collectstatic step needed).
    urlpatterns += [re_path(r"^static/(?P<path>.*)$", static_serve, {"insecure": True})]

handler400 = "tltweb.handlers.bad_request"
handler403 = "tltweb.handlers.permission_denied"
handler404 = "tltweb.handlers.page_not_found"
handler500 = "tltweb.handlers.server_error"
