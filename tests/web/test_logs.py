"""A job's log as people read it: no ANSI codes, tqdm bars collapsed to their last state, the tail
on the run page, and the whole log as a team-checked download once the run has ended."""

from __future__ import annotations

import pytest
from django.urls import reverse

from tests.web.test_dispatch import FakeJobs
from tltweb.accounts.services import api_token_create
from tltweb.runs import services
from tltweb.runs.logtext import log_clean, log_tail

RAW = (
    "\x1b[36m(RolloutWorker pid=123)\x1b[0m started\n"
    "sft:   0%|          | 0/300 [00:00<?, ?step/s]\rsft:  50%|█████     | 150/300 [00:10<00:10, 15.0step/s]"
    "\rsft: 100%|██████████| 300/300 [00:20<00:00, 15.0step/s]\n"
    "rl:  10%|█         | 1/10 [00:01<00:09, 1.00step/s, reward=0.100]\n"
    "rl:  20%|██        | 2/10 [00:02<00:08, 1.00step/s, reward=0.200]\n"
    "rl:  30%|███       | 3/10 [00:03<00:07, 1.00step/s, reward=0.300]\n"
    "\x1b[1m\x1b[31mERROR\x1b[0m something \x1b]8;;http://x\x07link\x1b]8;;\x07 happened\n"
)


def test_it_strips_ansi_codes_and_keeps_the_text():
    clean = log_clean(RAW)
    assert "\x1b" not in clean and "(RolloutWorker pid=123) started" in clean
    assert "ERROR something link happened" in clean


def test_it_collapses_a_tqdm_bar_to_its_last_state_on_one_line():
    lines = log_clean(RAW).splitlines()
    sft = [line for line in lines if line.startswith("sft:")]
    rl = [line for line in lines if line.startswith("rl:")]
    assert sft == ["sft: 100%|██████████| 300/300 [00:20<00:00, 15.0step/s]"]
    assert rl == ["rl:  30%|███       | 3/10 [00:03<00:07, 1.00step/s, reward=0.300]"]  # newline-separated redraws too
    assert len(lines) == 4


def test_two_different_bars_in_a_row_are_both_kept():
    text = "a:  50%|#    | 1/2 [00:01<00:01]\nb:  50%|#    | 1/2 [00:01<00:01]\n"
    assert log_clean(text).splitlines() == ["a:  50%|#    | 1/2 [00:01<00:01]", "b:  50%|#    | 1/2 [00:01<00:01]"]


def test_the_tail_is_the_last_lines_within_the_character_budget():
    text = "\n".join(f"line {i}" for i in range(1000))
    assert log_tail(text, lines=3) == "line 997\nline 998\nline 999"
    tail = log_tail(text, lines=1000, chars=50)
    assert len(tail) <= 50 and tail.endswith("line 999") and tail.startswith("line ")


@pytest.fixture
def ended(run):
    """A run whose Ray job ended: the sync kept its whole log."""
    jobs = FakeJobs()
    jobs.get_job_logs = lambda job_id: RAW * 400  # longer than the tail
    services.run_submit(run_id=run.id, client=jobs)
    jobs.jobs[run.submission_id].status = "SUCCEEDED"
    services.runs_sync(client=jobs)
    run.refresh_from_db()
    return run


def test_the_sync_keeps_the_whole_clean_log_and_a_clean_tail(ended):
    assert ended.state == "succeeded"
    assert "\x1b" not in ended.log_tail and len(ended.log_tail) <= services.LOG_TAIL_CHARS
    whole = services.run_log_path(ended).read_text()
    assert whole.count("started") == 400 and "\x1b" not in whole and "\r" not in whole


def test_the_run_page_shows_the_clean_tail_and_offers_the_whole_log(client, alice, ended):
    client.force_login(alice)
    html = client.get(reverse("run-detail", args=[ended.id])).content.decode()
    assert 'id="log-download"' in html and "\x1b" not in html and "100%|" in html


@pytest.mark.parametrize("who,status", [("alice", 200), ("bob", 200), ("charlie", 404)])
def test_the_whole_log_downloads_for_the_team_only(client, request, ended, bob, charlie, who, status):
    client.force_login(request.getfixturevalue(who))
    resp = client.get(reverse("run-log", args=[ended.id]))
    assert resp.status_code == status
    if status == 200:
        assert resp["Content-Disposition"].startswith("attachment;") and resp["Content-Type"].startswith("text/plain")
        assert resp.content.decode().count("started") == 400


def test_the_log_download_needs_a_login(client, ended):
    assert client.get(reverse("run-log", args=[ended.id])).status_code == 302


def test_the_api_serves_the_whole_log_and_says_when_there_is_none(client, alice, ended, run_make_active):
    token = api_token_create(user=alice, name="t")[1]
    resp = client.get(reverse("api-run-log", args=[ended.id]), HTTP_AUTHORIZATION=f"Bearer {token}")
    assert resp.status_code == 200 and "started" in resp.content.decode()
    assert client.get(reverse("api-run", args=[ended.id]), HTTP_AUTHORIZATION=f"Bearer {token}").json()["log_url"]
    resp = client.get(reverse("api-run-log", args=[run_make_active.id]), HTTP_AUTHORIZATION=f"Bearer {token}")
    assert resp.status_code == 404 and "no log yet" in resp.json()["error"]


@pytest.fixture
def run_make_active(team, alice):
    from tests.conftest import run_make

    return run_make(team, alice, name="still running", state="running")


def test_an_old_raw_tail_is_shown_clean(client, alice, run):
    run.log_tail = "\x1b[32mok\x1b[0m\nx:  10%|#  | 1/10\rx: 100%|###| 10/10\n"
    run.state = "failed"
    run.save()
    client.force_login(alice)
    html = client.get(reverse("run-detail", args=[run.id])).content.decode()
    assert "\x1b" not in html and "x: 100%|###| 10/10" in html and "x:  10%" not in html
