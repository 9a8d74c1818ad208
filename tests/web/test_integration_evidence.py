"""#14 end to end with real services and Chromium: a real tiny TLT run whose drafter is frozen by its
config (`drafter: {spot_training: false}`) raises the stale-drafter alert and uploads one drafter
version (three identical checkpoints, each with its model card); "Run baseline control" launches
its real baseline and the pair page fills both curves; a viewer sees the pair but has no launch.

    scripts/test.sh tests/web/test_integration_evidence.py
"""

from __future__ import annotations

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

from tests.conftest import PASSWORD
from tests.web.test_integration_run import TINY_SHORT, _diagnose, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.django_db(transaction=True)]

STEPS = 3


def frozen_drafter_yaml() -> str:
    from workers.tlt.config import preset

    # 150 SFT steps and 4 samples per prompt: some answers right and some wrong in a group, so the
    # policy really moves (grad norm > 0), which "stale" requires; the SFT'd policy is cached, so
    # the control (same model and seed) skips it. Seed 3: under the keyed race (e070cd7) seed 0's
    # first two steps drew no right answer at all (no gradient, no alert); seeds 1-3 moved in every step
    over = {**TINY_SHORT, "run": {**TINY_SHORT["run"], "steps": STEPS, "checkpoint_interval": 1, "seed": 3},
            "model": {**TINY_SHORT["model"], "sft_steps": 150},
            "rollout": {**TINY_SHORT["rollout"], "samples_per_prompt": 4},
            "drafter": {**TINY_SHORT["drafter"], "spot_training": False}}
    return preset("tiny-cpu", over).to_yaml()


def chart_traces(page, chart_id: str) -> list[int]:
    """Points on each trace of a chart ([] while the chart is not drawn)."""
    return page.evaluate(
        "id => { const el = document.getElementById(id); return el && el.data ? el.data.map(t => (t.y || []).filter(v => v !== null).length) : []; }",
        chart_id)


def wait_run_end(run_id, celery, timeout=540):
    from tltweb.runs.models import Run

    wait_for(lambda: Run.objects.get(pk=run_id).state not in ("queued", "running"), timeout, "the run to finish",
             lambda: _diagnose(run_id, celery))
    run = Run.objects.get(pk=run_id)
    assert run.state == "succeeded", _diagnose(run_id, celery)
    return run


def test_a_frozen_drafter_alerts_and_one_click_gives_the_pair_of_two_real_runs(
    settings, celery_worker_proc, live_server, page, browser, screenshots, hook
):
    from django.contrib.auth.models import User

    from tests.conftest import member_add
    from tests.web.test_browser import launch, login
    from tltweb.accounts.services import team_create
    from tltweb.runs.models import Artifact, Run, RunAlert

    settings.TLT_DRAFTER_STALE_STEPS = 2  # read where the steps arrive: the live server, in this process
    alice = User.objects.create_user("alice", password=PASSWORD)
    team = team_create(name="Alice's lab", owner=alice)
    bob = User.objects.create_user("bob", password=PASSWORD)
    member_add(team, bob, "viewer")
    team.alert_webhook_url = hook.url("/tlt-alerts")  # posted by the real Celery worker
    team.save()

    base = live_server.url
    page.set_default_timeout(120_000)  # a real trainer shares the 2 cores; nothing here checks a timing
    login(page, base)
    tlt = launch(page, base, "frozen drafter", frozen_drafter_yaml())
    assert tlt.config["drafter"]["spot_training"] is False and tlt.is_tlt
    # leave the live run page: it reloads itself 0.5 s after it sees the run end, and the goto below
    # was once interrupted by that reload ("interrupted by another navigation")
    page.goto("about:blank")
    tlt = wait_run_end(tlt.id, celery_worker_proc)

    # The alert: raised by the real run's own metrics (no applied drafter update while the policy moved).
    alert = RunAlert.objects.filter(run=tlt, kind="drafter_stale").first()
    assert alert is not None, [s for s in tlt.metric_steps.values_list("step", "scalars")]
    assert "spot training is off" in alert.message
    wait_for(lambda: RunAlert.objects.get(pk=alert.pk).webhook_state == "sent", 60, "the webhook POST",
             lambda: celery_worker_proc.log.read_text()[-3000:])
    assert [b["alert"] for b in hook.bodies] == ["drafter_stale"] and hook.bodies[0]["run"]["id"] == str(tlt.id)
    page.goto(f"{base}/runs/{tlt.id}/")
    page.locator('#dashboard[data-active="0"]').wait_for()
    assert "Drafter stale" in page.inner_text("#alert-banner")
    # The registry: three checkpoints of the one frozen drafter are one version, with a model card.
    drafters = list(Artifact.objects.filter(run=tlt, kind="drafter").order_by("step"))
    assert [a.step for a in drafters] == [1, 2, 3], [(a.kind, a.step) for a in tlt.artifacts.all()]
    assert len({a.content_sha256 for a in drafters}) == 1 and len({a.sha256 for a in drafters}) == 3  # cards differ
    assert page.locator("#drafter-versions tr[data-version]").count() == 1
    page.click("#drafter-versions details.model-card summary")
    card = page.inner_text("#drafter-versions details.model-card pre")
    assert '"rl_step": 3' in card and "vllm_speculative_config" in card and "target_sha256" in card
    with page.expect_download() as download:
        page.click("#latest-drafter")
    assert download.value.suggested_filename.endswith(".zip")
    page.screenshot(path=str(screenshots / "evidence-run-alert-registry.png"), full_page=True)
    page.goto(base + "/runs/")
    assert page.locator(f'tr[data-run="{tlt.id}"] .alert-badge').count() == 1

    # One click: the baseline control, then the pair page, filled as the real control runs.
    page.goto(f"{base}/runs/{tlt.id}/")
    assert page.inner_text("#ab-launch-button") == "Run baseline control"
    page.click("#ab-launch-button")
    page.wait_for_url(f"**/runs/{tlt.id}/pair")
    control = Run.objects.get(ab_partner=tlt)
    assert control.config["run"]["tlt"] is False and control.config["run"]["seed"] == tlt.config["run"]["seed"]
    wait_run_end(control.id, celery_worker_proc)
    try:
        page.wait_for_function(
            "() => { const el = document.getElementById('chart-pair-reward-wall');"
            " return el && el.data && el.data.length === 2 && el.data.every(t => t.y.filter(v => v !== null).length === %d); }" % STEPS,
            timeout=60_000)
    except PlaywrightTimeoutError:
        pytest.fail(f"the pair's curves did not fill: {chart_traces(page, 'chart-pair-reward-wall')}")
    for chart in ("chart-pair-reward-step", "chart-pair-accuracy-step", "chart-pair-length-wall"):
        assert chart_traces(page, chart) == [STEPS, STEPS], chart
    assert page.inner_text("#fig-e2e").endswith("×") and page.inner_text("#fig-bound").endswith("×")
    assert page.inner_text("#fig-parity") == "too few steps"  # 3 paired steps: the test says it cannot tell
    assert "sign-flip permutation test" in page.inner_text("#parity-method")
    page.screenshot(path=str(screenshots / "evidence-pair.png"), full_page=True)
    assert not RunAlert.objects.filter(run=control).exists()  # a baseline has no drafter to go stale

    # A viewer sees the pair and no launch button.
    viewer = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    viewer.set_default_timeout(120_000)
    login(viewer, base, "bob")
    viewer.goto(f"{base}/runs/{tlt.id}/pair")
    viewer.wait_for_function("() => { const el = document.getElementById('chart-pair-reward-step'); return el && el.data && el.data.length === 2; }")
    viewer.goto(f"{base}/runs/{tlt.id}/")
    assert viewer.locator("#ab-launch-button").count() == 0 and viewer.locator("#pair-link").count() == 1
    viewer.context.close()
