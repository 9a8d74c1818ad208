"""Fault injection on real services: a tiny run (24 RL steps, a checkpoint each) through a real
Celery worker, a real Ray job and the live server, and in the middle of it

- kill -9 of the Celery worker (restarted like a supervisor would),
- kill -9 of the Ray job's driver (the trainer process),
- kill -9 of one Ray rollout-worker actor,
- the web app unreachable for TLT_TEST_OUTAGE_S seconds (default 20: several
  rounds of the trainers' back-off, at most 2 s in the tests).

Each time the run must end succeeded (resumed where its job died), with the metrics of every step,
its checkpoints complete, artifacts matching their sha256, and no process of a dead job left behind.

    scripts/test.sh tests/web/test_faults.py
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
import requests

from tests.conftest import pids_alive, pids_matching
from tests.web.test_integration_run import TINY_SHORT, _diagnose, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

STEPS = 24  # a tiny step (with its checkpoint) takes ~0.1-0.3 s: 24 leave seconds for a fault to land mid-run

OUTAGE_S = float(os.environ.get("TLT_TEST_OUTAGE_S", "20"))


def _yaml() -> str:
    from workers.tlt.config import preset

    return preset("tiny-cpu", {**TINY_SHORT, "run": {"steps": STEPS, "checkpoint_interval": 1}}).to_yaml()


def wait_fast(predicate, timeout: float, what: str, on_timeout=lambda: "", run_id=None):
    """wait_for at 50 ms: a tiny run's steps are short, and a fault must land between them. With run_id,
    it stops as soon as the run has ended before the predicate held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if run_id is not None and not _run(run_id).is_active:
            pytest.fail(f"the run ended while waiting for {what}\n{on_timeout()}")
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{on_timeout()}")


def _trained_steps(out_dir: str) -> int:
    """Steps the trainer has finished (its own metrics.jsonl), whatever the platform has seen."""
    try:
        lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return len({json.loads(ln)["step"] for ln in lines if '"scalars"' in ln})


@pytest.fixture
def launch(alice_team, celery_worker_proc, settings):
    from tltweb.runs.services import run_launch

    alice, team = alice_team
    settings.TLT_LAUNCH_CHECK_CLUSTER = True  # the real cluster is asked, as in production

    def go(name: str):
        return run_launch(user=alice, team=team, name=name, preset="tiny-cpu", config_yaml=_yaml())

    return go


def _run(run_id):
    from tltweb.runs.models import Run

    return Run.objects.get(pk=run_id)


def _steps(run_id) -> list[int]:
    from tltweb.runs.models import MetricStep

    return sorted(MetricStep.objects.filter(run_id=run_id).values_list("step", flat=True))


def _latest_checkpoint(out_dir: str) -> int:
    from workers.tlt.checkpoint import CheckpointManager

    latest = CheckpointManager(Path(out_dir) / "checkpoints").latest()
    return int(latest.name.split("_")[-1]) if latest else 0


def _ray_get(path: str) -> dict:
    from django.conf import settings

    from tltweb.runs.dispatch import ray_auth_headers

    resp = requests.get(settings.RAY_ADDRESS.rstrip("/") + path, headers=ray_auth_headers(), timeout=10)
    resp.raise_for_status()
    return resp.json()


def _actors(job_id: str) -> list[dict]:
    data = _ray_get(f"/api/v0/actors?limit=1000&detail=1&filter_keys=job_id&filter_predicates=%3D&filter_values={job_id}")
    return data["data"]["result"]["result"]


def _job_id(submission_id: str) -> str:
    from tltweb.runs import dispatch

    return dispatch.ray_client().get_job_info(submission_id).job_id


def assert_finished_whole(run_id, worker, *, before: dict[int, dict] | None = None) -> None:
    """Succeeded, every step's metrics (those recorded before the fault unchanged), the last checkpoint
    complete, every artifact stored whole (its file's sha256 is the recorded one), the spool empty."""
    from django.conf import settings

    from tltweb.runs.models import Artifact, MetricStep

    run = _run(run_id)
    assert run.state == "succeeded", _diagnose(run_id, worker)
    assert _steps(run_id) == list(range(1, STEPS + 1)), _diagnose(run_id, worker)
    for step, scalars in (before or {}).items():
        assert MetricStep.objects.get(run_id=run_id, step=step).scalars == scalars, step
    assert _latest_checkpoint(run.out_dir) == STEPS
    artifacts = list(Artifact.objects.filter(run_id=run_id))
    assert {a.kind for a in artifacts} >= {"drafter", "policy"}, [(a.kind, a.step) for a in artifacts]
    for a in artifacts:
        stored = Path(settings.TLT_ARTIFACT_DIR) / a.path
        assert stored.stat().st_size == a.size and hashlib.sha256(stored.read_bytes()).hexdigest() == a.sha256
    policy = Artifact.objects.get(run_id=run_id, kind="policy")
    assert hashlib.sha256((Path(run.out_dir) / "policy.zip").read_bytes()).hexdigest() == policy.sha256
    assert not list((Path(run.out_dir) / "spool" / "pending").glob("*.json"))
    assert not pids_matching("workers.tlt.train", run.out_dir), "a trainer process of this run is still there"


def test_a_run_survives_kill_9_of_the_celery_worker(launch, celery_worker_proc):
    procs = celery_worker_proc
    run = launch("worker killed")
    wait_fast(lambda: _steps(run.id), 300, "the first step", lambda: _diagnose(run.id, procs), run_id=run.id)
    beat_pid = procs.beat.pid
    worker_pid = procs.kill_worker()
    assert not pids_alive([worker_pid])
    with pytest.raises(ProcessLookupError):
        os.killpg(worker_pid, 0)  # nothing of the worker's process group is left either
    time.sleep(5)  # the run trains on with no worker at all
    procs.start_worker()  # what compose's restart policy (or a supervisor) does
    wait_for(lambda: not _run(run.id).is_active, 300, "the run to finish", lambda: _diagnose(run.id, procs))
    assert_finished_whole(run.id, procs)
    assert _run(run.id).attempt == 0  # its Ray job never noticed
    # one scheduler, the same one: the kill did not orphan it and the restart did not start another
    assert procs.beat.poll() is None
    assert pids_matching("celery", " beat ", str(procs.work / "beat-schedule")) == [beat_pid]


def test_a_run_whose_driver_is_killed_resumes_from_its_last_checkpoint(launch, celery_worker_proc):
    procs = celery_worker_proc
    run = launch("driver killed")
    wait_for(lambda: _run(run.id).out_dir, 120, "the submit", lambda: _diagnose(run.id, procs))
    out_dir = _run(run.id).out_dir
    wait_fast(lambda: _latest_checkpoint(out_dir) >= 2, 300, "the checkpoint of step 2", lambda: _diagnose(run.id, procs),
              run_id=run.id)
    run = _run(run.id)
    from tltweb.runs.models import MetricStep

    kept = _latest_checkpoint(run.out_dir)
    before = {r.step: r.scalars for r in MetricStep.objects.filter(run=run, step__lte=kept)}
    job_id = _job_id(run.submission_id)
    drivers = pids_matching("workers.tlt.train", run.out_dir)
    for pid in drivers:
        os.kill(pid, signal.SIGKILL)
    assert drivers and _trained_steps(run.out_dir) < STEPS, "the run ended before the fault could land"
    wait_for(lambda: _run(run.id).attempt >= 1, 120, "the automatic resume", lambda: _diagnose(run.id, procs))
    wait_for(lambda: not _run(run.id).is_active, 300, "the resumed run to finish", lambda: _diagnose(run.id, procs))
    assert_finished_whole(run.id, procs, before=before)
    run = _run(run.id)
    assert run.attempt == 1 and run.auto_resumes == 1
    first = run.attempts_log[0]
    assert first["state"] == "failed" and first["failure"] == "infra" and first["resumed_by"] == "auto"
    assert "-9" in first["error"], first  # Ray: "Job entrypoint command failed with exit code -9"
    assert not pids_alive(drivers)
    assert all(a["state"] == "DEAD" for a in _actors(job_id)), _actors(job_id)  # the dead job's workers went too
    log = (Path(run.out_dir) / "metrics.jsonl").read_text().splitlines()
    assert {json.loads(line)["step"] for line in log if '"scalars"' in line} == set(range(1, STEPS + 1))


def test_a_run_whose_rollout_worker_is_killed_ends_resumed_or_failed_and_resumable(launch, celery_worker_proc, alice_team):
    """A dead rollout actor. Restarting it inside the job is trainer-side work (others' part of #12);
    today it surfaces either as a RayActorError (the driver exits 69 and the platform resumes the run
    by itself) or as an error of the trainer's own (exit 1: e.g. the coordinator missing the dead
    worker's report, `KeyError: 'steps'` in CoordinatorImpl.finish), which leaves the run failed and
    resumable. Either way the checkpoints and the metrics so far are intact, and the run, resumed with
    the Resume action where it was not resumed already, ends succeeded with every step."""
    from tltweb.runs.models import MetricStep
    from tltweb.runs.services import run_resume

    procs = celery_worker_proc
    run = launch("rollout worker killed")
    wait_for(lambda: _run(run.id).out_dir, 120, "the submit", lambda: _diagnose(run.id, procs))
    out_dir = _run(run.id).out_dir
    job_id = wait_for(lambda: _job_id(_run(run.id).submission_id), 120, "the Ray job's id")
    workers = wait_fast(lambda: _latest_checkpoint(out_dir) >= 1 and [
        a for a in _actors(job_id) if a.get("class_name", "").startswith("RolloutWorker") and a["state"] == "ALIVE"],
        300, "a checkpoint and live rollout workers", lambda: _diagnose(run.id, procs), run_id=run.id)
    kept = _latest_checkpoint(out_dir)
    before = {r.step: r.scalars for r in MetricStep.objects.filter(run_id=run.id, step__lte=kept)}
    os.kill(int(workers[0]["pid"]), signal.SIGKILL)
    assert _trained_steps(out_dir) < STEPS, "the run ended before the fault could land"
    wait_for(lambda: not _run(run.id).is_active, 420, "the run to end", lambda: _diagnose(run.id, procs))
    run = _run(run.id)
    if run.state == "failed":  # failed and resumable: the checkpoints are there, a click resumes it
        assert run.is_resumable and run.failure in ("trainer", "infra"), (run.failure, run.error[-2000:])
        assert _latest_checkpoint(out_dir) >= kept and set(before) <= set(_steps(run.id))
        alice, _ = alice_team
        run_resume(run=run, user=alice)
        wait_for(lambda: not _run(run.id).is_active, 420, "the resumed run to finish", lambda: _diagnose(run.id, procs))
    assert_finished_whole(run.id, procs, before=before)
    run = _run(run.id)
    assert all(a["state"] == "DEAD" for a in _actors(job_id))  # nothing of the first job is left
    if run.attempt:
        assert run.attempts_log[0]["failure"] in ("infra", "trainer"), run.attempts_log


def test_a_run_loses_nothing_while_the_web_app_is_away(launch, celery_worker_proc, ingest_gate, settings):
    procs = celery_worker_proc
    run = launch("web app away")
    wait_fast(lambda: _steps(run.id), 300, "the first step", lambda: _diagnose(run.id, procs), run_id=run.id)
    ingest_gate.stop()
    try:
        outage_end = time.monotonic() + OUTAGE_S
        time.sleep(1)  # a request whose bytes were through before the cut may still commit
        delivered = _steps(run.id)
        out = Path(_run(run.id).out_dir)
        # The trainer goes on: its steps reach metrics.jsonl (and its spool), not the platform.
        wait_for(lambda: _trained_steps(out) > len(delivered), OUTAGE_S, "a step trained during the outage",
                 lambda: _diagnose(run.id, procs))
        while time.monotonic() < outage_end:
            time.sleep(1)
        assert _steps(run.id) == delivered  # nothing got through meanwhile
        assert list((out / "spool" / "pending").glob("*.json")), "the spool holds what the platform missed"
        assert _run(run.id).is_active  # the job did not die of it
    finally:
        ingest_gate.start()
    wait_for(lambda: not _run(run.id).is_active, 300, "the run to finish after the outage",
             lambda: _diagnose(run.id, procs))
    assert_finished_whole(run.id, procs)
    assert _run(run.id).attempt == 0
