"""Metric records and the sinks they fan out to (console, JSONL file, the platform's HTTP API).

One record per RL step:

    {"step": 3,
     "scalars": {"reward/mean": 0.41, "spec/acceptance_length": 3.2, ...},
     "series":  {"rollout/lengths": [...], "idle/timeline": [...], ...}}

Keys are namespaced `section/name`. Scalars are plain floats that the platform plots over steps;
series are per-step structures (histograms, timelines) that the run page draws for a chosen step.
The names the dashboards read are listed in SCALAR_KEYS and SERIES_KEYS; a trainer may add more.

Besides steps, the trainer reports its progress through each phase (setup, then RL steps):

    tracking.progress("policy", 120, 300, "SFT step 120/300")   # phases: policy, drafter_warmup, actors, rl

Every sink has `progress(phase, done, total, message)`; Tracking forwards at most one update per
second per phase (plus every phase's first and last), so a 300-step SFT does not post 300 times.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

SCALAR_KEYS = {
    "reward/mean": "mean reward of all samples",
    "reward/accuracy": "share of samples whose answer is correct",
    "rollout/len_mean": "mean response length (tokens)",
    "rollout/len_p50": "median response length",
    "rollout/len_p90": "90th percentile response length",
    "rollout/len_p99": "99th percentile response length",
    "rollout/len_max": "longest response",
    "rollout/tokens_per_s": "generated tokens per second, whole rollout, all workers",
    "rollout/tail_tokens_per_s_sd": "tokens/s while SD was on (tail)",
    "rollout/tail_tokens_per_s_no_sd": "tokens/s in the tail with SD off (baseline runs, or before the switch)",
    "rollout/logprob_mismatch": "mean |rollout log-prob - learner log-prob| per token, on the rows the learner ran",
    "spec/acceptance_length": "tokens emitted per verify pass while SD was on",
    "spec/switch_on_s": "seconds into the rollout when SD first switched on (-1: never)",
    "drafter/loss": "spot-training loss (last window)",
    "drafter/accuracy": "drafter top-1 agreement with the target on trained tokens",
    "drafter/steps": "drafter optimizer steps done this RL step",
    "idle/worker_s": "worker-seconds spent idle waiting for the tail",
    "idle/reclaimed_s": "idle worker-seconds used for drafter training",
    "idle/reclaimed_frac": "reclaimed / idle",
    "timing_s/step": "wall time of the whole step",
    "timing_s/rollout": "rollout phase",
    "timing_s/reward": "reward computation",
    "timing_s/learner": "learner update (old log-probs + gradient step)",
    "timing_s/sync": "weight sync to workers",
    "learner/loss": "GRPO loss",
    "learner/grad_norm": "gradient norm before clipping",
    "learner/kl": "KL to the reference (0 when disabled)",
}

# scalars a step reports only when it measured them (a chart shows a gap, never a made-up zero):
# acceptance only when SD verified a draft, each tail speed only when that mode ran in the tail,
# the drafter's loss and accuracy only when a spot-training update was applied
WHEN_MEASURED = {"spec/acceptance_length", "rollout/tail_tokens_per_s_sd", "rollout/tail_tokens_per_s_no_sd",
                 "drafter/loss", "drafter/accuracy"}

SERIES_KEYS = {
    "rollout/lengths": "list[int]: every response length of the step",
    "rollout/running": "{t: [s], running: [int], sd: [0|1]}: running sequences over rollout time",
    "spec/accept_by_position": "list[float]: acceptance rate at draft position 1..depth",
    "spec/strategy": "{bucket label: {arm label: times chosen}}",
    "idle/timeline": "[{worker: int, segments: [[kind, start_s, end_s]]}], kind in generate|idle|drafter",
    "rollout/samples": "[{sample, prompt, tokens: [str], from_draft: [0|1], reward, length, truncated}]: "
                       "a few of the step's responses (samples.py)",
}
# Optional series: up to 8 of the step's responses for the platform's sample viewer (stored apart
# from the other series, so the charts never load them): [{sample: int, prompt: str, tokens: [str],
# from_draft: [0|1] (1: proposed by the drafter and accepted), reward: float, length: int,
# truncated: bool}], from_draft as long as tokens.
SAMPLES_KEY = "rollout/samples"
PROGRESS_PHASES = ("policy", "drafter_warmup", "actors", "rl")


class MetricSink(Protocol):
    def log(self, step: int, scalars: dict[str, float], series: dict[str, Any]) -> None: ...

    def artifact(self, kind: str, step: int, path: Path) -> None: ...

    def progress(self, phase: str, done: int, total: int, message: str = "") -> None: ...

    def close(self) -> None: ...


class ConsoleSink:
    """One line per step with the headline numbers."""

    HEADLINE = ("reward/mean", "rollout/len_max", "spec/acceptance_length", "idle/reclaimed_frac", "timing_s/step")

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr

    def log(self, step: int, scalars: dict[str, float], series: dict[str, Any]) -> None:
        parts = [f"{k.split('/')[-1]}={scalars[k]:.3g}" for k in self.HEADLINE if k in scalars]
        print(f"step {step}: " + " ".join(parts), file=self.stream, flush=True)

    def artifact(self, kind: str, step: int, path: Path) -> None:
        print(f"step {step}: saved {kind} -> {path}", file=self.stream, flush=True)

    def progress(self, phase: str, done: int, total: int, message: str = "") -> None:
        tail = f" {message}" if message else ""
        print(f"progress {phase} {done}/{total}{tail}", file=self.stream, flush=True)

    def close(self) -> None:
        pass


class JsonlSink:
    """Appends every record to a JSONL file (one object per line)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8")

    def log(self, step: int, scalars: dict[str, float], series: dict[str, Any]) -> None:
        self._fh.write(json.dumps({"step": step, "scalars": scalars, "series": series}) + "\n")
        self._fh.flush()

    def artifact(self, kind: str, step: int, path: Path) -> None:
        self._fh.write(json.dumps({"step": step, "artifact": kind, "path": str(path)}) + "\n")
        self._fh.flush()

    def progress(self, phase: str, done: int, total: int, message: str = "") -> None:
        record = {"phase": phase, "done": done, "total": total, "message": message, "time": time.time()}
        self._fh.write(json.dumps({"progress": record}) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class HttpSink:
    """Posts records to the platform's ingestion API with the run's token.

    `base_url` is the run's ingestion root (`.../api/ingest/runs/<run id>/`); the platform upserts
    per (run, step), so a retried post never duplicates a step. Network failures are retried with
    back-off and then raised: a run must not silently lose its metrics.
    """

    def __init__(self, base_url: str, token: str, retries: int = 5):
        import requests  # local: GPU nodes without the platform extras never need it

        self._session = requests.Session()
        self._session.headers["Authorization"] = f"Bearer {token}"
        self.base_url = base_url.rstrip("/") + "/"
        self.retries = retries

    def _post(self, path: str, **kwargs: Any) -> None:
        delay = 0.5
        for attempt in range(self.retries):
            try:
                resp = self._session.post(self.base_url + path, timeout=60, **kwargs)
                if resp.status_code < 500:
                    resp.raise_for_status()
                    return
                err = f"HTTP {resp.status_code}: {resp.text[:200]}"
            except Exception as exc:  # connection errors: retry
                if attempt == self.retries - 1:
                    raise
                err = str(exc)
            log.warning("ingest %s failed (%s), retrying in %.1fs", path, err, delay)
            time.sleep(delay)
            delay *= 2
        raise RuntimeError(f"ingest {path} failed after {self.retries} attempts")

    def log(self, step: int, scalars: dict[str, float], series: dict[str, Any]) -> None:
        self._post("metrics", json={"step": step, "scalars": scalars, "series": series})

    def artifact(self, kind: str, step: int, path: Path) -> None:
        with open(path, "rb") as fh:
            self._post("artifacts", data={"kind": kind, "step": str(step)}, files={"file": (path.name, fh)})

    def progress(self, phase: str, done: int, total: int, message: str = "") -> None:
        """Progress is a nicety: one try, and a failure is logged, never raised (unlike metrics)."""
        body = {"phase": phase, "done": done, "total": total, "message": message[:500]}
        try:
            resp = self._session.post(self.base_url + "progress", json=body, timeout=10)
            resp.raise_for_status()
        except Exception as exc:
            log.warning("ingest progress failed: %s", exc)

    def close(self) -> None:
        self._session.close()


class MlflowSink:
    """Mirrors a run's metrics to MLflow, so a team keeps its own tracker next to the platform.

        sink = MlflowSink("file:///shared/mlruns", experiment="alice's lab", run_name="tiny run",
                          tags={"tlt.run_id": "..."}, params={"rollout.num_workers": 2})

    `tracking_uri` is anything MLflow's client takes (an http(s) tracking server, a file store
    `file:///...` (MLflow >= 3 wants MLFLOW_ALLOW_FILE_STORE=true for it, set here unless already
    set), a database store `sqlite:///...` when SQLAlchemy and Alembic are installed). Scalars
    become MLflow metrics at the same step (null and NaN left out); series are not mirrored; progress
    goes to the tag `tlt.phase`; artifacts are noted as tags `tlt.artifact.<kind>` and, with
    `upload_artifacts`, also copied into the MLflow run. close() ends the MLflow run as FINISHED.
    The platform stays the record: an MLflow error is logged, never raised into the training.
    """

    BATCH = 1000  # MLflow's log_batch takes at most 1000 metrics, 100 params per call

    def __init__(self, tracking_uri: str, experiment: str, run_name: str = "", tags: dict[str, str] | None = None,
                 params: dict[str, Any] | None = None, upload_artifacts: bool = False):
        if "://" not in tracking_uri or tracking_uri.startswith("file:"):
            # MLflow >= 3 keeps its file store only on request; a configured file: URI is that request
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient  # local: only runs that mirror to MLflow need it

        self._client = MlflowClient(tracking_uri=tracking_uri)
        self.upload_artifacts = upload_artifacts
        # MLflow looks experiments up with a filter string that quotes names naively: "Alice's lab"
        # breaks it (file store), so straight quotes become typographic ones.
        experiment = experiment.replace("'", "\u2019").replace('"', "\u201d")
        self.experiment = experiment
        found = self._client.get_experiment_by_name(experiment)
        if found is None:
            try:
                experiment_id = self._client.create_experiment(experiment)
            except Exception:  # another run created it meanwhile
                experiment_id = self._client.get_experiment_by_name(experiment).experiment_id
        else:
            experiment_id = found.experiment_id
        self.experiment_id = experiment_id
        run = self._client.create_run(experiment_id, run_name=run_name or None, tags=dict(tags or {}))
        self.run_id = run.info.run_id
        items = [Param(str(k)[:250], str(v)[:6000]) for k, v in (params or {}).items()]
        for i in range(0, len(items), 100):
            self._client.log_batch(self.run_id, params=items[i: i + 100])

    def _safely(self, what: str, call: Any, *args: Any, **kwargs: Any) -> None:
        try:
            call(*args, **kwargs)
        except Exception as exc:
            log.warning("mlflow %s failed: %s", what, exc)

    def log(self, step: int, scalars: dict[str, float], series: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, step) for key, value in scalars.items()
                   if isinstance(value, (int, float)) and math.isfinite(value)]
        for i in range(0, len(metrics), self.BATCH):
            self._safely("log_batch", self._client.log_batch, self.run_id, metrics=metrics[i: i + self.BATCH])

    def artifact(self, kind: str, step: int, path: Path) -> None:
        self._safely("set_tag", self._client.set_tag, self.run_id, f"tlt.artifact.{kind}", f"step {step}: {Path(path).name}")
        if self.upload_artifacts:
            self._safely("log_artifact", self._client.log_artifact, self.run_id, str(path), f"{kind}/step{step:06d}")

    def progress(self, phase: str, done: int, total: int, message: str = "") -> None:
        self._safely("set_tag", self._client.set_tag, self.run_id, "tlt.phase", f"{phase} {done}/{total}")

    def close(self) -> None:
        self._safely("set_terminated", self._client.set_terminated, self.run_id, "FINISHED")


class Tracking:
    """Fans each record out to every sink (verl's Tracking, in small)."""

    def __init__(self, sinks: list[MetricSink], progress_interval_s: float = 1.0):
        self.sinks = sinks
        self.progress_interval_s = progress_interval_s
        self._last_progress: tuple[str, float] | None = None  # (phase, monotonic time) of the last forwarded

    def progress(self, phase: str, done: int, total: int, message: str = "") -> None:
        """Report progress through a phase to every sink: a phase's first and last update always
        go out, others at most once per `progress_interval_s`."""
        now = time.monotonic()
        last = self._last_progress
        edge = last is None or last[0] != phase or done <= 0 or done >= total
        if not edge and now - last[1] < self.progress_interval_s:
            return
        self._last_progress = (phase, now)
        for sink in self.sinks:
            report = getattr(sink, "progress", None)  # a sink written before progress existed has none
            if report is not None:
                report(phase, done, total, message)

    def log(self, step: int, scalars: dict[str, float], series: dict[str, Any] | None = None) -> None:
        for sink in self.sinks:
            sink.log(step, scalars, series or {})

    def artifact(self, kind: str, step: int, path: Path) -> None:
        for sink in self.sinks:
            sink.artifact(kind, step, path)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
