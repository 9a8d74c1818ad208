"""Metric records and the sinks they fan out to (console, JSONL file, the platform's HTTP API).

One record per RL step:

    {"step": 3,
     "scalars": {"reward/mean": 0.41, "spec/acceptance_length": 3.2, ...},
     "series":  {"rollout/lengths": [...], "idle/timeline": [...], ...}}

Keys are namespaced `section/name`. Scalars are plain floats that the platform plots over steps;
series are per-step structures (histograms, timelines) that the run page draws for a chosen step.
The names the dashboards read are listed in SCALAR_KEYS and SERIES_KEYS; a trainer may add more.
"""

from __future__ import annotations

import json
import logging
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


class MetricSink(Protocol):
    def log(self, step: int, scalars: dict[str, float], series: dict[str, Any]) -> None: ...

    def artifact(self, kind: str, step: int, path: Path) -> None: ...

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

    def close(self) -> None:
        self._session.close()


class Tracking:
    """Fans each record out to every sink (verl's Tracking, in small)."""

    def __init__(self, sinks: list[MetricSink]):
        self.sinks = sinks

    def log(self, step: int, scalars: dict[str, float], series: dict[str, Any] | None = None) -> None:
        for sink in self.sinks:
            sink.log(step, scalars, series or {})

    def artifact(self, kind: str, step: int, path: Path) -> None:
        for sink in self.sinks:
            sink.artifact(kind, step, path)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
