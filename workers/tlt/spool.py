"""A local spool between the trainer and the platform: training never waits for, or dies of, the web app.

    spool = SpoolSink(out / "spool", HttpSink(ingest_url, token))
    tracking = Tracking([ConsoleSink(), JsonlSink(out / "metrics.jsonl"), spool])
    ...                      # tracking.log() / tracking.artifact() return as soon as the spool has it
    tracking.close()         # waits (at most drain_s) until the platform has everything

Every record and artifact announcement is first written to the spool folder (under the run's
--out folder), one small JSON file each, atomically (write, fsync, rename); an artifact's file is
hard-linked next to it, so pruning an old checkpoint cannot take the file away before it is sent.
A background thread delivers the files in order (by step; a step's metrics before its artifacts)
through HttpSink, which retries network errors and 5xx with back-off, and removes each file once
the platform has acknowledged it. Delivery is idempotent: the platform upserts per step and per
(kind, step), and a step logged again (a resumed run repeats the steps after its last checkpoint)
replaces its spooled file.

    OUT/spool/pending/000000003-0-metrics.json       {"type": "metrics", "step", "scalars", "series"}
    OUT/spool/pending/000000004-1-drafter.json       {"type": "artifact", "kind", "step", "file", ...}
    OUT/spool/files/000000004-drafter-drafter_eagle.zip   (a hard link, or a copy across filesystems)
    OUT/spool/rejected/...                           what the platform refused (4xx), with the reason

What happens when the platform is away: the trainer goes on; each delivery is retried for
`HttpSink.retry_s`, and if the platform is still unreachable then, the item stays in the spool and
delivery starts over after `pause_s`. At the end, close() waits up to `drain_s` for the spool to
empty; what is left stays on disk (`undelivered` says how much) and a `--resume` of the same run
folder delivers it. A 4xx (wrong token, a finished run, a bad record) is not retried: the item moves
to rejected/ and the next log()/artifact() call (or close()) raises IngestRejected, so the job
fails with the platform's reason instead of training on unseen.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from .metrics import HttpSink, IngestRejected, IngestUnavailable, file_digest

log = logging.getLogger(__name__)


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _link_or_copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex}.tmp")
    try:
        os.link(src, tmp)
    except OSError:  # another filesystem, or links not allowed: a copy, streamed
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


class SpoolSink:
    """A MetricSink that spools to disk and delivers in the background (see the module doc)."""

    def __init__(self, folder: str | Path, transport: HttpSink, *, drain_s: float = 900.0, pause_s: float = 30.0,
                 poll_s: float = 5.0):
        self.folder = Path(folder)
        self.pending_dir = self.folder / "pending"
        self.files_dir = self.folder / "files"
        self.rejected_dir = self.folder / "rejected"
        for d in (self.pending_dir, self.files_dir, self.rejected_dir):
            d.mkdir(parents=True, exist_ok=True)
        for stale in self.pending_dir.glob(".*.tmp"):  # a write cut short by a crash
            stale.unlink(missing_ok=True)
        self.transport = transport
        self.drain_s = drain_s
        self.pause_s = pause_s
        self.poll_s = poll_s
        self.failure: Exception | None = None  # the first refusal (IngestRejected) or unreadable spool item
        self.undelivered = 0
        self.delivered = 0
        self._lock = threading.Lock()  # a spooled file is replaced and removed under it
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._raised = False
        self._progress: tuple[str, int, int, str] | None = None
        self._thread = threading.Thread(target=self._deliver_loop, name="tlt-spool", daemon=True)
        self._thread.start()

    # --- the trainer's side -------------------------------------------------------------------

    def log(self, step: int, scalars: dict[str, float], series: dict[str, Any]) -> None:
        self._raise_failure()
        item = {"type": "metrics", "step": step, "scalars": scalars, "series": series, "id": uuid.uuid4().hex}
        with self._lock:
            _write_atomic(self.pending_dir / f"{step:09d}-0-metrics.json", item)
        self._wake.set()

    def artifact(self, kind: str, step: int, path: Path) -> None:
        self._raise_failure()
        path = Path(path)
        stored = f"{step:09d}-{kind}-{path.name}"
        item = {"type": "artifact", "kind": kind, "step": step, "file": stored, "filename": path.name,
                "id": uuid.uuid4().hex}
        with self._lock:
            _link_or_copy(path, self.files_dir / stored)
            _write_atomic(self.pending_dir / f"{step:09d}-1-{kind}.json", item)
        self._wake.set()

    def progress(self, phase: str, done: int, total: int, message: str = "") -> None:
        """Setup progress is a live hint, not a record: only the newest is kept (in memory, never spooled)
        and the delivery thread sends it once when it is idle, so the trainer never waits for it."""
        self._progress = (phase, done, total, message)
        self._wake.set()

    def close(self) -> None:
        """Wait up to drain_s for everything to be delivered; raise IngestRejected if the platform refused any."""
        self._closing.set()
        self._wake.set()
        self._thread.join(self.drain_s)
        if self._thread.is_alive():  # still undelivered: stop retrying now, keep the files for --resume
            self.transport.abort.set()
            self._thread.join(60)
        self.transport.close()
        self.undelivered = len(self.pending())
        if self.undelivered:
            log.error("%d spooled records were not delivered to the platform; they stay in %s and are sent "
                      "by a --resume of this run folder", self.undelivered, self.pending_dir)
        self._raise_failure()

    def pending(self) -> list[Path]:
        return sorted(p for p in self.pending_dir.glob("*.json") if not p.name.startswith("."))

    def _raise_failure(self) -> None:
        if self.failure is not None and not self._raised:
            self._raised = True
            raise self.failure

    # --- the delivery thread ------------------------------------------------------------------

    def _deliver_loop(self) -> None:
        while True:
            items = self.pending()
            if not items:
                self._send_progress()
                if self._closing.is_set():
                    return
                self._wake.wait(self.poll_s)
                self._wake.clear()
                continue
            for path in items:
                if self.transport.abort.is_set():
                    return
                try:
                    self._deliver(path)
                except IngestRejected as exc:
                    log.error("%s", exc)
                    self._reject(path, str(exc))
                    self.failure = self.failure or exc
                except IngestUnavailable as exc:
                    log.error("%s; %d records wait in the spool, trying again in %.0fs",
                              exc, len(self.pending()), self.pause_s)
                    self.transport.abort.wait(self.pause_s)
                    break
                except (OSError, ValueError, KeyError) as exc:  # a spool file or artifact we cannot read
                    log.error("spooled %s cannot be delivered: %s", path.name, exc)
                    self._reject(path, f"local error: {exc}")
                    self.failure = self.failure or RuntimeError(f"spooled {path.name} cannot be delivered: {exc}")

    def _send_progress(self) -> None:
        progress, self._progress = self._progress, None
        send = getattr(self.transport, "progress", None)
        if progress is not None and send is not None:
            try:
                send(*progress)  # one try; a lost progress update is replaced by the next
            except Exception as exc:  # noqa: BLE001 - a hint must never stop delivery
                log.debug("progress not delivered: %s", exc)

    def _deliver(self, path: Path) -> None:
        try:
            item = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return  # replaced or removed meanwhile
        if item["type"] == "metrics":
            self.transport.log(item["step"], item["scalars"], item["series"])
        else:
            file = self.files_dir / item["file"]
            if "sha256" not in item:  # hashed once, here, not in the trainer's thread
                item["size"], item["sha256"] = file_digest(file)
                with self._lock:
                    if self._same(path, item["id"]):
                        _write_atomic(path, item)
            self.transport.artifact(item["kind"], item["step"], file, size=item["size"], sha256=item["sha256"],
                                    filename=item["filename"])
        with self._lock:
            if self._same(path, item["id"]):  # not replaced by a newer record of the same step meanwhile
                path.unlink()
                if item["type"] == "artifact":
                    (self.files_dir / item["file"]).unlink(missing_ok=True)
        self.delivered += 1

    @staticmethod
    def _same(path: Path, item_id: str) -> bool:
        try:
            return json.loads(path.read_text(encoding="utf-8")).get("id") == item_id
        except (OSError, ValueError):
            return False

    def _reject(self, path: Path, reason: str) -> None:
        with self._lock:
            stamp = time.strftime("%Y%m%dT%H%M%S")
            target = self.rejected_dir / f"{stamp}-{path.name}"
            try:
                os.replace(path, target)
            except FileNotFoundError:
                return
            target.with_suffix(".error").write_text(reason + "\n", encoding="utf-8")


def spool_from_env(out: Path, url: str, token: str) -> SpoolSink:
    """The trainer's spool, with the delivery bounds from the job's environment (see README)."""

    def seconds(name: str, default: float) -> float:
        try:
            return float(os.environ.get(name) or default)
        except ValueError:
            log.warning("%s=%r is not a number; using %s", name, os.environ.get(name), default)
            return default

    transport = HttpSink(url, token, retry_s=seconds("TLT_INGEST_RETRY_S", 600),
                         max_wait_s=seconds("TLT_INGEST_MAX_WAIT_S", 60), timeout_s=seconds("TLT_INGEST_TIMEOUT_S", 60))
    return SpoolSink(out / "spool", transport, drain_s=seconds("TLT_INGEST_DRAIN_S", 900),
                     pause_s=seconds("TLT_INGEST_PAUSE_S", 30))
