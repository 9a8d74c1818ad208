"""The MLflow mirror, against the real MLflow library (mlflow-skinny) and a real local file store:
what the sink writes is read back with MLflow's own client."""

from __future__ import annotations

import logging

import pytest

mlflow = pytest.importorskip("mlflow", reason="mlflow-skinny is a test dependency (pyproject [test])")
from mlflow.tracking import MlflowClient  # noqa: E402

from workers.tlt.metrics import ConsoleSink, MlflowSink, Tracking  # noqa: E402


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return (tmp_path / "mlruns").as_uri()


def test_it_mirrors_every_finite_scalar_at_its_step(store):
    sink = MlflowSink(store, experiment="Alice's lab", run_name="tiny run", tags={"tlt.run_id": "r1"},
                      params={"run.steps": 3, "rollout.num_workers": 2})
    sink.log(1, {"reward/mean": 0.25, "spec/acceptance_length": 3.5, "drafter/loss": float("nan"), "learner/kl": None}, {})
    sink.log(2, {"reward/mean": 0.5, "spec/acceptance_length": 4.0}, {"rollout/lengths": [1, 2]})
    sink.close()
    client = MlflowClient(tracking_uri=store)
    run = client.get_run(sink.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny run"
    assert client.get_experiment(run.info.experiment_id).name == "Alice\u2019s lab"  # MLflow's filters choke on '
    assert run.data.params == {"run.steps": "3", "rollout.num_workers": "2"}
    assert run.data.tags["tlt.run_id"] == "r1"
    assert [(m.step, m.value) for m in client.get_metric_history(sink.run_id, "reward/mean")] == [(1, 0.25), (2, 0.5)]
    assert set(run.data.metrics) == {"reward/mean", "spec/acceptance_length"}  # NaN and null left out


def test_two_runs_share_their_experiment(store):
    first = MlflowSink(store, experiment="lab")
    second = MlflowSink(store, experiment="lab")
    assert first.experiment_id == second.experiment_id and first.run_id != second.run_id


def test_progress_and_artifacts_become_tags_and_uploads_on_request(store, tmp_path):
    zip_path = tmp_path / "drafter.zip"
    zip_path.write_bytes(b"PK\x05\x06" + bytes(18))
    sink = MlflowSink(store, experiment="lab", upload_artifacts=True)
    sink.progress("drafter_warmup", 100, 200, "training the drafter")
    sink.artifact("drafter", 2, zip_path)
    sink.close()
    client = MlflowClient(tracking_uri=store)
    tags = client.get_run(sink.run_id).data.tags
    assert tags["tlt.phase"] == "drafter_warmup 100/200" and tags["tlt.artifact.drafter"] == "step 2: drafter.zip"
    assert [a.path for a in client.list_artifacts(sink.run_id, "drafter/step000002")] == ["drafter/step000002/drafter.zip"]


def test_the_trainer_adds_the_mirror_when_configured(store, tmp_path, monkeypatch):
    from workers.tlt.config import preset
    from workers.tlt.train import build_tracking

    monkeypatch.setenv("TLT_MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("TLT_MLFLOW_EXPERIMENT", "Alice's lab")
    monkeypatch.setenv("TLT_RUN_NAME", "from the platform")
    monkeypatch.setenv("TLT_RUN_ID", "1234")
    monkeypatch.delenv("TLT_INGEST_URL", raising=False)
    tracking = build_tracking(tmp_path, preset("tiny-cpu"))
    sinks = [s for s in tracking.sinks if isinstance(s, MlflowSink)]
    assert len(sinks) == 1
    tracking.log(1, {"reward/mean": 0.1})
    tracking.close()
    run = MlflowClient(tracking_uri=store).get_run(sinks[0].run_id)
    assert run.info.run_name == "from the platform" and run.data.tags["tlt.run_id"] == "1234"
    assert run.data.params["run.steps"] == str(preset("tiny-cpu").run.steps) and run.data.metrics["reward/mean"] == 0.1


def test_the_mirror_sits_beside_the_platforms_spool(store, tmp_path, monkeypatch):
    from workers.tlt.train import build_tracking

    monkeypatch.setenv("TLT_MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("TLT_INGEST_URL", "http://127.0.0.1:9/api/ingest/runs/x/")  # nothing listens on port 9
    monkeypatch.setenv("TLT_RUN_TOKEN", "t")
    monkeypatch.setenv("TLT_INGEST_DRAIN_S", "1")
    tracking = build_tracking(tmp_path)
    assert [type(s).__name__ for s in tracking.sinks] == ["ConsoleSink", "JsonlSink", "SpoolSink", "MlflowSink"]
    tracking.close()


def test_the_mirror_is_closed_even_when_the_spool_raises_at_close(store, tmp_path, monkeypatch):
    from workers.tlt.train import build_tracking

    monkeypatch.setenv("TLT_MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("TLT_INGEST_URL", "http://127.0.0.1:9/api/ingest/runs/x/")
    monkeypatch.setenv("TLT_RUN_TOKEN", "t")
    monkeypatch.setenv("TLT_INGEST_DRAIN_S", "1")
    tracking = build_tracking(tmp_path)
    spool, mirror = tracking.sinks[2], tracking.sinks[3]
    spool.failure = RuntimeError("the platform refused a record")  # as a 4xx leaves it
    with pytest.raises(RuntimeError, match="refused"):
        tracking.close()
    assert MlflowClient(tracking_uri=store).get_run(mirror.run_id).info.status == "FINISHED"


def test_no_mirror_without_configuration(tmp_path, monkeypatch):
    from workers.tlt.train import build_tracking

    monkeypatch.delenv("TLT_MLFLOW_TRACKING_URI", raising=False)
    tracking = build_tracking(tmp_path)
    assert not [s for s in tracking.sinks if isinstance(s, MlflowSink)]
    tracking.close()


def test_an_unusable_tracking_uri_is_reported_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    from workers.tlt.train import build_tracking

    monkeypatch.setenv("TLT_MLFLOW_TRACKING_URI", "nosuchscheme://tracker")
    with caplog.at_level(logging.ERROR):
        tracking = build_tracking(tmp_path)
    assert [type(s) for s in tracking.sinks][:1] == [ConsoleSink] and "not mirroring to MLflow" in caplog.text
    assert not [s for s in tracking.sinks if isinstance(s, MlflowSink)]
    tracking.close()


def test_a_failing_tracker_never_raises_into_the_training(store, caplog):
    sink = MlflowSink(store, experiment="lab")
    sink.run_id = "no-such-run"
    tracking = Tracking([sink])
    tracking.log(1, {"reward/mean": 1.0})  # logged, not raised
    tracking.close()
    assert "mlflow log_batch failed" in caplog.text
