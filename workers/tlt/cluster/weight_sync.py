"""Weight sync without the driver: named tensors go from their owner to the rollout workers in buckets.

    pub = BucketPublisher("policy", bucket_bytes=64 << 20)      # on the owner (learner rank 0)
    manifest = pub.publish(version, named_tensors)               # a few hundred bytes of metadata
    ...                                                           # the driver forwards the manifest only
    receive(manifest, dict(worker_model.named_parameters()))     # on every rollout worker

On one node (every CPU run, and GPU runs whose workers share the learner's node) the buckets are
files in /dev/shm: the owner copies each tensor once into its bucket, each worker maps the file and
copies from it into its own parameters, so a sync costs two memcpys per worker and no pickling, and
every worker reads the very same bytes (bit-identical weights). Elsewhere the buckets go through the
Ray object store, put by the owner (never by the driver). The drafter takes the same path
whenever it changes (`tag="drafter"`).

A manifest names every tensor it carries; `receive` refuses one that does not cover the model
exactly (a partial sync never passes unnoticed).

A publisher's folder, /dev/shm/tlt-sync-<tag>-<pid>-*, goes with `close()`; one whose owner died
without it (killed for memory, say) is removed by the next publisher on the node, so a crashed run's
weights do not hold the node's shared memory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import Tensor

SHM_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
DEFAULT_BUCKET_BYTES = 64 << 20  # big enough to amortise per-bucket costs, small enough to stream


@dataclass
class Bucket:
    """One bucket: tensors of one dtype laid end to end in a flat buffer."""

    dtype: str  # torch dtype name, e.g. "float32"
    numel: int
    entries: list[tuple[str, tuple[int, ...], int]]  # (name, shape, offset in elements)
    path: str | None = None  # shared-memory file (same node)
    ref: Any = None  # or a Ray ObjectRef of the flat tensor (other nodes)


@dataclass
class Manifest:
    tag: str
    version: int
    buckets: list[Bucket] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(b.numel * torch.empty(0, dtype=getattr(torch, b.dtype)).element_size() for b in self.buckets)

    @property
    def names(self) -> set[str]:
        return {name for b in self.buckets for name, _, _ in b.entries}


class BucketPublisher:
    """Owner side: writes versions of a set of named tensors into reusable buckets."""

    def __init__(self, tag: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES, shared_memory: bool = True):
        self.tag = tag
        self.bucket_bytes = bucket_bytes
        self.shared_memory = shared_memory
        self.root = None
        if shared_memory:
            remove_orphaned_folders()
            self.root = Path(tempfile.mkdtemp(prefix=f"tlt-sync-{tag}-{os.getpid()}-", dir=SHM_ROOT))
        self._flats: dict[int, Tensor] = {}  # bucket index -> the mapped flat tensor, reused across versions

    def publish(self, version: int, named: Iterable[tuple[str, Tensor]]) -> Manifest:
        """Copy the tensors into the buckets (a generator may produce them one at a time, e.g. FSDP's
        per-parameter all-gather, so at most one full tensor besides the buckets is alive)."""
        manifest = Manifest(self.tag, version)
        index = 0
        pending: list[tuple[str, Tensor]] = []
        size = 0
        for name, t in named:
            t = t.detach()
            nbytes = t.numel() * t.element_size()
            if pending and (pending[0][1].dtype != t.dtype or size + nbytes > self.bucket_bytes):
                manifest.buckets.append(self._write(index, pending))
                index, pending, size = index + 1, [], 0
            pending.append((name, t))
            size += nbytes
        if pending:
            manifest.buckets.append(self._write(index, pending))
        return manifest

    def _write(self, index: int, items: list[tuple[str, Tensor]]) -> Bucket:
        dtype = items[0][1].dtype
        numel = sum(t.numel() for _, t in items)
        entries, offset = [], 0
        for name, t in items:
            entries.append((name, tuple(t.shape), offset))
            offset += t.numel()
        name = str(dtype).removeprefix("torch.")
        if self.root is None:  # other nodes: one object per bucket, put by the owner
            import ray

            flat = torch.cat([t.reshape(-1).cpu() for _, t in items]) if items else torch.empty(0, dtype=dtype)
            return Bucket(name, numel, entries, ref=ray.put(flat))
        path = self.root / f"bucket_{index:04d}"
        flat = self._flats.get(index)
        if flat is None or flat.numel() != numel or flat.dtype != dtype:
            with open(path, "wb") as f:  # size the file, then map it shared
                f.truncate(numel * items[0][1].element_size())
            flat = self._flats[index] = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
        for (_, t), (_, _, off) in zip(items, entries):
            flat[off: off + t.numel()].copy_(t.reshape(-1))
        return Bucket(name, numel, entries, path=str(path))

    def close(self) -> None:
        self._flats.clear()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


def remove_orphaned_folders(root: Path = SHM_ROOT) -> list[Path]:
    """Remove the sync folders of publishers that are no longer running; returns those removed."""
    removed = []
    for folder in root.glob("tlt-sync-*-*-*"):
        pid = folder.name.rsplit("-", 2)[-2]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


def receive(manifest: Manifest, targets: dict[str, Tensor], strict: bool = True) -> int:
    """Copy a manifest's tensors into `targets` (name -> tensor, e.g. dict(model.named_parameters()));
    returns the bytes read. strict: the manifest must carry exactly the targets' names."""
    if strict and manifest.names != set(targets):
        missing, extra = set(targets) - manifest.names, manifest.names - set(targets)
        raise ValueError(f"{manifest.tag} sync v{manifest.version} does not match the model: "
                         f"missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}")
    nbytes = 0
    with torch.no_grad():
        for b in manifest.buckets:
            dtype = getattr(torch, b.dtype)
            if b.path is not None:
                flat = torch.from_file(b.path, shared=True, size=b.numel, dtype=dtype)
            else:
                import ray

                flat = ray.get(b.ref)
            for name, shape, off in b.entries:
                if name not in targets:
                    continue
                n = 1
                for s in shape:
                    n *= s
                dst = targets[name]
                dst.copy_(flat[off: off + n].view(shape))  # copy_ bumps the version: packed kernels repack
                nbytes += n * flat.element_size()
            del flat
    return nbytes



def node_id() -> str:
    """This process's Ray node (or the host name outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside a Ray worker: the host decides
        pass
    return os.uname().nodename
