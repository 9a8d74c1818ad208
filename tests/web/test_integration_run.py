"""End to end with real services: form -> Celery worker (subprocess) -> Ray job (the real trainer)
-> ingestion API (live_server) -> rows in the test database.

    scripts/test.sh -m integration
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from django.test import Client
from django.urls import reverse


ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

# tiny-cpu made tiny and short: two RL steps of a small model, still with a long tail.
TINY_SHORT = {
    "run": {"steps": 2, "checkpoint_interval": 1},
    "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "sft_steps": 30},
    "task": {"prompts_per_step": 4},
    "rollout": {"num_workers": 2, "samples_per_prompt": 2, "max_new_tokens": 48},
    "drafter": {"warmup_steps": 10, "batch_tokens": 256},
}


def tiny_short_yaml() -> str:
    from workers.tlt.config import preset

    return preset("tiny-cpu", TINY_SHORT).to_yaml()


def wait_for(predicate, timeout: float, what: str, on_timeout=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{on_timeout()}")


def _diagnose(run_id, worker) -> str:
    from tltweb.runs.models import Run

    run = Run.objects.filter(pk=run_id).first()
    info = f"run: {run and run.state} error={run and run.error!r}\nlog tail:\n{run and run.log_tail[-3000:]}"
    return info + "\n--- celery worker log ---\n" + worker.log.read_text()[-4000:]


@pytest.mark.skipif(not (ROOT / "workers/tlt/train.py").exists(), reason="the trainer (workers/tlt/train.py) is not there yet")
def test_a_tiny_run_launched_from_the_form_finishes_with_metrics_and_a_drafter(celery_worker_proc, alice_team, live_server):
    from tltweb.runs.models import Artifact, MetricStep, Run

    alice, team = alice_team
    client = Client()
    client.force_login(alice)
    resp = client.post(reverse("run-launch"), {"team": team.pk, "name": "integration", "preset": "tiny-cpu",
                                               "config_yaml": tiny_short_yaml(), "tags": "ci"})
    assert resp.status_code == 302, resp.content.decode()[-2000:]
    run = Run.objects.get(name="integration")

    wait_for(lambda: Run.objects.get(pk=run.pk).submitted_at, 60, "the Celery worker to submit the Ray job",
             lambda: _diagnose(run.id, celery_worker_proc))
    wait_for(lambda: Run.objects.get(pk=run.pk).state not in ("queued", "running"), 540, "the run to finish",
             lambda: _diagnose(run.id, celery_worker_proc))
    run.refresh_from_db()
    assert run.state == "succeeded", _diagnose(run.id, celery_worker_proc)
    steps = list(MetricStep.objects.filter(run=run).order_by("step"))
    assert len(steps) == 2
    assert "reward/mean" in steps[-1].scalars and "rollout/lengths" in steps[-1].series
    drafter = Artifact.objects.filter(run=run, kind="drafter").first()
    kinds = list(Artifact.objects.filter(run=run).values_list("kind", "step"))
    assert drafter is not None, f"no drafter artifact; got {kinds}\n{_diagnose(run.id, celery_worker_proc)}"
    assert drafter.size > 0 and len(drafter.sha256) == 64
    download = client.get(reverse("artifact-download", args=[run.id, drafter.pk]))
    assert download.status_code == 200
    import hashlib
    import io
    import zipfile

    data = b"".join(download.streaming_content)
    assert hashlib.sha256(data).hexdigest() == drafter.sha256
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert any(n.endswith("config.json") for n in names) and any(n.endswith("model.safetensors") for n in names)


@pytest.mark.browser
@pytest.mark.skipif(not (ROOT / "workers/tlt/train.py").exists(), reason="the trainer (workers/tlt/train.py) is not there yet")
def test_in_the_browser_a_real_run_fills_the_charts_and_a_clone_can_be_cancelled(
    celery_worker_proc, alice_team, live_server, page, screenshots
):
    import hashlib

    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

    from tests.web.test_browser import launch, login, trace_points, wait_points
    from tltweb.runs import dispatch
    from tltweb.runs.models import Run

    base = live_server.url
    # A real trainer shares the 2 CPU cores with the browser and the live server here, so page
    # loads can take far longer than Playwright's 20 s default; nothing below is a timing check.
    page.set_default_timeout(120_000)
    login(page, base)
    run = launch(page, base, "real run", tiny_short_yaml())

    diagnose = lambda: _diagnose(run.id, celery_worker_proc)  # noqa: E731
    wait_for(lambda: trace_points(page, "chart-reward") >= 1, 300, "the first step on the chart", diagnose)
    # The page reloads itself once the run ends; clicking before that reload lands would lose the
    # click. data-active is rendered by the server only, so "0" means the reloaded page is here.
    try:
        page.locator('#dashboard[data-active="0"]').wait_for(timeout=300_000)
    except PlaywrightTimeoutError:
        pytest.fail(f"timed out waiting for the run to end\n{diagnose()}")
    assert page.locator("#run-state .state-succeeded").count() == 1, diagnose()
    wait_points(page, "chart-reward", 2)
    assert trace_points(page, "chart-reward") == 2
    page.screenshot(path=str(screenshots / "real-run-succeeded.png"), full_page=True)
    with page.expect_download() as download_info:
        page.click("a.download[data-kind=drafter]")
    digest = hashlib.sha256(Path(download_info.value.path()).read_bytes()).hexdigest()
    assert digest in set(run.artifacts.filter(kind="drafter").values_list("sha256", flat=True))

    # Clone, wait until its trainer is running, cancel: the Ray job is stopped, the run cancelled.
    page.click("text=Clone")
    page.wait_for_url(lambda url: str(run.id) not in url and "/runs/" in url)
    clone = Run.objects.get(cloned_from=run)
    wait_for(lambda: Run.objects.get(pk=clone.pk).state == "running", 300, "the clone to run",
             lambda: _diagnose(clone.id, celery_worker_proc))
    page.once("dialog", lambda dialog: dialog.accept())  # cancel asks first
    page.click("#cancel-button")
    page.wait_for_selector("#run-state .state-cancelled")
    client = dispatch.ray_client()
    wait_for(lambda: dispatch.job_status(client.get_job_info(clone.submission_id)) in ("STOPPED", "SUCCEEDED"), 60,
             "Ray to stop the clone's job", lambda: _diagnose(clone.id, celery_worker_proc))
    assert Run.objects.get(pk=clone.pk).state == "cancelled"
    page.screenshot(path=str(screenshots / "real-run-cancelled.png"), full_page=True)
