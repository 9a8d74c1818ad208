"""Drafter training: the EAGLE loss, the preemptible spot trainer, parameter averaging.

    trainer = DrafterTrainer(drafter, cfg.drafter)              # drafter: warmed up (drafter_warmup.py)
    ran = trainer.train(buffer, max_steps=50, should_stop=rollout_finished.is_set)   # spot training
    ckpt = trainer.state_dict()                                 # trainable weights + optimizer only
    merged = average_state_dicts([t.drafter_state() for t in trainers])   # one drafter for all

Loss at every position i whose next state h_{i+1} is a response position (buffer mask):

    pred   = drafter(h_i, x_{i+1})                                          # ~ h_{i+1}
    loss   = w_h * SmoothL1(pred, h_{i+1})                                  # w_h = 1.0
           + w_t * CE(softmax(lm_head(h_{i+1})), log_softmax(lm_head(pred)))  # w_t = 0.1, soft labels

averaged over the masked positions (SmoothL1 also over the H features). The target's embedding and
LM head are used frozen: their weights are detached here, so training the drafter never writes
gradients into a policy that shares the process.

Unrolled training (`unroll` N > 1, EAGLE-3's "training-time test"): when drafting, step m > 1
reads the drafter's OWN prediction of the previous state, not the target's, and a drafter trained
only on target states drifts there (acceptance drops at every position after the first). So the
loss also runs draft steps 2..N as they run at decoding time: step m at position i reads step
m-1's prediction at i-1 and attends to step-1 keys up to i-m+1 (target states) plus the keys of
steps 2..m on its own chain (see `unrolled_mask`); the N steps' losses are averaged.

Preemption: `train` checks `should_stop()` before every micro-batch. An optimizer step is applied
only after all of its `accum` micro-batches; a stop in between discards the partial gradients, so
the weights are always those of a whole number of steps.
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .buffer import Batch, DrafterBuffer
from ..models.drafter import Drafter
from ..models.linear import Linear

if TYPE_CHECKING:  # the config needs pydantic; the loss alone (bench rollout on a bare GPU node) does not
    from ..config import DrafterSection

log = logging.getLogger(__name__)


def unrolled_mask(T: int, step: int, device=None) -> Tensor:
    """[T, step*T] attention mask of draft step `step` (1-based) in unrolled training.

    Cache slot (l-1)*T + j holds draft step l's key at position j. The query of step m at position
    i is the m-th draft step after the target state h_{i-m+1}: it sees step 1's keys at positions
    <= i-m+1 (computed from target states, as the drafter's cache holds them when drafting) and
    step l's key at position i-m+l for l = 2..m (its own chain). Step 1 is plain causal attention.
    """
    slot = torch.arange(step * T, device=device)
    level, pos = slot // T + 1, slot % T  # [S]
    i = torch.arange(T, device=device)[:, None]  # [T, 1]
    return torch.where(level == 1, pos <= i - step + 1, pos == i - step + level)


def unrolled_predictions(drafter: Drafter, hidden: Tensor, tokens: Tensor, unroll: int = 1) -> list[Tensor]:
    """Draft steps 1..unroll at every position: preds[m-1][:, i] ~ h_{i+1} (valid for i >= m-1).

    hidden: [B, T+1, H] target states; tokens: [B, T+1] ids. Step 1 reads the target states.
    """
    if unroll <= 1:
        return [drafter(hidden[:, :-1], tokens[:, 1:])]
    B, T = tokens.shape[0], tokens.shape[1] - 1
    cache = drafter.new_cache(B, unroll * T, differentiable=True)
    positions = torch.arange(T, device=tokens.device).expand(B, T)
    preds, h_in = [], hidden[:, :-1]
    for m in range(1, unroll + 1):
        step_mask = unrolled_mask(T, m, tokens.device).expand(B, T, m * T)
        preds.append(drafter(h_in, tokens[:, 1:], positions, cache, positions + (m - 1) * T, step_mask))
        h_in = torch.cat([preds[-1][:, :1], preds[-1][:, :-1]], dim=1)  # step m+1 at i reads step m at i-1
    return preds


def drafter_loss(drafter: Drafter, batch: Batch, hidden_weight: float = 1.0, token_weight: float = 0.1,
                 vocab: Tensor | None = None, unroll: int = 1, feature_noise: float = 0.0,
                 generator: torch.Generator | None = None) -> tuple[Tensor, dict[str, float]]:
    """The EAGLE loss on the masked positions of `batch`, over `unroll` draft steps; returns (loss, metrics).

    `vocab` (sorted token ids) restricts the soft cross-entropy and the accuracy to those tokens,
    e.g. the reduced draft vocabulary the drafter will propose from (None: the whole vocabulary).
    `feature_noise` a > 0 adds U(-a, a) times each state's RMS to the states the drafter reads (drawn
    from `generator`); the states it must predict stay clean.
    metrics["accuracy"] is draft step 1's top-1 agreement; "accuracy_<m>" that of step m > 1.
    """
    dtype = drafter.fc.weight.dtype
    device = drafter.fc.weight.device
    hidden = batch.hidden.to(device=device, dtype=dtype)  # [B, T, H]
    hidden_in = hidden
    if feature_noise > 0:
        u = torch.rand(hidden.shape, generator=generator, device=device, dtype=torch.float32)
        h32 = hidden.float()
        rms = h32.pow(2).mean(-1, keepdim=True).sqrt()
        hidden_in = (h32 + (2 * u - 1) * (feature_noise * rms)).to(dtype)
    tokens = batch.tokens.to(device)
    mask = batch.mask[:, :-1].to(device)  # [B, T-1]: position i predicts h_{i+1}
    true = hidden[:, 1:]
    # the target's LM head, detached: same numbers, no gradient into a policy sharing the process;
    # its rows restricted to `vocab`, through the kernel tuned for the whole head's many-row products
    target_head = drafter.target.lm_head
    weight = target_head.weight.detach()
    head = Linear.frozen(weight if vocab is None else weight.index_select(0, vocab.to(weight.device)))
    head.bulk_kernel = target_head.bulk_kernel

    preds = unrolled_predictions(drafter, hidden_in, tokens, unroll)
    metrics: dict[str, float] = {}
    losses = []
    for m, pred in enumerate(preds, start=1):
        valid = mask.clone()
        valid[:, : m - 1] = False  # step m at i needs a chain back to the target state at i-m+1 >= 0
        pred_m, true_m = pred[valid], true[valid]  # [N, H]
        if pred_m.shape[0] == 0:
            losses.append(pred.sum() * 0.0)
            continue
        hidden_loss = F.smooth_l1_loss(pred_m.float(), true_m.float())
        with torch.no_grad():
            target_logits = head(true_m).float()
            target_p = torch.softmax(target_logits, dim=-1)
        pred_logits = head(pred_m).float()
        token_loss = -(target_p * torch.log_softmax(pred_logits, dim=-1)).sum(-1).mean()
        losses.append(hidden_weight * hidden_loss + token_weight * token_loss)
        with torch.no_grad():
            acc = float((pred_logits.argmax(-1) == target_logits.argmax(-1)).float().mean())
        if m == 1:
            metrics.update(hidden_loss=float(hidden_loss.detach()), token_loss=float(token_loss.detach()),
                           accuracy=acc)
        else:
            metrics[f"accuracy_{m}"] = acc
    loss = torch.stack(losses).mean()
    n = int(mask.sum())
    if n == 0:
        return loss, {"loss": 0.0, "hidden_loss": 0.0, "token_loss": 0.0, "accuracy": 0.0, "tokens": 0}
    return loss, {"loss": float(loss.detach()), **metrics, "tokens": n}


class DrafterTrainer:
    """AdamW on the drafter's trainable weights (fc.*, layers.0.*), preemptible between micro-batches.

    A bfloat16 (or float16) drafter, as a bfloat16 rollout drafts with, keeps float32 master weights here:
    forward and backward run in the drafter's dtype, AdamW steps the float32 copies, and the drafter
    gets them rounded back. In the drafter's own dtype AdamW's small updates would round to nothing
    (bfloat16 has 8 significant bits). Weights loaded into the drafter from outside (a merged
    drafter, a checkpoint) become the masters at the next step."""

    def __init__(self, drafter: Drafter, cfg: DrafterSection | None = None, accum: int = 1,
                 grad_clip: float = 1.0, weight_decay: float = 0.0, seed: int = 0):
        self.drafter = drafter
        if cfg is None:
            from ..config import DrafterSection

            cfg = DrafterSection()
        self.cfg = cfg
        self.accum = max(1, accum)
        self.grad_clip = grad_clip
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self._mixed = any(p.dtype != torch.float32 for p in self.params)
        self.masters = [p.detach().float() for p in self.params] if self._mixed else self.params
        self._master_of: list[int] = [p._version for p in self.params]  # drafter versions the masters hold
        self.opt = torch.optim.AdamW(self.masters, lr=self.cfg.lr, betas=(0.9, 0.95), weight_decay=weight_decay)
        self.steps_done = 0
        self.last_metrics: dict[str, float] = {}
        self.rng = random.Random(seed)
        self.noise = torch.Generator(drafter.fc.weight.device).manual_seed(seed)  # feature_noise's draws
        self._vocab_cache: tuple[tuple, Tensor] | None = None

    def _loss(self, batch: Batch) -> tuple[Tensor, dict[str, float]]:
        return drafter_loss(self.drafter, batch, self.cfg.hidden_loss_weight, self.cfg.token_loss_weight,
                            vocab=self._vocab(), unroll=self.cfg.unroll, feature_noise=self.cfg.feature_noise,
                            generator=self.noise)

    def _vocab(self) -> Tensor | None:
        """The soft cross-entropy's vocabulary: drafter.train_vocab most frequent tokens of the warm-up
        answers (their counts travel with the drafter), recomputed when the counts change."""
        counts = self.drafter.token_counts
        if not 0 < self.cfg.train_vocab < counts.shape[0] or not bool(counts.any()):
            return None
        key = (counts.data_ptr(), counts._version)
        if self._vocab_cache is None or self._vocab_cache[0] != key:
            from ..rollout.speculative import draft_vocab_ids

            eos = self.drafter.config.eos_ids
            self._vocab_cache = (key, draft_vocab_ids(counts.float().cpu(), self.cfg.train_vocab, eos).to(counts.device))
        return self._vocab_cache[1]

    def _apply(self) -> None:
        if self._mixed:
            self._grads_to_masters()
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.masters, self.grad_clip)
        self.opt.step()
        if self._mixed:
            self._masters_to_drafter()
        self._zero_grad()
        self.steps_done += 1

    def _zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        for p in self.params:  # the drafter's own (bfloat16) gradients, where masters take the steps
            p.grad = None

    @torch.no_grad()
    def _grads_to_masters(self) -> None:
        """Gradients to the float32 masters; a weight changed from outside since our last step first."""
        for i, (p, m) in enumerate(zip(self.params, self.masters)):
            if p._version != self._master_of[i]:
                m.copy_(p)
            m.grad = None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def _masters_to_drafter(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.copy_(m)
        self._master_of = [p._version for p in self.params]

    def step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on one batch; returns {loss, accuracy, hidden_loss, token_loss, tokens}."""
        self.drafter.train()
        self._zero_grad()
        loss, metrics = self._loss(batch)
        loss.backward()
        self._apply()
        self.last_metrics = metrics
        return metrics

    def train(self, buffer: DrafterBuffer, max_steps: int, should_stop: Callable[[], bool] = lambda: False,
              on_step: Callable[[int, dict[str, float]], None] | None = None) -> int:
        """Up to `max_steps` optimizer steps over the buffer (epochs repeat); returns steps applied.

        `should_stop()` is polled before every micro-batch; when it turns true the trainer returns
        at once, dropping the gradients of an unfinished step (weights stay whole-step).
        """
        if max_steps <= 0 or buffer.trainable_tokens == 0:
            return 0
        self.drafter.train()
        self._zero_grad()
        ran = 0
        micro = 0
        acc: list[dict[str, float]] = []
        while ran < max_steps:
            for batch in buffer.batches(self.cfg.batch_tokens, self.rng):
                if should_stop():
                    self._zero_grad()  # a half-accumulated step is discarded
                    return ran
                loss, metrics = self._loss(batch)
                (loss / self.accum).backward()
                acc.append(metrics)
                micro += 1
                if micro % self.accum == 0:
                    self._apply()
                    ran += 1
                    self.last_metrics = _mean_metrics(acc)
                    acc = []
                    if on_step is not None:
                        on_step(self.steps_done, self.last_metrics)
                    if ran >= max_steps:
                        break
        return ran

    # --- checkpoints: trainable weights + optimizer only ----------------------------------------

    def drafter_state(self) -> dict[str, Tensor]:
        """The trainable weights (fc.*, layers.0.*) and the token counts, detached CPU copies."""
        return {k: v.detach().cpu().clone() for k, v in self.drafter.state_dict().items()}

    def state_dict(self) -> dict:
        return {"drafter": self.drafter_state(), "optimizer": self.opt.state_dict(), "steps_done": self.steps_done}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's trainer state, or the warm-up's (drafter_warmup.warmup_optimizer): AdamW's
        moments go on from where they were, at this trainer's learning rate."""
        self.drafter.load_state_dict(state["drafter"], strict=True)
        if state.get("optimizer") is not None:
            self.opt.load_state_dict(state["optimizer"])
            for group in self.opt.param_groups:  # a saved group carries its own rate (the warm-up's last)
                group["lr"] = self.cfg.lr
        self.steps_done = state.get("steps_done", 0)


def _mean_metrics(ms: list[dict[str, float]]) -> dict[str, float]:
    if len(ms) == 1:
        return dict(ms[0])
    tokens = sum(m["tokens"] for m in ms) or 1
    keys = {k for m in ms for k in m if k != "tokens"}  # an empty batch reports no per-step accuracies
    out = {k: sum(m.get(k, 0.0) * m["tokens"] for m in ms) / tokens for k in sorted(keys)}
    out["tokens"] = tokens
    return out


def average_state_dicts(states: Sequence[dict[str, Tensor]], weights: Sequence[float] | None = None) -> dict[str, Tensor]:
    """Element-wise (weighted) mean of drafter weight dicts with identical keys and shapes.

    Used to merge the drafters that several idle workers trained from the same start into ONE
    drafter for the next step. Floating tensors are averaged in float32 and cast back; other
    tensors are taken from the first dict. Optimizer states are not averaged (each worker keeps its own).
    """
    if not states:
        raise ValueError("nothing to average")
    keys = set(states[0])
    for s in states[1:]:
        if set(s) != keys:
            raise ValueError(f"state dicts differ in keys: {sorted(keys ^ set(s))[:5]}")
    w = torch.tensor(list(weights) if weights is not None else [1.0] * len(states), dtype=torch.float32)
    if w.shape[0] != len(states) or float(w.sum()) <= 0:
        raise ValueError("need one positive-sum weight per state dict")
    w = w / w.sum()
    out: dict[str, Tensor] = {}
    for k in states[0]:
        first = states[0][k]
        if not first.is_floating_point():
            out[k] = first.clone()
            continue
        acc = torch.zeros(first.shape, dtype=torch.float32, device=first.device)
        for wi, s in zip(w, states):
            if s[k].shape != first.shape:
                raise ValueError(f"{k}: shape {tuple(s[k].shape)} != {tuple(first.shape)}")
            acc += wi * s[k].to(device=first.device, dtype=torch.float32)
        out[k] = acc.to(first.dtype)
    return out
