"""GRPO learner: group-normalised advantages and a clipped policy-ratio update.

The learner owns the policy's optimizer (and the frozen reference when kl_coef > 0). It is handed
the step's responses and rewards by the driver and returns its metrics:

    learner = GRPOLearner(policy, cfg.grpo, pad_id=task.pad_id)
    batch = RolloutBatch(prompts=[p.ids for p in prompts_repeated], responses=tokens, rewards=rewards,
                         group_size=cfg.rollout.samples_per_prompt, rollout_logprobs=logprobs)
    metrics = learner.step(batch)   # {"learner/loss": ..., "learner/grad_norm": ..., ...}

Per RL step the learner (1) takes the old log-probs of every response token from its own forward
pass, detached (one optimizer step per batch from the rollout's policy: they equal a separate
scoring pass); the rollout engine's log-probs are only compared with them,
`rollout/logprob_mismatch`, since an engine may compute them in another precision or kernel, (2)
computes the loss in micro-batches of `grpo.micro_batch` sequences, accumulating gradients so that the loss is the mean
over every response token of the step (token-mean aggregation), (3) clips the global gradient
norm and takes one AdamW step. Samples of a prompt are contiguous: rows g*n .. g*n+n-1.

Two things make the pass cheaper without changing the update. Rows whose gradient is exactly
zero are not run: a sample with zero advantage (its whole group got the same reward) contributes
nothing to the clipped loss when there is no KL term, and the denominator stays every response
token of the step. Micro-batches are formed from rows sorted by length, so a long-tail step pads
its few long answers together instead of padding every micro-batch to the longest one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import GRPOSection
from .model import Transformer

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
        if self.group_size < 1 or n % self.group_size:
            raise ValueError(f"{n} samples do not split into groups of {self.group_size}")


def group_advantages(rewards: Tensor, group_size: int, eps: float = ADV_EPS) -> Tensor:
    """(r - mean_g) / (std_g + eps) within each group of `group_size`; zero-variance groups give 0.

    rewards: [N] with N divisible by group_size; returns [N] float32.
    """
    r = rewards.float().view(-1, group_size)  # [G, n]
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, unbiased=False) if group_size > 1 else torch.zeros_like(mean)
    adv = (r - mean) / (std + eps)
    adv = torch.where(std > eps, adv, torch.zeros_like(adv))
    return adv.view(-1)


def pad_sequences(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded [B, T] tokens, the response mask [B, T-1] aligned with next-token targets, and prompt lengths.

    mask[b, t] is 1 where token t+1 of row b is a response token (so logits at t score it).
    """
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    T = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), max(T - 1, 1), dtype=torch.float32)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        s = seqs[b]
        tokens[b, : len(s)] = torch.tensor(s, dtype=torch.long)
        if r:
            mask[b, len(p) - 1 : len(p) - 1 + len(r)] = 1.0
    return tokens, mask, torch.tensor([len(p) for p in prompts])


def token_logprobs(model: Transformer, tokens: Tensor, return_hidden: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) for t < T-1: [B, T-1] float32.

    return_hidden: also return the same forward's last hidden states [B, T, H] (ModelOutput.hidden,
    after the final norm: the drafter's training input), so harvesting costs no extra pass.
    """
    out = model(tokens)
    logits = out.logits[:, :-1].float()  # [B, T-1, V]
    target = tokens[:, 1:]
    lp = logits.gather(-1, target[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return (lp, out.hidden) if return_hidden else lp


class GRPOLearner:
    """Policy optimizer + GRPO loss. Lives wherever the driver puts it (here: the driver process)."""

    def __init__(self, policy: Transformer, cfg: GRPOSection, pad_id: int, ref: Transformer | None = None):
        self.policy = policy
        self.cfg = cfg
        self.pad_id = pad_id
        self.last_hidden: list[Tensor] | None = None  # see step(harvest_hidden=True)
        self.optimizer = torch.optim.AdamW(
            [p for p in policy.parameters() if p.requires_grad], lr=cfg.lr, betas=(0.9, 0.999), weight_decay=0.0
        )
        self.ref: Transformer | None = None
        if cfg.kl_coef > 0:
            self.ref = ref if ref is not None else copy.deepcopy(policy)
            self.ref.eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)

    def _micro_batches(self, batch: RolloutBatch, adv: Tensor, every_row: bool) -> list[list[int]]:
        """Row indices per micro-batch: the rows with a gradient (all of them when `every_row`),
        longest first, `grpo.micro_batch` at a time."""
        rows = [i for i in range(len(batch.prompts)) if every_row or adv[i] != 0]
        rows.sort(key=lambda i: -(len(batch.prompts[i]) + len(batch.responses[i])))
        mb = self.cfg.micro_batch
        return [rows[i : i + mb] for i in range(0, len(rows), mb)]

    def _padded(self, batch: RolloutBatch, rows: list[int]) -> tuple[Tensor, Tensor]:
        tokens, mask, _ = pad_sequences([batch.prompts[r] for r in rows], [batch.responses[r] for r in rows], self.pad_id)
        return tokens, mask

    @torch.no_grad()
    def _logprobs(self, model: Transformer, batch: RolloutBatch, rows: list[int]) -> Tensor:
        tokens, _ = self._padded(batch, rows)
        return token_logprobs(model, tokens.to(model.device)).cpu()

    def step(self, batch: RolloutBatch, harvest_hidden: bool = False) -> dict[str, float]:
        """One GRPO update on the step's samples; returns `learner/*` and `rollout/logprob_mismatch`.

        harvest_hidden: keep the forward pass's hidden states in `self.last_hidden` (one
        [len(prompt) + len(response), H] float16 CPU tensor per sample, aligned with prompt +
        response tokens): the drafter buffer's input when the rollout engine returns none (vLLM).
        """
        cfg = self.cfg
        n = len(batch.prompts)
        adv = group_advantages(torch.tensor(batch.rewards), batch.group_size)  # [N]
        # zero-advantage rows still matter with a KL term (its gradient) or when their hidden
        # states are wanted; otherwise their gradient is exactly zero and they are skipped
        chunks = self._micro_batches(batch, adv, every_row=self.ref is not None or harvest_hidden)
        total_tokens = float(sum(len(r) for r in batch.responses))
        denom = max(total_tokens, 1.0)
        # Old log-probs: the policy is unchanged since the rollout and takes ONE optimizer step on
        # this batch, so they are exactly the training forward's own log-probs, detached (ratio 1,
        # the same gradient): no separate scoring pass. The frozen reference needs its own.
        ref = [self._logprobs(self.ref, batch, c) for c in chunks] if self.ref is not None else None
        hidden_by_row: dict[int, Tensor] = {}

        self.policy.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = kl_sum = clipped = mismatch_sum = 0.0
        mismatch_n = 0
        device = self.policy.device
        for i, c in enumerate(chunks):
            tokens, mask = (x.to(device) for x in self._padded(batch, c))
            a = adv[c].to(device)[:, None]  # [b, 1]
            lp, hidden = token_logprobs(self.policy, tokens, return_hidden=True)  # [b, T-1], [b, T, H]
            old_lp = lp.detach()
            if harvest_hidden:  # unpadded [L, H] per row, fp16 on CPU
                for b, row in enumerate(c):
                    L = len(batch.prompts[row]) + len(batch.responses[row])
                    hidden_by_row[row] = hidden[b, :L].detach().to("cpu", torch.float16)
            if batch.rollout_logprobs is not None:  # the engine's log-probs vs ours, on the rows run
                for b, row in enumerate(c):
                    rl = batch.rollout_logprobs[row]
                    if not len(rl):
                        continue
                    sel = old_lp[b][mask[b] > 0][: len(rl)].float().cpu()
                    mismatch_sum += float((sel - torch.as_tensor(rl[: len(sel)], dtype=torch.float32)).abs().sum())
                    mismatch_n += len(sel)
            ratio = torch.exp(lp - old_lp)
            surr1 = ratio * a
            surr2 = torch.clamp(ratio, 1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps) * a
            per_token = -torch.minimum(surr1, surr2)
            if ref is not None:
                # k3 estimator of KL(pi || ref): exp(ref - lp) - (ref - lp) - 1 >= 0, unbiased
                d = ref[i].to(device) - lp
                kl = torch.exp(d) - d - 1.0
                per_token = per_token + cfg.kl_coef * kl
                kl_sum += float((kl.detach() * mask).sum())
            loss = (per_token * mask).sum() / denom
            loss.backward()
            loss_sum += float(loss.detach())
            clipped += float((((ratio - 1.0).abs() > cfg.clip_eps).float() * mask).sum())
        self.last_hidden = [hidden_by_row[r] for r in range(n)] if harvest_hidden else None
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.policy.eval()
        return {
            "learner/loss": loss_sum,
            "learner/grad_norm": float(grad_norm),
            "learner/kl": kl_sum / denom,
            "learner/clip_frac": clipped / denom,
            "learner/adv_abs_mean": float(adv.abs().mean()),
            "learner/tokens": total_tokens,
            "learner/rows_run": float(sum(len(c) for c in chunks)),
            "rollout/logprob_mismatch": mismatch_sum / mismatch_n if mismatch_n else 0.0,
        }

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
