"""nn.Linear with faster CPU kernels for the few-row products of decoding.

A decode step multiplies ONE row per sequence by every weight matrix, and a speculative verify
pass multiplies a handful (the draft tokens). On a CPU both are bound by reading the weights, and
PyTorch's default kernels read them badly for so few rows. Measured on 2 AVX2 cores (SmolLM2-135M,
fp32, whole decode step at batch 1; `python -m workers.tlt.bench rollout` shows the effect):

    rows  default (MKL sgemv / small-M sgemm)   here
    1     ~58 ms                                 ~31 ms   W @ [x; x]^T: sgemm with N=2 streams W
                                                          ~3x faster than sgemv does
    4-10  ~76-90 ms                              ~39-46 ms  oneDNN with the weight pre-packed once
                                                           (used up to MAX_FEW_ROWS rows)

Decoding runs ~1.9x faster, and a verify pass of 8 tokens still costs ~1.5 (now faster) decode
steps. The packed copy is made on first use and made again when the weight changes: a new tensor,
or an in-place update (load_state_dict, optimizer steps) that bumps the tensor's version counter.
Writes through `.data` bypass that counter and would leave the packed copy stale, so none are made
in this package. Results equal F.linear's up to float rounding. Everything else (autograd, more
rows, other dtypes, GPUs) goes through F.linear unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

MAX_FEW_ROWS = 64  # measured up to 64 rows (a tail batch's decode, or a few rows' verify passes):
                   # pre-packed oneDNN still takes 0.55-0.7x the default GEMM's time there
MIN_WEIGHT_NUMEL = 1 << 16  # smaller weights sit in cache, where F.linear with less Python wins
                            # (the tiny model: 64 wide, its decode is all per-op overhead)
_PACK_HINT = 8  # oneDNN picks its packed layout for this many rows; good for 2..64 here
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear(nn.Linear):
    """Drop-in nn.Linear (same parameters and state_dict keys) that routes few-row CPU products."""

    _packed: tuple[tuple, Tensor] | None = None

    @classmethod
    def frozen(cls, weight: Tensor) -> "Linear":
        """A bias-free Linear over an existing [out, in] weight (no copy, no gradient)."""
        layer = cls(weight.shape[1], weight.shape[0], bias=False, device="meta")
        layer.weight = nn.Parameter(weight, requires_grad=False)
        return layer

    def __getstate__(self):
        state = super().__getstate__()
        return {**state, "_packed": None}  # a cache, and oneDNN's packed tensors do not pickle

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if not 1 <= rows <= MAX_FEW_ROWS or w.numel() < MIN_WEIGHT_NUMEL or not _cpu_float32_inference(x, w):
            return F.linear(x, w, self.bias)
        x2 = x.reshape(rows, x.shape[-1])
        if rows == 1:
            # [x; x] as the transposed view of a contiguous [2, in] block: the layout sgemm streams fast
            y = torch.mm(w, torch.cat([x2, x2]).t())[:, :1].t()
            if self.bias is not None:
                y = y + self.bias
        elif _ONEDNN and not w.is_inference():  # the packed copy is keyed by the version counter,
            y = torch.ops.mkldnn._linear_pointwise(x2, self._packed_weight(), self.bias, "none", [], "")
        else:  # which inference tensors lack
            return F.linear(x, w, self.bias)
        return y.reshape(*x.shape[:-1], -1)

    def _packed_weight(self) -> Tensor:
        w = self.weight
        key = (w.data_ptr(), w._version, tuple(w.shape))
        if self._packed is None or self._packed[0] != key:
            self._packed = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACK_HINT))
        return self._packed[1]


def _cpu_float32_inference(x: Tensor, w: Tensor) -> bool:
    if x.device.type != "cpu" or x.dtype != torch.float32 or w.dtype != torch.float32:
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))  # autograd keeps its path
