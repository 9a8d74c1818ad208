"""The drafter's offline warm-up: one recipe, used by the trainer (before step 1) and the rollout
bench, cached across runs like the SFT'd tiny model.

    drafter, info = warmup_drafter(policy, task, cfg.drafter, sampling=sampling_params(cfg.rollout),
                                   policy_key=weights_digest(policy_folder), seed=cfg.run.seed)
    # its two halves (bench coupling --recipes trains other recipes on the same cached answers):
    answers = warmup_answers(policy, task, cfg.drafter, sampling=..., policy_key=..., max_new_tokens=...)
    drafter, info = fit_drafter(policy, answers, cfg.drafter, eos_ids=...)

Data. The policy answers `drafter.warmup_prompts` training prompts of the run's task, sampled as
the rollout samples (so the drafter learns the text RL will draw), each answer cut at
`drafter.warmup_max_new_tokens` (most of a runaway answer's decode time is its end); the first
`drafter.warmup_continue` of the cut ones are then decoded on, together, to the rollout's cap: its
long tail decodes there, and a drafter that never saw those late positions agrees least on them.
The rollout engine harvests the target's hidden state of every position while it decodes, so the
(token, hidden state) pairs cost no extra pass (a continued answer's earlier states: its prefill's).
The answers are cached (tokens and float16 states, keyed by the policy's weights, the task and
these settings): another training recipe, or another run of the same preset, reuses them.

Training (EAGLE's loss, drafter_train.drafter_loss): AdamW (0.9, 0.95), `drafter.warmup_lr` warmed
up linearly over the first 5% of `drafter.warmup_steps` and then cosine-decayed to 5% of it,
gradient clip 1, batches of `drafter.warmup_batch_tokens` padded tokens, the soft cross-entropy
over the `drafter.train_vocab` most frequent tokens of the answers (plus EOS; 0: the whole
vocabulary). The token frequencies go with the drafter (`Drafter.token_counts`): the reduced
draft vocabulary (spec.draft_vocab) and spot training's vocabulary are chosen from them.
AdamW's final state is cached with the drafter (`warmup_optimizer`): spot training on the
workers resumes from it rather than from fresh moments.

Cost (first run; later runs load the cache in a second): printed as it goes and returned in
`info` ("generate_s", "train_s"). For SmolLM2-135M on 2 CPU cores see README "Benchmarks".
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import Tensor

from .buffer import DrafterBuffer
from ..memory import return_freed_memory
from ..models.drafter import Drafter
from ..models.linear import tune
from .drafter_train import drafter_loss
from ..models.transformer import Transformer
from ..rollout.sampling import SamplingParams
from ..rollout.speculative import draft_vocab_ids

if TYPE_CHECKING:  # pydantic: the bench on a bare GPU node passes a plain namespace instead
    from ..config import DrafterSection

log = logging.getLogger(__name__)

RECIPE_VERSION = 2  # bump when the recipe changes, so cached drafters are trained again (2: AdamW state kept)
OPTIMIZER_FILE = "optimizer.pt"  # beside drafter.safetensors: the warm-up's AdamW state (warmup_optimizer)
# answers decoded together (finished rows leave the batch; the KV cache of 128 x 330 SmolLM2 positions is ~2 GB):
# the preset's first 256 warm-up prompts on 2 AVX2 EPYC cores decoded 141 tokens/s at 128 rows, 129 at 64,
# 107 at 32 and 114 at 256 (2026-12-07): most answers are short, and a small batch soon runs on a few rows
GEN_BATCH = 128
# answers decoded on together (continue_answers): on 2 AVX2 EPYC cores 32 rows of SmolLM2 decoded 192
# tokens/s against 155 at 128 rows (2026-12-07), and their KV cache at a 1024-token cap is a quarter's
CONTINUE_BATCH = 32
Progress = Callable[[int, int, str], None]  # (done, total, what): `what` names the phase (progress_scale)


def progress_scale(cfg: "DrafterSection") -> tuple[dict[str, int], int]:
    """One count over the whole warm-up: where each phase's count starts, and where the last ends.
    The phases run in this order and count at most these many (continued answers: those that ran to
    the cap, at most warmup_continue), so a caller's count never goes back between phases."""
    sizes = {"answers": cfg.warmup_prompts, "continued answers": cfg.warmup_continue, "steps": cfg.warmup_steps}
    starts = dict(zip(sizes, itertools.accumulate([0, *sizes.values()])))
    return starts, sum(sizes.values())

Answer = tuple[Tensor, Tensor, int]  # tokens [L] int64, hidden [L, H] float16 (h_i pairs with token i+1), prompt length


def weights_digest(folder: str | Path) -> str:
    """A short content hash of a model folder's weights (the cache key of what was derived from them)."""
    h = hashlib.sha256()
    for f in sorted(Path(folder).glob("*.safetensors")):
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()[:16]


def _key(data: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:12]


def lr_at(step: int, total: int, base: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine from `base` down to 5% of it."""
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return base * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))


def generate_answers(policy: Transformer, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                     max_new_tokens: int, eos_ids: Sequence[int], seed: int,
                     on_progress: Progress | None = None, batch: int = GEN_BATCH,
                     what: str = "answers") -> list[Answer]:
    """The policy's own answers with the hidden states the engine harvested while decoding them
    (a prompt's states too: its prefill's)."""
    from ..rollout.engine import generate

    out: list[Answer] = []
    for i in range(0, len(prompts), batch):
        chunk = [list(p) for p in prompts[i:i + batch]]
        res = generate(policy, chunk, sampling, max_new_tokens=max_new_tokens, eos_ids=eos_ids, seed=seed + i,
                       harvest_hidden=True, hidden_dtype=torch.float16)
        for p, toks, hid in zip(chunk, res.tokens, res.hidden):
            seq = torch.tensor(p + list(toks), dtype=torch.long)
            out.append((seq[:hid.shape[0]], hid, len(p)))  # the last token was never fed to the target
        if on_progress is not None:
            on_progress(min(i + batch, len(prompts)), len(prompts), what)
    return out


def continue_answers(policy: Transformer, answers: list[Answer], count: int, cap: int, sampling: SamplingParams,
                     max_new_tokens: int, eos_ids: Sequence[int], seed: int,
                     on_progress: Progress | None = None) -> list[Answer]:
    """`answers` with the first `count` of those cut at `cap` response tokens decoded on to
    `max_new_tokens`, from their stored text (prompt and response but its last token) as a prompt.

    A drafter trained on cut answers agrees least where the long tail decodes, past the cut
    (README "Past the warm-up's cap"), and decoding only the answers that ran to the cap, together, buys
    those late positions at a full batch's rate. (An answer whose EOS fell exactly on the cap is
    continued too: its prefix lacks the EOS, and the policy draws that token afresh.)"""
    cut = [k for k, (toks, _, plen) in enumerate(answers) if len(toks) - plen >= cap - 1][:count]
    if not cut or max_new_tokens <= cap:
        return answers
    log.info("drafter warm-up: %d of the answers cut at %d tokens decoded on to %d", len(cut), cap, max_new_tokens)
    longer = generate_answers(policy, [answers[k][0].tolist() for k in cut], sampling, max_new_tokens - (cap - 1),
                              eos_ids, seed, on_progress, batch=CONTINUE_BATCH, what="continued answers")
    out = list(answers)
    for k, (toks, hid, _) in zip(cut, longer):
        out[k] = (toks, hid, answers[k][2])  # the response starts where the original prompt ends
    return out


def warmup_drafter(policy: Transformer, task, cfg: "DrafterSection", *, sampling: SamplingParams,
                   policy_key: str, max_new_tokens: int, seed: int = 0, cache_dir: str | Path | None = None,
                   retrain: bool = False, on_progress: Progress | None = None) -> tuple[Drafter, dict[str, Any]]:
    """Warm a drafter up to `policy` on its own answers (module doc); returns it and a summary.
    retrain: ignore a cached drafter (cached answers are still reused)."""
    root = _cache_root(cache_dir)
    data_spec = _data_spec(policy, task, cfg, sampling, policy_key, max_new_tokens, seed)
    train_spec = {**data_spec, "steps": cfg.warmup_steps, "lr": cfg.warmup_lr, "batch_tokens": cfg.warmup_batch_tokens,
                  "train_vocab": cfg.train_vocab, "hidden_w": cfg.hidden_loss_weight, "token_w": cfg.token_loss_weight,
                  "unroll": cfg.unroll, "recipe": RECIPE_VERSION,
                  **({"feature_noise": cfg.feature_noise} if cfg.feature_noise else {})}  # older keys stay valid
    folder = root / f"drafter-{_key(train_spec)}"
    if (folder / "info.json").exists() and not retrain:
        from safetensors.torch import load_file

        drafter = Drafter.for_target(policy, seed=seed)
        drafter.load_state_dict({k: v.to(policy.device, policy.dtype if v.is_floating_point() else v.dtype)
                                 for k, v in load_file(str(folder / "drafter.safetensors")).items()})
        info = json.loads((folder / "info.json").read_text())
        log.info("drafter warm-up: loaded from %s (%d steps on %d answers, top-1 %.3f)", folder, info["steps"],
                 info["answers"], info["train_top1"])
        return drafter.eval(), {**info, "cached": True, "folder": str(folder)}

    t0 = time.perf_counter()
    answers = warmup_answers(policy, task, cfg, sampling=sampling, policy_key=policy_key,
                             max_new_tokens=max_new_tokens, seed=seed, cache_dir=cache_dir, on_progress=on_progress)
    generate_s = time.perf_counter() - t0
    drafter, info = fit_drafter(policy, answers, cfg, eos_ids=stop_ids(policy, task), seed=seed, on_progress=on_progress)
    del answers
    return_freed_memory()
    optimizer = info.pop("optimizer")
    info = {**info, "generate_s": round(generate_s, 1)}
    from safetensors.torch import save_file

    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}, str(tmp / "drafter.safetensors"))
    torch.save(optimizer, tmp / OPTIMIZER_FILE)
    (tmp / "info.json").write_text(json.dumps(info, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    log.info("drafter warm-up: done in %.0f s (top-1 %.3f on its last batches), cached in %s",
             time.perf_counter() - t0, info["train_top1"], folder)
    return drafter, {**info, "cached": False, "folder": str(folder)}


def warmup_optimizer(folder: str | Path) -> dict[str, Any] | None:
    """The AdamW state a cached warm-up ended with (`warmup_drafter`'s info["folder"]), in
    DrafterTrainer's parameter order; None for a folder cached without it.

    Spot training resumes from it (trainer.py), so a worker's first updates are steps of the warmed
    moments: a fresh AdamW's first step moves every weight by about its learning rate, whatever the
    gradient's size (m / sqrt(v) = sign(g)), which on a warmed-up drafter is noise."""
    path = Path(folder) / OPTIMIZER_FILE
    return torch.load(path, map_location="cpu") if path.exists() else None


def warmup_answers(policy: Transformer, task, cfg: "DrafterSection", *, sampling: SamplingParams, policy_key: str,
                   max_new_tokens: int, seed: int = 0, cache_dir: str | Path | None = None,
                   on_progress: Progress | None = None) -> list[Answer]:
    """The warm-up's training data: the policy's answers to `cfg.warmup_prompts` prompts (module doc),
    cached; generated on the first call. The cut answers are cached apart from their continuation,
    so another `warmup_continue` decodes only what it adds."""
    root = _cache_root(cache_dir)
    spec = _data_spec(policy, task, cfg, sampling, policy_key, max_new_tokens, seed)
    cut_spec = {k: v for k, v in spec.items() if k != "continue"}
    cap, eos = cut_spec["max_new_tokens"], stop_ids(policy, task)

    def cut() -> list[Answer]:
        log.info("drafter warm-up: the policy answers %d prompts (at most %d tokens each)", cfg.warmup_prompts, cap)
        prompts = [p.ids for p in task.sample_prompts(cfg.warmup_prompts, random.Random(seed + 7))]
        return generate_answers(policy, prompts, sampling, cap, eos, seed, on_progress)

    answers = _cached(root / f"answers-{_key(cut_spec)}.pt", cut)
    if spec != cut_spec:
        answers = _cached(root / f"answers-{_key(spec)}.pt", lambda: continue_answers(
            policy, answers, cfg.warmup_continue, cap, sampling, max_new_tokens, eos, seed + 1_000_003, on_progress))
    return answers


def _cached(path: Path, make: Callable[[], list[Answer]]) -> list[Answer]:
    if path.exists():
        answers = torch.load(path)
        log.info("drafter warm-up: %d cached answers from %s", len(answers), path)
        return answers
    answers = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(answers, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)
    return answers


def fit_drafter(policy: Transformer, answers: Sequence[Answer], cfg: "DrafterSection", *, eos_ids: Sequence[int],
                seed: int = 0, on_progress: Progress | None = None) -> tuple[Drafter, dict[str, Any]]:
    """A fresh drafter trained by the recipe (module doc) on `answers`; returns it and a summary
    whose "optimizer" is the AdamW state it ended with (warmup_drafter caches it: warmup_optimizer)."""
    V = policy.config.vocab_size
    drafter = Drafter.for_target(policy, seed=seed)
    counts = torch.zeros(V, dtype=torch.float64)
    buf = DrafterBuffer(max_tokens=10 ** 12)
    for toks, hid, plen in answers:
        counts += torch.bincount(toks[plen:], minlength=V).double()[:V]
        buf.add(toks, hid, response_start=plen, step=0)
    drafter.token_counts.copy_(counts.float())
    vocab = draft_vocab_ids(counts, cfg.train_vocab, eos_ids).to(policy.device) if 0 < cfg.train_vocab < V else None
    n_resp = int(sum(len(t) - p for t, _, p in answers))
    log.info("drafter warm-up: %d steps on %d answers (%d response tokens)", cfg.warmup_steps, len(answers), n_resp)
    t1 = time.perf_counter()
    for model in (policy, drafter):  # this CPU's fastest kernels for the training products (a no-op on GPUs)
        tune(model)
    steps, train_top1, optimizer = _train(drafter, buf, cfg, vocab, seed, on_progress)
    return drafter.eval(), {"steps": steps, "answers": len(answers), "response_tokens": n_resp, "train_top1": train_top1,
                            "train_s": round(time.perf_counter() - t1, 1), "train_vocab": cfg.train_vocab,
                            "optimizer": optimizer}


def _cache_root(cache_dir: str | Path | None) -> Path:
    from ..models.policies import model_cache_dir

    return Path(cache_dir) if cache_dir is not None else model_cache_dir() / "drafters"


def stop_ids(policy: Transformer, task) -> list[int]:
    """The token ids that end an answer: the task's EOS and the policy's own."""
    return sorted({task.eos_id, *policy.config.eos_ids})


def _data_spec(policy: Transformer, task, cfg: "DrafterSection", sampling: SamplingParams, policy_key: str,
               max_new_tokens: int, seed: int) -> dict[str, Any]:
    """What decides the warm-up answers: their cache key, and part of the trained drafter's."""
    return {"policy": policy_key, "task": getattr(task, "name", type(task).__name__),
            "task_options": {k: v for k, v in vars(task).items() if isinstance(v, (int, float, str, bool))},
            "prompts": cfg.warmup_prompts, "seed": seed, "max_new_tokens": min(cfg.warmup_max_new_tokens, max_new_tokens),
            "sampling": [sampling.temperature, sampling.top_p, sampling.top_k], "dtype": str(policy.dtype),
            "gen_batch": GEN_BATCH,  # the batch decides each answer's sampling key
            **({"continue": [cfg.warmup_continue, max_new_tokens, CONTINUE_BATCH]}
               if cfg.warmup_continue and max_new_tokens > cfg.warmup_max_new_tokens else {})}  # older keys stay valid


def _train(drafter: Drafter, buf: DrafterBuffer, cfg: "DrafterSection", vocab: Tensor | None, seed: int,
           on_progress: Progress | None) -> tuple[int, float, dict[str, Any]]:
    """The warm-up's optimizer loop; returns (steps, top-1 over the last tenth of the steps, AdamW's state)."""
    drafter.train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.warmup_lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(seed)
    noise = torch.Generator(drafter.fc.weight.device).manual_seed(seed)
    total, warm = cfg.warmup_steps, max(1, cfg.warmup_steps // 20)
    accs: list[tuple[float, int]] = []
    step, t = 0, time.perf_counter()
    while step < total and buf.trainable_tokens:
        for batch in buf.batches(cfg.warmup_batch_tokens, rng):
            if step >= total:
                break
            for g in opt.param_groups:
                g["lr"] = lr_at(step, total, cfg.warmup_lr, warm)
            loss, m = drafter_loss(drafter, batch, cfg.hidden_loss_weight, cfg.token_loss_weight, vocab=vocab,
                                   unroll=cfg.unroll, feature_noise=cfg.feature_noise, generator=noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            accs.append((m["accuracy"], m["tokens"]))
            step += 1
            if step % 50 == 0 or step == total:
                recent = accs[-50:]
                log.info("drafter warm-up step %d/%d: loss %.4f, top-1 %.3f (%.2f s/step)", step, total, float(loss.detach()),
                         sum(a * n for a, n in recent) / max(1, sum(n for _, n in recent)),
                         (time.perf_counter() - t) / step)
                if on_progress is not None:
                    on_progress(step, total, "steps")
    drafter.eval()
    last = accs[-max(1, len(accs) // 10):]
    return step, sum(a * n for a, n in last) / max(1, sum(n for _, n in last)), opt.state_dict()
