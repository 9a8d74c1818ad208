"""The run list: live columns (progress, phase, duration, latest reward and acceptance), sortable,
with filters and sort in the URL, and the same rows from the JSON endpoint its page polls."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from tests.conftest import metrics_record_fake, run_make
from tltweb.runs import services
from tltweb.runs.models import Run


@pytest.fixture
def three(team, alice):
    """Three runs: 'low' (2 steps, reward 0.3), 'high' (4 steps, reward 0.9), 'fresh' (no steps)."""
    now = timezone.now()
    runs = {}
    for name, steps, reward, minutes in (("low", 2, 0.3, 30), ("high", 4, 0.9, 5), ("fresh", 0, None, 0)):
        run = run_make(team, alice, name=name, tags=[name])
        for step in range(1, steps + 1):
            rec = metrics_record_fake(step)
            rec["scalars"]["reward/mean"] = reward * step / steps
            services.metrics_record(run=run, step=step, scalars=rec["scalars"], series=rec["series"])
        if minutes:
            Run.objects.filter(pk=run.pk).update(started_at=now - timedelta(minutes=minutes))
        runs[name] = Run.objects.get(pk=run.pk)
    return runs


def _api(client, **query):
    return client.get(reverse("api-runs"), query).json()["runs"]


def test_the_api_gives_each_run_its_live_columns(client, alice, three):
    client.force_login(alice)
    rows = {r["name"]: r for r in _api(client)}
    high = rows["high"]
    assert high["step"] == 4 and high["steps_total"] == three["high"].config["run"]["steps"]
    assert high["reward"] == pytest.approx(0.9) and high["acceptance"] == pytest.approx(2.4)
    assert high["phase"] == "RL training" and high["duration_s"] == pytest.approx(300, abs=5)
    assert rows["fresh"]["step"] is None and rows["fresh"]["reward"] is None and rows["fresh"]["duration_s"] is None
    assert rows["fresh"]["phase"] == "queued"


@pytest.mark.parametrize("sort,order", [
    ("-reward", ["high", "low", "fresh"]),
    ("reward", ["low", "high", "fresh"]),  # runs without a value go last either way
    ("-step", ["high", "low", "fresh"]),
    ("-duration", ["low", "high", "fresh"]),
    ("name", ["fresh", "high", "low"]),
    ("-created", ["fresh", "high", "low"]),
])
def test_it_sorts_by_each_column(client, alice, three, sort, order):
    client.force_login(alice)
    assert [r["name"] for r in _api(client, sort=sort)] == order
    page = client.get(reverse("run-list"), {"sort": sort}).content.decode()
    positions = [page.index(f">{name}</a>") for name in order]
    assert positions == sorted(positions)


def test_the_setup_phase_shows_while_the_trainer_prepares(client, alice, three):
    services.run_progress_record(run=three["fresh"], phase="drafter_warmup", done=50, total=200)
    client.force_login(alice)
    fresh = next(r for r in _api(client) if r["name"] == "fresh")
    assert fresh["phase"] == "Drafter warm-up" and fresh["phase_fraction"] == 0.25 and fresh["state"] == "running"
    assert "Drafter warm-up · 25%" in client.get(reverse("run-list")).content.decode()


def test_a_finished_run_shows_no_phase_and_a_fixed_duration(client, alice, three):
    run = three["low"]
    Run.objects.filter(pk=run.pk).update(state="succeeded", finished_at=run.started_at + timedelta(seconds=90))
    client.force_login(alice)
    low = next(r for r in _api(client) if r["name"] == "low")
    assert low["phase"] == "" and low["duration_s"] == pytest.approx(90)
    assert "1m 30s" in client.get(reverse("run-list")).content.decode()


def test_sort_links_keep_the_filters_and_flip_the_direction(client, alice, three):
    client.force_login(alice)
    resp = client.get(reverse("run-list"), {"tag": "high", "sort": "-reward"})
    html = resp.content.decode()
    assert 'href="?tag=high&amp;sort=reward"' in html  # the current column flips
    assert 'href="?tag=high&amp;sort=-step"' in html  # others start high to low
    assert 'aria-sort="descending"' in html
    assert [r.name for r in resp.context["runs"]] == ["high"]


def test_an_unknown_sort_on_the_page_falls_back_to_newest_first(client, alice, three):
    client.force_login(alice)
    resp = client.get(reverse("run-list"), {"sort": "bogus"})
    assert resp.status_code == 200 and resp.context["sort"] == "-created"


def test_the_page_polls_the_runs_api_with_its_own_query(client, alice, three):
    client.force_login(alice)
    html = client.get(reverse("run-list")).content.decode()
    assert 'data-api-url="/api/runs"' in html and "js/run_list.js" in html


def test_viewers_see_no_launch_link_anywhere(client, bob, three):
    client.force_login(bob)
    html = client.get(reverse("run-list")).content.decode()
    assert 'id="nav-launch"' not in html and 'id="launch-link"' not in html and reverse("run-launch") not in html


def test_editors_see_the_launch_links(client, alice, three):
    client.force_login(alice)
    html = client.get(reverse("run-list")).content.decode()
    assert 'id="nav-launch"' in html and 'id="launch-link"' in html


def test_viewers_see_no_cancel_clone_or_edit_on_a_run(client, bob, three):
    client.force_login(bob)
    html = client.get(reverse("run-detail", args=[three["high"].id])).content.decode()
    for marker in ('id="cancel-button"', "Clone</button>", "Edit &amp; relaunch", reverse("run-edit", args=[three["high"].id])):
        assert marker not in html
