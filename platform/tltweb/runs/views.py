"""Server-rendered run pages. Every view calls one access helper before anything else."""

from __future__ import annotations

from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from tltweb.accounts.selectors import team_list_for_user
from tltweb.runs import downloads, evidence, health, selectors, services
from tltweb.runs.forms import LaunchForm, RunEditForm, SampleFilterForm
from tltweb.runs.logtext import log_clean
from tltweb.runs.models import RunState
from workers.tlt.config import PRESETS, ConfigError
from workers.tlt.metrics import SCALAR_KEYS


RUN_COLUMNS = [  # (sort key or "", header) of the run list, in order
    ("", ""), ("name", "Name"), ("state", "State"), ("step", "Progress"), ("", "Phase"), ("duration", "Duration"),
    ("reward", "Reward"), ("acceptance", "Acceptance"), ("", "TLT speedup"), ("", "Team"), ("", "Creator"), ("", "Preset"), ("", "Tags"),
    ("created", "Created"),
]


@login_required
def run_list(request: HttpRequest) -> HttpResponse:
    """Filters and sort live in the URL (a bookmark keeps them); run_list.js polls the API with the
    same query string and redraws the rows."""
    filters = {k: request.GET.get(k, "").strip() for k in ("state", "tag", "creator", "preset", "q")}
    sort = request.GET.get("sort", "-created")
    if not selectors.run_sort_valid(sort):
        sort = "-created"
    runs = list(selectors.run_list_for_user(user=request.user, sort=sort, **filters)[:300])
    for run in runs:
        run.live = selectors.run_live(run)
    query = {k: v for k, v in filters.items() if v}
    columns = []
    for key, label in RUN_COLUMNS:
        if not key:
            columns.append({"label": label})
            continue
        current = sort.lstrip("-") == key
        desc = sort.startswith("-")
        # first click on a number sorts high to low, on a name a-z; a second click flips it
        default_desc = key in {"step", "duration", "reward", "acceptance", "created"}
        nxt = ("" if desc else "-") if current else ("-" if default_desc else "")
        columns.append({
            "key": key, "label": label, "current": current, "desc": desc,
            "href": "?" + urlencode({**query, "sort": nxt + key}),
        })
    ctx = {
        "runs": runs,
        "filters": filters,
        "sort": sort,
        "columns": columns,
        "states": RunState.choices,
        "choices": selectors.run_filter_choices(user=request.user),
        "can_launch": bool(team_list_for_user(user=request.user, need="edit")),
        "api_url": reverse("api-runs"),
    }
    return render(request, "runs/list.html", ctx)


@login_required
def run_launch(request: HttpRequest) -> HttpResponse:
    teams = team_list_for_user(user=request.user, need="edit")
    if not teams:
        raise PermissionDenied("you need editor access to a team to launch runs")
    config_errors: dict[str, str] = {}
    if request.method == "POST":
        form = LaunchForm(request.POST, teams=teams)
        if form.is_valid():
            team = next(t for t in teams if t.pk == form.cleaned_data["team"])
            try:
                run = services.run_launch(
                    user=request.user,
                    team=team,
                    name=form.cleaned_data["name"],
                    preset=form.cleaned_data["preset"],
                    config_yaml=form.cleaned_data["config_yaml"],
                    tags=form.cleaned_data["tags"],
                    notes=form.cleaned_data["notes"],
                )
            except ConfigError as exc:
                config_errors = exc.errors
            else:
                messages.success(request, f"Launched {run.name}.")
                return redirect("run-detail", run_id=run.id)
        status = 400
    else:
        name = next(iter(PRESETS))
        initial = {"preset": name, "config_yaml": services.preset_yaml(name), "team": teams[0].pk}
        source = request.GET.get("from")
        if source:
            run, _ = selectors.run_get_for_user(user=request.user, run_id=source, need="view")
            initial.update(
                preset=run.preset or name, config_yaml=run.config_yaml, name=f"{run.name} (edited)",
                tags=", ".join(run.tags), team=run.team_id,
            )
        form = LaunchForm(initial=initial, teams=teams)
        status = 200
    ctx = {
        "form": form,
        "config_errors": config_errors,
        "preset_yaml": {name: services.preset_yaml(name) for name in PRESETS},
    }
    return render(request, "runs/launch.html", ctx, status=status)


@login_required
def run_detail(request: HttpRequest, run_id: str) -> HttpResponse:
    run, member = selectors.run_get_for_user(user=request.user, run_id=run_id, need="view")
    ctx = {
        "run": run,
        "can_edit": member.allows("edit"),
        "progress": selectors.run_progress(run),
        "log_tail": log_clean(run.log_tail) if run.log_tail else "",
        "has_log": not run.is_active and selectors.run_log_text(run=run) is not None,
        "has_samples": bool(selectors.rollout_sample_steps(run=run)),
        "artifacts": selectors.artifact_list(run=run),
        "drafter_versions": evidence.drafter_versions(run=run),
        "latest_drafter": evidence.drafter_latest(run=run),
        "alerts": evidence.run_alerts(run=run),
        "partner": evidence.run_partner(run),
        "long_prompts": evidence.prompt_length_history(run=run),
        "edit_form": RunEditForm(initial={"name": run.name, "tags": ", ".join(run.tags), "notes": run.notes}),
        "metrics_url": reverse("api-run-metrics", args=[run.id]),
        "step_url": reverse("api-run-metrics-step", args=[run.id, 0]).rsplit("/", 1)[0] + "/",
    }
    return render(request, "runs/detail.html", ctx)


@login_required
@require_POST
def run_cancel(request: HttpRequest, run_id: str) -> HttpResponse:
    run, _ = selectors.run_get_for_user(user=request.user, run_id=run_id, need="edit")
    try:
        services.run_cancel(run=run)
    except services.RunStateError as exc:
        messages.error(request, f"Not cancelled: {exc}.")
    else:
        messages.info(request, "Run cancelled; its checkpoints are kept.")
    return redirect("run-detail", run_id=run.id)


@login_required
@require_POST
def run_resume(request: HttpRequest, run_id: str) -> HttpResponse:
    run, _ = selectors.run_get_for_user(user=request.user, run_id=run_id, need="edit")
    try:
        run = services.run_resume(run=run, user=request.user)
        messages.success(request, f"Resuming from the last checkpoint (attempt {run.attempt + 1}).")
    except services.RunStateError as exc:
        messages.error(request, f"Not resumed: {exc}.")
    return redirect("run-detail", run_id=run.id)


@login_required
@require_POST
def run_clone(request: HttpRequest, run_id: str) -> HttpResponse:
    run, _ = selectors.run_get_for_user(user=request.user, run_id=run_id, need="edit")
    clone = services.run_clone(user=request.user, run=run)
    messages.success(request, f"Launched {clone.name}.")
    return redirect("run-detail", run_id=clone.id)


@login_required
@require_POST
def run_edit(request: HttpRequest, run_id: str) -> HttpResponse:
    run, _ = selectors.run_get_for_user(user=request.user, run_id=run_id, need="edit")
    form = RunEditForm(request.POST)
    if form.is_valid():
        services.run_update(run=run, **form.cleaned_data)
        messages.success(request, "Saved.")
    else:
        messages.error(request, "Not saved: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in form.errors.items()))
    return redirect("run-detail", run_id=run.id)


@login_required
def artifact_download(request: HttpRequest, run_id: str, artifact_id: int) -> HttpResponse:
    artifact = selectors.artifact_get_for_user(user=request.user, run_id=run_id, artifact_id=artifact_id)
    return downloads.artifact_response(artifact)


@login_required
def run_log_download(request: HttpRequest, run_id: str) -> HttpResponse:
    run, _ = selectors.run_get_for_user(user=request.user, run_id=run_id, need="view")
    return downloads.log_response(run)


@login_required
def run_samples(request: HttpRequest, run_id: str) -> HttpResponse:
    """A step's stored responses; step and the reward/length filters are GET parameters."""
    run, _ = selectors.run_get_for_user(user=request.user, run_id=run_id, need="view")
    steps = selectors.rollout_sample_steps(run=run)
    form = SampleFilterForm(request.GET or None)
    filters = form.cleaned_data if form.is_valid() else {}
    step = filters.get("step")
    if step not in steps:
        step = steps[-1] if steps else None
    samples = []
    if step is not None:
        rows = selectors.rollout_samples(
            run=run, step=step, **{k: filters.get(k) for k in ("min_reward", "max_reward", "min_length", "max_length")}
        )
        samples = [{"row": r, "pieces": list(zip(r.tokens, r.from_draft))} for r in rows]
    query = {k: v for k, v in (request.GET.items()) if k != "step" and v}
    i = steps.index(step) if step is not None else -1
    ctx = {
        "run": run,
        "form": form,
        "steps": steps,
        "step": step,
        "samples": samples,
        "prev_href": "?" + urlencode({**query, "step": steps[i - 1]}) if i > 0 else None,
        "next_href": "?" + urlencode({**query, "step": steps[i + 1]}) if 0 <= i < len(steps) - 1 else None,
        "query": query,
    }
    return render(request, "runs/samples.html", ctx)


@login_required
def run_compare(request: HttpRequest) -> HttpResponse:
    runs = selectors.runs_for_compare(user=request.user, run_ids=request.GET.getlist("run"))
    series = {
        str(run.id): {"name": run.name, "steps": selectors.metrics_scalars(run=run)} for run in runs
    }
    keys = sorted({k for s in series.values() for row in s["steps"] for k in row["scalars"]} | set(SCALAR_KEYS))
    ctx = {
        "runs": runs,
        "diff": selectors.config_diff([r.config for r in runs]),
        "series": series,
        "keys": keys,
        "metric": request.GET.get("metric", "reward/mean"),
    }
    return render(request, "runs/compare.html", ctx)


@login_required
@require_POST
def run_ab_launch(request: HttpRequest, run_id: str) -> HttpResponse:
    """One click: the run's baseline control (a TLT run) or TLT treatment (a baseline); then the pair page."""
    run, _ = selectors.run_get_for_user(user=request.user, run_id=run_id, need="edit")
    try:
        partner = services.run_launch_control(user=request.user, run=run)
    except ConfigError as exc:
        messages.error(request, "Not launched: " + "; ".join(f"{k}: {v}" for k, v in exc.errors.items()))
        return redirect("run-detail", run_id=run.id)
    messages.success(request, f"Launched {partner.name}.")
    return redirect("run-pair", run_id=run.id)


@login_required
def run_pair(request: HttpRequest, run_id: str) -> HttpResponse:
    """The A/B pair's page: curves by step and by wall-clock, speedups, Amdahl bound, reward parity."""
    tlt, base, member = evidence.run_pair_get_for_user(user=request.user, run_id=run_id)
    ctx = {
        "run_id": run_id,
        "tlt": tlt,
        "base": base,
        "summary": evidence.ab_summary(tlt=tlt, base=base),
        "pair_url": reverse("api-run-pair", args=[run_id]),
        "can_edit": member.allows("edit"),
        "parity_alpha": evidence.PARITY_ALPHA,
        "parity_min_steps": evidence.PARITY_MIN_STEPS,
    }
    return render(request, "runs/pair.html", ctx)


@login_required
def run_drafter_latest(request: HttpRequest, run_id: str) -> HttpResponse:
    run, _ = selectors.run_get_for_user(user=request.user, run_id=run_id, need="view")
    latest = evidence.drafter_latest(run=run)
    if latest is None:
        raise Http404("this run has no drafter yet")
    return downloads.artifact_response(latest)


@login_required
def team_drafters(request: HttpRequest, team_id: int) -> HttpResponse:
    team, groups = evidence.team_drafters_for_user(user=request.user, team_id=team_id)
    return render(request, "runs/team_drafters.html", {"team": team, "groups": groups})


@login_required
@require_POST
def team_webhook(request: HttpRequest, team_id: int) -> HttpResponse:
    from django.core.exceptions import ValidationError

    from tltweb.accounts.selectors import team_get_for_user

    team, _ = team_get_for_user(user=request.user, team_id=team_id, need="own")
    try:
        health.team_webhook_set(team=team, url=request.POST.get("alert_webhook_url", ""))
    except ValidationError as exc:
        messages.error(request, "Not saved: " + "; ".join(exc.messages))
    else:
        messages.success(request, "Alert webhook saved." if team.alert_webhook_url else "Alert webhook removed.")
    return redirect("team-detail", team_id=team.pk)
