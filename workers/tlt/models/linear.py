"""nn.Linear whose few-row CPU products (decode and verify passes) use the kernel measured fastest
on the machine at hand.

A decode step multiplies ONE row per sequence by every weight matrix, and a speculative verify
pass multiplies a handful (the draft tokens). On a CPU both are bound by reading the weights, and
which kernel reads them fastest depends on the CPU: on 2 AVX2 EPYC cores a pre-packed oneDNN
weight ran a SmolLM2 decode step ~1.9x faster than PyTorch's default MKL sgemv; on an AVX-512
Xeon the same choice ran slower than the default. So nothing is assumed: `tune(model)` times each
candidate on the model's own layers (grouped by weight shape, each group streamed whole, as a
decode step streams it) for 1..64 rows, at each thread count the process decodes on
(`decode_threads`), keeps the fastest per group, and caches the choice on disk per CPU model,
torch version and thread counts (`kernel_cache_path()`); rollout.generate() tunes the models it
decodes with on first use.

Only a ROW-INVARIANT kernel may be chosen: one that gives a row the same bits whatever rows come
with it (up to MAX_FEW_ROWS rows in float32, BF16_INVARIANT_ROWS in bfloat16), checked on each
group at tuning. A verify pass must compute a draft token's logits exactly as the decode step
would have, or a near-tie rounds the other way and SD emits a token plain decoding would not
(greedy SD is lossless token for token only so, and only if attention is invariant too:
transformer.cached_attention, in bfloat16). PyTorch's own sgemv/sgemm fails this on an AVX-512 Xeon
(a row beside others rounds differently from the row alone); packed oneDNN passed on every CPU we
measured.

float32 products are routed so everywhere; bfloat16 ones where oneDNN multiplies bfloat16 on this
CPU (`onednn_bf16()`: AVX-512 BF16 or AMX). On AMX a packed bf16 weight makes a 16-row verify pass
cost what one row costs (SmolLM2's layers on 2 Xeon cores: 14.5 ms for 1 row, 15.3 for 16;
float32's oneDNN 24 and 38 ms). Everywhere it is also what makes bfloat16 lossless: PyTorch's bf16
F.linear rounds about 2 outputs in 10,000 of a row beside others differently from the row alone
(AVX-512 EPYC), packed oneDNN none in 600,000. Other dtypes, bfloat16 on older CPUs, and GPUs
always take F.linear.

Candidates (all equal F.linear up to float rounding; products of more than MAX_FEW_ROWS rows and
autograd take the bulk kernel below):

    linear   F.linear: PyTorch's default (MKL sgemv / small-M sgemm)
    onednn   oneDNN with the weight packed once; a single row is computed as two (the row
             repeated), which takes oneDNN's many-row path, the one several rows take
    gemv     our own kernel (cpu_kernels.py, compiled for the CPU on first use), which
             streams the weights at close to the memory's speed and is row-invariant by
             construction; on 2 AVX2 EPYC cores a SmolLM2 decode step took 40-44 ms through it
             against 62-67 ms through packed oneDNN, a 7-token verify pass 60-65 against 77-100.
             float32 everywhere; a bfloat16 model's products where the CPU has AVX-512 BF16
             (csrc/dot_bf16.cpp: exact products of bfloat16 pairs, float32 sums), where oneDNN's
             bfloat16 is slower than float32 without AMX

Drafters only: `gemv_bf16` (DRAFT_KERNEL), gemv over a bfloat16 copy of the weight with float32
sums, set by draft_in_bfloat16() on the layers the tuner gave gemv. Never tuned, never a target's:
it does not equal F.linear (the weights are rounded), which only proposals may afford.

Compute-bound products are a separate choice, `Linear.bulk_kernel`: PyTorch's linear, or oneDNN.
It takes every autograd product (the product and both gradient products, `_OneDNNLinear`; weights
packed afresh at each call, since every optimizer step changes them) and every inference product
of more than MAX_FEW_ROWS rows (prefill; the drafter warm-up's 128-row decode; the packed copy
below). `tune` times both on one BULK_ROWS-row product per weight shape: on a 2-core AVX-512 AMD
EPYC oneDNN ran 2-2.5x PyTorch's default sgemm at every size from 64 to 4096 rows, a SmolLM2
forward + backward of 4 x 1024 tokens ran 1.3-1.6x faster, and the learner's step (bench learner)
1.8x.

Linears that read the same input (attention's q/k/v, the MLP's gate/up) are multiplied as one
stacked product in few-row inference (`Fused`), tuned and checked like any other layer.

The packed copy is made on first use and made again when the weight changes: a new tensor, or an
in-place update (load_state_dict, optimizer steps) that bumps the tensor's version counter.
Writes through `.data` bypass that counter and would leave the packed copy stale, so none are made
in this package. Set TLT_KERNEL=linear|onednn to force one kernel everywhere (no tuning, no check).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cpu_kernels
from .. import file_lock
from .policies import REPO_ROOT

log = logging.getLogger(__name__)

MAX_FEW_ROWS = 64  # decode of a tail batch, or a few rows' verify passes; more rows are compute-bound
KERNELS = ("linear", "onednn", "gemv")
DRAFT_KERNEL = "gemv_bf16"  # gemv over a bfloat16 copy of the weight: for drafters only (draft_in_bfloat16)
TUNE_ROWS = (1, 2, 4, 8, 16, 32, 64)  # row counts each candidate is timed at
# ... for a drafter: a draft step multiplies a tail's rows (x its tree's top-k). Scored over 1..64 rows
# at a rollout worker's one thread (AVX-512 EPYC), its gate/up and draft head went to oneDNN and a
# d4k1 draft took 11.5 ms; at these rows every drafter layer takes gemv and it takes 6.1 (bench draft)
DRAFT_ROWS = (1, 2, 4, 8)
BULK_KERNELS = ("linear", "onednn")  # for compute-bound products (Linear.bulk_kernel)
BULK_ROWS = 1024  # rows of the product the bulk kernels are timed on
BUSY_SHARE = 0.85  # a probe getting less of its threads' time than this: the machine is crowded (machine_busy)
QUIET_WAIT_S = 5.0  # how long tuning waits for a crowded machine to quieten before it times anyway (tune)
_PACK_HINT = 8  # oneDNN picks its packed layout for this many rows; good for 2..64
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
CUDA_FIXED_SHAPES = True  # few-row CUDA inference at one padded shape (padded_rows); off: PyTorch's shapes
BF16_INVARIANT_ROWS = 32  # AMX bf16: a row's bits are the same beside up to this many rows (test_linear),
# so larger few-row bf16 products (a tail of 4 rows verifying 9 tokens each) run in chunks of this size


class Linear(nn.Linear):
    """Drop-in nn.Linear (same parameters and state_dict keys) that routes few-row CPU products."""

    kernel: str = "linear"  # set by tune()
    bulk_kernel: str = "linear"  # set by tune(): autograd and many-row products (BULK_KERNELS)
    _packed: tuple[tuple, Tensor] | None = None  # (weight key, oneDNN's packed copy)
    _blocked: tuple[tuple, Tensor] | None = None  # (weight key, gemv's packed copy)

    @classmethod
    def frozen(cls, weight: Tensor) -> "Linear":
        """A bias-free Linear over an existing [out, in] weight (no copy, no gradient)."""
        layer = cls(weight.shape[1], weight.shape[0], bias=False, device="meta")
        layer.weight = nn.Parameter(weight, requires_grad=False)
        return layer

    def __getstate__(self):
        state = super().__getstate__()
        return {**state, "_packed": None, "_blocked": None}  # caches; oneDNN's packed tensors do not pickle

    def forward(self, x: Tensor) -> Tensor:
        return self.run(x, self.kernel)

    def run(self, x: Tensor, kernel: str) -> Tensor:
        """x @ W^T + b through `kernel` for few-row CPU inference (_cpu_inference), else through bulk_kernel
        (autograd, or more than MAX_FEW_ROWS rows); F.linear wherever neither applies."""
        w = self.weight
        if torch.is_autocast_enabled(x.device.type):  # the caller asked for PyTorch's mixed precision (a
            return F.linear(x, w, self.bias)  # bfloat16 learner): autocast casts inside F.linear, not ours
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if 0 < rows <= MAX_FEW_ROWS and cuda_fixed_shape(x, w):
            return padded_rows(lambda x2: F.linear(x2, w, self.bias), x)
        if self.bulk_kernel == "onednn" and rows and _ONEDNN and _cpu_float32_training(x, w):
            y = _OneDNNLinear.apply(x.reshape(rows, x.shape[-1]), w, self.bias)
            # a 2-D product is returned as is: a model's output must not be a view (FSDP2 hooks it)
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], -1)
        if rows > MAX_FEW_ROWS:  # prefill, many-row decode: compute-bound, like a training product
            kernel = self.bulk_kernel
        if not rows or not _cpu_inference(x, w) or not usable(kernel, x.dtype) or (
                kernel == "linear" and rows > MAX_FEW_ROWS):
            return F.linear(x, w, self.bias)
        if kernel != "linear" and w.is_inference():  # the kernels' weight copies are keyed by the
            return F.linear(x, w, self.bias)  # version counter, which inference tensors lack
        x2 = x.reshape(rows, x.shape[-1])
        if kernel in ("gemv", DRAFT_KERNEL):  # few rows (the bulk kernels are linear and onednn)
            if x.dtype == torch.bfloat16:  # a bfloat16 model's: AVX-512 BF16 dot products (usable)
                packed = self._weight_copy("_blocked", cpu_kernels.pack_bf16_pairs)
                return cpu_kernels.linear_bf16(x2, packed, w.shape[0], self.bias).reshape(*x.shape[:-1], -1)
            packed = self._weight_copy("_blocked", cpu_kernels.pack if kernel == "gemv" else _pack_bf16)
            return cpu_kernels.linear(x2, packed, w.shape[0], self.bias).reshape(*x.shape[:-1], -1)
        if rows > MAX_FEW_ROWS:
            y = _onednn(x2, self._packed_weight(), self.bias)
        elif rows <= (chunk := invariant_rows(x.dtype)):  # a decode step or verify pass: products no
            # larger than those checked row-invariant, whichever kernel (PyTorch's bfloat16 linear on
            # AMX, too, rounds otherwise beyond 32 rows)
            y = self._few_rows(x2, kernel)
        else:
            y = torch.cat([self._few_rows(p, kernel) for p in x2.split(chunk)])
        return y.reshape(*x.shape[:-1], -1)

    def _few_rows(self, x2: Tensor, kernel: str) -> Tensor:
        if kernel == "linear":
            return F.linear(x2, self.weight, self.bias)
        if x2.shape[0] == 1:  # oneDNN's one-row path rounds differently from its many-row one: use the latter
            return _onednn(torch.cat([x2, x2]), self._packed_weight(), self.bias)[:1]
        return _onednn(x2, self._packed_weight(), self.bias)

    def _packed_weight(self) -> Tensor:
        return self._weight_copy("_packed", _pack)

    def _weight_copy(self, slot: str, make: Callable[[Tensor], Tensor]) -> Tensor:
        """A kernel's copy of the weight in its own layout, made again when the weight changes."""
        w = self.weight
        key = (w.data_ptr(), w._version, tuple(w.shape), make)
        held = getattr(self, slot)
        if held is None or held[0] != key:
            held = (key, make(w.detach()))
            setattr(self, slot, held)
        return held[1]


class Fused:
    """Linears that read the same input (q, k, v; gate, up) multiplied as ONE in few-row CPU
    inference: a product over their stacked weights costs less than one per part (2 AVX2 EPYC
    cores, SmolLM2, 2 rows through packed oneDNN: q/k/v 86 against 199 us, gate/up 151 against
    225). The parts' own Linears run everywhere else (autograd, prefill, GPUs), so parameters and
    state_dict stay the parts'. Not a Module: a plain attribute, invisible to state_dict and FSDP.

    Only models `tune` has seen stack (`active`): the rollout's, whose weights change only through
    copy_ or load_state_dict. The stacked layer is made again when a part's parameter changes (a new
    tensor, or an in-place update that bumps its version), keeping the kernels `tune` chose for it.
    The learner's never stack: FSDP2 gathers new weights into the same storage without bumping the
    version, so a stacked copy would go stale. Decode steps and verify passes both take the stacked
    layer, so the products they compare are the same kernel's."""

    def __init__(self, *parts: Linear):
        self.parts = parts
        self.sizes = [p.out_features for p in parts]
        self.active = False  # set by tune()
        self._layer: tuple[tuple, Linear] | None = None
        self._kernels: tuple[str, str] | None = None  # a copied Fused's stacked kernels (__getstate__)

    def __getstate__(self):
        # the stacked layer is a cache of copies of the parts' weights, made again on use; the kernels
        # tuned for it must travel, or a copy of a tuned model (marked tuned) stacks on F.linear
        return {**self.__dict__, "_layer": None, "_kernels": self._stacked_kernels()}

    def _stacked_kernels(self) -> tuple[str, str] | None:
        """(kernel, bulk_kernel) of the stacked layer: the current one's, else a copied Fused's."""
        return (self._layer[1].kernel, self._layer[1].bulk_kernel) if self._layer else self._kernels

    def __call__(self, x: Tensor) -> tuple[Tensor, ...]:
        w = self.parts[0].weight
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if self.active and 0 < rows <= MAX_FEW_ROWS and _ONEDNN and _cpu_inference(x, w) and not w.is_inference():
            return self.layer()(x).split_with_sizes(self.sizes, -1)
        return tuple(p(x) for p in self.parts)

    def layer(self) -> Linear:
        """The stacked Linear over the parts' current weights."""
        key = tuple((t.data_ptr(), t._version) for p in self.parts for t in (p.weight, p.bias) if t is not None)
        if self._layer is None or self._layer[0] != key:
            self._layer = (key, self._stack())
        return self._layer[1]

    @torch.inference_mode(False)  # a stacked copy made inside inference mode could not be packed
    @torch.no_grad()
    def _stack(self) -> Linear:
        layer = Linear.frozen(torch.cat([p.weight for p in self.parts]))
        if self.parts[0].bias is not None:
            layer.bias = nn.Parameter(torch.cat([p.bias for p in self.parts]), requires_grad=False)
        if kernels := self._stacked_kernels():
            layer.kernel, layer.bulk_kernel = kernels
        return layer


def _onednn(x2: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")


def _pack(w: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, _PACK_HINT)


def _pack_bf16(w: Tensor) -> Tensor:
    return cpu_kernels.pack(w.to(torch.bfloat16))


class _OneDNNLinear(torch.autograd.Function):
    """y = x W^T + b with the product and both gradient products in oneDNN (CPU float32 training).

    x2 [M, in], weight [out, in]: grad x = g W, grad W = g^T x, grad b = sum of g over rows. Each
    operand is packed at the call (a copy, small beside a training-sized product); nothing is cached,
    so an optimizer step or an FSDP all-gather into the weight can never leave a stale copy."""

    @staticmethod
    def forward(ctx, x2: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return _onednn(x2, _pack(weight.detach()), None if bias is None else bias.detach())

    @staticmethod
    def backward(ctx, g: Tensor):
        x2, weight = ctx.saved_tensors
        g = g.contiguous()
        gx = _onednn(g, _pack(weight.t().contiguous())) if ctx.needs_input_grad[0] else None
        gw = _onednn(g.t().contiguous(), _pack(x2.t().contiguous())) if ctx.needs_input_grad[1] else None
        gb = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def cuda_fixed_shape(x: Tensor, w: Tensor | None = None) -> bool:
    """CUDA inference (decode steps, verify passes), whose few-row products run at one padded shape
    (padded_rows) where CUDA_FIXED_SHAPES."""
    return CUDA_FIXED_SHAPES and x.is_cuda and not _autograd(x, w)


def padded_rows(fn: Callable[[Tensor], Tensor], x: Tensor, rows: int = MAX_FEW_ROWS) -> Tensor:
    """fn over x's rows (all dims but the last) padded with zero rows to `rows`, then cut back.

    On a GPU the kernel a product or reduction runs (its tiling, split-K, the threads that share a
    row's sum) is picked by its shape, so a row alone (a decode step) and the same row beside the
    other draft tokens (a verify pass) can round differently, and greedy SD then departs from plain
    decoding at a near-tie. One shape for every few-row product makes it the same kernel, and
    rows never mix inside one. Zero rows cost nothing that matters: these products are bound by
    reading the weights."""
    x2 = x.reshape(-1, x.shape[-1])
    y = fn(F.pad(x2, (0, 0, 0, rows - x2.shape[0])))[:x2.shape[0]]
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _autograd(x: Tensor, w: Tensor | None = None) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or (w is not None and w.requires_grad))


def _cpu_float32_training(x: Tensor, w: Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == w.dtype == torch.float32 and _autograd(x, w)


def _cpu_inference(x: Tensor, w: Tensor) -> bool:
    """A product the few-row kernels take: float32, or bfloat16 where the CPU multiplies it in AMX."""
    return (x.device.type == "cpu" and x.dtype == w.dtype and x.dtype in tuned_dtypes()
            and not _autograd(x, w))  # autograd takes _OneDNNLinear or F.linear


@functools.cache
def tuned_dtypes() -> tuple[torch.dtype, ...]:
    """The CPU dtypes whose products the kernels here take: float32, and bfloat16 where oneDNN
    multiplies it (onednn_bf16)."""
    return (torch.float32, torch.bfloat16) if onednn_bf16() else (torch.float32,)


@functools.cache
def onednn_bf16() -> bool:
    """oneDNN multiplies bfloat16 natively on this CPU (AVX-512 BF16 or AMX; module doc). Elsewhere
    bfloat16 stays on F.linear, which is neither fast nor row-invariant there."""
    return _ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def bf16_pays() -> bool:
    """Does a bfloat16 model make a TLT run faster than a float32 one here (config `model.dtype:
    auto`)? With AMX: oneDNN multiplies bfloat16 on its tiles, a verify pass of a few tokens costs
    about what a one-token decode step does, and the preset's A/B gained more than in float32.
    Not with AVX-512 BF16 alone, although gemv's dot products (csrc/dot_bf16.cpp) decode there much
    faster than float32 (2 EPYC cores, SmolLM2: a decode step 15.0 against 26.0 ms, a 6-token verify
    pass 18.7 against 31.8): in the preset's A/B (2026-12-05, workers/tlt/bench/RESULTS.md
    "End to end") SD did not speed up the tail (99.5 against 99.4 tokens/s), TLT's step was 0.97x
    the baseline's (float32 on that VM: 1.04x), and the learner's log-probs of the rollout's tokens
    moved by up to 1.0 (1.1e-4)."""
    return onednn_bf16() and "amx_bf16" in cpu_flags()


# --- tuning ---------------------------------------------------------------------------------------


def cpu_name() -> str:
    """The CPU model as the OS names it (Linux /proc/cpuinfo), else platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The vector extensions that decide which kernels are fast (AVX2, AVX-512, AMX, ...)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return sorted(f for f in have if f.startswith(("avx", "amx", "fma")))
    except OSError:
        pass
    return []


def kernel_cache_path() -> Path:
    """Where tuned choices are kept (env TLT_KERNEL_CACHE; default var/models/kernels.json)."""
    default = REPO_ROOT / "var" / "models" / "kernels.json"
    return Path(os.environ.get("TLT_KERNEL_CACHE") or default)


_decode_threads: tuple[int, ...] = ()  # set_decode_threads


def set_decode_threads(*counts: int) -> None:
    """Declare the intra-op thread counts this process's few-row products run at; tune() then scores
    each kernel at every one of them (none declared: at the calling thread's count).

    A rollout worker decodes on its own core until its peers finish, then on theirs too
    (rollout.lend_idle_cores), and one kernel must serve both, since a kernel switched mid-rollout
    would change a token's bits. Tuned at the worker's one thread alone, an AVX-512 EPYC chose oneDNN
    for most of SmolLM2's layers, on which the long tail, run on two threads, took a plain decode step
    21% longer than on gemv; timed at two threads (rows 1-8 or 1-12) it chose gemv for every layer
    (README, "The tuner's kernels slowed the baseline more than TLT")."""
    global _decode_threads
    if any(c < 1 for c in counts):
        raise ValueError(f"thread counts must be at least 1, not {counts}")
    _decode_threads = tuple(sorted(set(counts)))


def decode_threads() -> tuple[int, ...]:
    """The thread counts tune() scores at (set_decode_threads; else the calling thread's)."""
    return _decode_threads or (torch.get_num_threads(),)


def _cache_key(shape: tuple[int, int], count: int, dtype: torch.dtype, rows: tuple[int, ...] = TUNE_ROWS) -> str:
    # the model name alone is ambiguous ("AMD EPYC" on both an AVX2 and an AVX-512 part): add the flags
    flags = hashlib.sha256(" ".join(cpu_flags()).encode()).hexdigest()[:8]
    # "row-invariant" and the candidates (gemv's build): choices made among other kernels, or
    # before only row-invariant ones were allowed, are not reused
    return (f"{cpu_name()} [{flags}]|torch {torch.__version__}|threads {'+'.join(map(str, decode_threads()))}|"
            f"{shape[0]}x{shape[1]}x{count}|{str(dtype).removeprefix('torch.')}|row-invariant|"
            f"{','.join(KERNELS)} {cpu_kernels.build_tag()}"
            + ("" if rows == TUNE_ROWS else f"|rows {','.join(map(str, rows))}"))


def _read_cache() -> dict[str, str]:
    try:
        return json.loads(kernel_cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(updates: dict[str, str]) -> None:
    path = kernel_cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {**_read_cache(), **updates}
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)  # atomic: concurrent workers never read half a file
    except OSError as exc:
        log.warning("could not cache tuned kernels in %s: %s", path, exc)


def machine_busy(probes: int = 4, seconds: float = 0.05) -> bool:
    """Is something else crowding this process's threads? Then kernels timed now were ranked by
    how they bear the crowd, not by speed: on 2 AVX2 EPYC cores, tuned beside a benchmark and a test
    run, the tuner once chose oneDNN for SmolLM2's LM head and gate/up, and a quiet re-tune chose
    gemv and a 12% faster decode step. The probe: a multi-threaded product loop's CPU time over its
    wall time and threads (median of `probes`). Measured there: ~0.97-1.0 alone, 0.5 beside a
    2-thread job, 0.46-0.76 beside a 1-thread one."""
    a = torch.randn(384, 384)
    shares = []
    for _ in range(probes):
        cpu, wall = time.process_time(), time.perf_counter()
        while time.perf_counter() - wall < seconds:
            a @ a
        shares.append((time.process_time() - cpu) / ((time.perf_counter() - wall) * torch.get_num_threads()))
    return sorted(shares)[len(shares) // 2] < BUSY_SHARE


def _best_times(runs: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Best of `reps` timed calls of each run; the runs take turns, so a burst of load elsewhere hits
    them all alike, after an untimed first round (it packs the weights and faults pages in)."""
    best = dict.fromkeys(runs, float("inf"))
    for rep in range(reps + 1):
        for name, run in runs.items():
            t = time.perf_counter()
            run()
            if rep:
                best[name] = min(best[name], time.perf_counter() - t)
    return best


def _time_group(layers: list[Linear], kernels: tuple[str, ...], rows: int, reps: int) -> dict[str, float]:
    """A `rows`-row input through every layer of the group, per kernel (_best_times)."""
    x = torch.randn(rows, layers[0].in_features, dtype=layers[0].weight.dtype)
    return _best_times({k: lambda k=k: [layer.run(x, k) for layer in layers] for k in kernels}, reps)


def _time_bulk(layer: Linear, reps: int) -> dict[str, float]:
    """A BULK_ROWS-row product by the layer's weight, per bulk kernel (_best_times; forward only:
    the gradient products are products of the same kind and size). float32's oneDNN packs at each
    call, as training does; bfloat16 only serves inference, from the layer's packed copy."""
    w = layer.weight.detach()
    x = torch.randn(BULK_ROWS, layer.in_features, dtype=w.dtype)
    packed = (lambda: _pack(w)) if w.dtype == torch.float32 else layer._packed_weight
    return _best_times({"linear": lambda: F.linear(x, w), "onednn": lambda: _onednn(x, packed())}, reps)


def _fused(model: nn.Module) -> list[Fused]:
    """A model's Fused groups over real (not meta, not inference) weights."""
    return [f for m in model.modules() for f in vars(m).values()
            if isinstance(f, Fused) and not f.parts[0].weight.is_meta and not f.parts[0].weight.is_inference()]


def _linears(model: nn.Module) -> list[Linear]:
    """A model's Linear layers and the stacked layers of its Fused groups (made here if need be)."""
    return [m for m in model.modules() if isinstance(m, Linear)] + [f.layer() for f in _fused(model)]


def chosen_kernels(model: nn.Module) -> dict[str, str]:
    """{"<out>x<in>x<count>": kernel} of a model's Linear layers, stacked ones included, as set now."""
    groups: dict[tuple[int, int], list[Linear]] = defaultdict(list)
    for m in _linears(model):
        groups[tuple(m.weight.shape)].append(m)
    return {f"{o}x{i}x{len(g)}": ",".join(sorted({m.kernel for m in g})) for (o, i), g in groups.items()}


def set_kernels(model: nn.Module, kernels: str | list[str] | None) -> list[str]:
    """Give the model's Linear layers (stacked ones included) few-row `kernels`: one for all, or one
    each in the order this returns them (None: none, only read them); returns the kernels they had,
    to put back (bench verify's decode_check). Set only row-invariant ones: see model_candidates."""
    layers = _linears(model)
    before = [m.kernel for m in layers]
    if kernels is not None:
        for m, k in zip(layers, [kernels] * len(layers) if isinstance(kernels, str) else kernels, strict=True):
            m.kernel = k
    return before


def model_candidates(model: nn.Module) -> tuple[str, ...]:
    """The few-row kernels tune() may give every layer of the model on this machine (_candidates)."""
    groups: dict[tuple[tuple[int, int], torch.dtype], list[Linear]] = defaultdict(list)
    for m in _linears(model):
        groups[tuple(m.weight.shape), m.weight.dtype].append(m)
    each = [set(_candidates(g)) for g in groups.values()]
    return tuple(k for k in KERNELS if all(k in c for c in each))


def invariant_rows(dtype: torch.dtype) -> int:
    """Up to how many rows a few-row kernel must give a row the same bits (module doc)."""
    return MAX_FEW_ROWS if dtype == torch.float32 else BF16_INVARIANT_ROWS


@torch.no_grad()
def row_invariant(layer: Linear, kernel: str) -> bool:
    """Does `kernel` compute each of invariant_rows() rows as it computes that row alone?"""
    w = layer.weight
    gen = torch.Generator().manual_seed(0)
    # a float32 difference shows in every output; in bfloat16 it shows only where it crosses a
    # rounding boundary (~2 outputs in 10,000 for F.linear), so bfloat16 is checked on more rows
    for _ in range(1 if w.dtype == torch.float32 else 4):
        x = torch.randn(invariant_rows(w.dtype), layer.in_features, generator=gen).mul(3).to(w.dtype)
        alone = torch.cat([layer.run(x[i:i + 1], kernel) for i in range(x.shape[0])])
        if not all(torch.equal(layer.run(x[:n], kernel), alone[:n]) for n in (2, 5, x.shape[0])):
            return False
    return True


@torch.no_grad()
def thread_invariant(model: nn.Module, threads: int, rows: tuple[int, ...] = (1, 5, 16)) -> bool:
    """Do the model's products, as its layers run them now, give the same bits on 1 and on `threads`
    intra-op threads? A rollout worker may take a finished peer's core mid-rollout (generate's
    `threads`); where a row's bits depended on the thread count, the arms of an A/B, and SD against
    plain decoding, would part at the first near-tie. gemv gives each output to one thread, so it
    is; F.linear's MKL products split their sums by thread count (test_rollout). Checked once per
    model and thread count, on the calling thread (which the check leaves as it found it)."""
    checked: dict[int, bool] = model.__dict__.setdefault("_tlt_thread_invariant", {})
    if threads not in checked:
        own, ok = torch.get_num_threads(), True
        gen = torch.Generator().manual_seed(0)
        layers = [m for m in model.modules() if isinstance(m, Linear)] + [f.layer() for f in _fused(model) if f.active]
        # few rows only (decode steps, verify passes): the bulk kernel never runs here
        groups = {(m.kernel, tuple(m.weight.shape), m.weight.dtype): m for m in layers}
        try:
            for layer in groups.values():
                for n in rows:
                    x = torch.randn(n, layer.in_features, generator=gen).to(layer.weight.dtype)
                    torch.set_num_threads(1)
                    one = layer(x)
                    torch.set_num_threads(threads)
                    if not torch.equal(one, layer(x)):
                        ok = False
                        break
                if not ok:
                    break
        finally:
            torch.set_num_threads(own)
        checked[threads] = ok
    return checked[threads]


def usable(kernel: str, dtype: torch.dtype) -> bool:
    """Can `kernel` run few-row products of `dtype` here (PyTorch built with oneDNN; gemv built)?"""
    if kernel == "onednn":
        return _ONEDNN
    if kernel == "gemv":  # float32; a bfloat16 model's products where the CPU has AVX-512 BF16
        return cpu_kernels.available() and (dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_kernels.bf16_dot()))
    if kernel == DRAFT_KERNEL:
        return dtype == torch.float32 and cpu_kernels.available()
    return True


def _candidates(group: list[Linear]) -> tuple[str, ...]:
    """The usable row-invariant kernels for this group (all usable ones, with a warning, if none is)."""
    runnable = tuple(k for k in KERNELS if usable(k, group[0].weight.dtype))
    if len(runnable) == 1:
        return runnable
    ok = tuple(k for k in runnable if row_invariant(group[0], k))
    if not ok:
        log.warning("no row-invariant kernel for %s on this CPU: greedy SD may differ from plain decoding "
                    "on near-ties", tuple(group[0].weight.shape))
    return ok or runnable


@torch.inference_mode(False)
def tune(model: nn.Module, reps: int = 5, rows: tuple[int, ...] = TUNE_ROWS) -> dict[str, str]:
    """Choose each Linear's kernel for this machine; returns {"<out>x<in>x<count>": kernel}.

    Layers are grouped by weight shape and dtype; a group's row-invariant candidates (module doc)
    are timed over the whole group (its weights stream from memory as in a decode step) at each of
    `rows` (a target's decode steps and verify passes: 1..64; a drafter's steps: DRAFT_ROWS) and
    each of decode_threads(), each such time normalised by its best candidate; the lowest total wins unless an
    earlier candidate in KERNELS is within 3% of it (timing noise must not pick a kernel). The
    bulk kernel (`bulk_kernel`) is chosen the same way on one BULK_ROWS-row product per group.
    A no-op for models already tuned for these rows and thread counts, on GPUs, for dtypes not in tuned_dtypes() and
    under TLT_KERNEL (which leaves bulk products on PyTorch's linear).

    The first choice made on a machine is every process's (`_tuning_lock`): kernels differ in their
    last bits, so two processes that chose differently would sample different tokens from the same
    weights. A run's rollout workers tune side by side as they start; one that timed its kernels on
    a crowded machine and kept its own choice gave the e2e bench's arms different samples from step
    4 on (2026-12-06, an AVX-512 EPYC: only the rows of the worker with its own choice differed), and
    a restarted worker would not redraw its step's samples. So tuning waits its turn under a file
    lock, reads what an earlier process chose, and caches what it timed even on a crowded machine,
    after waiting up to QUIET_WAIT_S for the crowd to pass (a choice timed in a crowd can be slower:
    delete kernel_cache_path() on a quiet machine to time again).
    """
    if getattr(model, "_tlt_tuned", None) in ((rows, decode_threads()), True):  # True: kernels set by hand, kept
        return {}
    layers = [m for m in _linears(model) if not m.weight.is_meta]
    if not layers:
        return {}
    forced = os.environ.get("TLT_KERNEL", "").strip()
    if forced:
        if forced not in KERNELS:
            raise ValueError(f"TLT_KERNEL={forced!r}: choose one of {', '.join(KERNELS)}")
        if not usable(forced, torch.float32):
            raise ValueError(f"TLT_KERNEL={forced!r}: that kernel cannot run on this machine")
        for layer in layers:
            layer.kernel = forced
        _tuned(model, rows)
        return {"*": forced}
    groups: dict[tuple[tuple[int, int], torch.dtype], list[Linear]] = defaultdict(list)
    for layer in layers:
        w = layer.weight
        if w.device.type == "cpu" and w.dtype in tuned_dtypes() and not w.is_inference():
            groups[tuple(w.shape), w.dtype].append(layer)
    with _tuning_lock():
        chosen = _tune_groups(groups, reps, rows)
    _tuned(model, rows)
    return chosen


def _tune_groups(groups: dict[tuple[tuple[int, int], torch.dtype], list["Linear"]], reps: int,
                 rows: tuple[int, ...]) -> dict[str, str]:
    """tune's choices for each group: cached ones, else timed now and cached (under _tuning_lock)."""
    cached, chosen, fresh = _read_cache(), {}, {}
    if any(_cache_key(shape, len(g), dtype, rows) not in cached for (shape, dtype), g in groups.items()):
        _wait_for_quiet()
    t0 = time.perf_counter()
    with torch.no_grad():
        for (shape, dtype), group in groups.items():
            key = _cache_key(shape, len(group), dtype, rows)
            kernel = cached.get(key)
            if kernel not in KERNELS or not usable(kernel, dtype):  # e.g. gemv, where it was built once
                kernel = None
            if kernel is None and len(candidates := _candidates(group)) == 1:
                kernel = fresh[key] = candidates[0]
            elif kernel is None:
                times = _time_at_threads(group, candidates, rows, reps)
                score = {k: sum(t[k] / min(t.values()) for t in times) for k in candidates}
                low = min(score.values())
                kernel = next(k for k in candidates if score[k] <= low * 1.03)
                fresh[key] = kernel
            bulk = cached.get(key + "|bulk")
            if bulk not in BULK_KERNELS:
                t = _time_bulk(group[0], reps) if _ONEDNN else {"linear": 0.0}
                bulk = next(k for k in BULK_KERNELS if k in t and t[k] <= min(t.values()) * 1.03)
                fresh[key + "|bulk"] = bulk
            for layer in group:
                layer.kernel, layer.bulk_kernel = kernel, bulk
                if "onednn" not in (kernel, bulk):  # no copies kept for kernels a layer never uses
                    layer._packed = None
                if kernel != "gemv":
                    layer._blocked = None
            chosen[f"{shape[0]}x{shape[1]}x{len(group)}"] = kernel
    if fresh:
        log.info("tuned CPU kernels in %.1f s on %s (threads %s): %s; bulk: %s", time.perf_counter() - t0,
                 cpu_name(), "+".join(map(str, decode_threads())), chosen,
                 {f"{o}x{i}": g[0].bulk_kernel for ((o, i), _), g in groups.items()})
        if machine_busy():
            log.warning("the machine was busy while the kernels were timed: cached all the same, so that every "
                        "process here computes the same bits (delete %s on a quiet machine to time them again)",
                        kernel_cache_path())
        _write_cache(fresh)
    return chosen


def _time_at_threads(group: list[Linear], kernels: tuple[str, ...], rows: tuple[int, ...],
                     reps: int) -> list[dict[str, float]]:
    """_time_group at each of `rows` on each of decode_threads(), the calling thread's count restored."""
    own = torch.get_num_threads()
    try:
        times = []
        for threads in decode_threads():
            torch.set_num_threads(threads)
            times += [_time_group(group, kernels, r, reps) for r in rows]
        return times
    finally:
        torch.set_num_threads(own)


def _tuning_lock():
    """One process tunes at a time on this machine: the others wait, then read its choices instead of
    timing their own (tune). Unlocked where the cache's folder cannot be written: then nothing is
    cached either."""
    return file_lock.held(kernel_cache_path().with_suffix(".lock"))


def _wait_for_quiet() -> None:
    """Before timing kernels: wait up to QUIET_WAIT_S while machine_busy(), e.g. for a learner
    that publishes its weights while the rollout workers start."""
    deadline = time.monotonic() + QUIET_WAIT_S
    while machine_busy() and time.monotonic() < deadline:
        time.sleep(0.5)


def draft_in_bfloat16(model: nn.Module) -> int:
    """Let a drafter's few-row float32 products read a bfloat16 copy of its weights wherever the
    tuner chose gemv for them (DRAFT_KERNEL); returns how many layers switched. Call after tune().

    Drafting reads the drafter's weights once per draft step for a handful of rows, so it streams
    them like a decode step does (SmolLM2's drafter: ~26 MB in float32 with a 4096-token draft head,
    four times per pass of a depth-4 chain, with the target's 540 MB streamed between passes). Half
    the bytes made a d4k1 draft 1.23x faster on 2 AVX2 EPYC cores (`bench draft`: 7.75 against 6.32
    ms, our kernels 3.4 against 2.3 of them). The proposals change by bfloat16's
    rounding of the weights; verification, which uses the target alone, decides what is emitted,
    so the rollout stays lossless. Never for a target: its products must equal plain decoding's."""
    switched = 0
    for layer in _linears(model):
        if layer.kernel == "gemv" and layer.weight.dtype == torch.float32:
            layer.kernel, layer._blocked = DRAFT_KERNEL, None
            switched += 1
    return switched


def _tuned(model: nn.Module, rows: tuple[int, ...]) -> None:
    for f in _fused(model):
        f.active = True
    model._tlt_tuned = (rows, decode_threads())  # tuned for these row and thread counts (tune again for others)
