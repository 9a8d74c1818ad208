"""GRPO learner: group-normalised advantages and a clipped importance-ratio update.

The learner owns the policy's optimizer (and the frozen reference when kl_coef > 0). It is handed
the step's responses and rewards by the driver and returns its metrics:

    learner = GRPOLearner(policy, cfg.grpo, pad_id=task.pad_id, sampling=SamplingParams(temperature=0.7))
    batch = RolloutBatch(prompts=[p.ids for p in prompts_repeated], responses=tokens, rewards=rewards,
                         group_size=cfg.rollout.samples_per_prompt, rollout_logprobs=logprobs)
    metrics = learner.step(batch)   # {"learner/loss": ..., "learner/grad_norm": ..., ...}

What is optimised. Samples of a prompt are contiguous (rows g*n .. g*n+n-1) and their advantage is
the group-normalised reward. Log-probs are those of the distribution the rollout sampled from
(sampling.token_logprobs: temperature, top-k, top-p; greedy rollouts are scored at temperature 1),
so the policy gradient is unbiased for the sampler actually used. The old log-probs of the ratio
are the learner's own scoring of the policy that sampled the step (as verl recomputes them): the
step's groups are split into `grpo.mini_batches` mini-batches with one AdamW step each (verl's
ppo_mini_batch); the first mini-batch's forward IS that scoring (ratio exactly 1, no extra pass),
the rows of later ones are scored before the first update, and there the ratio departs from 1 as
the earlier steps moved the policy, and the PPO clip bounds how far. So the update depends on the
sampled tokens only, never on the numerics of the engine that drew them (SD on or off give
bit-identical updates). Each mini-batch's loss is the mean over its response tokens (token-mean
aggregation), accumulated over micro-batches of at most `grpo.micro_batch` rows and
`grpo.micro_batch_tokens` padded tokens (rows sorted by length, so a long-tail step pads its few
long answers together).
`rollout/logprob_mismatch` (mean) and `rollout/logprob_mismatch_max` compare the rollout
engine's log-probs with the learner's scoring of the same policy, on every row the learner runs.

Rows whose gradient is exactly zero are not run: a sample with zero advantage (its whole group got
the same reward) contributes nothing to the clipped loss when there is no KL term; the denominator
still counts its tokens, and a mini-batch with no row to run still takes its optimizer step with
zero gradients (AdamW moves the weights on its momentum then), so the update is exactly the one of
running every row.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from ..models.transformer import Transformer
from ..rollout.sampling import SamplingParams, token_logprobs

if TYPE_CHECKING:  # pydantic stays out of a bare GPU node's imports (bench/gpu_check.py)
    from ..config import GRPOSection

ADV_EPS = 1e-6  # added to the group std; groups whose std is below it get zero advantage


@dataclass
class RolloutBatch:
    """One step's samples in group order (the n samples of prompt g are rows g*n .. g*n+n-1)."""

    prompts: list[list[int]]  # prompt ids per sample
    responses: list[list[int]]  # generated ids per sample (with the EOS when it finished)
    rewards: list[float]
    group_size: int
    rollout_logprobs: list[list[float]] | None = None  # engine's log-prob per response token

    def __post_init__(self) -> None:
        n = len(self.prompts)
        if len(self.responses) != n or len(self.rewards) != n:
            raise ValueError("prompts, responses and rewards must have one entry per sample")
        if self.group_size < 2 or n % self.group_size:
            raise ValueError(f"{n} samples do not split into groups of {self.group_size} (GRPO needs groups of >= 2)")


def group_advantages(rewards: Tensor, group_size: int, eps: float = ADV_EPS) -> Tensor:
    """(r - mean_g) / (std_g + eps) within each group of `group_size`; zero-variance groups give 0.

    rewards: [N] with N divisible by group_size; returns [N] float32.
    """
    r = rewards.float().view(-1, group_size)  # [G, n]
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, unbiased=False)
    adv = (r - mean) / (std + eps)
    adv = torch.where(std > eps, adv, torch.zeros_like(adv))
    return adv.view(-1)


def pad_sequences(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-padded tokens [B, T] and the response mask [B, T-1] (bool) aligned with next-token targets.

    mask[b, t] is True where token t+1 of row b is a response token (so position t scores it);
    read row by row, the True positions are the response tokens in order.
    """
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    T = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), max(T - 1, 1), dtype=torch.bool)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        tokens[b, : len(seqs[b])] = torch.tensor(seqs[b], dtype=torch.long)
        mask[b, len(p) - 1 : len(p) - 1 + len(r)] = True
    return tokens, mask


def response_logprobs(model: Transformer, tokens: Tensor, mask: Tensor, params: SamplingParams,
                      return_hidden: bool = False, autocast: torch.dtype | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probs of the response tokens under the processed distribution: [N] float32, N = mask.sum(),
    in row-major order of `mask` (pad_sequences). The LM head runs only where a response token is
    scored. return_hidden: also the forward's last hidden states [B, T, H] (after the final norm:
    the drafter's training input), so harvesting them costs no extra pass. autocast: the dtype of
    the forward's matrix products (None: the model's own); the softmax runs in float32 either way.
    """
    with torch.autocast(tokens.device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext():
        logits, hidden = model(tokens, score_mask=mask)  # [N, V], [B, T, H]
    lp = token_logprobs(logits, tokens[:, 1:][mask], params)
    return (lp, hidden) if return_hidden else lp


def micro_batches(lengths: list[int], rows: list[int], max_rows: int, max_tokens: int) -> list[list[int]]:
    """`rows` longest first, cut into chunks of at most max_rows rows and max_tokens padded tokens
    (a row longer than max_tokens gets a chunk of its own)."""
    out: list[list[int]] = []
    for r in sorted(rows, key=lambda i: -lengths[i]):
        if out and len(out[-1]) < max_rows and (len(out[-1]) + 1) * lengths[out[-1][0]] <= max_tokens:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def split_rows(lengths: list[int], rows: list[int], world: int) -> list[list[int]]:
    """`rows` dealt to `world` ranks, longest first to the rank with the fewest tokens so far
    (deterministic: every rank computes the same split from the same batch)."""
    out: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for r in sorted(rows, key=lambda i: (-lengths[i], i)):
        k = min(range(world), key=lambda j: (load[j], j))
        out[k].append(r)
        load[k] += lengths[r]
    return out


def clip_grad_norm(params: list[Tensor], max_norm: float) -> float:
    """Global gradient norm clipped to max_norm; with FSDP2's sharded (DTensor) gradients the norm
    is the whole model's, the same on every rank."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    if hasattr(total, "full_tensor"):  # a DTensor: reduce the shards' partial norms
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def _group_sums(loss_sum: float, kl_sum: float, clipped: float, audit: "_MismatchAudit",
                hist: dict[str, list]) -> tuple[float, float, float, dict[str, float], dict[str, list]]:
    """The group's totals of one step's per-rank sums (torch.distributed is set up)."""
    import torch.distributed as dist

    sums = torch.tensor([loss_sum, kl_sum, clipped, audit.total, float(audit.count), *hist["counts"]],
                        dtype=torch.float64)
    dist.all_reduce(sums)
    top = torch.tensor([audit.max], dtype=torch.float64)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    loss_sum, kl_sum, clipped, total, count = (float(x) for x in sums[:5])
    mismatch = {"rollout/logprob_mismatch": total / count if count else 0.0,
                "rollout/logprob_mismatch_max": float(top[0])}
    return loss_sum, kl_sum, clipped, mismatch, {**hist, "counts": [int(c) for c in sums[5:].tolist()]}


class _MismatchAudit:
    """|rollout engine log-prob - learner log-prob| over the scored rows (same policy, two engines)."""

    def __init__(self, rollout_logprobs: list[list[float]] | None):
        self.rollout = rollout_logprobs
        self.total = self.max = 0.0
        self.count = 0
        self.deltas: list[Tensor] = []

    def add(self, rows: list[int], learner_lp: Tensor) -> None:
        if self.rollout is None or not rows:
            return
        engine = torch.cat([torch.as_tensor(self.rollout[r], dtype=torch.float32) for r in rows])
        d = (learner_lp.detach().float().cpu() - engine).abs()
        if d.numel():
            self.total += float(d.sum())
            self.max = max(self.max, float(d.max()))
            self.count += d.numel()
            self.deltas.append(d)

    def metrics(self) -> dict[str, float]:
        return {"rollout/logprob_mismatch": self.total / self.count if self.count else 0.0,
                "rollout/logprob_mismatch_max": self.max}

    def histogram(self) -> dict[str, list]:
        from ..audit import mismatch_histogram

        return mismatch_histogram(torch.cat(self.deltas) if self.deltas else torch.empty(0))


COMPUTE_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}  # grpo.compute_dtype -> response_logprobs' autocast


class GRPOLearner:
    """Policy optimizer + GRPO loss, in one process or as one rank of a data-parallel group.

    rank/world > 1 (cluster/learner_group.py: the policy wrapped by FSDP2's fully_shard, torch.distributed
    set up): each rank runs its share of every mini-batch's rows (balanced by tokens), every rank
    runs the same number of forwards (an empty share runs a zero-loss dummy row, as FSDP's
    collectives need), and the metrics are summed over the group, so the update and the metrics
    equal the single-process ones up to float rounding.
    """

    def __init__(self, policy: Transformer, cfg: GRPOSection, pad_id: int,
                 sampling: SamplingParams = SamplingParams(), ref: Transformer | None = None,
                 rank: int = 0, world: int = 1, accumulate_unsharded: bool = False):
        self.policy = policy
        self.accumulate_unsharded = accumulate_unsharded  # FSDP2 only: see LearnerRankImpl._keep_gathered
        self.cfg = cfg
        self.pad_id = pad_id
        self.sampling = sampling
        self.rank, self.world = rank, world
        self.last_hidden: list[Tensor | None] | None = None  # see step(harvest_hidden=True)
        self.last_mismatch_hist: dict[str, list] = {}  # audit.mismatch_histogram of the last step
        if cfg.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"grpo.compute_dtype {cfg.compute_dtype!r}: resolve it for the device first "
                             "(trainer.resolve_dtype)")
        self.autocast = COMPUTE_DTYPES[cfg.compute_dtype]
        self.params = [p for p in policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.999), weight_decay=0.0)
        self.ref: Transformer | None = None
        if cfg.kl_coef > 0:
            self.ref = ref if ref is not None else copy.deepcopy(policy)
            self.ref.eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)

    def _share(self, lengths: list[int], rows: list[int]) -> list[list[int]]:
        """This rank's micro-batches of `rows`, padded with empty ones to the group's most."""
        if self.world == 1:
            return micro_batches(lengths, rows, self.cfg.micro_batch, self.cfg.micro_batch_tokens)
        per_rank = split_rows(lengths, rows, self.world)
        chunks = [micro_batches(lengths, rs, self.cfg.micro_batch, self.cfg.micro_batch_tokens) for rs in per_rank]
        most = max(len(c) for c in chunks)
        mine = chunks[self.rank]
        return mine + [[] for _ in range(most - len(mine))]

    def _dummy(self) -> tuple[Tensor, Tensor]:
        """One two-token row scoring one token: a forward (and backward) that keeps a rank with no
        rows of its own in step with the group's collectives."""
        dev = self.policy.device
        return (torch.full((1, 2), self.pad_id, dtype=torch.long, device=dev),
                torch.ones(1, 1, dtype=torch.bool, device=dev))

    def _padded(self, batch: RolloutBatch, rows: list[int]) -> tuple[Tensor, Tensor]:
        tokens, mask = pad_sequences([batch.prompts[r] for r in rows], [batch.responses[r] for r in rows], self.pad_id)
        dev = self.policy.device
        return tokens.to(dev), mask.to(dev)

    @torch.no_grad()
    def _scored(self, model: Transformer, batch: RolloutBatch, rows: list[int]) -> list[Tensor]:
        """Per row, the log-probs `model` gives its response tokens (no gradient)."""
        if not rows:  # this rank's share ran out: a dummy forward for the group's collectives
            response_logprobs(model, *self._dummy(), self.sampling, autocast=self.autocast)
            return []
        tokens, mask = self._padded(batch, rows)
        lp = response_logprobs(model, tokens, mask, self.sampling, autocast=self.autocast)
        return list(lp.cpu().split(mask.sum(1).tolist()))

    def step(self, batch: RolloutBatch, harvest_hidden: bool = False) -> dict[str, float]:
        """One GRPO update on the step's samples; returns `learner/*` and `rollout/logprob_mismatch*`.

        harvest_hidden: keep the forward pass's hidden states in `self.last_hidden` (one
        [len(prompt) + len(response), H] float16 CPU tensor per sample, aligned with prompt +
        response tokens): the drafter buffer's input when the rollout engine returns none (vLLM).
        """
        cfg = self.cfg
        n_rows, n = len(batch.prompts), batch.group_size
        adv = group_advantages(torch.tensor(batch.rewards), n)  # [N]
        lengths = [len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)]
        # zero-advantage rows still matter with a KL term (its gradient) or when their hidden
        # states are wanted; otherwise their gradient is exactly zero and they are skipped
        every_row = self.ref is not None or harvest_hidden
        runs = [r for r in range(n_rows) if every_row or adv[r] != 0]
        run_set = set(runs)
        groups = np.array_split(np.arange(n_rows // n), min(cfg.mini_batches, n_rows // n))
        members = [[int(g) * n + j for g in gs for j in range(n) if int(g) * n + j in run_set] for gs in groups]
        denoms = [max(float(sum(len(batch.responses[int(g) * n + j]) for g in gs for j in range(n))), 1.0)
                  for gs in groups]
        chunks = lambda rows: self._share(lengths, rows)  # noqa: E731  (this rank's micro-batches)
        rollout_lp = batch.rollout_logprobs
        audit = _MismatchAudit(rollout_lp if rollout_lp is not None and all(
            len(rollout_lp[r]) == len(batch.responses[r]) for r in runs) else None)

        # the behaviour policy's log-probs: the first mini-batch's own forward gives its rows',
        # the later mini-batches' rows are scored now, before any update
        # (per mini-batch, so each row is scored on the rank that trains it)
        old: dict[int, Tensor] = {}
        for c in (c for m in members[1:] for c in chunks(m)):
            old.update(zip(c, self._scored(self.policy, batch, c)))
        for r, lp in old.items():
            audit.add([r], lp)
        ref: dict[int, Tensor] = {}
        if self.ref is not None:
            for c in (c for m in members for c in chunks(m)):
                ref.update(zip(c, self._scored(self.ref, batch, c)))

        hidden_by_row: dict[int, Tensor] = {}
        loss_sum = kl_sum = clipped = grad_norm_sum = 0.0
        device = self.policy.device
        self.policy.train()
        for mb, (rows, denom) in enumerate(zip(members, denoms)):
            self.optimizer.zero_grad(set_to_none=True)
            mine = chunks(rows)
            for i, c in enumerate(mine):
                if self.accumulate_unsharded:  # gradients stay whole until the mini-batch's last backward
                    last = i == len(mine) - 1
                    self.policy.set_requires_gradient_sync(last)
                    self.policy.set_reshard_after_backward(last)
                if not c:  # nothing of this rank's in the chunk: a zero-loss dummy for the collectives
                    lp = response_logprobs(self.policy, *self._dummy(), self.sampling, autocast=self.autocast)
                    (lp.sum() * 0.0).backward()
                    continue
                tokens, mask = self._padded(batch, c)
                counts = mask.sum(1).tolist()
                lp, hidden = response_logprobs(self.policy, tokens, mask, self.sampling, return_hidden=True,
                                               autocast=self.autocast)  # [N]
                if mb == 0:  # the policy is still the one that sampled: ratio exactly 1
                    old_lp = lp.detach()
                    audit.add(c, old_lp)
                else:
                    old_lp = torch.cat([old[r] for r in c]).to(device)
                a = torch.cat([adv[r].expand(k) for r, k in zip(c, counts)]).to(device)
                if harvest_hidden:  # unpadded [L, H] per row, fp16 on CPU
                    for b, row in enumerate(c):
                        hidden_by_row[row] = hidden[b, :lengths[row]].detach().to("cpu", torch.float16)
                ratio = torch.exp(lp - old_lp)
                surr1 = ratio * a
                surr2 = torch.clamp(ratio, 1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps) * a
                per_token = -torch.minimum(surr1, surr2)
                if self.ref is not None:
                    # k3 estimator of KL(pi || ref): exp(ref - lp) - (ref - lp) - 1 >= 0, unbiased
                    dref = torch.cat([ref[r] for r in c]).to(device) - lp
                    kl = torch.exp(dref) - dref - 1.0
                    per_token = per_token + cfg.kl_coef * kl
                    kl_sum += float(kl.detach().sum())
                loss = per_token.sum() / denom
                # FSDP averages gradients over the group; each rank's loss is its share of the sum
                (loss * self.world if self.world > 1 else loss).backward()
                loss_sum += float(loss.detach())
                clipped += float(((ratio.detach() - 1.0).abs() > cfg.clip_eps).sum())
            for p in self.params:  # rows skipped for a zero gradient: AdamW still steps on zeros
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grad_norm_sum += clip_grad_norm(self.params, cfg.grad_clip)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.policy.eval()
        # this rank's rows only when world > 1 (the group merges them)
        self.last_hidden = [hidden_by_row.get(r) for r in range(n_rows)] if harvest_hidden else None
        hist = audit.histogram()  # the step's series rollout/logprob_mismatch_hist
        mismatch = audit.metrics()
        if self.world > 1:  # sums over the group's rows (grad norm is already the group's)
            loss_sum, kl_sum, clipped, mismatch, hist = _group_sums(loss_sum, kl_sum, clipped, audit, hist)
        self.last_mismatch_hist = hist
        total_tokens = float(sum(len(r) for r in batch.responses))
        return {
            "learner/loss": loss_sum / len(groups),
            "learner/grad_norm": grad_norm_sum / len(groups),
            "learner/kl": kl_sum / max(total_tokens, 1.0),
            "learner/clip_frac": clipped / max(total_tokens, 1.0),
            "learner/adv_abs_mean": float(adv.abs().mean()),
            "learner/tokens": total_tokens,
            "learner/rows_run": float(len(runs)),
            "learner/optimizer_steps": float(len(groups)),
            **mismatch,
        }

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
