"""Through Chromium (Playwright), the pages of issue #15: the live, sortable run list; setup
progress with its ETA; cancel that asks first; the cleaned log and its download; the rollout sample
viewer; teams created and joined from the UI, with links only for those who may follow them; the
API docs served offline; the favicon; YAML errors that keep their layout.

The trainer is played by the real HttpSink (workers/tlt/metrics.py) posting to live_server.
Screenshots land in test-artifacts/screenshots/.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import PASSWORD, member_add, metrics_record_fake, run_make
from tests.web.test_browser import login

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def lab(db):
    """alice owns "Alice's lab" (two runs); bob is a viewer there."""
    from django.contrib.auth.models import User
    from tltweb.accounts.services import team_create

    alice = User.objects.create_user("alice", password=PASSWORD)
    bob = User.objects.create_user("bob", password=PASSWORD)
    team = team_create(name="Alice's lab", owner=alice)
    member_add(team, bob, "viewer")
    return alice, bob, team


@pytest.fixture
def no_dispatch(monkeypatch):
    from workers import tasks

    monkeypatch.setattr(tasks.run_submit, "delay", lambda run_id: None)
    monkeypatch.setattr(tasks.run_cancel, "delay", lambda run_id: None)


def _sink(base, run):
    from tltweb.runs.services import run_token_rotate
    from workers.tlt.metrics import HttpSink

    return HttpSink(f"{base}/api/ingest/runs/{run.id}/", run_token_rotate(run=run), retry_s=1)


def _rows(page) -> list[str]:
    return page.eval_on_selector_all("#run-rows tr[data-run] td:nth-child(2) a", "els => els.map(e => e.textContent)")


def test_the_run_list_refreshes_itself_sorts_and_keeps_its_filters_in_the_url(page, live_server, lab, screenshots):
    alice, _, team = lab
    base = live_server.url
    first, second = run_make(team, alice, name="first run", tags=["sweep"]), run_make(team, alice, name="second run", tags=["sweep"])
    sink = _sink(base, first)
    rec = metrics_record_fake(1)
    sink.log(1, rec["scalars"], rec["series"])  # first: reward 0.1
    login(page, base)
    page.goto(base + "/runs/?sort=-reward")
    assert _rows(page) == ["first run", "second run"]
    assert page.text_content(f"tr[data-run='{first.id}'] .c-progress") == f"1/{first.config['run']['steps']}"

    # the trainer of the second run reports: the list re-sorts itself without a reload
    other = _sink(base, second)
    rec = metrics_record_fake(3)
    other.log(3, rec["scalars"], rec["series"])  # reward 0.3
    page.wait_for_function("document.querySelector('#run-rows tr[data-run] td:nth-child(2) a').textContent === 'second run'",
                           timeout=15_000)
    assert page.text_content(f"tr[data-run='{second.id}'] .c-reward") == "0.300"
    assert page.text_content(f"tr[data-run='{second.id}'] .c-phase") == "RL training"
    page.screenshot(path=str(screenshots / "run-list-live.png"), full_page=True)

    page.click("th[data-sort-key=name] a")  # a header sorts; the URL keeps it
    page.wait_for_url("**sort=name**")
    assert _rows(page) == ["first run", "second run"]
    page.select_option("select[name=tag]", "sweep")  # a filter applies at once, into the URL
    page.wait_for_url("**tag=sweep**")
    assert "sort=name" in page.url and _rows(page) == ["first run", "second run"]
    page.reload()
    assert page.input_value("select[name=tag]") == "sweep" and _rows(page) == ["first run", "second run"]
    sink.close()
    other.close()


def test_the_run_page_shows_setup_progress_and_its_eta_then_the_steps(page, live_server, lab, no_dispatch, screenshots):
    alice, _, team = lab
    base = live_server.url
    run = run_make(team, alice, name="warming up")
    sink = _sink(base, run)
    login(page, base)
    page.goto(f"{base}/runs/{run.id}/")
    assert page.is_hidden("#progress")

    sink.progress("policy", 0, 300, "preparing the policy")
    page.wait_for_timeout(1200)
    sink.progress("policy", 60, 300, "SFT step 60/300, loss 1.234")
    page.wait_for_selector("#progress:not([hidden])")
    page.wait_for_function("document.getElementById('progress-count').textContent === '60/300'")
    assert page.text_content("#progress-phase") == "Policy preparation (SFT)"
    assert page.text_content("#progress-message") == "SFT step 60/300, loss 1.234"
    assert page.text_content("#progress-eta").startswith("ETA ")
    assert page.eval_on_selector("#progress-bar", "e => e.value") == pytest.approx(0.2)
    page.screenshot(path=str(screenshots / "run-detail-setup-progress.png"), full_page=True)

    sink.progress("policy", 300, 300, "policy ready")
    sink.progress("drafter_warmup", 0, 200, "training the drafter")
    page.wait_for_function("document.getElementById('progress-phase').textContent === 'Drafter warm-up'")
    page.wait_for_function("document.getElementById('progress-phases').textContent.includes('Policy preparation (SFT)')")

    sink.progress("rl", 1, 4, "step 1/4")
    rec = metrics_record_fake(1)
    sink.log(1, rec["scalars"], rec["series"])
    page.wait_for_function("document.getElementById('progress-phase').textContent === 'RL step 1 of 4'")
    page.wait_for_selector("#samples-link:not([hidden])")
    sink.close()


def test_cancel_asks_first_and_does_nothing_when_the_user_says_no(page, live_server, lab, no_dispatch):
    from tltweb.runs.models import Run

    alice, _, team = lab
    base = live_server.url
    run = run_make(team, alice, name="keep me")
    login(page, base)
    page.goto(f"{base}/runs/{run.id}/")
    messages = []

    def answer(dialog, accept):
        messages.append(dialog.message)
        dialog.accept() if accept else dialog.dismiss()

    page.once("dialog", lambda d: answer(d, False))
    page.click("#cancel-button")
    page.wait_for_timeout(500)
    assert Run.objects.get(pk=run.pk).state == "queued" and "keep me" in messages[0] and "checkpoints" in messages[0]
    page.once("dialog", lambda d: answer(d, True))
    page.click("#cancel-button")
    page.wait_for_selector("#run-state .state-cancelled")
    assert Run.objects.get(pk=run.pk).state == "cancelled"


def test_the_log_is_clean_and_downloads_whole(page, live_server, lab, screenshots):
    from tltweb.runs import services
    from tltweb.runs.models import Run

    alice, _, team = lab
    base = live_server.url
    run = run_make(team, alice, name="finished run", state="succeeded")
    raw = "".join(f"\x1b[32mstep {i}\x1b[0m done\n" for i in range(500))
    raw += "rl:  50%|#    | 5/10 [00:05<00:05]\rrl: 100%|#####| 10/10 [00:10<00:00]\n"
    Run.objects.filter(pk=run.pk).update(log_tail=services.run_log_save(run=run, text=raw))
    login(page, base)
    page.goto(f"{base}/runs/{run.id}/")
    tail = page.text_content("#log-tail")
    assert "\x1b" not in tail and "[32m" not in tail and "step 499 done" in tail and "rl:  50%" not in tail
    page.screenshot(path=str(screenshots / "run-detail-log.png"), full_page=True)
    with page.expect_download() as info:
        page.click("#log-download")
    whole = Path(info.value.path()).read_text()
    assert whole.count(" done\n") == 500 and "step 0 done" in whole and whole.endswith("10/10 [00:10<00:00]\n")


def test_the_sample_viewer_browses_steps_marks_drafted_tokens_and_filters(page, live_server, lab, screenshots):
    alice, _, team = lab
    base = live_server.url
    run = run_make(team, alice, name="with samples")
    sink = _sink(base, run)
    for step in (1, 2):
        rec = metrics_record_fake(step)
        sink.log(step, rec["scalars"], rec["series"])
    sink.close()
    login(page, base)
    page.goto(f"{base}/runs/{run.id}/")
    page.click("#samples-link")
    page.wait_for_url("**/samples")
    assert page.input_value("#step-select") == "2"  # the newest step first
    assert page.locator("article.sample").count() == 4
    assert page.locator("article.sample[data-sample='0'] .tok.from-draft").count() == 1
    assert page.text_content("article.sample[data-sample='0'] .sample-prompt pre") == "step 2 problem 0: 3 + 4 = ?"
    page.screenshot(path=str(screenshots / "samples.png"), full_page=True)

    page.select_option("#step-select", "1")  # another step, at once
    page.wait_for_url("**step=1**")
    assert "step 1 problem 0" in page.text_content("article.sample[data-sample='0']")
    page.fill("input[name=min_reward]", "0.5")
    page.fill("input[name=min_length]", "10")
    page.click("#sample-filters button[type=submit]")
    page.wait_for_url("**min_reward=0.5**")
    assert page.locator("article.sample").count() == 1
    assert page.get_attribute("article.sample", "data-sample") == "2"  # reward 1.0, 12 tokens
    page.click("#next-step")  # the filters stay while paging
    page.wait_for_url("**step=2**")
    assert "min_reward=0.5" in page.url and page.locator("article.sample").count() == 1


def test_teams_are_created_and_joined_from_the_ui_and_viewers_get_no_launch_link(page, live_server, lab, screenshots):
    from django.contrib.auth.models import User

    base = live_server.url
    User.objects.create_user("dana", password=PASSWORD)
    login(page, base)
    page.goto(base + "/teams/")
    page.fill("#team-name", "Reasoning lab")
    page.click("#team-create-form button[type=submit]")
    page.wait_for_url("**/teams/*/")
    assert page.text_content("h1") == "Reasoning lab"
    page.fill("#invite-username", "dana")
    page.select_option("#invite-role", "viewer")
    page.click("#invite-form button[type=submit]")
    page.wait_for_selector("text=Member saved.")
    assert page.is_visible("button[data-remove=dana]")
    page.screenshot(path=str(screenshots / "team-invite.png"), full_page=True)

    page.click("button.link[type=submit]:has-text('Log out')")
    login(page, base, "dana")
    assert page.locator("#nav-launch").count() == 0 and page.locator("#launch-link").count() == 0
    page.goto(base + "/teams/")
    assert "Reasoning lab" in page.text_content("#team-table") and "Viewer" in page.text_content("#team-table")
    page.screenshot(path=str(screenshots / "teams.png"), full_page=True)


def test_the_api_docs_render_from_the_vendored_bundle_without_the_network(page, live_server, lab, screenshots):
    base = live_server.url
    elsewhere: list[str] = []
    page.on("request", lambda req: None if req.url.startswith(base) or req.url.startswith("data:") else elsewhere.append(req.url))
    login(page, base)
    page.goto(base + "/api/docs")
    page.wait_for_selector(".swagger-ui .info .title")
    assert "TLT Platform API" in page.text_content(".swagger-ui .info .title")
    page.get_by_text("/api/runs/{run_id}/cancel", exact=True).wait_for()  # every operation is listed
    page.screenshot(path=str(screenshots / "api-docs.png"), full_page=False)
    assert elsewhere == []


def test_every_page_has_the_favicon(page, live_server, lab):
    base = live_server.url
    login(page, base)
    href = page.get_attribute("link[rel=icon]", "href")
    assert href.endswith("favicon.svg")
    resp = page.goto(base + "/favicon.ico")
    assert resp.ok and "svg" in resp.headers["content-type"]


def test_a_yaml_error_on_the_launch_form_keeps_its_lines_and_caret(page, live_server, lab, no_dispatch, screenshots):
    base = live_server.url
    login(page, base)
    page.goto(base + "/runs/new")
    page.fill("#id_config_yaml", "run:\n  steps: 3\n   seed: [1, 2\nmodel: {}\n")
    page.click("#launch-form button[type=submit]")
    page.wait_for_selector("#config-errors pre.yaml-error")
    text = page.inner_text("#config-errors pre.yaml-error")
    lines = text.splitlines()
    assert len(lines) >= 3, text  # "mapping values are not allowed here", "  in ... line 3, column 8", ...
    assert any("line 3" in line for line in lines)
    assert page.eval_on_selector("#config-errors pre.yaml-error", "e => getComputedStyle(e).whiteSpace") == "pre"
    page.screenshot(path=str(screenshots / "launch-yaml-error.png"), full_page=True)
