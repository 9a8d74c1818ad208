"""Delivery from the trainer to the platform: HttpSink (bounded retries, streamed uploads) and
SpoolSink (local spool, background delivery), against the real ingestion endpoints of the live
server, reached through a Gate that can stop "the web app" or cut an upload midway."""

from __future__ import annotations

import hashlib
import os
import threading
import time
import tracemalloc

import pytest

from tests.conftest import Gate, metrics_record_fake
from tltweb.runs.models import Artifact, MetricStep, Run
from workers.tlt.metrics import HttpSink, IngestRejected, IngestUnavailable
from workers.tlt.spool import SpoolSink

pytestmark = pytest.mark.django_db(transaction=True)  # the live server's thread must see the rows


@pytest.fixture
def gate(live_server):
    from urllib.parse import urlsplit

    parts = urlsplit(live_server.url)
    g = Gate((parts.hostname, parts.port))
    yield g
    g.stop()


def _sink(gate, run, token, **kwargs) -> HttpSink:
    kwargs = {"retry_s": 20, "max_wait_s": 0.5, "timeout_s": 10, **kwargs}
    return HttpSink(f"{gate.url}/api/ingest/runs/{run.id}/", token, **kwargs)


def _file(path, size: int, seed: int = 0):
    block = hashlib.sha256(str(seed).encode()).digest() * (1 << 15)  # 1 MiB of a repeating pattern
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        left = size
        while left > 0:
            fh.write(block[: min(left, len(block))])
            left -= min(left, len(block))
    return path


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- HttpSink ----

def test_an_upload_cut_midway_is_sent_again_whole_and_stored_only_once_complete(gate, run, run_token, tmp_path, settings,
                                                                               caplog):
    path = _file(tmp_path / "drafter.zip", 3 * 1024 * 1024 + 17)
    gate.cut_next_after(1024 * 1024)  # the first attempt dies after 1 MiB of the body
    with caplog.at_level("WARNING", logger="workers.tlt.metrics"):
        _sink(gate, run, run_token).artifact("drafter", 3, path)
    assert "ingest artifact drafter of step 3 failed" in caplog.text  # there was a broken first attempt
    artifact = Artifact.objects.get(run=run)
    assert artifact.size == path.stat().st_size and artifact.sha256 == _sha(path)
    assert (settings.TLT_ARTIFACT_DIR / artifact.path).read_bytes() == path.read_bytes()
    assert not list(settings.TLT_ARTIFACT_DIR.rglob(".upload-*"))  # the broken attempt left nothing behind


def test_an_upload_streams_from_disk(gate, run, run_token, tmp_path):
    path = _file(tmp_path / "policy.zip", 40 * 1024 * 1024)
    tracemalloc.start()
    try:
        _sink(gate, run, run_token).artifact("policy", 1, path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert Artifact.objects.get(run=run).sha256 == _sha(path)
    # client and server (the live server's thread) together: far below the 40 MiB file
    assert peak < 12 * 1024 * 1024, f"peak {peak / 2**20:.1f} MiB"


def test_metrics_wait_for_the_platform_to_come_back(gate, run, run_token):
    gate.stop()
    threading.Timer(2.0, gate.start).start()
    rec = metrics_record_fake(4)
    t = time.monotonic()
    _sink(gate, run, run_token).log(rec["step"], rec["scalars"], rec["series"])
    assert time.monotonic() - t >= 1.5
    assert MetricStep.objects.filter(run=run, step=4).exists()


def test_a_4xx_is_not_retried(gate, run, run_token):
    t = time.monotonic()
    with pytest.raises(IngestRejected) as err:
        _sink(gate, run, run_token + "x").log(1, {}, {})
    assert err.value.status == 403 and "wrong run token" in str(err.value)
    assert time.monotonic() - t < 5


def test_retries_are_bounded(gate, run, run_token):
    gate.stop()
    t = time.monotonic()
    with pytest.raises(IngestUnavailable):
        _sink(gate, run, run_token, retry_s=2).log(1, {}, {})
    assert time.monotonic() - t < 10


# ---- SpoolSink ----

def test_the_trainer_goes_on_while_the_platform_is_away_and_nothing_is_lost(gate, run, run_token, tmp_path):
    gate.stop()
    spool = SpoolSink(tmp_path / "spool", _sink(gate, run, run_token), drain_s=60, pause_s=0.5)
    ckpt = _file(tmp_path / "ckpt" / "drafter_eagle.zip", 200_000, seed=1)
    t = time.monotonic()
    for step in range(1, 4):
        rec = metrics_record_fake(step)
        spool.log(step, rec["scalars"], rec["series"])
    spool.artifact("drafter", 2, ckpt)
    assert time.monotonic() - t < 2  # nothing waited for the platform
    sha = _sha(ckpt)
    ckpt.unlink()  # the checkpoint is pruned before delivery: the spool kept its own link
    time.sleep(1.5)
    assert not MetricStep.objects.filter(run=run).exists()
    gate.start()
    spool.close()
    assert spool.undelivered == 0 and not spool.pending()
    assert sorted(MetricStep.objects.filter(run=run).values_list("step", flat=True)) == [1, 2, 3]
    assert Artifact.objects.get(run=run, kind="drafter", step=2).sha256 == sha
    assert not list((tmp_path / "spool" / "files").iterdir())


def test_a_step_logged_again_replaces_its_spooled_record(gate, run, run_token, tmp_path):
    gate.stop()
    spool = SpoolSink(tmp_path / "spool", _sink(gate, run, run_token), drain_s=60, pause_s=0.5)
    for value in (0.1, 0.9):  # a resumed trainer repeats the steps after its last checkpoint
        rec = metrics_record_fake(5)
        rec["scalars"]["reward/mean"] = value
        spool.log(5, rec["scalars"], rec["series"])
    assert len(spool.pending()) == 1
    gate.start()
    spool.close()
    assert MetricStep.objects.get(run=run, step=5).scalars["reward/mean"] == 0.9


def test_what_is_left_at_the_end_stays_on_disk_and_a_resumed_trainer_delivers_it(gate, run, run_token, tmp_path):
    gate.stop()
    spool = SpoolSink(tmp_path / "spool", _sink(gate, run, run_token), drain_s=1, pause_s=0.5)
    spool.log(7, {"reward/mean": 0.5}, {})
    spool.close()
    assert spool.undelivered == 1 and not MetricStep.objects.exists()
    gate.start()
    again = SpoolSink(tmp_path / "spool", _sink(gate, run, run_token), drain_s=60)  # the --resume's spool
    again.close()
    assert again.undelivered == 0 and MetricStep.objects.get(run=run, step=7).scalars == {"reward/mean": 0.5}


def test_a_refusal_fails_the_trainer_clearly_and_keeps_the_record(gate, run, run_token, tmp_path):
    Run.objects.filter(pk=run.pk).update(state="succeeded")  # a finished run refuses everything
    spool = SpoolSink(tmp_path / "spool", _sink(gate, run, run_token), drain_s=30)
    spool.log(1, {"reward/mean": 0.5}, {})
    deadline = time.monotonic() + 20
    while spool.failure is None and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(IngestRejected) as err:
        spool.log(2, {}, {})
    assert err.value.status == 403 and "immutable" in str(err.value)
    spool.close()
    rejected = sorted((tmp_path / "spool" / "rejected").iterdir())
    assert [p.name.split("-", 1)[1] for p in rejected] == ["000000001-0-metrics.error", "000000001-0-metrics.json"]
    assert "HTTP 403" in rejected[0].read_text()


def test_the_trainer_builds_the_spool_from_its_environment(tmp_path, monkeypatch):
    from workers.tlt.spool import spool_from_env

    monkeypatch.setenv("TLT_INGEST_RETRY_S", "42")
    monkeypatch.setenv("TLT_INGEST_DRAIN_S", "7")
    monkeypatch.setenv("TLT_INGEST_MAX_WAIT_S", "not a number")
    spool = spool_from_env(tmp_path, "http://127.0.0.1:9/api/ingest/runs/x/", "t")
    try:
        assert spool.transport.retry_s == 42 and spool.drain_s == 7 and spool.transport.max_wait_s == 60
        assert spool.folder == tmp_path / "spool" and os.path.isdir(spool.pending_dir)
    finally:
        spool.drain_s = 0
        spool.close()


def test_progress_never_makes_the_trainer_wait(gate, run, run_token, tmp_path):
    gate.stop()
    spool = SpoolSink(tmp_path / "spool", _sink(gate, run, run_token), drain_s=1, pause_s=0.5)
    t = time.monotonic()
    for done in range(50):
        spool.progress("sft", done, 50, "warming up")
    assert time.monotonic() - t < 0.5 and not spool.pending()  # kept in memory, newest only
    spool.close()
    assert spool.undelivered == 0


def test_the_trainers_setup_progress_reaches_the_platform_through_the_spool(gate, run, run_token, tmp_path, monkeypatch):
    from workers.tlt.train import build_tracking

    monkeypatch.setenv("TLT_INGEST_URL", f"{gate.url}/api/ingest/runs/{run.id}/")
    monkeypatch.setenv("TLT_RUN_TOKEN", run_token)
    monkeypatch.delenv("TLT_MLFLOW_TRACKING_URI", raising=False)
    tracking = build_tracking(tmp_path)
    assert [type(s).__name__ for s in tracking.sinks] == ["ConsoleSink", "JsonlSink", "SpoolSink"]
    tracking.progress("policy", 120, 300, "SFT step 120/300")
    deadline = time.monotonic() + 20
    while not Run.objects.get(pk=run.pk).progress and time.monotonic() < deadline:
        time.sleep(0.1)
    tracking.close()
    progress = Run.objects.get(pk=run.pk).progress
    assert (progress["phase"], progress["done"], progress["total"]) == ("policy", 120, 300)
