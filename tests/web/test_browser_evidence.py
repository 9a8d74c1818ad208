"""Through Chromium (Playwright): the run page draws a step that did not measure a value as a gap
(never a zero, never a line bridging it), shows the long-tail charts of #14 from the trainer's
series, and an alert raised while the page is open joins its banner. The trainer is played by the real HttpSink posting to live_server."""

from __future__ import annotations

import pytest

from tests.conftest import PASSWORD, metrics_record_fake, run_make
from tests.web.test_browser import login, wait_points

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_unmeasured_steps_are_gaps_and_the_long_tail_charts_draw(page, live_server, screenshots):
    from django.contrib.auth.models import User

    from tltweb.accounts.services import team_create
    from tltweb.runs.services import run_token_rotate
    from workers.tlt.metrics import HttpSink

    alice = User.objects.create_user("alice", password=PASSWORD)
    run = run_make(team_create(name="Alice's lab", owner=alice), alice, name="gaps")
    sink = HttpSink(f"{live_server.url}/api/ingest/runs/{run.id}/", run_token_rotate(run=run), retry_s=1)
    def send(step):
        rec = metrics_record_fake(step)
        if step == 1:  # no spot update applied, the whole tail with SD: the trainer leaves these out
            for key in ("drafter/loss", "drafter/accuracy", "rollout/tail_tokens_per_s_no_sd"):
                rec["scalars"].pop(key)
        rec["scalars"]["rollout/tail_time_frac"] = 0.3
        rec["series"]["spec/arm_timeline"] = [{"worker": 0, "t": [0.0, 1.5, 2.5], "arm": ["off", "d4k1v4", "off"]}]
        rec["series"]["rollout/logprob_mismatch_hist"] = {"edges": [0, 1e-7, 1e-6, None], "counts": [5, 2, 1]}
        if step == 2:  # a losslessness failure at a checkpoint, while the page is open
            rec["scalars"].update({"audit/greedy_identical": 0.5, "audit/greedy_prompts": 2.0})
        sink.log(step, rec["scalars"], rec["series"])

    send(0)
    send(1)
    login(page, live_server.url)
    page.goto(f"{live_server.url}/runs/{run.id}/")
    wait_points(page, "chart-reward", 2)
    assert page.locator("#alert-banner").is_hidden()
    send(2)
    sink.close()
    wait_points(page, "chart-reward", 3)
    page.locator("#alert-banner").wait_for(state="visible")
    assert "Losslessness check failed" in page.inner_text("#alert-banner")
    loss = page.evaluate("() => { const t = document.getElementById('chart-drafter').data[0]; return [t.x, t.y, t.connectgaps]; }")
    assert loss[0] == [0, 1, 2] and loss[1][1] is None and loss[1][0] is not None and loss[2] is False
    tail = page.evaluate("() => document.getElementById('chart-tail').data[1].y")
    assert tail[1] is None and tail[0] == 180.0
    page.wait_for_function("() => { const el = document.getElementById('chart-arms'); return el && el.data && el.data.length === 1; }")
    assert page.evaluate("() => document.getElementById('chart-arms').data[0].y") == ["off", "d4k1v4", "off", "off"]
    assert page.evaluate("() => document.getElementById('chart-mismatch-hist').data[0].y") == [5, 2, 1]
    assert page.evaluate("() => document.getElementById('chart-tail-frac').data[0].y") == [0.3, 0.3, 0.3]
    page.screenshot(path=str(screenshots / "evidence-gaps-long-tail.png"), full_page=True)
