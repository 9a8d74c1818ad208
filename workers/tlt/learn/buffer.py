"""The online drafter buffer: (tokens, target hidden states) of whole responses, for spot training.

Rollout workers (or the learner's log-prob pass) add one record per finished sequence; idle
workers draw padded batches from it to train the drafter:

    buf = DrafterBuffer(max_tokens=200_000)
    buf.add(tokens, hidden, response_start=len(prompt_ids), step=rl_step)   # hidden: [L, H]
    for batch in buf.batches(batch_tokens=2048, rng=random.Random(0)):
        trainer.step(batch)

A record is the whole sequence (prompt + response, never truncated to its first N tokens) with
the target's last-layer hidden state (after the final norm) of every position, stored float16 on
the CPU. The loss mask covers the positions i whose *next* hidden state h_{i+1} belongs to the
response (i >= response_start - 1): the first response token is sampled by the target from the
prompt's last state, and the drafter drafts everything after it. Prompt positions stay in the
batch as attention context.

Eviction policy (when the token budget is exceeded): records of older RL steps go first, and within
one step the shortest go first. So the buffer holds this step's records plus the *longest* ones of
the previous steps: the current step's finished sequences are biased short (the long ones are
still decoding when spot training starts), and the long tail is exactly where the drafter is used.
A single record longer than the whole budget is refused (counted in `stats()["refused"]`).

The buffer is plain data (tensors, ints, lists): `state_dict()` / `from_state_dict()` ship it
between Ray actors, and `extend()` merges records harvested by several workers.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Sequence

import torch
from torch import Tensor

log = logging.getLogger(__name__)


@dataclass
class Record:
    tokens: Tensor  # [L] int64, prompt + response
    hidden: Tensor  # [L, H] float16, target last-layer states after the final norm
    response_start: int  # index of the first response token
    step: int  # RL step that produced it

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def trainable(self) -> int:
        return trainable_tokens(len(self), self.response_start)


def trainable_tokens(length: int, response_start: int) -> int:
    """Positions of a sequence with a loss: i in [response_start - 1, length - 2]."""
    return max(0, length - max(response_start, 1))


class Batch(NamedTuple):
    tokens: Tensor  # [B, T] int64, right-padded with 0
    hidden: Tensor  # [B, T, H] float16 (cast to the drafter's dtype at use)
    mask: Tensor  # [B, T] bool: position i has a loss (predicts h_{i+1} of a response token)
    lengths: Tensor  # [B] int64 real lengths

    @property
    def num_loss_tokens(self) -> int:
        return int(self.mask.sum())


class DrafterBuffer:
    """Records bounded by `max_tokens` (sum of sequence lengths); see the module doc for eviction."""

    def __init__(self, max_tokens: int = 200_000):
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        self.max_tokens = max_tokens
        self.records: list[Record] = []
        self.num_tokens = 0
        self.evicted = 0
        self.refused = 0

    def __len__(self) -> int:
        return len(self.records)

    def add(self, tokens: Sequence[int] | Tensor, hidden: Tensor, response_start: int, step: int) -> bool:
        """Add one whole sequence; returns False when it was refused (no response or over budget).

        tokens: [L] ids; hidden: [L, H] target states for the same positions; response_start:
        index of the first response token (the prompt length).
        """
        tokens = torch.as_tensor(tokens, dtype=torch.long).detach().cpu().reshape(-1)
        hidden = hidden.detach()
        if hidden.dim() != 2 or hidden.shape[0] != tokens.shape[0]:
            raise ValueError(f"hidden must be [L, H] with L = len(tokens) = {tokens.shape[0]}, got {tuple(hidden.shape)}")
        if not 0 <= response_start <= tokens.shape[0]:
            raise ValueError(f"response_start {response_start} outside 0..{tokens.shape[0]}")
        rec = Record(tokens.clone(), hidden.to(device="cpu", dtype=torch.float16).contiguous(), int(response_start), int(step))
        if rec.trainable == 0:
            return False
        if len(rec) > self.max_tokens:
            self.refused += 1
            log.warning("drafter buffer: refused a %d-token record (budget %d tokens)", len(rec), self.max_tokens)
            return False
        self.records.append(rec)
        self.num_tokens += len(rec)
        self._evict()
        return True

    def extend(self, records: Sequence[Record]) -> None:
        """Merge records from another buffer (e.g. harvested by another worker)."""
        for r in records:
            self.add(r.tokens, r.hidden, r.response_start, r.step)

    def _evict(self) -> None:
        if self.num_tokens <= self.max_tokens:
            return
        # oldest step first, within a step shortest first; ties: oldest insertion first
        order = sorted(range(len(self.records)), key=lambda i: (self.records[i].step, len(self.records[i]), i))
        drop: set[int] = set()
        for i in order:
            if self.num_tokens <= self.max_tokens:
                break
            drop.add(i)
            self.num_tokens -= len(self.records[i])
            self.evicted += 1
        self.records = [r for i, r in enumerate(self.records) if i not in drop]

    def clear(self) -> None:
        self.records.clear()
        self.num_tokens = 0

    def stats(self) -> dict[str, Any]:
        steps = sorted({r.step for r in self.records})
        return {"records": len(self.records), "tokens": self.num_tokens, "trainable_tokens": self.trainable_tokens,
                "steps": steps, "evicted": self.evicted, "refused": self.refused}

    @property
    def trainable_tokens(self) -> int:
        return sum(r.trainable for r in self.records)

    def batches(self, batch_tokens: int, rng: random.Random | None = None) -> Iterator[Batch]:
        """One epoch of padded batches, each at most `batch_tokens` padded tokens (B * T).

        Records are grouped by similar length (shuffled within equal lengths) to waste little
        padding, and the batches come out in a random order. A record longer than `batch_tokens`
        gets a batch of its own (whole responses are never cut).
        """
        rng = rng or random.Random(0)
        idx = list(range(len(self.records)))
        rng.shuffle(idx)
        idx.sort(key=lambda i: len(self.records[i]))  # stable: shuffled among equal lengths
        groups: list[list[int]] = []
        cur: list[int] = []
        for i in idx:
            longest = len(self.records[i])  # ascending order: the newcomer is the longest
            if cur and (len(cur) + 1) * longest > batch_tokens:
                groups.append(cur)
                cur = []
            cur.append(i)
        if cur:
            groups.append(cur)
        rng.shuffle(groups)
        for g in groups:
            yield collate([self.records[i] for i in g])

    # --- shipping between actors ---------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "evicted": self.evicted,
            "refused": self.refused,
            "records": [{"tokens": r.tokens, "hidden": r.hidden, "response_start": r.response_start, "step": r.step}
                        for r in self.records],
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "DrafterBuffer":
        buf = cls(state["max_tokens"])
        buf.evicted = state.get("evicted", 0)
        buf.refused = state.get("refused", 0)
        for r in state["records"]:
            buf.records.append(Record(torch.as_tensor(r["tokens"], dtype=torch.long),
                                      torch.as_tensor(r["hidden"]).to(torch.float16), r["response_start"], r["step"]))
            buf.num_tokens += len(buf.records[-1])
        buf._evict()
        return buf


def collate(records: Sequence[Record]) -> Batch:
    """Right-pad records into a Batch; mask[b, i] is True for i in [response_start - 1, L - 2]."""
    B = len(records)
    T = max(len(r) for r in records)
    H = records[0].hidden.shape[1]
    tokens = torch.zeros(B, T, dtype=torch.long)
    hidden = torch.zeros(B, T, H, dtype=torch.float16)
    mask = torch.zeros(B, T, dtype=torch.bool)
    lengths = torch.zeros(B, dtype=torch.long)
    for b, r in enumerate(records):
        L = len(r)
        tokens[b, :L] = r.tokens
        hidden[b, :L] = r.hidden
        mask[b, max(r.response_start - 1, 0): L - 1] = True
        lengths[b] = L
    return Batch(tokens, hidden, mask, lengths)
