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

import hashlib
import json
import logging
import math
import os
import re
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Protocol

import tenacity

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
    "rollout/tail_time_frac": "share of the rollout's wall time after 90% of the responses had finished",
    "rollout/borrowed_s": "decode seconds the workers ran on cores their finished peers lent them, summed over "
                          "workers (CPU workers, rollout.lend_idle_cores)",
    "spec/acceptance_length": "tokens emitted per verify pass while SD was on",
    "spec/acceptance_chain": "acceptance_length of the drafter's chain passes alone",
    "spec/acceptance_tree": "acceptance_length of the drafter's tree passes alone",
    "spec/acceptance_ngram": "acceptance_length of the n-gram drafts alone (sibling responses' n-grams)",
    "spec/acceptance_hybrid": "acceptance_length of the hybrid arm's passes (n-gram drafts, else the drafter's chain)",
    "spec/chain4_acceptance": "tokens per pass a 4-deep drafter chain emits at the step's measured rates per "
                              "position: acceptance with the arm held fixed, so drafters compare on it",
    "spec/switch_on_s": "seconds into the rollout when SD first switched on (-1: never)",
    "drafter/loss": "spot-training loss (last window)",
    "drafter/accuracy": "drafter top-1 agreement with the target on trained tokens",
    "drafter/steps": "drafter optimizer steps done this RL step",
    "drafter/spot_paused": "1: this step trained no drafter because it had not gone stale (drafter.spot_stale_drop)",
    "idle/worker_s": "worker-seconds spent idle waiting for the tail",
    "idle/reclaimed_s": "idle worker-seconds used for drafter training",
    "idle/reclaimed_frac": "reclaimed / idle",
    "timing_s/step": "wall time of the whole step",
    "timing_s/rollout": "rollout phase",
    "timing_s/reward": "reward computation",
    "timing_s/learner": "learner update (old log-probs + gradient step)",
    "timing_s/sync": "weight sync to workers (and waking their engines, see timing_s/engine_sleep)",
    "timing_s/engine_sleep": "rollout engines releasing device memory for the learner (rollout.sleep_while_learning)",
    "sync/bytes": "bytes of weights the rollout workers read at this step's sync (policy + drafter)",
    "drafter/stale_workers": "rollout workers that drafted with an older drafter than the published one (TLT runs)",
    "learner/loss": "GRPO loss",
    "learner/grad_norm": "gradient norm before clipping",
    "learner/kl": "KL to the reference (0 when disabled)",
    "learner/cpu_share": "CPU learners: the step's CPU time over its wall time x threads (well below 1: it "
                         "waited for cores other processes held)",
    "audit/greedy_identical": "checkpoint audit: share of held-out prompts whose greedy SD output equals plain "
                              "decoding token for token (below 1: a losslessness failure)",
    "audit/greedy_prompts": "checkpoint audit: held-out prompts decoded",
    "audit/acceptance_length": "checkpoint audit: tokens per verify pass on the held-out prompts (the model card's)",
}

# scalars a step reports only when it measured them (a chart shows a gap, never a made-up zero):
# acceptance only when SD verified a draft (per kind: when that kind of draft ran), each tail speed only when that mode ran in the tail,
# the drafter's loss and accuracy only when a spot-training update was applied, the audit at
# checkpoints of TLT runs, the chain figure only when a drafter chain ran, the learner's core share on CPUs,
# whether spot training paused only in runs that spot-train
WHEN_MEASURED = {"spec/acceptance_length", "spec/acceptance_chain", "spec/acceptance_tree", "spec/acceptance_ngram",
                 "spec/acceptance_hybrid", "spec/chain4_acceptance", "rollout/tail_tokens_per_s_sd",
                 "rollout/tail_tokens_per_s_no_sd", "learner/cpu_share", "drafter/loss", "drafter/accuracy",
                 "audit/greedy_identical", "audit/greedy_prompts", "audit/acceptance_length", "timing_s/engine_sleep",
                 "drafter/spot_paused"}

SERIES_KEYS = {
    "rollout/lengths": "list[int]: every response length of the step",
    "rollout/running": "{t: [s], running: [int], sd: [0|1]}: running sequences over rollout time",
    "spec/accept_by_position": "list[float]: acceptance rate at draft position 1..depth",
    "spec/strategy": "{bucket label: {arm label: times chosen}}",
    "rollout/prompt_lengths": "[{prompt: text hash, text, lengths: [int]}]: each prompt's sample lengths",
    "rollout/logprob_mismatch_hist": "{edges: [0, 1e-7, ..., 10, None], counts}: |rollout - learner log-prob| per token",
    "spec/arm_timeline": "[{worker, t: [s], arm: [label]}]: the SD arm in force over rollout time (at each change)",
    "rollout/passes_by_rows": "{threads: {rows: passes}}: target passes by thread count and rows in their products",
    "idle/timeline": "[{worker: int, segments: [[kind, start_s, end_s]]}], kind in generate|idle|drafter",
    "rollout/samples": "[{sample, prompt, tokens: [str], from_draft: [0|1], reward, length, truncated}]: "
                       "a few of the step's responses (rollout/samples.py)",
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


class IngestRejected(RuntimeError):
    """The platform refused a record (HTTP 4xx other than 408/425/429): sending it again cannot help."""

    def __init__(self, what: str, status: int, body: str):
        self.what, self.status, self.body = what, status, body
        super().__init__(f"the platform rejected {what}: HTTP {status}: {body[:500]}")


class IngestUnavailable(RuntimeError):
    """The platform stayed unreachable (network errors, 5xx) for the whole retry budget."""


class _Transient(Exception):
    """A response worth retrying (5xx, 408, 425, 429)."""


RETRY_STATUSES = frozenset({408, 425, 429})


def file_digest(path: str | Path, chunk: int = 1 << 20) -> tuple[int, str]:
    """(size, sha256 hex) of a file, read in chunks (never whole into memory)."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            digest.update(block)
            size += len(block)
    return size, digest.hexdigest()


class MultipartFile:
    """A multipart/form-data body that streams one file from disk, with a known Content-Length.

    requests sends an object with `read` and `__len__` in blocks, so a multi-GB checkpoint never sits
    in memory (requests' own `files=` builds the whole body in memory). Exactly `size` bytes of the
    file are sent; the server compares what it stored with the `size` and `sha256` fields.
    """

    def __init__(self, fields: dict[str, str], path: str | Path, *, size: int, filename: str, field: str = "file"):
        self.boundary = uuid.uuid4().hex
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", filename) or "file"
        parts = [
            f'--{self.boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'
            for name, value in fields.items()
        ]
        parts.append(f'--{self.boundary}\r\nContent-Disposition: form-data; name="{field}"; filename="{safe}"\r\n'
                     "Content-Type: application/octet-stream\r\n\r\n")
        self._head = "".join(parts).encode()
        self._tail = f"\r\n--{self.boundary}--\r\n".encode()
        self._size = size
        self._fh = open(path, "rb")  # opened per attempt: a retry never resends a file read to its end
        self._pos = 0
        self.content_type = f"multipart/form-data; boundary={self.boundary}"

    def __len__(self) -> int:
        return len(self._head) + self._size + len(self._tail)

    def read(self, n: int = -1) -> bytes:
        total = len(self)
        if n is None or n < 0:
            n = total - self._pos
        out = bytearray()
        while n > 0 and self._pos < total:
            head_end, file_end = len(self._head), len(self._head) + self._size
            if self._pos < head_end:
                piece = self._head[self._pos:self._pos + n]
            elif self._pos < file_end:
                piece = self._fh.read(min(n, file_end - self._pos))
                if not piece:  # the file shrank: stop short (the server sees fewer bytes and refuses it)
                    raise OSError(f"{self._fh.name} shrank while uploading")
            else:
                offset = self._pos - file_end
                piece = self._tail[offset:offset + n]
            out += piece
            self._pos += len(piece)
            n -= len(piece)
        return bytes(out)

    def __iter__(self):
        while chunk := self.read(1 << 16):
            yield chunk

    def close(self) -> None:
        self._fh.close()


class HttpSink:
    """Posts records to the platform's ingestion API with the run's token, synchronously.

    `base_url` is the run's ingestion root (`.../api/ingest/runs/<run id>/`); the platform upserts
    per (run, step) and per (run, kind, step), so a retried post never duplicates anything.
    Network errors, 5xx, 408/425/429 are retried with exponential back-off (tenacity; waits grow
    from 1 s to `max_wait_s`) for up to `retry_s` seconds, then IngestUnavailable; any other 4xx
    raises IngestRejected at once. An artifact is streamed from disk, its file reopened on every
    attempt, with its size and sha256 so the platform stores it only if that is what it received.

    The trainer does not use this directly: SpoolSink (workers/tlt/spool.py) writes to a local
    spool first and delivers through this class from a background thread.
    """

    def __init__(self, base_url: str, token: str, *, retry_s: float = 600.0, max_wait_s: float = 60.0,
                 timeout_s: float = 60.0):
        import requests  # local: GPU nodes without the platform extras never need it

        self._requests = requests
        self._session = requests.Session()
        self._session.headers["Authorization"] = f"Bearer {token}"
        self.base_url = base_url.rstrip("/") + "/"
        self.retry_s = retry_s
        self.max_wait_s = max_wait_s
        self.timeout_s = timeout_s
        self.abort = threading.Event()  # set to give up at once (the spool's hard stop)

    def _transient(self, exc: BaseException) -> bool:
        r = self._requests.exceptions
        return isinstance(exc, (_Transient, r.ConnectionError, r.Timeout, r.ChunkedEncodingError))

    def _post(self, path: str, what: str, make: Callable[[], dict[str, Any]]) -> Any:
        """POST with bounded retries; `make()` builds fresh request kwargs for every attempt."""

        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning("ingest %s failed (%s); attempt %d, retrying in %.0fs", what, exc, state.attempt_number,
                        state.next_action.sleep if state.next_action else 0)

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(self._transient),
            wait=tenacity.wait_exponential_jitter(initial=1.0, max=self.max_wait_s, jitter=1.0),
            stop=tenacity.stop_after_delay(self.retry_s) | tenacity.stop_when_event_set(self.abort),
            sleep=lambda seconds: self.abort.wait(seconds),  # a hard stop cuts the wait short
            before_sleep=before_sleep,
        )
        try:
            for attempt in retrying:
                with attempt:
                    kwargs = make()
                    body = kwargs.get("data")
                    try:
                        resp = self._session.post(self.base_url + path, timeout=self.timeout_s, **kwargs)
                    finally:
                        if isinstance(body, MultipartFile):
                            body.close()
                    if resp.status_code >= 500 or resp.status_code in RETRY_STATUSES:
                        raise _Transient(f"HTTP {resp.status_code}: {resp.text[:200]}")
                    if resp.status_code >= 400:
                        raise IngestRejected(what, resp.status_code, resp.text)
                    return resp
        except tenacity.RetryError as exc:
            last = exc.last_attempt.exception()
            raise IngestUnavailable(
                f"ingest {what}: the platform was unreachable for {exc.last_attempt.attempt_number} attempts: {last}"
            ) from last

    def log(self, step: int, scalars: dict[str, float], series: dict[str, Any]) -> None:
        body = {"step": step, "scalars": scalars, "series": series}
        self._post("metrics", f"metrics of step {step}", lambda: {"json": body})

    def artifact(self, kind: str, step: int, path: Path, *, size: int | None = None, sha256: str | None = None,
                 filename: str | None = None) -> None:
        if size is None or sha256 is None:
            size, sha256 = file_digest(path)
        fields = {"kind": kind, "step": str(step), "size": str(size), "sha256": sha256}
        name = filename or Path(path).name

        def make() -> dict[str, Any]:
            body = MultipartFile(fields, path, size=size, filename=name)
            return {"data": body, "headers": {"Content-Type": body.content_type}}

        self._post("artifacts", f"artifact {kind} of step {step}", make)

    def progress(self, phase: str, done: int, total: int, message: str = "") -> None:
        """Progress is a nicety: one try with a short timeout; a failure is logged, never raised."""
        body = {"phase": phase, "done": done, "total": total, "message": message[:500]}
        try:
            resp = self._session.post(self.base_url + "progress", json=body, timeout=min(10.0, self.timeout_s))
            resp.raise_for_status()
        except Exception as exc:  # noqa: BLE001 - never let a hint fail the run
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
        """Close every sink, even when one raises (the spool's IngestRejected); then raise the first error."""
        first: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the other sinks closed
                first = first or exc
        if first is not None:
            raise first
