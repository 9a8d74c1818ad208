"""Decoder-only transformer of the Llama / Qwen2 family with a ragged, rollback-able KV cache.

The network and its cache, nothing else (generation lives in rollout/engine.py). Module names match
Hugging Face's, so checkpoints load 1:1:

    model = Transformer.from_pretrained("var/models/smollm2-135m")   # config.json + *.safetensors
    out = model(tokens, positions)                                  # training: causal, no cache
    cache = model.new_cache(batch=4, max_len=512)
    out = model(tokens, positions, cache=cache, write_pos=positions, mask=mask)

Every row of a batch has its own cache length (`cache.lengths`), so sequences of different
lengths decode together without padding on the left, several tokens can be appended per step
(speculative verification), and rejected tokens are rolled back by lowering the row's length:
their stale entries are masked out and overwritten later.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cpu_kernels
from .linear import MAX_FEW_ROWS, Fused, Linear, cuda_fixed_shape, onednn_bf16, padded_rows

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # Qwen2: bias on q, k, v projections
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # other HF keys, written back on save

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; supported: {SUPPORTED_ARCHITECTURES}")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
        rope_scaling = hf.get("rope_scaling") or (hf.get("rope_parameters") or {})
        if rope_scaling.get("rope_type", rope_scaling.get("type", "default")) not in ("default", None):
            raise ValueError(f"rope scaling {rope_scaling!r} is not supported")
        theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        known = {
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
            "tie_word_embeddings", "attention_bias", "architectures", "bos_token_id", "eos_token_id",
        }
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim") or 0,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", arch == "LlamaForCausalLM"),
            attention_bias=hf.get("attention_bias", arch == "Qwen2ForCausalLM"),
            architecture=arch,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            extra={k: v for k, v in hf.items() if k not in known},
        )

    def to_hf(self) -> dict[str, Any]:
        data = asdict(self)
        extra = data.pop("extra")
        arch = data.pop("architecture")
        out = {**extra, **data, "architectures": [arch], "model_type": "qwen2" if arch.startswith("Qwen2") else "llama"}
        if arch == "Qwen2ForCausalLM":
            out.pop("attention_bias")  # Qwen2 always has q/k/v bias; its config has no such key
        return out

    @property
    def eos_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


class KVCache:
    """Per-layer keys/values [B, S, n_kv, hd] plus each row's filled length.

    Entries at index >= lengths[b] are garbage by contract: attention masks exclude them and the
    next write overwrites them, which is what makes rollback a matter of lowering `lengths`.
    `differentiable` caches write out of place, so that gradients flow through keys written by
    earlier passes (the drafter's unrolled training); decoding writes in place.
    """

    def __init__(self, n_layers: int, batch: int, max_len: int, n_kv: int, head_dim: int, dtype, device,
                 differentiable: bool = False):
        shape = (batch, max_len, n_kv, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.max_len = max_len
        self.differentiable = differentiable

    def write(self, layer: int, write_pos: Tensor, k: Tensor, v: Tensor) -> None:
        """Store k, v [B, T, n_kv, hd] at cache indices write_pos [B, T] of `layer`."""
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        if self.differentiable:
            self.k[layer] = self.k[layer].index_put((rows, write_pos), k)
            self.v[layer] = self.v[layer].index_put((rows, write_pos), v)
        else:
            self.k[layer][rows, write_pos] = k
            self.v[layer][rows, write_pos] = v

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def keep_rows(self, rows: Tensor) -> None:
        """Drop finished sequences: keep only `rows` (indices), in that order."""
        self.k = [k.index_select(0, rows) for k in self.k]
        self.v = [v.index_select(0, rows) for v in self.v]
        self.lengths = self.lengths.index_select(0, rows)

    def move(self, rows: Tensor, src: Tensor, dst: Tensor) -> None:
        """Copy entries src[i, j] -> dst[i, j] for row rows[i] in every layer (tree path compaction).

        rows: [N], src/dst: [N, M] cache indices. Reads all sources before writing any destination.
        """
        r = rows[:, None].expand_as(src)
        for t in self.k + self.v:
            t[r, dst] = t[r, src].clone()


class ModelOutput(NamedTuple):
    logits: Tensor  # [B, T, V]
    hidden: Tensor  # [B, T, D] last layer after the final norm (what the drafter reads)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # computed in float32 like the reference implementations, for bit-level agreement
        if x.numel() <= MAX_FEW_ROWS * x.shape[-1] and cuda_fixed_shape(x):  # the row sums' kernel
            # follows the row count (linear.padded_rows)
            return padded_rows(self._norm, x)
        if x.device.type == "cpu" and not torch.is_grad_enabled() and cpu_kernels.available():
            return cpu_kernels.rms_norm(x, self.weight, self.eps)  # the same ops, issued from C++
        return self._norm(x)

    def _norm(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(cfg: ModelConfig, positions: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """cos, sin: [B, T, hd] for absolute positions [B, T] (HF's rotate-half layout), computed in
    float32 and cast to the activations' dtype, as HF's Llama does (in bfloat16 the rotation then
    needs no conversion in each of the layers)."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=positions.device).float() / cfg.head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [B, T, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [B, T, h, hd]; cos/sin: [B, T, hd]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


SPLIT_EVERY = 32  # a query's keys split into a head and a tail at a multiple of this many keys ...
MAX_DEPTH = 32  # ... at least this many keys before the query: the deepest draft token still bit-identical
QUERY_ROWS = 64  # CUDA: a pass of fewer queries is padded to this many (cached_attention)


class KeyLayout(NamedTuple):
    """The cached keys each query attends to, split as cached_attention computes them (its doc).

    mask [B, T, S]: True = may attend. A query's visible keys, in slot order, are its sequence in
    order (prefix slots, then its ancestors in a tree pass, written before their descendants); the
    k-th is at sequence position k. Its split point is the largest multiple of SPLIT_EVERY that lies
    at least MAX_DEPTH keys before the query itself (so for a draft token up to MAX_DEPTH deep its
    head is cache slots 0.., as in its decode step). head_width: the pass's largest split point, the
    key count of the head product; head_off [B, 1, T, 1, head_width]: slots outside a query's head.
    tail [B, T, SPLIT_EVERY + MAX_DEPTH]: the slots of the rest, in order (tail_rows: the same as
    rows of the flattened [B * S] cache); tail_off marks the padding among them. The masks come shaped for the [B, kv, T,
    g, keys] weights, built once per forward rather than once per layer."""

    mask: Tensor
    hidden: Tensor  # ~mask, [B, 1, T, 1, S]
    head_width: int
    head_off: Tensor
    tail: Tensor
    tail_rows: Tensor
    tail_off: Tensor  # [B, 1, T, 1, SPLIT_EVERY + MAX_DEPTH]

    @classmethod
    def of(cls, mask: Tensor) -> "KeyLayout":
        B, S, width = mask.shape[0], mask.shape[-1], SPLIT_EVERY + MAX_DEPTH
        rank = mask.cumsum(-1) - 1  # a visible key's position in its query's sequence
        query = mask.sum(-1, keepdim=True) - 1  # the query's own position
        split = (query - MAX_DEPTH).clamp(min=0) // SPLIT_EVERY * SPLIT_EVERY
        head_width = int(split.max())
        slots = torch.arange(S, device=mask.device).expand_as(mask)
        tail = torch.where(mask & (rank >= split), slots, S).sort(-1).values[..., :width]
        tail = F.pad(tail, (0, width - tail.shape[-1]), value=S)  # short caches: pad to the fixed width
        padding, tail = tail == S, tail.clamp(max=S - 1)
        rows = (tail + S * torch.arange(B, device=mask.device)[:, None, None]).view(-1)
        head_off = ~(mask & (rank < split))[..., :head_width]
        return cls(mask, ~mask[:, None, :, None], head_width, head_off[:, None, :, None], tail, rows,
                   padding[:, None, :, None])


def cached_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | KeyLayout) -> Tensor:
    """Attention of new queries q [B, h, T, hd] over cache keys/values [B, kv, S, hd] (GQA: kv divides
    h), mask [B, T, S] (True = may attend; or its KeyLayout, built once per forward) -> [B, h, T, hd].

    On the CPU (but for float32 where our kernel cannot be built, which takes SDPA; see
    invariant_attention) a query gets the same bits whatever else is in the pass: alone (a decode
    step) or beside the other draft tokens of a verify pass, and whatever masked slots surround its
    keys (other rows' longer prefixes, tree siblings between its ancestors). Greedy SD is then
    token-identical to plain decoding by construction, not only where no near-tie falls. PyTorch's
    CPU SDPA is not: it blocks queries and keys by the pass's shape, and bfloat16's 8-bit logits
    turned that into flipped tokens (README "Rollout"). A decode step's or a verify pass's few
    queries, float32 or bfloat16, take our kernel, each query alone (kernel_attention).

    Where it cannot be built, bfloat16 takes split products in oneDNN (invariant_attention), whose
    results do not depend on how many query rows share a product; the softmax's row maximum is exact
    in any order and its normaliser is the output product's own (a column of ones beside the
    values). How oneDNN blocks the keys it sums, though, depends on the product's key count: in a
    tree pass a query's last keys sit between masked siblings, in other blocks than in its decode
    step (a real SmolLM2 draft tree got other bits so: test_smollm2), and on AMX some key counts
    (multiples of 30 from 210 to 450, among others) are summed in other blocks than the rest, which
    trailing zero weights then do not hide (test_bit_identity). So the weighted sum is split
    (KeyLayout): the head, cache slots 0.. in place up to a query's split point, zeros after, in a
    product over the pass's largest split point (a multiple of SPLIT_EVERY, which every product here
    sums alike); the tail, the at most SPLIT_EVERY + MAX_DEPTH keys after it gathered into sequence
    order, in a product of fixed width. A decode step splits the same sequence at the same point.
    Those numerics are HF's eager bfloat16 attention's (products in bfloat16, softmax in float32);
    our kernel's products and sums are float32, rounded to bfloat16 once.
    """
    B, h, T, hd = q.shape
    if kernel_attention(q, keys, values):  # a few queries on the CPU: each alone, in our kernel
        m = mask.mask if isinstance(mask, KeyLayout) else mask
        out = cpu_kernels.attention(q.transpose(1, 2).float(), keys.transpose(1, 2), values.transpose(1, 2), m,
                                    hd ** -0.5)
        return out.transpose(1, 2).to(q.dtype)
    if T < QUERY_ROWS and B * T <= MAX_FEW_ROWS and cuda_fixed_shape(q):  # the tail's passes at one
        # query count (linear.padded_rows); a padding query attends where the first does
        m = torch.cat([mask, mask[:, :1].expand(-1, QUERY_ROWS - T, -1)], 1)
        return cached_attention(F.pad(q, (0, 0, 0, QUERY_ROWS - T)), keys, values, m)[:, :, :T]
    if not invariant_attention(q):
        m = mask.mask if isinstance(mask, KeyLayout) else mask
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=m[:, None], enable_gqa=True)
    keyed = mask if isinstance(mask, KeyLayout) else KeyLayout.of(mask)
    kv, S, H = keys.shape[1], keys.shape[2], keyed.head_width
    g = h // kv  # query heads per key head: their rows share one product with that head's keys
    q = q.view(B, kv, g, T, hd).transpose(2, 3).reshape(B, kv, T * g, hd)  # rows (token, head)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * hd ** -0.5  # [B, kv, T * g, S]
    scores = scores.view(B, kv, T, g, S).masked_fill(keyed.hidden, float("-inf"))
    weights = torch.exp(scores - scores.amax(-1, keepdim=True)).to(q.dtype)  # [B, kv, T, g, S]
    # values with a column of ones (the normaliser), as rows [B * S, kv, hd + 1] for the tail's gather
    rows = torch.cat([values.transpose(1, 2), values.new_ones(B, S, kv, 1)], dim=-1)
    tail_w = weights.gather(-1, keyed.tail[:, None, :, None].expand(B, kv, T, g, -1))
    tail_v = rows.view(B * S, kv, hd + 1).index_select(0, keyed.tail_rows).view(B, T, -1, kv, hd + 1)
    out = torch.matmul(tail_w.masked_fill(keyed.tail_off, 0), tail_v.permute(0, 3, 1, 2, 4)).float()
    if H:  # [B, kv, T, g, hd + 1]
        head_w = weights[..., :H].masked_fill(keyed.head_off, 0).view(B, kv, T * g, H)
        out = out + torch.matmul(head_w, rows[:, :H].transpose(1, 2)).view(B, kv, T, g, hd + 1).float()
    out = (out[..., :hd] / out[..., hd:]).to(q.dtype)  # [B, kv, T, g, hd]
    return out.permute(0, 1, 3, 2, 4).reshape(B, h, T, hd)


def kernel_attention(q: Tensor, keys: Tensor, values: Tensor) -> bool:
    """A decode step's or a verify pass's queries on the CPU, float32 or bfloat16, go to
    cpu_kernels.attention, which computes each query from the keys it may see, in order, and nothing
    else: invariant by construction. In float32 it is 2-3x faster than SDPA per layer at one or two
    queries (on par at 13; SDPA pays its blocking in every layer); in bfloat16 it replaces the split
    oneDNN products below, whose ~25 small ops cost ~225 us per layer at one query on AMX. Not under
    autograd (the drafter's unrolled training) nor for many queries (prefill)."""
    B, _, T, hd = q.shape
    return (few_queries_to_kernel(q, B * T, hd) and keys.dtype == q.dtype
            and not (torch.is_grad_enabled() and (q.requires_grad or keys.requires_grad or values.requires_grad)))


def step_kernel(q: Tensor, cache: KVCache, mask: Tensor | KeyLayout | None, head_dim: int) -> bool:
    """A decode step's or verify pass's attention block (rope, cache writes, attention) takes
    cpu_kernels.attention_step where its attention would take our kernel (kernel_attention): one
    call instead of ~25 small ops per layer, with their bits. Not for the drafter's unrolled
    training, whose cache keeps gradients (KVCache.differentiable)."""
    B, T, _ = q.shape
    return (not cache.differentiable and isinstance(mask, Tensor) and cache.k[0].dtype == q.dtype
            and few_queries_to_kernel(q, B * T, head_dim) and not (torch.is_grad_enabled() and q.requires_grad))


def few_queries_to_kernel(x: Tensor, queries: int, head_dim: int) -> bool:
    """Whether `queries` queries in x's dtype and device (a pass's, in all rows) take our kernel."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and 0 < queries <= MAX_FEW_ROWS
            and head_dim % 8 == 0 and cpu_kernels.available())


def invariant_attention(q: Tensor) -> bool:
    """cached_attention's split products compute a query as it would alone (its doc): bfloat16 on
    CPUs where oneDNN multiplies it (linear.onednn_bf16), which is where torch.matmul sends it; they
    serve where our kernel (kernel_attention) does not. float32 matmul runs in MKL, whose products
    round a row differently beside others, so float32 without our kernel takes SDPA (logits differ
    from a decode step's by ~1e-6; no flipped token measured)."""
    return q.device.type == "cpu" and q.dtype == torch.bfloat16 and onednn_bf16()


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = Linear(cfg.hidden_size, nh * hd, bias=cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, nkv * hd, bias=cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, nkv * hd, bias=cfg.attention_bias)
        self.o_proj = Linear(nh * hd, cfg.hidden_size, bias=False)
        self.qkv = Fused(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], layer: int, cache: KVCache | None,
                write_pos: Tensor | None, mask: Tensor | KeyLayout | None) -> Tensor:
        B, T, _ = x.shape
        hd = self.cfg.head_dim
        q, k, v = self.qkv(x)
        if cache is not None and step_kernel(q, cache, mask, hd):  # the rest of the block in one call
            out = cpu_kernels.attention_step(q, k, v, *rope, cache.k[layer], cache.v[layer], write_pos, mask, hd ** -0.5)
            return self.o_proj(out)
        q = _apply_rope(q.view(B, T, -1, hd), *rope)
        k = _apply_rope(k.view(B, T, -1, hd), *rope)
        v = v.reshape(B, T, -1, hd)
        if cache is None:
            # training / scoring: plain causal attention over the T tokens
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=True)
        else:
            cache.write(layer, write_pos, k, v)
            S = (mask.mask if isinstance(mask, KeyLayout) else mask).shape[-1]  # the filled prefix only
            keys = cache.k[layer][:, :S].transpose(1, 2)
            values = cache.v[layer][:, :S].transpose(1, 2)
            out = cached_attention(q.transpose(1, 2), keys, values, mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up = Fused(self.gate_proj, self.up_proj)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(F.silu(gate) * up)  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, input_norm: bool = True):
        super().__init__()
        # EAGLE drafters drop the first layer's input norm (their input is already a fused state)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else nn.Identity()
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, rope, layer: int, cache, write_pos, mask) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, layer, cache, write_pos, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """The policy (target) model. `model.model.*` and `lm_head` mirror HF's parameter names."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = _Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache(c.num_hidden_layers, batch, max_len, c.num_key_value_heads, c.head_dim, self.dtype, self.device)

    def forward(self, tokens: Tensor, positions: Tensor | None = None, cache: KVCache | None = None,
                write_pos: Tensor | None = None, mask: Tensor | None = None, logits: bool = True,
                score_mask: Tensor | None = None) -> ModelOutput:
        """tokens/positions/write_pos: [B, T]; mask: [B, T, S] bool (True = may attend), S <= max_len.

        score_mask: [B, T-1] bool; the logits are then those of the positions it marks only, [N, V]
        (the learner's scoring: the LM head runs inside forward, where FSDP has gathered it).

        Without a cache the T tokens attend causally to each other (training, scoring). With one,
        their keys/values are written at `write_pos` (default: `positions`) and each query attends
        to the cache entries its mask row allows; the caller advances `cache.lengths`.
        """
        positions, write_pos, mask = step_layout(tokens, positions, cache, write_pos, mask)
        x = self.model.embed_tokens(tokens)
        if cache is not None and invariant_attention(x) and not few_queries_to_kernel(x, tokens.numel(),
                                                                                      self.config.head_dim):
            mask = KeyLayout.of(mask)  # the split products' layout, the same for every layer
        rope = rope_tables(self.config, positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rope, i, cache, write_pos, mask)
        hidden = self.model.norm(x)
        if score_mask is not None:
            return ModelOutput(self.lm_head(hidden[:, :-1][score_mask]), hidden)
        return ModelOutput(self.lm_head(hidden) if logits else hidden.new_empty(0), hidden)

    # --- Hugging Face folders -------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "Transformer":
        """Load config.json + *.safetensors from a local folder; never touches the network."""
        from safetensors.torch import load_file

        folder = Path(folder)
        cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
        with torch.device("meta"):
            model = cls(cfg)
        state: dict[str, Tensor] = {}
        for f in sorted(folder.glob("*.safetensors")):
            state.update(load_file(str(f), device=str(device)))
        if not state:
            raise FileNotFoundError(f"no *.safetensors in {folder}")
        if cfg.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model.to(device)

    def save_pretrained(self, folder: str | Path) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        hf = self.config.to_hf()
        hf["torch_dtype"] = str(self.dtype).removeprefix("torch.")
        (folder / "config.json").write_text(json.dumps(hf, indent=2))


def step_layout(tokens: Tensor, positions: Tensor | None, cache: KVCache | None, write_pos: Tensor | None,
                mask: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Defaults shared by the policy and the drafter for T new tokens [B, T]: positions 0..T-1,
    cache writes at those positions, and a causal mask over each row's filled cache prefix."""
    B, T = tokens.shape
    if positions is None:
        positions = torch.arange(T, device=tokens.device).expand(B, T)
    if cache is not None:
        write_pos = positions if write_pos is None else write_pos
        if mask is None:
            mask = causal_mask(cache.lengths, T, int(cache.lengths.max()) + T)
    return positions, write_pos, mask


def causal_mask(lengths: Tensor, T: int, S: int) -> Tensor:
    """[B, T, S] mask for T new tokens appended at each row's `lengths`: query t sees keys < len + t + 1."""
    keys = torch.arange(S, device=lengths.device)
    limit = lengths[:, None] + torch.arange(T, device=lengths.device)[None, :] + 1  # [B, T]
    return keys[None, None, :] < limit[:, :, None]


def init_weights(model: nn.Module, std: float = 0.02) -> None:
    """GPT-2 style init for models trained from scratch (scaled residual projections)."""
    n_layers = max(1, sum(1 for m in model.modules() if isinstance(m, DecoderLayer)))
    for name, p in model.named_parameters():
        if p.dim() == 1:
            continue  # norms keep ones, biases keep zeros
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            nn.init.normal_(p, 0.0, std / math.sqrt(2 * n_layers))
        else:
            nn.init.normal_(p, 0.0, std)
    for name, p in model.named_parameters():
        if p.dim() == 1 and "bias" in name:
            nn.init.zeros_(p)
