"""Supervised warm-up of the tiny policy trained from scratch on the built-in long-tail task.

RL needs a policy that sometimes gets the answer right; a randomly initialised model never does.
A few hundred steps of supervised fine-tuning on gold solutions get it there (accuracy well above
zero, but not perfect, so RL still has something to learn):

    python -m workers.tlt.learn.sft --steps 300 --out var/models/tiny-longtail

    model = build_tiny_model(cfg.model, vocab_size=18, bos_id=1, eos_id=2)
    losses = sft(model, examples, steps=300, lr=3e-3, batch_size=32, seed=0)

The output folder is a Hugging Face folder (config.json, model.safetensors, tokenizer.json) that
`Transformer.from_pretrained` and the trainer's `source: hf` read.

`generate_ids` decodes through the rollout engine (evaluations and tests).
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import time
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import ModelSection
from ..models.transformer import ModelConfig, Transformer, init_weights

log = logging.getLogger(__name__)

Example = tuple[Sequence[int], Sequence[int]]  # (prompt_ids, response_ids ending in EOS)

# Who hears of every SFT step besides sft()'s own on_progress: set for a block by
# reporting_sft_steps, so a caller several calls up (the trainer's setup progress, through the
# policy-folder cache) needs no callback threaded through the functions in between.
_step_reporter: ContextVar[Callable[[int, int, float], None] | None] = ContextVar("sft_step_reporter", default=None)


@contextmanager
def reporting_sft_steps(report: Callable[[int, int, float], None]) -> Iterator[None]:
    """Within the block, every sft() step calls report(step, steps, loss)."""
    token = _step_reporter.set(report)
    try:
        yield
    finally:
        _step_reporter.reset(token)


def build_tiny_model(cfg: ModelSection, vocab_size: int, bos_id: int | None, eos_id: int | None,
                     max_positions: int = 512, seed: int = 0) -> Transformer:
    """A small Llama-family model (tied embeddings, SwiGLU, GQA, RoPE) initialised from `seed`."""
    mc = ModelConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=3 * cfg.hidden_size,  # SwiGLU: ~8/3 x in Llama; 3 x keeps it a round number
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        architecture="LlamaForCausalLM",
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        extra={"hidden_act": "silu"},
    )
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = Transformer(mc)
    init_weights(model)
    torch.random.set_rng_state(gen_state)
    return model


def collate_examples(examples: Sequence[Example], pad_id: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """inputs [B, T], targets [B, T], loss mask [B, T]: next-token targets on response tokens only."""
    seqs = [list(p) + list(r) for p, r in examples]
    T = max(len(s) for s in seqs) - 1
    B = len(seqs)
    inputs = torch.full((B, T), pad_id, dtype=torch.long)
    targets = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, ((p, _), s) in enumerate(zip(examples, seqs)):
        n = len(s) - 1
        inputs[b, :n] = torch.tensor(s[:-1])
        targets[b, :n] = torch.tensor(s[1:])
        mask[b, len(p) - 1: n] = True  # position i predicts token i + 1; response starts at len(p)
    return inputs, targets, mask


def response_loss(model: Transformer, inputs: Tensor, targets: Tensor, mask: Tensor, reduction: str = "mean") -> Tensor:
    logits = model(inputs).logits  # [B, T, V]
    return F.cross_entropy(logits[mask].float(), targets[mask], reduction=reduction)


def length_groups(examples: Sequence[Example], micro_tokens: int) -> list[list[Example]]:
    """Split a batch into length-sorted micro-batches of at most `micro_tokens` padded tokens.

    Long-tailed lengths make one padded batch mostly padding; sorted micro-batches with gradient
    accumulation give the same gradient at a fraction of the cost.
    """
    ordered = sorted(examples, key=lambda e: len(e[0]) + len(e[1]))
    groups: list[list[Example]] = []
    cur: list[Example] = []
    for e in ordered:
        if cur and (len(cur) + 1) * (len(e[0]) + len(e[1])) > micro_tokens:
            groups.append(cur)
            cur = []
        cur.append(e)
    return groups + [cur] if cur else groups


def sft(model: Transformer, examples: Sequence[Example], steps: int, lr: float = 3e-3, batch_size: int = 32,
        seed: int = 0, on_progress: Callable[[int, float], None] | None = None, warmup_frac: float = 0.05,
        weight_decay: float = 0.01, grad_clip: float = 1.0, pad_id: int = 0, micro_tokens: int = 1024) -> list[float]:
    """Train on `examples` for `steps` AdamW steps; returns the loss of every step.

    Each step draws `batch_size` examples with a seeded RNG (same seed, same run); the loss is the
    next-token cross-entropy on response tokens (mean over the batch's response tokens, computed in
    length-sorted micro-batches of at most `micro_tokens` padded tokens). Learning rate: linear warm-up over `warmup_frac`
    of the steps, then cosine decay to 10%.
    """
    if not examples:
        raise ValueError("no examples")
    rng = random.Random(seed)
    device = model.device
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95),
                            weight_decay=weight_decay)
    warm = max(1, int(warmup_frac * steps))

    def lr_at(s: int) -> float:
        if s < warm:
            return lr * (s + 1) / warm
        t = (s - warm) / max(1, steps - warm)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    model.train()
    losses: list[float] = []
    report = _step_reporter.get()
    for s in range(steps):
        batch = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
        n_tokens = sum(len(r) for _, r in batch)
        for g in opt.param_groups:
            g["lr"] = lr_at(s)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for group in length_groups(batch, micro_tokens):
            inputs, targets, mask = (t.to(device) for t in collate_examples(group, pad_id))
            loss = response_loss(model, inputs, targets, mask, reduction="sum") / n_tokens
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        losses.append(total)
        if on_progress is not None:
            on_progress(s + 1, losses[-1])
        if report is not None:
            report(s + 1, steps, losses[-1])
    model.eval()
    return losses


def generate_ids(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_ids: Sequence[int],
                 temperature: float = 0.0, seed: int = 0) -> list[list[int]]:
    """Responses (ids, ending at and including EOS when one was produced) from the rollout engine."""
    from ..rollout.engine import generate
    from ..rollout.sampling import SamplingParams

    res = generate(model, prompts, SamplingParams(temperature=temperature), max_new_tokens=max_new_tokens,
                   eos_ids=eos_ids, seed=seed, harvest_hidden=False)
    return [list(map(int, t)) for t in res.tokens]


def evaluate_longtail(model: Transformer, n: int = 64, seed: int = 12345, max_new_tokens: int = 192) -> float:
    """Greedy accuracy (mean reward) of `model` on `n` fresh long-tail prompts."""
    from ..tasks.longtail import LongTailTask

    task = LongTailTask()
    prompts = task.sample_prompts(n, random.Random(seed))
    responses = generate_ids(model, [p.ids for p in prompts], max_new_tokens, [task.eos_id])
    return sum(task.reward(p, r) for p, r in zip(prompts, responses)) / n


def train_tiny_longtail(cfg: ModelSection, steps: int, out: str | Path | None = None, lr: float = 3e-3,
                        batch_size: int = 32, num_examples: int = 20_000, seed: int = 0,
                        on_progress: Callable[[int, float], None] | None = None) -> tuple[Transformer, list[float]]:
    """Build the tiny model, SFT it on gold long-tail solutions, optionally save it to `out`."""
    from ..tasks.longtail import BOS, EOS, LongTailTask, save_tokenizer

    task = LongTailTask()
    tok = task.tokenizer
    model = build_tiny_model(cfg, tok.get_vocab_size(), tok.token_to_id(BOS), tok.token_to_id(EOS), seed=seed)
    examples = task.sft_examples(num_examples, seed=seed)
    losses = sft(model, examples, steps, lr=lr, batch_size=batch_size, seed=seed, on_progress=on_progress,
                 pad_id=task.pad_id)
    if out is not None:
        model.save_pretrained(out)
        save_tokenizer(tok, out)
    return model, losses


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    parser = argparse.ArgumentParser(description="SFT the tiny model on the long-tail task and save it.")
    parser.add_argument("--steps", type=int, default=ModelSection().sft_steps, help="AdamW steps (default %(default)s)")
    parser.add_argument("--out", default="var/models/tiny-longtail", help="output folder (default %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=ModelSection().hidden_size)
    parser.add_argument("--layers", type=int, default=ModelSection().num_layers)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--eval", type=int, default=128, help="prompts for the greedy accuracy check (0: skip)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = ModelSection(hidden_size=args.hidden, num_layers=args.layers)
    bar = tqdm(total=args.steps, desc="sft", unit="step")

    def progress(step: int, loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")

    t0 = time.monotonic()
    model, losses = train_tiny_longtail(cfg, args.steps, args.out, lr=args.lr, batch_size=args.batch_size,
                                        seed=args.seed, on_progress=progress)
    bar.close()
    log.info("trained %d steps in %.0f s; loss %.3f -> %.3f; saved to %s", args.steps, time.monotonic() - t0,
             losses[0], losses[-1], args.out)
    if args.eval:
        log.info("greedy accuracy on %d fresh prompts: %.3f", args.eval, evaluate_longtail(model, args.eval))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
