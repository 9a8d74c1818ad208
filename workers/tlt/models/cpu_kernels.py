"""Our own CPU kernels for decode steps and verify passes, compiled for the CPU at hand on
first use: a few-row product (csrc/gemv.cpp; a bfloat16 model's in csrc/dot_bf16.cpp, on AVX-512 BF16)
and a few-query attention (csrc/attention.cpp).

PyTorch's CPU kernels are built for products of many rows. At one row (a decode step) they read
the weights far below the memory's speed: on 2 AVX2 EPYC cores SmolLM2's LM head (113 MB in
float32) took 10 ms through F.linear, two rows 23 ms and seven 34, while a plain sum reads as many
bytes in 3.5 ms. csrc/gemv.cpp streams a packed copy of the weight once and multiplies each loaded
vector into up to six rows: 3.7 ms at one row, 6.5 at seven. It is one more candidate for
linear.tune(), which keeps it only where it measures fastest and row-invariant. Its SDPA likewise
pays its blocking and buffers in every layer for a few queries; `attention` reads the keys each
query may see, in order, and nothing else (transformer.cached_attention). Around it, a decode step's
small ops cost as much as the kernels at one row, so `attention_step` does a layer's rope, cache
writes and attention in one call and `rms_norm` issues RMSNorm's ops from C++ (csrc/norm.cpp), both
with the bits of the PyTorch ops they replace.

Built with the system's C++ compiler into var/build/ as one translation unit (csrc/kernels.cpp;
about a minute, once per CPU kind and torch version: -march=native code must never run on another
CPU), and shared by every process there (one builds or loads at a time, under a lock that a killed
process cannot leave taken). Where it cannot be built the tuner never offers gemv and attention
stays on SDPA.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path

import torch
from torch import Tensor

from .. import file_lock
from .policies import REPO_ROOT

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
BUILD_LOCK = "tlt-build.lock"  # in the build folder: one process builds or loads the kernels at a time (file_lock)
TORCH_BATON = "lock"  # in the build folder: torch.utils.cpp_extension's lock file (its FileBaton)
SOURCES = ("kernels.cpp", "gemv.cpp", "dot_bf16.cpp", "attention.cpp", "norm.cpp", "simd.h")  # kernels.cpp includes the others


@functools.cache
def build_tag() -> str:
    """One build per CPU feature set, torch version and source: -march=native targets the CPU."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")),
                     platform.processor())
    except OSError:
        flags = platform.processor()
    blob = "|".join([flags, torch.__version__, *((CSRC / f).read_text() for f in SOURCES)])
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


@functools.cache
def _extension():
    """The compiled module, or None where it cannot be built (no compiler, a non-x86 CPU)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    from torch.utils.cpp_extension import load

    name = f"tlt_kernels_{build_tag()}"
    build = REPO_ROOT / "var" / "build" / name
    try:
        if shutil.which("ninja") is None:  # the pinned PyPI ninja: a worker need not have the venv on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        with file_lock.held(build / BUILD_LOCK):
            # torch's own lock is a file that exists while a process builds or loads here, and one
            # killed meanwhile (a cancelled run) leaves it: every later load would wait on it for
            # ever. Under our lock no process of ours is loading, so such a file is a leftover.
            (build / TORCH_BATON).unlink(missing_ok=True)
            if not any(build.glob("*.so")):
                log.info("building the CPU kernels for this CPU in %s (about a minute, once)", build)
            return load(name, [str(CSRC / "kernels.cpp")], build_directory=str(build), verbose=False,
                        extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as exc:  # a missing compiler or headers: the other kernels still serve
        log.warning("the CPU kernels could not be built (%s: %s); decoding uses PyTorch's kernels",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None


def available() -> bool:
    return _extension() is not None


def pack(w: Tensor) -> Tensor:
    """A float32 or bfloat16 CPU weight [out, in] in the kernel's blocked layout (a copy, made once
    per weight; bfloat16 halves the bytes a product streams, for drafters: linear.draft_in_bfloat16)."""
    return _extension().pack(w)


def linear(x2: Tensor, packed: Tensor, out: int, bias: Tensor | None = None) -> Tensor:
    """x2 [rows, in] @ w[out, in]^T + bias, float32 on the CPU (sums in float32 whatever w's dtype),
    from packed = pack(w)."""
    y = _extension().gemv(x2, packed, out)
    return y if bias is None else y.add_(bias)


@functools.cache  # asked on every bfloat16 product (linear.usable)
def bf16_dot() -> bool:
    """Built with csrc/dot_bf16.cpp's few-row bfloat16 product (the CPU has AVX-512 BF16)."""
    return available() and _extension().has_bf16_dot()


def pack_bf16_pairs(w: Tensor) -> Tensor:
    """A bfloat16 CPU weight [out, in] in linear_bf16's blocked layout (a copy, made once per weight)."""
    return _extension().pack_bf16_pairs(w)


def linear_bf16(x2: Tensor, packed: Tensor, out: int, bias: Tensor | None = None) -> Tensor:
    """x2 [rows, in] @ w[out, in]^T + bias for a bfloat16 model on the CPU, from packed =
    pack_bf16_pairs(w): exact products, float32 sums, the bias added before one rounding to
    bfloat16 (csrc/dot_bf16.cpp; where bf16_dot())."""
    return _extension().gemv_bf16_pairs(x2, packed, out, bias)


def attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
    """CPU attention of float32 q [B, T, h, hd] over float32 or bfloat16 keys/values [B, S, kv, hd]
    where mask [B, T, S] allows -> float32 [B, T, h, hd]; each query computed alone, in float32
    (csrc/attention.cpp). hd % 8 == 0."""
    return _extension().attention(q, keys, values, mask, scale)


def attention_step(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, kcache: Tensor, vcache: Tensor,
                   write_pos: Tensor, mask: Tensor, scale: float) -> Tensor:
    """A decode step's or verify pass's attention block after its q/k/v product, in one call: q
    [B, T, h * hd] and k, v [B, T, kv * hd] (views of the product's columns will do) rotated by
    cos/sin [B, T, hd], k and v written at cache slots write_pos [B, T] of kcache/vcache [B, L, kv,
    hd], then `attention` of q over the slots mask [B, T, S] allows -> [B, T, h * hd], all in q's
    dtype (float32 or bfloat16) and with the bits of those steps done one by one in PyTorch."""
    return _extension().attention_step(q, k, v, cos, sin, kcache, vcache, write_pos, mask, scale)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformer.RMSNorm's ops on CPU inference tensors, issued from C++: the same bits, without
    Python's overhead per op (csrc/norm.cpp)."""
    return _extension().rms_norm(x, weight, eps)
