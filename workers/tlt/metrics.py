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

import hashlib
import json
import logging
import re
import sys
import threading
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

SERIES_KEYS = {
    "rollout/lengths": "list[int]: every response length of the step",
    "rollout/running": "{t: [s], running: [int], sd: [0|1]}: running sequences over rollout time",
    "spec/accept_by_position": "list[float]: acceptance rate at draft position 1..depth",
    "spec/strategy": "{bucket label: {arm label: times chosen}}",
    "idle/timeline": "[{worker: int, segments: [[kind, start_s, end_s]]}], kind in generate|idle|drafter",
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
