"""Server-rendered run pages. Every view calls one access helper before anything else."""

from __future__ import annotations

import json

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from tltweb.accounts.selectors import team_list_for_user
from tltweb.api.views import artifact_file_response
from tltweb.runs import selectors, services
from tltweb.runs.forms import LaunchForm, RunEditForm
from tltweb.runs.models import RunState
from workers.tlt.config import PRESETS, ConfigError
from workers.tlt.metrics import SCALAR_KEYS


@login_required
def run_list(request: HttpRequest) -> HttpResponse:
    filters = {k: request.GET.get(k, "").strip() for k in ("state", "tag", "creator", "preset", "q")}
    runs = selectors.run_list_for_user(user=request.user, **filters)[:300]
    ctx = {
        "runs": runs,
        "filters": filters,
        "states": RunState.choices,
        "choices": selectors.run_filter_choices(user=request.user),
        "can_launch": bool(team_list_for_user(user=request.user, need="edit")),
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
        "artifacts": selectors.artifact_list(run=run),
        "edit_form": RunEditForm(initial={"name": run.name, "tags": ", ".join(run.tags), "notes": run.notes}),
        "metrics_url": reverse("api-run-metrics", args=[run.id]),
        "step_url": reverse("api-run-metrics-step", args=[run.id, 0]).rsplit("/", 1)[0] + "/",
    }
    return render(request, "runs/detail.html", ctx)


@login_required
@require_POST
def run_cancel(request: HttpRequest, run_id: str) -> HttpResponse:
    run, _ = selectors.run_get_for_user(user=request.user, run_id=run_id, need="edit")
    services.run_cancel(run=run)
    messages.info(request, "Run cancelled; its checkpoints are kept.")
    return redirect("run-detail", run_id=run.id)


@login_required
@require_POST
def run_resume(request: HttpRequest, run_id: str) -> HttpResponse:
    run, _ = selectors.run_get_for_user(user=request.user, run_id=run_id, need="edit")
    try:
        run = services.run_resume(run=run, user=request.user)
        messages.success(request, f"Resuming from the last checkpoint (attempt {run.attempt + 1}).")
    except ValidationError as exc:
        messages.error(request, "; ".join(exc.messages))
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
    return artifact_file_response(artifact)


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
