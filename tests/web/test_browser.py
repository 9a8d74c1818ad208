"""Through Chromium (Playwright): log in, launch, watch the charts fill as steps arrive, download
the drafter, cancel; a screenshot of every page lands in test-artifacts/screenshots/.

The trainer is played by the real HttpSink from workers/tlt/metrics.py posting to live_server.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
from playwright.sync_api import Error as PlaywrightError

from tests.conftest import PASSWORD, metrics_record_fake

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def no_dispatch(monkeypatch):
    """No Celery worker here: launches and cancels stay in the database."""
    from workers import tasks

    monkeypatch.setattr(tasks.run_submit, "delay", lambda run_id: None)
    monkeypatch.setattr(tasks.run_cancel, "delay", lambda run_id: None)


def login(page, base: str, username: str = "alice") -> None:
    page.goto(base + "/login/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(base + "/runs/")


def launch(page, base: str, name: str, config_yaml: str):
    """Launch a run from the browser's form (logged in); its Run once the page shows it."""
    from tltweb.runs.models import Run

    page.goto(base + "/runs/new")
    page.fill("#id_name", name)
    page.fill("#id_config_yaml", config_yaml)
    page.click("#launch-form button[type=submit]")
    page.wait_for_url("**/runs/*/")
    return Run.objects.get(name=name)


def trace_points(page, chart_id: str) -> int:
    """Points on a chart's first trace; 0 while the page is reloading (the run page reloads itself
    once the run ends, and a script evaluated mid-reload loses its document)."""
    try:
        return page.evaluate(
            "id => { const el = document.getElementById(id); return el && el.data && el.data[0] ? el.data[0].x.length : 0; }",
            chart_id,
        )
    except PlaywrightError as error:
        if "context was destroyed" in str(error) or "navigat" in str(error):
            return 0
        raise


def wait_points(page, chart_id: str, n: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while trace_points(page, chart_id) < n:
        assert time.monotonic() < deadline, f"{chart_id} never showed {n} points"
        page.wait_for_timeout(250)


def test_log_in_launch_watch_charts_fill_download_and_cancel(page, live_server, alice_team, no_dispatch, screenshots, tmp_path):
    from tltweb.runs.models import Run
    from tltweb.runs.services import run_token_rotate
    from workers.tlt.metrics import HttpSink

    base = live_server.url
    page.goto(base + "/login/")
    page.screenshot(path=str(screenshots / "login.png"), full_page=True)
    login(page, base)

    page.goto(base + "/runs/new")
    assert "sft_steps" in page.input_value("#id_config_yaml")
    page.fill("#id_name", "browser run")
    page.fill("#id_tags", "browser, demo")
    page.screenshot(path=str(screenshots / "launch.png"), full_page=True)
    page.click("#launch-form button[type=submit]")
    page.wait_for_url("**/runs/*/")
    run = Run.objects.get(name="browser run")
    assert run.tags == ["browser", "demo"]

    # The "trainer": the real HttpSink, posting steps while the page polls.
    token = run_token_rotate(run=run)
    sink = HttpSink(f"{base}/api/ingest/runs/{run.id}/", token, retry_s=1)
    rec = metrics_record_fake(0)
    sink.log(0, rec["scalars"], rec["series"])
    wait_points(page, "chart-reward", 1)
    page.wait_for_selector("#run-state .state-running")
    for step in (1, 2):
        rec = metrics_record_fake(step)
        sink.log(step, rec["scalars"], rec["series"])
    wait_points(page, "chart-reward", 3)
    wait_points(page, "chart-timing", 3)
    assert trace_points(page, "chart-lengths-hist") == 8  # the histogram of the newest step
    assert page.input_value("#step-slider") == "2"
    page.screenshot(path=str(screenshots / "run-detail-live.png"), full_page=True)

    # Older step on the slider redraws the per-step charts.
    page.eval_on_selector("#step-slider", "el => { el.value = 0; el.dispatchEvent(new Event('input')); }")
    page.wait_for_function("document.getElementById('step-label').textContent === '0'")

    drafter = tmp_path / "drafter.zip"
    drafter.write_bytes(b"PK\x05\x06" + bytes(18) + b"drafter weights")
    sink.artifact("drafter", 2, drafter)
    rec = metrics_record_fake(3)
    sink.log(3, rec["scalars"], rec["series"])  # a new step makes the page look for new artifacts
    sink.close()
    page.wait_for_selector("a.download[data-kind=drafter]")
    with page.expect_download() as download_info:
        page.click("a.download[data-kind=drafter]")
    downloaded = Path(download_info.value.path())
    assert hashlib.sha256(downloaded.read_bytes()).hexdigest() == hashlib.sha256(drafter.read_bytes()).hexdigest()

    page.once("dialog", lambda dialog: dialog.accept())  # "Cancel ...? The job stops now"
    page.click("#cancel-button")
    page.wait_for_selector("#run-state .state-cancelled")
    run.refresh_from_db()
    assert run.state == "cancelled"
    page.screenshot(path=str(screenshots / "run-detail-cancelled.png"), full_page=True)


def test_every_page_renders_in_the_browser(page, live_server, alice_team, no_dispatch, screenshots):
    from tests.conftest import run_make
    from tltweb.runs.services import metrics_record

    alice, team = alice_team
    runs = [run_make(team, alice, name=f"run {i}", tags=["sweep"]) for i in range(2)]
    for i, run in enumerate(runs):
        for step in range(4):
            rec = metrics_record_fake(step)
            rec["scalars"]["reward/mean"] += 0.2 * i
            metrics_record(run=run, step=step, scalars=rec["scalars"], series=rec["series"])
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    base = live_server.url
    login(page, base)
    page.screenshot(path=str(screenshots / "run-list.png"), full_page=True)
    page.check(f"input[value='{runs[0].id}']")
    page.check(f"input[value='{runs[1].id}']")
    page.click("#compare-button")
    page.wait_for_url("**/runs/compare?**")
    wait_points(page, "chart-compare", 4)
    page.screenshot(path=str(screenshots / "compare.png"), full_page=True)
    page.goto(f"{base}/runs/{runs[0].id}/")
    wait_points(page, "chart-reward", 4)
    page.screenshot(path=str(screenshots / "run-detail.png"), full_page=True)
    for name, path in [("team", f"/teams/{team.pk}/"), ("tokens", "/account/tokens/")]:
        page.goto(base + path)
        page.screenshot(path=str(screenshots / f"{name}.png"), full_page=True)
    page.click("text=Create token")
    assert page.text_content("#new-token").startswith("tlt_")
    assert not errors, errors


def test_a_run_that_never_started_says_why_stops_polling_and_resumes_on_a_click(page, live_server, alice_team, no_dispatch,
                                                                                  screenshots):
    from django.utils import timezone

    from tests.conftest import run_make
    from tltweb.runs.models import Run

    alice, team = alice_team
    run = run_make(team, alice, name="never started", state="failed", failure="submit", finished_at=timezone.now(),
                   error="could not submit to Ray: Failed to connect to Ray at http://127.0.0.1:8265")
    polls: list[str] = []
    page.on("request", lambda req: polls.append(req.url) if "/metrics" in req.url else None)
    base = live_server.url
    login(page, base)
    page.goto(f"{base}/runs/{run.id}/")
    page.wait_for_function("document.getElementById('summary').textContent.startsWith('No steps')")
    assert "before its first step" in page.text_content("#summary")
    assert "could not submit to Ray" in page.text_content("#run-error")
    page.wait_for_timeout(5000)  # a live page polls every 2 s; this one must not
    assert len(polls) == 1, polls
    page.screenshot(path=str(screenshots / "run-never-started.png"), full_page=True)

    page.click("#resume-button")
    page.wait_for_selector("#run-state .state-queued")
    assert "Attempt 2" in page.text_content("#attempts") and "after attempt 1 failed" in page.text_content("#attempts")
    run.refresh_from_db()
    assert run.state == "queued" and run.attempt == 1 and run.attempts_log[0]["resumed_by"] == "alice"
    page.screenshot(path=str(screenshots / "run-resumed.png"), full_page=True)
    assert Run.objects.count() == 1
