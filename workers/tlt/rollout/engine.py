"""The built-in rollout engine: batched generation with adaptive, lossless speculative decoding.

    from workers.tlt.rollout.engine import SpecPolicy, generate
    from workers.tlt.rollout.sampling import SamplingParams

    res = generate(policy, prompts, SamplingParams(temperature=1.0, top_p=0.95), max_new_tokens=256,
                   eos_ids=policy.config.eos_ids, drafter=drafter, spec=SpecPolicy.from_config(cfg.spec))
    res.tokens[i], res.logprobs[i], res.hidden[i]      # per sample (repeat a prompt n times for n samples)
    res.metrics.to_dict()                              # JSON-able: tail timeline, SD switches, acceptance

One loop serves every mode. Each step drafts a `Tree` rooted at each row's pending token (no draft:
a plain decode step; a chain; a top-k tree; an n-gram chain), runs the target once over it and
accepts losslessly (speculative.walk). Sampling is keyed (sampling.py): the token at each position
of a sample is decided by one uniform of (seed, sample, position), so SD on, SD off and any arm
the bandit picks emit the same tokens for the same seed, under greedy and under sampling alike.
Prompts are right-padded and prefilled together; every row keeps its own cache length and rope
positions, so no left padding. Finished rows leave the batch (KVCache.keep_rows), so the tail
decodes at small batch.

Speculative decoding (SD) may switch on when the running sequences are <= spec.threshold; then a
bucketed epsilon-greedy bandit (bandit.py) picks the arm for each step: an EAGLE strategy
(depth, top-k, verify tokens), the n-gram drafter, or "off" (plain decoding), by measured
tokens/s. So SD switches off again in a bucket where it stops paying, and back on when
exploration finds it pays. The drafter's cache is caught up lazily from the harvested hidden
states (speculative.catch_up), so switching costs no target re-prefill.

Harvest: the target's last hidden state (after the final norm) of every position it computed
(prefill, decode, accepted draft positions; rejected ones are dropped) is kept per row; that is
exactly the drafter's training input, with no extra forward pass.
"""

from __future__ import annotations

import bisect
import logging
import re
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from . import spec_defaults
from .bandit import BucketedBandit
from ..models.linear import DRAFT_ROWS, draft_in_bfloat16, thread_invariant, tune
from ..models.transformer import Transformer
from .sampling import SamplingParams, draw, processed_logits, sample_keys
from .speculative import DraftHead, SpecStats, Tree, ancestors, chain_tree, draft, draft_vocab_ids, ngram_propose, \
    root_tree, tree_mask, walk

log = logging.getLogger(__name__)

OFF, NGRAM = "off", "ngram"
HYBRID = re.compile(r"ngram\|d(\d+)")  # "ngram|d6": each row's n-gram draft where it has one, else the drafter's chain
# the hybrid arm's n-gram drafts match at least this many tokens: over smollm2-mathmix-cpu's warm-up
# answers a draft after a 1-token match got 0.49 tokens accepted, after 2 tokens 1.16 (the drafter's
# chains: ~1.3, at the cost of its draft steps) and after 3 tokens 2.33
HYBRID_NGRAM_MIN = 2
# tokens the n-gram arm proposes per pass: the root and 5 drafts are 6 rows, one tile of the CPU's gemv
# kernel on AVX2 (csrc/gemv.cpp, RB: 6 there, 12 with AVX-512); a 7th row costs a second tile (SmolLM2's
# linears on 2 AVX2 cores: 15.7 ms for 1 row, 18.0 for 6, 21.9 for 7)
NGRAM_DEPTH = 5
# RolloutMetrics.chain_acceptance's chain (scalar spec/chain4_acceptance): smollm2-mathmix-cpu's shallowest arm
FIXED_CHAIN_DEPTH = 4


class Arm(NamedTuple):
    label: str  # "off", "ngram", "ngram|d{depth}" or "d{depth}k{topk}v{verify}"
    depth: int = 0  # draft depth (0: no draft)
    topk: int = 1  # branching per tree level (1: chain)
    verify: int = 0  # draft tokens verified per pass (tree arms keep the best `verify` nodes)

    @classmethod
    def parse(cls, label: str, ngram_depth: int = NGRAM_DEPTH) -> "Arm":
        """Parse an arm label: off, ngram, ngram|d{depth} or d{depth}k{topk}v{verify} (e.g. d5k3v16)."""
        if label in (OFF, NGRAM):
            return cls(label) if label == OFF else cls(NGRAM, ngram_depth, 1, ngram_depth)
        if (h := HYBRID.fullmatch(label)) and int(h[1]) >= 1:
            return cls(label, int(h[1]), 1, int(h[1]))
        m = re.fullmatch(r"d(\d+)k(\d+)v(\d+)", label)
        if not m or int(m[1]) < 1 or not 1 <= int(m[2]) <= spec_defaults.MAX_TOPK:
            raise ValueError(f"bad arm label {label!r}: use off, ngram, ngram|d<depth> or d<depth>k<topk>v<verify> "
                             f"(1 <= topk <= {spec_defaults.MAX_TOPK})")
        d, k, v = int(m[1]), int(m[2]), int(m[3])
        return cls(label, d, k, max(v, d))

    @property
    def kind(self) -> str:
        """Which of SpecStats.KINDS a pass of this arm books its acceptance under."""
        if self.label == NGRAM:
            return "ngram"
        return "hybrid" if HYBRID.fullmatch(self.label) else "chain" if self.topk == 1 else "tree"


@dataclass
class SpecPolicy:
    """When and how the rollout speculates. Mirrors config.SpecSection plus engine-only knobs."""

    enabled: bool = True  # False: never speculate (baseline), but still measure the tail at `threshold`
    threshold: int = spec_defaults.THRESHOLD  # SD may switch on when running sequences <= threshold (the tail)
    strategies: tuple[tuple[int, int, int], ...] = spec_defaults.STRATEGIES
    ngram_arm: bool = spec_defaults.NGRAM_ARM  # n-gram drafter over the row itself and its siblings (same prompt)
    ngram_n: int = 3  # longest suffix the n-gram drafter matches (tries n..1)
    ngram_depth: int = NGRAM_DEPTH  # tokens it proposes per pass
    # the hybrid arm "ngram|d{depth}" (0: none): per row the n-gram draft where the row's text or its
    # siblings' offer one (free), else the drafter's chain, both `depth` tokens: at batch 1 in a
    # repetitive tail the n-gram arm wins most passes, but drafts nothing where no n-gram matches
    hybrid_depth: int = spec_defaults.HYBRID_DEPTH
    off_arm: bool = True  # plain decoding is an arm too: SD switches off where it does not pay
    epsilon: float = spec_defaults.EPSILON  # bandit exploration probability
    buckets: tuple[int, ...] = spec_defaults.BUCKETS  # bandit buckets by batch size: 1, 2-4, 5-20, 21+
    window: int = spec_defaults.WINDOW  # passes kept per arm and bucket for its rate
    arm: str | None = None  # force this arm in the tail, e.g. "d5k1v5" (benchmarks, tests); None: bandit picks
    # reduced draft vocabulary (FR-Spec): the EAGLE drafter's head scores only this many token ids, the
    # most frequent by `drafter.token_counts` (its training data) plus the EOS ids; 0: the full vocabulary.
    # Lossless either way (verification uses the target's full distribution); it makes draft steps cheap.
    draft_vocab: int = spec_defaults.DRAFT_VOCAB
    draft_ids: Sequence[int] | None = None  # explicit draft vocabulary (overrides draft_vocab; tests)
    # CPU float32: the drafter's few-row products read bfloat16 copies of its weights (half the bytes
    # each draft step streams; linear.draft_in_bfloat16). Lossless either way: only proposals change.
    draft_bf16: bool = spec_defaults.DRAFT_BF16
    # sampling: the drafter's keyed draw (sampling.draw) from q at this temperature (0: the rollout's own).
    # Lossless whatever it is (a draft is accepted only where it equals the target's own draw); a
    # sharper q than the target's agrees with it more often (bench coupling --draft-temperatures)
    draft_temperature: float = spec_defaults.DRAFT_TEMPERATURE

    @classmethod
    def from_config(cls, spec, **overrides: Any) -> "SpecPolicy":
        """From config.SpecSection (any object with its fields)."""
        fields = dict(threshold=spec.threshold, strategies=tuple(tuple(s) for s in spec.strategies),
                      ngram_arm=spec.ngram_arm, epsilon=spec.epsilon, buckets=tuple(spec.buckets),
                      window=spec.window, draft_vocab=getattr(spec, "draft_vocab", 0),
                      hybrid_depth=getattr(spec, "hybrid_depth", spec_defaults.HYBRID_DEPTH),
                      draft_bf16=getattr(spec, "draft_bf16", spec_defaults.DRAFT_BF16),
                      draft_temperature=getattr(spec, "draft_temperature", spec_defaults.DRAFT_TEMPERATURE))
        return cls(**{**fields, **overrides})

    def arms(self, has_drafter: bool) -> list[Arm]:
        if self.arm is not None:
            arm = Arm.parse(self.arm, self.ngram_depth)
            if arm.depth and arm.label != NGRAM and not has_drafter:
                raise ValueError(f"arm {self.arm!r} needs a drafter")
            return [arm]
        arms = [Arm(f"d{d}k{k}v{v}", d, k, max(v, d)) for d, k, v in self.strategies] if has_drafter else []
        if self.ngram_arm:
            arms.append(Arm(NGRAM, self.ngram_depth, 1, self.ngram_depth))
        if self.hybrid_depth and has_drafter:
            arms.append(Arm.parse(f"ngram|d{self.hybrid_depth}"))
        if self.off_arm or not arms:
            arms.append(Arm(OFF))
        return arms

    def draft_head(self, drafter, vocab_size: int, eos_ids: Sequence[int] = (), device=None) -> DraftHead:
        """The drafter's LM head for this policy: full, or over the reduced draft vocabulary."""
        if self.draft_ids is not None:
            ids = torch.as_tensor(list(self.draft_ids), dtype=torch.long).unique()
        elif self.draft_vocab and self.draft_vocab < vocab_size:
            counts = getattr(drafter, "token_counts", None)
            if counts is None or not bool(counts.any()):
                # without its training data's token counts the subset would be ids 0..N-1: still
                # lossless, but most drafts would miss; draft over the whole vocabulary instead
                log.warning("spec.draft_vocab=%d but the drafter carries no token counts: drafting over the "
                            "whole vocabulary", self.draft_vocab)
                return DraftHead(drafter)
            ids = draft_vocab_ids(counts.detach().float().cpu()[:vocab_size], self.draft_vocab, eos_ids)
        else:
            return DraftHead(drafter)
        return DraftHead(drafter, ids, vocab_size, device)

    def drafting_head(self, drafter, vocab_size: int, eos_ids: Sequence[int] = (), device=None) -> DraftHead:
        """draft_head, with the drafter's and the head's few-row kernels chosen for this machine on a
        CPU: tuned (cached), and reading bfloat16 copies of the weights where draft_bf16."""
        head = self.draft_head(drafter, vocab_size, eos_ids, device)
        if torch.device(device or "cpu").type == "cpu":
            for m in (drafter, head.head):
                if isinstance(m, torch.nn.Module):
                    tune(m, rows=DRAFT_ROWS)  # timed at the rows a draft step multiplies, not a verify pass's
                    if self.draft_bf16:
                        draft_in_bfloat16(m)
        return head

    def new_bandit(self, has_drafter: bool, seed: int = 0) -> BucketedBandit:
        """A bandit over this policy's arms; pass it to every generate() call to learn across steps."""
        return BucketedBandit([a.label for a in self.arms(has_drafter)], self.buckets, epsilon=self.epsilon,
                              window=self.window, seed=seed)


def sum_passes(profiles: Sequence[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """RolloutMetrics.passes_by_rows of several rollouts or workers added up."""
    out: dict[str, dict[str, int]] = {}
    for profile in profiles:
        for threads, by_rows in profile.items():
            at = out.setdefault(str(threads), {})
            for rows, passes in by_rows.items():
                at[str(rows)] = at.get(str(rows), 0) + int(passes)
    return out


def _tokens_per_pass(hist: Sequence[int]) -> float:
    """Tokens a verify pass emits on average, from row-passes by number of draft tokens accepted."""
    n = sum(hist)
    return sum((k + 1) * c for k, c in enumerate(hist)) / n if n else 0.0


@dataclass
class RolloutMetrics:
    """What one rollout measured (or several, merged). `to_dict()`/`from_dict()` are JSON-able;
    `scalars()`/`series()` use metrics.py keys and leave out what was not measured (no SD pass: no
    acceptance; no plain step in the tail: no plain tail speed), so charts show gaps, not zeros."""

    threshold: int = 0  # tail = running sequences <= threshold
    wall_s: float = 0.0  # whole rollout, prefill included
    prefill_s: float = 0.0
    total_tokens: int = 0  # response tokens of all samples
    lengths: list[int] = field(default_factory=list)  # response length per sample
    running: list[tuple[float, int, bool]] = field(default_factory=list)  # (t_s, running, sd_on) at each change
    sd_switches: list[tuple[float, bool]] = field(default_factory=list)  # (t_s, on) whenever SD flips
    verify_passes: int = 0  # target passes that verified a draft
    accepted_hist: list[int] = field(default_factory=list)  # [k]: row-passes that accepted k draft tokens
    # the same by kind of pass (SpecStats.KINDS: drafter chains and trees, n-gram drafts, hybrid), kinds that ran
    accepted_hist_by_kind: dict[str, list[int]] = field(default_factory=dict)
    accepted_by_pos: list[int] = field(default_factory=list)  # [j]: row-passes that accepted draft position j+1
    attempted_by_pos: list[int] = field(default_factory=list)  # [j]: row-passes with a candidate at position j+1
    # the same two, the drafter's chain passes only (their rates do not depend on the depths chosen)
    chain_accepted_by_pos: list[int] = field(default_factory=list)
    chain_attempted_by_pos: list[int] = field(default_factory=list)
    strategy: dict[str, dict[str, int]] = field(default_factory=dict)  # {bucket label: {arm label: steps}}
    tail_tokens_sd: int = 0  # tokens emitted in the tail by SD passes
    tail_s_sd: float = 0.0
    tail_tokens_no_sd: int = 0  # tokens emitted in the tail by plain decode steps
    tail_s_no_sd: float = 0.0
    tail_wall_s: float = 0.0  # decode time in the tail (merged: the longest worker's)
    borrowed_s: float = 0.0  # decode time on more threads than the rollout began with (cores lent by peers)
    # target passes by thread count and rows in their products, {threads: {rows: passes}} (str keys, as
    # JSON keeps them): where the rollout's products ran, which kernels must be fast at (bench e2e's decode_check)
    passes_by_rows: dict[str, dict[str, int]] = field(default_factory=dict)
    draft_vocab_coverage: float = -1.0  # share of emitted tokens inside the reduced draft vocabulary (-1: none)
    # the arm in force over rollout time, [[t_s, arm label], ...] at each change, one list per worker
    arm_timeline: list[list[tuple[float, str]]] = field(default_factory=lambda: [[]])

    def count_tail(self, emitted: int, seconds: float, sd_on: bool, bucket: str = "", arm: str = "") -> None:
        """Book one decode/verify step taken in the tail (running <= threshold)."""
        if sd_on:
            self.tail_tokens_sd += emitted
            self.tail_s_sd += seconds
        else:
            self.tail_tokens_no_sd += emitted
            self.tail_s_no_sd += seconds
        self.tail_wall_s += seconds
        if arm:
            counts = self.strategy.setdefault(bucket, {})
            counts[arm] = counts.get(arm, 0) + 1

    def count_pass(self, threads: int, rows: int) -> None:
        """Book one target pass of `rows` rows (sequences x tokens each) on `threads` threads."""
        at = self.passes_by_rows.setdefault(str(threads), {})
        at[str(rows)] = at.get(str(rows), 0) + 1

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per row per verify pass (accepted drafts + the target's own token)."""
        return _tokens_per_pass(self.accepted_hist)

    @property
    def acceptance_by_kind(self) -> dict[str, float]:
        """acceptance_length of each kind of pass that ran: which drafter the bandit's picks relied on."""
        return {kind: _tokens_per_pass(hist) for kind, hist in self.accepted_hist_by_kind.items() if sum(hist)}

    @property
    def accept_by_position(self) -> list[float]:
        return [a / n if n else 0.0 for a, n in zip(self.accepted_by_pos, self.attempted_by_pos)]

    def chain_acceptance(self, depth: int = FIXED_CHAIN_DEPTH) -> float:
        """Tokens per pass a `depth`-deep drafter chain emits at the rates per position that this
        rollout's chain passes measured: 1 + sum over i of prod_{j <= i} rate_j (a position no pass
        reached counts as rate 0). acceptance_length averages over whatever arms a bandit chose, and
        a deeper chain or a tree emits more per pass with the same drafter; this figure holds the
        arm fixed, so two drafters (adapted, static) compare on it."""
        emitted, reach = 1.0, 1.0
        for a, n in zip(self.chain_accepted_by_pos[:depth], self.chain_attempted_by_pos[:depth]):
            reach *= a / n if n else 0.0
            emitted += reach
        return emitted

    @property
    def tokens_per_s(self) -> float:
        return self.total_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def tail_tokens_per_s_sd(self) -> float:
        return self.tail_tokens_sd / self.tail_s_sd if self.tail_s_sd else 0.0

    @property
    def tail_tokens_per_s_no_sd(self) -> float:
        return self.tail_tokens_no_sd / self.tail_s_no_sd if self.tail_s_no_sd else 0.0

    @property
    def switch_on_s(self) -> float:
        return next((t for t, on in self.sd_switches if on), -1.0)

    @property
    def tail_time_frac(self) -> float:
        """Share of the rollout's wall time after 90% of its responses had finished (the long tail)."""
        n = len(self.lengths)
        if not n or not self.wall_s:
            return 0.0
        t90 = next((t for t, running, _ in self.running if running <= n - int(0.9 * n)), self.wall_s)
        return max(0.0, self.wall_s - t90) / self.wall_s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["running"] = [[round(t, 6), r, bool(s)] for t, r, s in self.running]
        d["sd_switches"] = [[round(t, 6), bool(s)] for t, s in self.sd_switches]
        d["arm_timeline"] = [[[round(t, 6), a] for t, a in w] for w in self.arm_timeline]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RolloutMetrics":
        known = {f for f in cls.__dataclass_fields__}
        m = cls(**{k: v for k, v in d.items() if k in known})
        m.running = [(float(t), int(r), bool(sd)) for t, r, sd in m.running]
        m.sd_switches = [(float(t), bool(on)) for t, on in m.sd_switches]
        m.arm_timeline = [[(float(t), str(a)) for t, a in w] for w in m.arm_timeline]
        return m

    @classmethod
    def merge(cls, parts: Sequence["RolloutMetrics"], offsets: Sequence[float]) -> "RolloutMetrics":
        """One rollout's metrics from its workers': offsets[i] is how long after the rollout's start
        worker i began (each worker's clock starts at its own generation). Counters add up (a worker
        that decoded more weighs more), the running curves add up as step functions, the wall and
        the tail are the longest worker's."""
        def add(lists: list[list[int]]) -> list[int]:
            out = [0] * max((len(x) for x in lists), default=0)
            for x in lists:
                for i, v in enumerate(x):
                    out[i] += v
            return out

        m = cls(threshold=max((p.threshold for p in parts), default=0))
        m.wall_s = max((p.wall_s + off for p, off in zip(parts, offsets)), default=0.0)
        m.prefill_s = max((p.prefill_s for p in parts), default=0.0)
        m.total_tokens = sum(p.total_tokens for p in parts)
        m.lengths = [n for p in parts for n in p.lengths]
        m.verify_passes = sum(p.verify_passes for p in parts)
        m.accepted_hist = add([p.accepted_hist for p in parts])
        for kind in sorted({k for p in parts for k in p.accepted_hist_by_kind}):
            m.accepted_hist_by_kind[kind] = add([p.accepted_hist_by_kind.get(kind, []) for p in parts])
        m.accepted_by_pos = add([p.accepted_by_pos for p in parts])
        m.attempted_by_pos = add([p.attempted_by_pos for p in parts])
        m.chain_accepted_by_pos = add([p.chain_accepted_by_pos for p in parts])
        m.chain_attempted_by_pos = add([p.chain_attempted_by_pos for p in parts])
        for p in parts:
            for bucket, arms in p.strategy.items():
                dst = m.strategy.setdefault(bucket, {})
                for arm, count in arms.items():
                    dst[arm] = dst.get(arm, 0) + int(count)
        m.passes_by_rows = sum_passes([p.passes_by_rows for p in parts])
        for key in ("tail_tokens_sd", "tail_s_sd", "tail_tokens_no_sd", "tail_s_no_sd", "borrowed_s"):
            setattr(m, key, sum(getattr(p, key) for p in parts))
        m.tail_wall_s = max((p.tail_wall_s for p in parts), default=0.0)
        covered = [(p.draft_vocab_coverage, p.total_tokens) for p in parts if p.draft_vocab_coverage >= 0]
        if covered:
            m.draft_vocab_coverage = sum(c * n for c, n in covered) / max(1, sum(n for _, n in covered))
        m.sd_switches = sorted((t + off, on) for p, off in zip(parts, offsets) for t, on in p.sd_switches)
        m.arm_timeline = [[(t + off, a) for t, a in w] for p, off in zip(parts, offsets) for w in p.arm_timeline]
        curves = [([t + off for t, _, _ in p.running], [r for _, r, _ in p.running], [sd for _, _, sd in p.running])
                  for p, off in zip(parts, offsets) if p.running]
        for t in sorted({t for ts, _, _ in curves for t in ts}):
            running = sd = 0
            for ts, rs, sds in curves:
                i = bisect.bisect_right(ts, t) - 1
                if i >= 0:
                    running += rs[i]
                    sd = max(sd, int(sds[i]))
            m.running.append((t, running, bool(sd)))
        return m

    def scalars(self) -> dict[str, float]:
        out = {
            "rollout/tokens_per_s": self.tokens_per_s,
            "rollout/wall_s": self.wall_s,
            "rollout/tail_s": self.tail_wall_s,
            "spec/verify_passes": float(self.verify_passes),
            "spec/switch_on_s": self.switch_on_s,
            "rollout/tail_time_frac": self.tail_time_frac,
            "rollout/borrowed_s": self.borrowed_s,
        }
        if self.tail_s_sd:
            out["rollout/tail_tokens_per_s_sd"] = self.tail_tokens_per_s_sd
        if self.tail_s_no_sd:
            out["rollout/tail_tokens_per_s_no_sd"] = self.tail_tokens_per_s_no_sd
        if sum(self.accepted_hist):
            out["spec/acceptance_length"] = self.acceptance_length
        for kind, value in self.acceptance_by_kind.items():
            out[f"spec/acceptance_{kind}"] = value
        if any(self.chain_attempted_by_pos[:1]):  # a drafter chain ran
            out["spec/chain4_acceptance"] = self.chain_acceptance()
        if self.draft_vocab_coverage >= 0:
            out["spec/draft_vocab_coverage"] = self.draft_vocab_coverage
        return out

    def series(self) -> dict[str, Any]:
        return {
            "rollout/lengths": list(self.lengths),
            "rollout/running": {"t": [round(t, 4) for t, _, _ in self.running], "running": [r for _, r, _ in self.running],
                                "sd": [int(s) for _, _, s in self.running]},
            "spec/accept_by_position": self.accept_by_position,
            "spec/strategy": self.strategy,
            "rollout/passes_by_rows": self.passes_by_rows,
            "spec/arm_timeline": [{"worker": i, "t": [round(t, 4) for t, _ in w], "arm": [a for _, a in w]}
                                  for i, w in enumerate(self.arm_timeline)],
        }


@dataclass
class RolloutResult:
    tokens: list[list[int]]  # response ids per sample (prompt excluded; ends with the EOS id when it stopped on one)
    # log-prob of each response token under the distribution it was sampled from (sampling.token_logprobs:
    # temperature, top-k, top-p; greedy: temperature 1), [len] float32: the learner's old log-probs
    logprobs: list[Tensor]
    lengths: list[int]
    finished: list[bool]  # True: stopped on an EOS id; False: reached max_new_tokens
    # per sample [prompt_len + len - 1, H] on CPU: h_i (last layer, after the final norm) for every
    # position i of prompt + response except the last; hidden[i] pairs with token i + 1 of that
    # sequence (the drafter's training pairs). None when harvest_hidden is False.
    hidden: list[Tensor] | None
    metrics: RolloutMetrics
    # per sample [len] bool: the token was a draft the target accepted (None: the engine does not say)
    from_draft: list[Tensor] | None = None


class _Rows:
    """Device state of the rows in the batch: row r of every tensor is the same sequence."""

    def __init__(self, model: Transformer, drafter, prompts: Sequence[Sequence[int]], L: int, need_hidden: bool,
                 seed: int):
        dev = model.device
        B = len(prompts)
        self.cache = model.new_cache(B, L)
        self.dcache = drafter.new_cache(B, L) if drafter is not None else None
        seq = torch.zeros(B, L, dtype=torch.long)
        for b, p in enumerate(prompts):
            seq[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        self.seq = seq.to(dev)  # prompt + response; seq[b, n] = pending token
        self.hid = torch.empty(B, L, model.config.hidden_size, dtype=model.dtype, device=dev) if need_hidden else None
        self.lp = torch.zeros(B, L, dtype=torch.float32, device=dev)  # log-prob of seq[b, i], response part
        self.fd = torch.zeros(B, L, dtype=torch.bool, device=dev)  # seq[b, i] was an accepted draft
        self.keys = sample_keys(seed, B, dev)  # sample b's randomness (sampling.draw)
        self.prompt_len = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=dev)
        self.ids = list(range(B))  # sample index of each row
        self.alive = torch.ones(B, dtype=torch.bool, device=dev)  # finished rows stay until compaction
        self.alive_host = [True] * B
        self.n_host = [len(p) for p in prompts]  # host copy of cache.lengths

    def keep(self, rows: list[int]) -> None:
        idx = torch.tensor(rows, dtype=torch.long, device=self.seq.device)
        self.cache.keep_rows(idx)
        if self.dcache is not None:
            self.dcache.keep_rows(idx)
        self.seq, self.lp, self.fd, self.keys = self.seq[idx], self.lp[idx], self.fd[idx], self.keys[idx]
        self.hid = self.hid[idx] if self.hid is not None else None
        self.prompt_len, self.alive = self.prompt_len[idx], self.alive[idx]
        self.ids = [self.ids[r] for r in rows]
        self.alive_host = [self.alive_host[r] for r in rows]
        self.n_host = [self.n_host[r] for r in rows]


@torch.inference_mode()
def generate(model: Transformer, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams(), *,
             max_new_tokens: int, eos_ids: Sequence[int] = (), drafter=None, spec: SpecPolicy | None = None,
             bandit: BucketedBandit | None = None, seed: int = 0, harvest_hidden: bool = True, hidden_dtype: torch.dtype = torch.float32,
             on_progress: Callable[[dict[str, Any]], None] | None = None,
             threads: Callable[[], int] | None = None) -> RolloutResult:
    """Generate a response for every prompt (token id lists; repeat a prompt for n samples).

    params: temperature (0 = greedy), top-p, top-k. Stops a sequence at any of eos_ids or after
    max_new_tokens. drafter: an EAGLE drafter (models/drafter.py) or None (then only the n-gram arm can
    speculate). spec: None or enabled=False for plain decoding. bandit: pass one
    (spec.new_bandit(...)) to keep learning across calls; else a fresh one per call.
    seed: the sampling randomness: sample b's tokens depend only on (seed, b, its prompt, the model),
    never on the arms, the batch or SD (sampling.py).
    on_progress: called with {"t", "running", "finished", "sd"} whenever the running count changes.
    threads: CPU only, asked before every decode step: the intra-op threads the next step may use
    (a rollout worker whose peers finished takes their cores; rollout_workers.py). Taken only where
    the model's products keep every bit on that many threads (linear.thread_invariant), so the
    thread count never changes a token or a log-prob (test_rollout.py).
    The device is the model's.
    """
    t0 = time.perf_counter()
    dev = model.device
    if not prompts or min(len(p) for p in prompts) < 1:
        raise ValueError("need at least one prompt, each with at least one token")
    policy = spec if spec is not None else SpecPolicy(enabled=False)
    arms = {a.label: a for a in policy.arms(drafter is not None)} if policy.enabled else {}
    draft_params = params if params.greedy or not policy.draft_temperature else replace(
        params, temperature=policy.draft_temperature)  # what the drafter's keyed draws sample from
    if isinstance(model, torch.nn.Module) and dev.type == "cpu":
        tune(model)  # this machine's fastest few-row kernels (cached)
    if arms and bandit is None:
        bandit = policy.new_bandit(drafter is not None, seed)
    max_depth = max([a.depth for a in arms.values()] + [1])
    slack = max([a.verify + 1 for a in arms.values()] + [a.depth * a.topk + 1 for a in arms.values()] + [2]) + 2
    B0 = len(prompts)
    L = max(len(p) for p in prompts) + max_new_tokens + slack
    rows = _Rows(model, drafter, prompts, L, harvest_hidden or drafter is not None, seed)
    head = policy.drafting_head(drafter, model.config.vocab_size, eos_ids, dev) if drafter is not None and arms else None
    eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=dev)
    stats = SpecStats(max_depth, dev)
    m = RolloutMetrics(threshold=policy.threshold)
    out_tokens: list[list[int]] = [[] for _ in range(B0)]
    out_lp: list[Tensor] = [torch.empty(0)] * B0
    out_fd: list[Tensor] = [torch.empty(0, dtype=torch.bool)] * B0
    out_hidden: list[Tensor] | None = [torch.empty(0)] * B0 if harvest_hidden else None
    out_eos = [False] * B0
    groups: dict[tuple[int, ...], int] = {}
    group_of = [groups.setdefault(tuple(p), len(groups)) for p in prompts]  # siblings share a prompt
    done_seqs: dict[int, list[np.ndarray]] = {}  # finished prompt+response per group (n-gram corpus)

    def finish(r: int, hit_eos: bool) -> None:
        # copy a finished row's outputs to the CPU; the row stays as an inert zombie until compaction
        i, n = rows.ids[r], rows.n_host[r]  # last emitted token at position n
        P = len(prompts[i])
        full = rows.seq[r, :n + 1].tolist()
        out_tokens[i] = full[P:]
        out_lp[i] = rows.lp[r, P:n + 1].float().cpu()
        out_fd[i] = rows.fd[r, P:n + 1].cpu()
        if out_hidden is not None:
            out_hidden[i] = rows.hid[r, :n].to("cpu", hidden_dtype)
        out_eos[i] = hit_eos
        done_seqs.setdefault(group_of[i], []).append(np.asarray(full, dtype=np.int64))
        rows.alive_host[r] = False

    def stop(em: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """em: [B, J] tokens emitted at positions n+1.., k: [B] how many are real -> (count, done, eos)."""
        r = rows.cache.lengths - rows.prompt_len + 1  # response tokens so far, the pending one included
        k = torch.minimum(k, max_new_tokens - r)
        hit = torch.zeros_like(rows.alive)
        if eos.numel():
            is_eos = torch.isin(em, eos) & (torch.arange(em.shape[1], device=dev)[None, :] < k[:, None])
            hit = is_eos.any(1)
            k = torch.where(hit, is_eos.int().argmax(1) + 1, k)
        k = torch.where(rows.alive, k, 0)  # zombies stay frozen
        return k, ((r + k >= max_new_tokens) | hit) & rows.alive, hit

    # --- prefill: right-padded prompts, one pass; the first response token comes from its logits ---
    P = rows.prompt_len
    Pmax = int(max(len(p) for p in prompts))
    bidx = torch.arange(B0, device=dev)
    pos = torch.arange(Pmax, device=dev).expand(B0, Pmax)
    out = model(rows.seq[:, :Pmax], pos, rows.cache, mask=torch.ones(Pmax, Pmax, dtype=torch.bool,
                device=dev).tril().expand(B0, Pmax, Pmax), logits=False)
    if rows.hid is not None:
        rows.hid[:, :Pmax] = out.hidden
    logits = model.lm_head(out.hidden[bidx, P - 1])  # [B, V] only where the prompts end
    z = processed_logits(logits, params)
    tok = logits.argmax(-1) if params.greedy else draw(z.softmax(-1), rows.keys, P)
    rows.seq[bidx, P] = tok
    rows.lp[bidx, P] = torch.log_softmax(z, -1).gather(1, tok[:, None])[:, 0]
    rows.cache.lengths = P.clone()  # pending token = the first response token, at position P
    hit = torch.isin(tok, eos) if eos.numel() else torch.zeros_like(rows.alive)
    done = hit | (max_new_tokens <= 1)
    for r, (d, h) in enumerate(zip(done.tolist(), hit.tolist())):
        if d:
            finish(r, h)
    rows.alive = rows.alive & ~done
    m.prefill_s = time.perf_counter() - t0

    # --- decode ----------------------------------------------------------------------------------
    sd_prev = False
    live_prev = -1
    own_threads = torch.get_num_threads()
    while True:
        live = sum(rows.alive_host)
        if live == 0:
            break
        B = len(rows.ids)
        zombies = B - live
        if zombies and (zombies * 8 >= B or live <= policy.threshold):
            keep = [r for r in range(B) if rows.alive_host[r]]
            rows.keep(keep)
            B = live
        if threads is not None and (want := threads()) != torch.get_num_threads():
            if thread_invariant(model, want):  # here, on the decoding thread: the count is per thread
                torch.set_num_threads(want)
            else:  # a thread count that changes bits would change tokens: keep this rollout's
                log.info("rollout: not taking %d threads, this model's kernels round differently on them", want)
                threads = None
        cores = torch.get_num_threads()  # this pass's (the bandit rates arms per thread count)
        t_step = time.perf_counter()
        arm = Arm(OFF)
        if arms and live <= policy.threshold:
            arm = arms[bandit.select(live, cores)]  # a forced arm is the bandit's only arm
        sd_on = arm.label != OFF
        now = t_step - t0
        if not m.arm_timeline[0] or m.arm_timeline[0][-1][1] != arm.label:
            m.arm_timeline[0].append((now, arm.label))
        if sd_on != sd_prev:
            m.sd_switches.append((now, sd_on))
            sd_prev = sd_on
        if live != live_prev or (m.running and m.running[-1][2] != sd_on):
            m.running.append((now, live, sd_on))
            if on_progress is not None and live != live_prev:
                on_progress({"t": now, "running": live, "finished": B0 - live, "sd": sd_on})
            live_prev = live

        n = rows.cache.lengths
        bidx = torch.arange(B, device=dev)
        roots = rows.seq[bidx, n]
        s_max = max(rows.n_host)
        grams = None  # each row's n-gram draft (the n-gram and hybrid arms)
        if sd_on and arm.kind in ("ngram", "hybrid"):
            grams = _ngram_proposals(rows, group_of, done_seqs, policy.ngram_n, arm.depth,
                                     HYBRID_NGRAM_MIN if arm.kind == "hybrid" else 1)
        if not sd_on:
            tree = root_tree(roots)
        elif grams is not None and (arm.kind == "ngram" or all(g or not a for g, a in zip(grams, rows.alive_host))):
            tree = chain_tree(roots, grams, arm.depth)  # no drafter step: every live row has its n-gram draft
        else:  # a draft token at level j sits at position n + j and races with that position's noise
            tree = draft(drafter, rows.dcache, rows.hid, rows.seq, n, s_max, depth=arm.depth, topk=arm.topk,
                         verify=arm.verify, params=draft_params, keys=rows.keys, head=head)
            if grams is not None:  # hybrid: the drafter's chain only for the rows without an n-gram draft
                tree = chain_tree(roots, [g or t for g, t in zip(grams, tree.tokens[:, 1:].tolist())], arm.depth)

        # --- one target pass over the tree, lossless acceptance ---
        T = tree.tokens.shape[1]
        ar = torch.arange(T, device=dev)
        if T == 1:
            mask = (torch.arange(s_max + 1, device=dev)[None, :] <= n[:, None])[:, None, :]
        else:
            mask = tree_mask(n, ancestors(tree), s_max + T)
        out = model(tree.tokens, n[:, None] + tree.depth, rows.cache, write_pos=n[:, None] + ar, mask=mask)
        z = processed_logits(out.logits, params)  # [B, T, V]
        if params.greedy:
            y = out.logits.argmax(-1)
        else:  # the target's draw after each node: the keyed draw of position n + depth + 1
            y = draw(z.softmax(-1), rows.keys, n[:, None] + tree.depth + 1)
        path, n_acc, nxt = walk(tree, y, stats if T > 1 else None, arm.kind)
        D = path.shape[1] - 1
        j = torch.arange(D + 1, device=dev)
        if D and not tree.chain:
            # move the accepted path's keys/values to contiguous slots n+1..n+n_acc (root stays at n)
            dst = n[:, None] + j[1:]
            src = torch.where(j[1:] <= n_acc[:, None], n[:, None] + path[:, 1:], dst)
            rows.cache.move(bidx, src, dst)
        if rows.hid is not None:  # harvest: true hidden states of the root and accepted nodes
            H = out.hidden.shape[-1]
            rows.hid[bidx[:, None], n[:, None] + j] = out.hidden.gather(1, path[..., None].expand(-1, -1, H))
        em = torch.cat([tree.tokens.gather(1, path[:, 1:]), nxt[:, None]], 1)  # [B, D+1] emitted at n+1..
        em.scatter_(1, n_acc[:, None], nxt[:, None])
        V = z.shape[-1]
        lps = torch.log_softmax(z.gather(1, path[..., None].expand(-1, -1, V)), -1)
        wpos = n[:, None] + 1 + j
        rows.seq[bidx[:, None], wpos] = em
        rows.lp[bidx[:, None], wpos] = lps.gather(2, em[..., None])[..., 0]
        rows.fd[bidx[:, None], wpos] = j[None, :] < n_acc[:, None]
        k, done, hit = stop(em, n_acc + 1)
        rows.cache.lengths = n + k
        k_host, done_host, hit_host, n_host = torch.stack([k, done.long(), hit.long(), rows.cache.lengths]).tolist()
        rows.n_host = n_host
        for r in range(B):
            if done_host[r]:
                finish(r, bool(hit_host[r]))
        rows.alive = rows.alive & ~done

        # --- measure: reward for the bandit, tail throughput, strategy counts ---
        dt = time.perf_counter() - t_step
        emitted = sum(k_host)
        if live <= policy.threshold:
            if arms:
                bandit.update(live, arm.label, emitted, dt, cores)
                m.count_tail(emitted, dt, sd_on, bandit.label(bandit.bucket(live)), arm.label)
            else:
                m.count_tail(emitted, dt, sd_on)
        if sd_on:
            m.verify_passes += 1
        m.count_pass(cores, B * T)
        if cores > own_threads:
            m.borrowed_s += dt

    m.wall_s = time.perf_counter() - t0
    m.running.append((m.wall_s, 0, sd_prev))
    m.lengths = [len(t) for t in out_tokens]
    m.total_tokens = sum(m.lengths)
    if head is not None and head.ids is not None:  # low: the draft vocabulary misses what this policy writes
        emitted = torch.tensor([t for toks in out_tokens for t in toks], dtype=torch.long)
        m.draft_vocab_coverage = float(torch.isin(emitted, head.ids.cpu()).float().mean()) if emitted.numel() else 1.0
    m.accepted_hist = stats.hist.sum(0).tolist()
    m.accepted_hist_by_kind = {kind: h for kind, h in zip(SpecStats.KINDS, stats.hist.tolist()) if sum(h)}
    m.accepted_by_pos = stats.accepted.sum(0).tolist()
    m.attempted_by_pos = stats.attempted.sum(0).tolist()
    chain = SpecStats.KINDS.index("chain")
    m.chain_accepted_by_pos = stats.accepted[chain].tolist()
    m.chain_attempted_by_pos = stats.attempted[chain].tolist()
    return RolloutResult(out_tokens, out_lp, list(m.lengths), out_eos, out_hidden, m, out_fd)


def _ngram_proposals(rows: _Rows, group_of: list[int], done_seqs: dict[int, list[np.ndarray]], n_max: int,
                     depth: int, n_min: int, max_siblings: int = 8) -> list[list[int]]:
    """Each row's n-gram draft (empty: no match of n_min tokens or more, or a finished row): its own
    text, then up to max_siblings siblings."""
    S = max(rows.n_host) + 1
    seq = rows.seq[:, :S].tolist()
    ctx = [seq[r][:rows.n_host[r] + 1] for r in range(len(rows.ids))]
    arrays = [np.asarray(c, dtype=np.int64) for c in ctx]
    proposals = []
    for r in range(len(rows.ids)):
        if not rows.alive_host[r]:
            proposals.append([])
            continue
        g = group_of[rows.ids[r]]
        others = done_seqs.get(g, [])[-max_siblings:]  # finished siblings first: complete texts
        for o in range(len(rows.ids)):
            if len(others) >= max_siblings:
                break
            if o != r and group_of[rows.ids[o]] == g:
                others.append(arrays[o])
        proposals.append(ngram_propose(ctx[r], others, n_max, depth, n_min))
    return proposals
