"""Launching: the service, the form and the API validate the config and change nothing when it is bad."""

from __future__ import annotations

import json

import pytest
import yaml
from django.core.exceptions import PermissionDenied
from django.urls import reverse

from tests.conftest import member_add
from tltweb.accounts.services import api_token_create
from tltweb.runs.models import Run
from tltweb.runs.services import preset_yaml, run_clone, run_launch
from workers.tlt.config import PRESETS, ConfigError

# the tiny preset's own step count, so these tests follow the preset when it is retuned
STEPS = f"steps: {PRESETS['tiny-cpu']['run']['steps']}"


def test_run_launch_creates_a_queued_run_and_submits_it_on_commit(alice, team, django_capture_on_commit_callbacks, monkeypatch):
    from workers import tasks

    sent = []
    monkeypatch.setattr(tasks.run_submit, "delay", lambda run_id: sent.append(run_id))
    with django_capture_on_commit_callbacks(execute=True):
        run = run_launch(user=alice, team=team, name="r1", preset="tiny-cpu")
    assert run.state == "queued" and run.config["run"]["steps"] == PRESETS["tiny-cpu"]["run"]["steps"]
    assert sent == [str(run.id)]
    assert run.submission_id == f"tlt-run-{run.id}"


def test_run_launch_keeps_the_yaml_text_and_the_expanded_config(alice, team):
    text = preset_yaml("tiny-cpu").replace(STEPS, "steps: 2")
    run = run_launch(user=alice, team=team, name="short", preset="tiny-cpu", config_yaml=text)
    assert run.config_yaml == text and run.config["run"]["steps"] == 2


def test_run_launch_rejects_a_bad_config_naming_the_field(alice, team):
    text = preset_yaml("tiny-cpu").replace("threshold: 8", "threshold: 0")
    with pytest.raises(ConfigError) as err:
        run_launch(user=alice, team=team, name="bad", preset="tiny-cpu", config_yaml=text)
    assert "spec.threshold" in err.value.errors
    assert not Run.objects.exists()


@pytest.mark.parametrize("text", ["[" * 5000, "{a: " * 3000])
def test_run_launch_turns_deeply_nested_yaml_into_a_config_error(alice, team, text):
    with pytest.raises(ConfigError) as err:
        run_launch(user=alice, team=team, name="deep", config_yaml=text)
    assert "yaml" in err.value.errors and not Run.objects.exists()


def test_run_launch_refuses_viewers(bob, team):
    with pytest.raises(PermissionDenied):
        run_launch(user=bob, team=team, name="x", preset="tiny-cpu")


def test_run_clone_copies_config_and_tags(alice, run):
    clone = run_clone(user=alice, run=run)
    assert clone.config == run.config and clone.tags == run.tags and clone.cloned_from == run


def test_the_form_is_prefilled_with_the_first_presets_yaml(client, alice, team):
    client.force_login(alice)
    resp = client.get(reverse("run-launch"))
    assert resp.status_code == 200
    assert "sft_steps: 300" in resp.content.decode()


def test_the_form_launches_and_redirects_to_the_run(client, alice, team):
    client.force_login(alice)
    text = preset_yaml("tiny-cpu").replace(STEPS, "steps: 2")
    resp = client.post(reverse("run-launch"), {"team": team.pk, "name": "form run", "preset": "tiny-cpu",
                                               "config_yaml": text, "tags": "a, b"})
    run = Run.objects.get()
    assert resp.status_code == 302 and resp.url == reverse("run-detail", args=[run.id])
    assert run.tags == ["a", "b"] and run.creator == alice


@pytest.mark.parametrize(
    "edit,field",
    [
        (("threshold: 8", "threshold: -1"), "spec.threshold"),
        ((STEPS, "steps: lots"), "run.steps"),
        (("num_workers: 2", "num_workers: 2\n  gpus: 4"), "rollout.gpus"),
        (("run:", "run: [unclosed"), "yaml"),
    ],
)
def test_the_form_shows_config_errors_inline_and_creates_nothing(client, alice, team, edit, field):
    client.force_login(alice)
    text = preset_yaml("tiny-cpu").replace(*edit, 1)
    resp = client.post(reverse("run-launch"), {"team": team.pk, "preset": "tiny-cpu", "config_yaml": text})
    assert resp.status_code == 400
    assert f"<code>{field}</code>" in resp.content.decode()
    assert resp.context["form"]["config_yaml"].value() == text  # the user's text is kept
    assert not Run.objects.exists()


def test_the_form_refuses_a_team_the_user_cannot_edit(client, alice, team, charlie):
    from tltweb.accounts.models import Team

    other = Team.objects.get(name="Charlie's lab")
    client.force_login(alice)
    resp = client.post(reverse("run-launch"), {"team": other.pk, "preset": "tiny-cpu"})
    assert resp.status_code == 400 and not Run.objects.exists()


def _api(client, user, method, url, body=None):
    _, token = api_token_create(user=user, name="t")
    kwargs = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
    if body is not None:
        kwargs.update(data=json.dumps(body) if not isinstance(body, bytes) else body, content_type="application/json")
    return getattr(client, method)(url, **kwargs)


def test_the_api_launches_a_run(client, alice, team):
    resp = _api(client, alice, "post", reverse("api-runs"), {"preset": "tiny-cpu", "name": "api run", "tags": ["x"]})
    assert resp.status_code == 201
    assert resp.json()["state"] == "queued" and resp.json()["tags"] == ["x"]


@pytest.mark.parametrize(
    "body,key",
    [
        ({"preset": "nope"}, "preset"),
        ({"preset": "tiny-cpu", "config_yaml": "run: {steps: 0}"}, "run.steps"),
        ({"preset": "tiny-cpu", "colour": "red"}, "colour"),
        ({"preset": "tiny-cpu", "tags": "not-a-list"}, "tags"),
        ({}, "config"),
    ],
)
def test_the_api_rejects_bad_launch_bodies_with_clear_errors(client, alice, team, body, key):
    resp = _api(client, alice, "post", reverse("api-runs"), body)
    assert resp.status_code == 400
    assert key in resp.json()["errors"]
    assert not Run.objects.exists()


def test_the_api_rejects_non_json(client, alice, team):
    resp = _api(client, alice, "post", reverse("api-runs"), b"preset=tiny")
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]


def test_the_api_asks_for_a_team_when_the_user_has_several(client, alice, team, charlie):
    from tltweb.accounts.models import Team

    member_add(Team.objects.get(name="Charlie's lab"), alice, "editor")
    resp = _api(client, alice, "post", reverse("api-runs"), {"preset": "tiny-cpu"})
    assert resp.status_code == 400 and "team" in resp.json()["errors"]


def test_the_api_refuses_viewers_launching(client, bob, team):
    resp = _api(client, bob, "post", reverse("api-runs"), {"preset": "tiny-cpu", "team": team.pk})
    assert resp.status_code == 403 and not Run.objects.exists()


def test_the_api_edits_tags_and_notes(client, alice, run):
    resp = _api(client, alice, "patch", reverse("api-run", args=[run.id]), {"tags": ["a"], "notes": "n"})
    assert resp.status_code == 200
    run.refresh_from_db()
    assert run.tags == ["a"] and run.notes == "n"


def test_the_api_needs_csrf_for_session_posts(alice, run):
    from django.test import Client

    client = Client(enforce_csrf_checks=True)
    client.force_login(alice)
    assert client.get(reverse("api-run", args=[run.id])).status_code == 200
    assert client.post(reverse("api-run-cancel", args=[run.id])).status_code == 403
    run.refresh_from_db()
    assert run.state == "queued"


def test_the_api_says_which_methods_are_allowed(client, alice, run):
    resp = _api(client, alice, "delete", reverse("api-run", args=[run.id]))
    assert resp.status_code == 405


def test_cancel_marks_the_run_cancelled_and_stops_the_job_on_commit(client, alice, run, django_capture_on_commit_callbacks, monkeypatch):
    from workers import tasks

    sent = []
    monkeypatch.setattr(tasks.run_cancel, "delay", lambda run_id: sent.append(run_id))
    client.force_login(alice)
    with django_capture_on_commit_callbacks(execute=True):
        client.post(reverse("run-cancel", args=[run.id]))
    run.refresh_from_db()
    assert run.state == "cancelled" and run.finished_at and sent == [str(run.id)]


def test_the_run_page_hands_urls_to_js_in_data_attributes(client, alice, run):
    client.force_login(alice)
    html = client.get(reverse("run-detail", args=[run.id])).content.decode()
    assert f'data-metrics-url="/api/runs/{run.id}/metrics"' in html
    assert "js/run_detail.js" in html and "vendor/plotly.min.js" in html


def test_the_metrics_endpoint_returns_steps_after_since(client, alice, run):
    from tests.conftest import metrics_record_fake
    from tltweb.runs.services import metrics_record

    for step in range(3):
        rec = metrics_record_fake(step)
        metrics_record(run=run, step=step, scalars=rec["scalars"], series=rec["series"])
    client.force_login(alice)
    data = client.get(reverse("api-run-metrics", args=[run.id]), {"since": 0}).json()
    assert [s["step"] for s in data["steps"]] == [1, 2] and data["last_step"] == 2
    one = client.get(reverse("api-run-metrics-step", args=[run.id, 2])).json()
    assert one["series"]["spec/accept_by_position"] == [0.8, 0.6, 0.4, 0.2]
    assert client.get(reverse("api-run-metrics-step", args=[run.id, 9])).status_code == 404


def test_compare_lists_only_differing_config_keys(client, alice, team, run):
    from tests.conftest import run_make

    cfg = json.loads(json.dumps(run.config))
    cfg["run"]["steps"] = 99
    other = run_make(team, alice, name="longer", config=cfg)
    client.force_login(alice)
    resp = client.get(reverse("run-compare"), {"run": [str(run.id), str(other.id)]})
    assert [row["key"] for row in resp.context["diff"]] == ["run.steps"]


def test_the_openapi_description_lists_the_endpoints(client):
    spec = client.get(reverse("api-openapi")).json()
    assert "/api/runs" in spec["paths"] and "/api/ingest/runs/{run_id}/metrics" in spec["paths"]


def test_every_page_renders_for_a_member(client, alice, run):
    client.force_login(alice)
    for url in [reverse("run-list"), reverse("run-launch"), reverse("run-compare") + f"?run={run.id}",
                reverse("team-list"), reverse("team-detail", args=[run.team_id]), reverse("tokens"),
                reverse("run-list") + "?state=queued&tag=baseline&q=tiny&preset=tiny-cpu&creator=alice"]:
        assert client.get(url).status_code == 200, url
    assert run.name in client.get(reverse("run-list") + "?tag=baseline").content.decode()
    assert run.name not in client.get(reverse("run-list") + "?tag=other").content.decode()


# ---- paths in configs: only inside the folders the operator allows ----

def _yaml_with(**sections) -> str:
    """The tiny preset's YAML with some fields changed: _yaml_with(task={"kind": "jsonl", "path": "x"})."""
    data = yaml.safe_load(preset_yaml("tiny-cpu"))
    for section, values in sections.items():
        data[section].update(values)
    return yaml.safe_dump(data, sort_keys=False)


def _jsonl_yaml(path: str) -> str:
    return _yaml_with(task={"kind": "jsonl", "path": path})


@pytest.mark.parametrize("path", ["/etc/passwd", "../../etc/passwd", "../999999/tasks.jsonl"])
def test_run_launch_rejects_a_task_path_outside_the_teams_data_folder(alice, team, path, settings):
    with pytest.raises(ConfigError) as err:
        run_launch(user=alice, team=team, name="x", preset="tiny-cpu", config_yaml=_jsonl_yaml(path))
    assert "outside the folders" in err.value.errors["task.path"]
    assert not Run.objects.exists()


def test_run_launch_rejects_a_symlink_out_of_the_data_folder(alice, team, settings, tmp_path):
    folder = settings.TLT_DATA_DIR / str(team.pk)
    folder.mkdir(parents=True)
    (folder / "sneaky.jsonl").symlink_to("/etc/passwd")
    with pytest.raises(ConfigError) as err:
        run_launch(user=alice, team=team, name="x", preset="tiny-cpu", config_yaml=_jsonl_yaml("sneaky.jsonl"))
    assert "task.path" in err.value.errors


def test_run_launch_accepts_paths_inside_the_allowed_folders(alice, team, settings):
    text = _yaml_with(task={"kind": "jsonl", "path": "tasks/math.jsonl"},
                      model={"source": "hf", "path": f"{settings.TLT_MODELS_DIR}/qwen"})
    run = run_launch(user=alice, team=team, name="ok", preset="tiny-cpu", config_yaml=text)
    assert run.config["task"]["path"] == "tasks/math.jsonl"  # stored as written; the trainer resolves it again


def test_run_launch_rejects_a_model_path_in_another_teams_folder(alice, team, charlie, settings):
    from tltweb.accounts.models import Team

    other = Team.objects.get(name="Charlie's lab")
    text = _yaml_with(model={"source": "hf", "path": f"{settings.TLT_DATA_DIR}/{other.pk}/model"})
    with pytest.raises(ConfigError) as err:
        run_launch(user=alice, team=team, name="x", preset="tiny-cpu", config_yaml=text)
    assert "model.path" in err.value.errors


def test_the_form_names_a_bad_path_inline(client, alice, team):
    client.force_login(alice)
    resp = client.post(reverse("run-launch"), {"team": team.pk, "preset": "tiny-cpu", "config_yaml": _jsonl_yaml("/etc/passwd")})
    assert resp.status_code == 400 and "<code>task.path</code>" in resp.content.decode()


# ---- impossible configs: more rollout workers than the Ray cluster has ----

@pytest.fixture
def cluster_check(settings, ray_head):
    settings.TLT_LAUNCH_CHECK_CLUSTER = True
    return ray_head


def test_run_launch_rejects_more_rollout_workers_than_the_cluster_has_cpus(alice, team, cluster_check):
    from tltweb.runs.dispatch import cluster_resources

    cpus = int(cluster_resources()["CPU"])
    text = _yaml_with(rollout={"num_workers": cpus + 1}, task={"prompts_per_step": 64})
    with pytest.raises(ConfigError) as err:
        run_launch(user=alice, team=team, name="big", preset="tiny-cpu", config_yaml=text)
    assert f"{cpus + 1} CPUs" in err.value.errors["rollout.num_workers"]
    assert not Run.objects.exists()


def test_run_launch_rejects_gpu_workers_on_a_cluster_without_enough_gpus(alice, team, cluster_check):
    from tltweb.runs.dispatch import cluster_resources

    gpus = int(cluster_resources().get("GPU", 0))
    text = _yaml_with(run={"device": "cuda"}, rollout={"num_workers": gpus + 1}, task={"prompts_per_step": 64})
    with pytest.raises(ConfigError) as err:
        run_launch(user=alice, team=team, name="gpu", preset="tiny-cpu", config_yaml=text)
    assert "GPUs" in err.value.errors["rollout.num_workers"]


def test_run_launch_accepts_what_the_cluster_can_hold(alice, team, cluster_check):
    assert run_launch(user=alice, team=team, name="fits", preset="tiny-cpu").state == "queued"


def test_run_launch_says_so_when_ray_does_not_answer(alice, team, settings, client):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    settings.TLT_LAUNCH_CHECK_CLUSTER = True
    settings.RAY_ADDRESS = f"http://127.0.0.1:{port}"
    with pytest.raises(ConfigError) as err:
        run_launch(user=alice, team=team, name="x", preset="tiny-cpu")
    assert "did not answer" in err.value.errors["cluster"]
    client.force_login(alice)
    resp = _api(client, alice, "post", reverse("api-runs"), {"preset": "tiny-cpu"})
    assert resp.status_code == 400 and "cluster" in resp.json()["errors"]
    assert not Run.objects.exists()
