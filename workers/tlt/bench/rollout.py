"""Rollout-engine benchmark: speculative decoding vs plain decoding in the long tail.

    python -m workers.tlt.bench rollout [--model smollm2|tiny] [--device cpu|cuda] [--dtype float32|bfloat16]
                                        [--threads 2] [--arm d6k1v6] [--draft-vocab 4096] [--retrain] ...

What it does, in one process on one machine:

1. Loads the policy (SmolLM2-135M-Instruct, converted once by models/smollm2.py, with the math word-problem
   task; or the SFT'd tiny model with the long-tail task) with our engine AND with transformers.
2. Adapts an EAGLE drafter to the policy the way TLT does: the policy answers TRAINING prompts of the
   task (the engine harvests its hidden states), the drafter trains on those whole responses
   (AdamW, warm-up + cosine lr, SmoothL1 on the next hidden state + soft cross-entropy on the
   next-token distribution). The trained weights and the token frequencies of the training
   responses (which pick the reduced draft vocabulary) are cached under var/bench/, keyed by model
   and settings, so re-runs skip training (--retrain forces it).
3. Benchmarks on HELD-OUT prompts (another seed), greedy, batch 1, i.e. the tail regime (running
   sequences below the SD threshold): each prompt without SD and with SD (a forced arm), tokens/s
   of the decode steps; outputs must match token for token. transformers' `generate()` runs the
   same prompts on the same weights (greedy, same max_new_tokens) for the engine-vs-HF figure.
   With --rollout-prompts N > 0 it also runs the whole long-tail rollout (N prompts in one batch,
   SD switching on when running <= --threshold, bandit-chosen arms) with and without SD.

Progress goes to stderr; the LAST stdout line is one JSON object (keys in `run`'s docstring).

CPU notes (SmolLM2-135M, fp32, 2 AVX2 cores, no AVX-512/AMX): decode and verify passes are bound
by reading ~540 MB of weights. PyTorch's default kernels (MKL sgemv for one row, small-M sgemm for
a few) read them at ~11 GB/s; models/linear.py routes them to faster kernels, so a batch-1 decode step
takes ~25-31 ms (was ~58) and verifying 7 tokens ~1.5 decode steps. The reduced draft
vocabulary (--draft-vocab 4096) cuts each draft step's head from ~10 ms to well under 1 ms.
bfloat16/float16 weights are slower there for T > 1 (no native bf16 matmul), so float32 is the
default. Where oneDNN multiplies bfloat16 (AVX-512 BF16 or AMX), --dtype bfloat16 takes packed oneDNN
kernels and a row-invariant attention (models/linear.py, transformer.cached_attention: on AMX a
16-row verify pass costs about one decode step; greedy SD is token-identical by construction; the
drafter trains through float32 master weights) and transformers' generate() runs in bfloat16 too.
Under CPU contention the multi-threaded matmuls slow down badly; measure on a quiet machine.
Needs only torch, transformers, safetensors, tokenizers and this package (no Ray, Django, vLLM).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from ..models.policies import REPO_ROOT

log = logging.getLogger("workers.tlt.bench.rollout")

DEFAULTS = {  # per model: what a plain `bench rollout --model X` does
    "smollm2": dict(max_new_tokens=256, train_prompts=1920, train_steps=1800, batch_tokens=1536, lr=1e-3,
                    gen_batch=64, tail_prompts=4, arm="auto", draft_vocab=4096, train_vocab=8192,
                    rollout_prompts=8, threshold=4, unroll=1),
    "tiny": dict(max_new_tokens=192, train_prompts=256, train_steps=2000, batch_tokens=2048, lr=2e-3,
                 gen_batch=64, tail_prompts=4, arm="d6k1v6", draft_vocab=0, train_vocab=0,
                 rollout_prompts=32, threshold=8, unroll=1),
}


# --- model and task -------------------------------------------------------------------------------

def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _tiny_folder(args: argparse.Namespace) -> Path:
    """The SFT'd tiny policy of the tiny-cpu preset (the trainer's cached one), or with --sft-steps."""
    from ..config import preset  # pydantic: only the tiny path needs it
    from ..models.policies import prepare_policy_folder

    overrides = {"model": {"sft_steps": args.sft_steps}} if args.sft_steps is not None else None
    return prepare_policy_folder(preset("tiny-cpu", overrides))


def load_policy(args: argparse.Namespace):
    """(model folder, our Transformer, task, eos ids)."""
    from ..models.transformer import Transformer
    from ..tasks import make_task

    if args.model == "smollm2":
        if args.model_path:
            folder = Path(args.model_path)
        else:
            from ..models.smollm2 import ensure_smollm2

            folder = ensure_smollm2()
        task = make_task("math", tokenizer=folder)
    else:
        folder = Path(args.model_path) if args.model_path else _tiny_folder(args)
        task = make_task("longtail")
    model = Transformer.from_pretrained(folder, dtype=_dtype(args.dtype), device=args.device).eval()
    eos = sorted(set(model.config.eos_ids) | {task.eos_id})
    return folder, model, task, eos


# --- the adapted drafter --------------------------------------------------------------------------

def adapted_drafter(model, task, folder: Path, args: argparse.Namespace, eos):
    """The drafter adapted to the policy by the product's own warm-up recipe (learn/drafter_warmup.py) on
    the policy's answers to training prompts; cached under --cache-dir."""
    from types import SimpleNamespace

    from ..learn.drafter_warmup import warmup_drafter, weights_digest
    from ..rollout.sampling import SamplingParams
    from .progress import PhaseProgress

    progress = PhaseProgress("[bench rollout] drafter warm-up")  # the first run's answers and steps take minutes
    recipe = SimpleNamespace(  # the fields of config.DrafterSection the recipe reads (no pydantic here)
        warmup_prompts=args.train_prompts, warmup_steps=args.train_steps, warmup_max_new_tokens=args.max_new_tokens,
        warmup_lr=args.lr, warmup_batch_tokens=args.batch_tokens, train_vocab=args.train_vocab,
        hidden_loss_weight=1.0, token_loss_weight=args.token_weight, unroll=args.unroll,
        feature_noise=args.feature_noise, warmup_continue=0)  # its answers run to the cap it decodes at
    drafter, info = warmup_drafter(model, task, recipe, sampling=SamplingParams(temperature=args.train_temperature),
                                   policy_key=weights_digest(folder), max_new_tokens=args.max_new_tokens,
                                   seed=args.train_seed, cache_dir=args.cache_dir, retrain=args.retrain,
                                   on_progress=progress.warmup)
    return drafter, info


def heldout_top1(drafter, seqs, draft_ids) -> dict[str, float]:
    """Step-1 top-1 agreement of drafter and target on held-out responses (true inputs), and how
    often the target's token lies in the draft vocabulary."""
    import torch

    hit = cover = n = 0
    with torch.inference_mode():
        W = drafter.target.lm_head.weight
        for toks, hid, plen in seqs:
            if hid.shape[0] < plen + 1:
                continue
            h = hid.to(W.device, W.dtype)
            x = torch.tensor(toks[1:hid.shape[0]], device=W.device)[None]
            if x.shape[1] < h.shape[0]:
                h = h[:x.shape[1]]
            pred = drafter(h[None], x)[0, plen - 1:-1]
            true = h[plen:]
            t_top = drafter.logits(true).argmax(-1)
            if draft_ids is not None:
                ids = draft_ids.to(W.device)
                p_top = ids[torch.nn.functional.linear(pred, W.index_select(0, ids)).argmax(-1)]
                cover += int(torch.isin(t_top, ids).sum())
            else:
                p_top = drafter.logits(pred).argmax(-1)
                cover += int(t_top.numel())
            hit += int((p_top == t_top).sum())
            n += int(t_top.numel())
    return {"heldout_top1": hit / max(1, n), "draft_vocab_coverage": cover / max(1, n), "heldout_positions": n}


# --- measurements ---------------------------------------------------------------------------------

def _sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


# chains, and trees up to 16 verified nodes: on a CPU where a verify pass costs about a plain step
# (weight-bound; 16 tokens at 1.26x one token at batch 1 on a 2-core AVX-512 EPYC) a wider tree can
# pay for its drafting; the calibration decides (there, greedy: d6k3v16 raised tokens per pass to
# 3.69 from the chain's 3.28 but ran at 43.5 vs 56.9 tok/s)
AUTO_ARMS = ("d4k1v4", "d6k1v6", "d8k1v8", "d5k2v8", "d6k2v12", "d6k3v16", "ngram")


def calibrate_arm(model, drafter, prompt, args, eos) -> tuple[str, dict[str, float]]:
    """--arm auto: decode one held-out calibration prompt (not a measured one) with each candidate
    arm at batch 1 and keep the fastest, i.e. what the bandit converges to in the batch-1 bucket."""
    from ..rollout.engine import SpecPolicy, generate
    from ..rollout.sampling import SamplingParams

    rates = {}
    for arm in AUTO_ARMS:
        spec = SpecPolicy(arm=arm, threshold=1, draft_vocab=args.draft_vocab, draft_bf16=args.draft_bf16)
        m = generate(model, [prompt], SamplingParams(temperature=0.0), max_new_tokens=min(args.max_new_tokens, 128),
                     eos_ids=eos, drafter=drafter, spec=spec, harvest_hidden=False).metrics
        rates[arm] = round(m.tail_tokens_per_s_sd, 2)
        log.info("calibration: %s %.1f tok/s (acceptance %.2f)", arm, m.tail_tokens_per_s_sd, m.acceptance_length)
    return max(rates, key=rates.get), rates


def tail_batch1(model, drafter, prompts, args, eos) -> dict[str, Any]:
    """Each held-out prompt alone (batch 1 = the deepest tail), plain vs SD with a forced arm."""
    from ..rollout.engine import SpecPolicy, generate
    from ..rollout.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    plain = SpecPolicy(enabled=False, threshold=1)
    spec = SpecPolicy(arm=args.arm, threshold=1, draft_vocab=args.draft_vocab, draft_bf16=args.draft_bf16)
    generate(model, prompts[:1], greedy, max_new_tokens=8, eos_ids=eos, drafter=drafter, spec=spec)  # warm-up
    tok_sd = s_sd = tok_no = s_no = wall_no = tot = 0.0
    identical = True
    hist: list[int] = []
    by_pos_acc: list[int] = []
    by_pos_att: list[int] = []
    outs, seqs = [], []
    for i, p in enumerate(prompts):
        base = generate(model, [p], greedy, max_new_tokens=args.max_new_tokens, eos_ids=eos, spec=plain,
                        harvest_hidden=True)
        res = generate(model, [p], greedy, max_new_tokens=args.max_new_tokens, eos_ids=eos, drafter=drafter,
                       spec=spec, harvest_hidden=False)
        mb, ms = base.metrics, res.metrics
        same = res.tokens == base.tokens
        identical &= same
        tok_no += mb.tail_tokens_no_sd
        s_no += mb.tail_s_no_sd
        wall_no += mb.wall_s
        tot += mb.total_tokens
        tok_sd += ms.tail_tokens_sd
        s_sd += ms.tail_s_sd
        hist = [a + b for a, b in zip(hist, ms.accepted_hist)] if hist else list(ms.accepted_hist)
        by_pos_acc = [a + b for a, b in zip(by_pos_acc, ms.accepted_by_pos)] if by_pos_acc else list(ms.accepted_by_pos)
        by_pos_att = [a + b for a, b in zip(by_pos_att, ms.attempted_by_pos)] if by_pos_att else list(ms.attempted_by_pos)
        outs.append(base.tokens[0])
        seqs.append((list(p) + base.tokens[0], base.hidden[0], len(p)))
        log.info("tail prompt %d/%d: %d tokens, plain %.1f tok/s, SD %.1f tok/s, acceptance %.2f, identical %s",
                 i + 1, len(prompts), mb.total_tokens, mb.tail_tokens_per_s_no_sd, ms.tail_tokens_per_s_sd,
                 ms.acceptance_length, same)
    n_pass = sum(hist)
    acc_len = sum((k + 1) * c for k, c in enumerate(hist)) / n_pass if n_pass else 0.0
    sd, no = tok_sd / s_sd if s_sd else 0.0, tok_no / s_no if s_no else 0.0
    return {
        "tail_tokens_per_s_sd": sd, "tail_tokens_per_s_no_sd": no, "tail_speedup": sd / no if no else 0.0,
        "acceptance_length": acc_len, "greedy_identical": bool(identical), "tail_tokens": int(tok_no),
        "accept_by_position": [round(a / n, 3) if n else 0.0 for a, n in zip(by_pos_acc, by_pos_att)],
        "engine_tokens_per_s_no_sd_wall": tot / wall_no if wall_no else 0.0,
        "_outs": outs, "_seqs": seqs, "_wall_no": wall_no, "_tot": tot,
    }


def logprob_mismatch(measured, reference, seqs) -> dict[str, float]:
    """|log p| differences of the emitted tokens between the measured policy (e.g. bfloat16 rollout
    weights) and the float32 one a learner scores them with, teacher-forced over the tail's answers:
    what a bfloat16 rollout adds to the rollout-vs-learner mismatch (grpo: rollout/logprob_mismatch)."""
    import torch

    deltas = []
    with torch.inference_mode():
        for toks, _, plen in seqs:
            x = torch.tensor(toks, device=reference.device)[None]
            lps = [torch.log_softmax(m(x).logits[0, plen - 1:-1].float(), -1).gather(-1, x[0, plen:, None])[:, 0]
                   for m in (measured, reference)]
            deltas.append((lps[0] - lps[1]).abs())
    d = torch.cat(deltas)
    return {"logprob_mismatch_vs_float32": float(d.mean()), "logprob_mismatch_vs_float32_max": float(d.max())}


def hf_generate(folder: Path, prompts, args, eos, ours: list[list[int]]) -> dict[str, Any]:
    """transformers' generate() on the same weights and prompts (greedy, batch 1, same max_new_tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=_dtype(args.dtype)).to(args.device).eval()
    hf.generation_config.pad_token_id = eos[0]
    with torch.inference_mode():
        x = torch.tensor([prompts[0]], device=args.device)
        hf.generate(x, max_new_tokens=8, do_sample=False, eos_token_id=eos)  # warm-up
        tot, wall, same = 0, 0.0, True
        for p, mine in zip(prompts, ours):
            x = torch.tensor([p], device=args.device)
            _sync(args.device)
            t = time.perf_counter()
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.max_new_tokens,
                            do_sample=False, eos_token_id=eos)
            _sync(args.device)
            wall += time.perf_counter() - t
            new = y[0, len(p):].tolist()
            tot += len(new)
            same &= new == mine
    del hf
    return {"hf_tokens_per_s": tot / wall if wall else 0.0, "hf_identical": bool(same)}


def whole_rollout(model, drafter, prompts, args, eos) -> dict[str, Any]:
    """All held-out prompts in one batch: SD on in the tail (bandit over arms) vs never."""
    from ..rollout.engine import SpecPolicy, generate
    from ..rollout.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    base = generate(model, prompts, greedy, max_new_tokens=args.max_new_tokens, eos_ids=eos,
                    spec=SpecPolicy(enabled=False, threshold=args.threshold), harvest_hidden=False)
    spec = SpecPolicy(threshold=args.threshold, draft_vocab=args.draft_vocab, draft_bf16=args.draft_bf16, ngram_arm=True,
                      strategies=((4, 1, 4), (5, 1, 5), (8, 1, 8), (5, 2, 8)), hybrid_depth=5,
                      epsilon=0.1)  # smollm2-mathmix-cpu's arms
    res = generate(model, prompts, greedy, max_new_tokens=args.max_new_tokens, eos_ids=eos, drafter=drafter,
                   spec=spec, harvest_hidden=False)
    mb, ms = base.metrics, res.metrics
    return {
        "rollout_prompts": len(prompts), "rollout_threshold": args.threshold,
        "rollout_wall_s_no_sd": mb.wall_s, "rollout_wall_s_sd": ms.wall_s,
        "rollout_speedup": mb.wall_s / ms.wall_s if ms.wall_s else 0.0,
        "rollout_tail_tokens_per_s_no_sd": mb.tail_tokens_per_s_no_sd,
        "rollout_tail_tokens_per_s_sd": ms.tail_tokens_per_s_sd,
        "rollout_tail_s_no_sd": mb.tail_s_no_sd + mb.tail_s_sd, "rollout_tail_s_sd": ms.tail_s_sd + ms.tail_s_no_sd,
        "rollout_acceptance_length": ms.acceptance_length, "rollout_strategy": ms.strategy,
        "rollout_greedy_identical": res.tokens == base.tokens,
        "rollout_p50_p100_lengths": [sorted(mb.lengths)[len(mb.lengths) // 2], max(mb.lengths)],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark. Result keys:

    tail_tokens_per_s_sd / _no_sd, tail_speedup   batch-1 decode throughput with / without SD (arm `arm`)
    acceptance_length                              tokens per verify pass (accepted drafts + 1), batch 1
    engine_vs_hf_generate                          our engine without SD / transformers generate(), tokens/s
                                                   (wall clock with prefill, batch 1, same prompts)
    logprob_mismatch_vs_float32[_max]              --dtype other than float32: mean (max) |delta log p|
                                                   of the tail's tokens, --dtype policy vs the float32 one
    greedy_identical                               SD and plain outputs equal token for token (batch 1)
    drafter_*                                      training summary, held-out top-1, draft-vocab coverage
    rollout_*                                      the whole long-tail rollout (with --rollout-prompts > 0)
    """
    import torch

    for k, v in DEFAULTS[args.model].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    folder, model, task, eos = load_policy(args)
    log.info("policy %s (%s, %s) on %s, %d threads", folder, args.model, args.dtype, args.device,
             torch.get_num_threads())
    drafter, info = adapted_drafter(model, task, folder, args, eos)
    pool = [p.ids for p in task.sample_prompts(max(4 * args.tail_prompts, args.rollout_prompts),
                                                random.Random(args.bench_seed))]
    held = pool[:args.rollout_prompts]
    # the tail: the longest held-out prompts (the long-tail task's longest problems), one at a time
    tail_prompts = sorted(pool, key=len, reverse=True)[:args.tail_prompts]
    calibration = None
    if args.arm == "auto":
        spare = [p for p in pool if p not in tail_prompts] or pool
        args.arm, calibration = calibrate_arm(model, drafter, spare[0], args, eos)
    tail = tail_batch1(model, drafter, tail_prompts, args, eos)
    head = None
    if args.draft_vocab:
        from ..rollout.engine import SpecPolicy

        head = SpecPolicy(draft_vocab=args.draft_vocab).draft_head(drafter, model.config.vocab_size, eos).ids
    seqs = tail.pop("_seqs")
    top1 = heldout_top1(drafter, seqs, head)
    if args.dtype != "float32":
        from ..models.transformer import Transformer

        tail.update(logprob_mismatch(model, Transformer.from_pretrained(folder, device=args.device), seqs))
    outs = tail.pop("_outs")
    wall_no, tot = tail.pop("_wall_no"), tail.pop("_tot")
    result: dict[str, Any] = {"bench": "rollout", "model": args.model, "device": args.device, "dtype": args.dtype,
                              "threads": torch.get_num_threads(), "arm": args.arm, "draft_vocab": args.draft_vocab,
                              "draft_bf16": args.draft_bf16,
                              "max_new_tokens": args.max_new_tokens, "tail_prompts": args.tail_prompts, **tail}
    if calibration is not None:
        result["arm_calibration_tokens_per_s"] = calibration
    if not args.no_hf:
        hf = hf_generate(folder, tail_prompts, args, eos, outs)
        ours = tot / wall_no if wall_no else 0.0
        result.update(hf)
        result["engine_vs_hf_generate"] = ours / hf["hf_tokens_per_s"] if hf["hf_tokens_per_s"] else 0.0
    else:
        result["engine_vs_hf_generate"] = None
    if args.rollout_prompts:
        result.update(whole_rollout(model, drafter, held, args, eos))
    result.update({f"drafter_{k}": v for k, v in info.items()})
    result.update({f"drafter_{k}": v for k, v in top1.items()})
    from ..models.linear import chosen_kernels, cpu_flags, cpu_name

    result.update({"torch": torch.__version__, "cpu": cpu_name(), "cpu_flags": cpu_flags(),
                   "kernels": chosen_kernels(model),
                   "loadavg_start": [round(x, 2) for x in load0],
                   "loadavg_end": [round(x, 2) for x in os.getloadavg()], "bench_s": round(time.perf_counter() - t0, 1)})
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    p.add_argument("--model-path", help="policy folder (default: converted SmolLM2 / cached SFT'd tiny model)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default %(default)s)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--arm", help="SD arm for the batch-1 figure, e.g. d6k1v6 (chain) or d5k2v8 (tree); auto: the "
                                 f"fastest of {', '.join(AUTO_ARMS)} on a calibration prompt")
    p.add_argument("--draft-vocab", type=int, help="reduced draft vocabulary size (0: full vocabulary)")
    p.add_argument("--draft-bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="CPU float32: draft steps read bfloat16 copies of the drafter's weights (default on)")
    p.add_argument("--tail-prompts", type=int, help="held-out prompts decoded one at a time (batch 1)")
    p.add_argument("--rollout-prompts", type=int, help="held-out prompts of the whole-rollout figure (0: skip)")
    p.add_argument("--threshold", type=int, help="SD switches on at running <= this (whole rollout)")
    p.add_argument("--bench-seed", type=int, default=2000, help="seed of the held-out prompts")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' generate() comparison")
    g = p.add_argument_group("drafter training (cached under --cache-dir)")
    g.add_argument("--train-prompts", type=int)
    g.add_argument("--train-seed", type=int, default=1000, help="seed of the training prompts")
    g.add_argument("--train-steps", type=int)
    g.add_argument("--train-temperature", type=float, default=0.0, help="temperature of the training answers")
    g.add_argument("--batch-tokens", type=int)
    g.add_argument("--lr", type=float)
    g.add_argument("--token-weight", type=float, default=0.1, help="weight of the soft cross-entropy term")
    g.add_argument("--train-vocab", type=int, help="vocabulary of the training cross-entropy (0: full)")
    g.add_argument("--unroll", type=int, help="draft steps trained per position (training-time test; 1: plain EAGLE)")
    g.add_argument("--feature-noise", type=float, default=0.0,
                   help="noise on the states the drafter reads, a fraction of their RMS (smollm2-mathmix-cpu: 0.2)")
    g.add_argument("--gen-batch", type=int)
    g.add_argument("--sft-steps", type=int, help="tiny: SFT steps when no cached tiny policy is used")
    g.add_argument("--cache-dir", default=str(REPO_ROOT / "var" / "bench"))
    g.add_argument("--retrain", action="store_true", help="ignore a cached drafter")


def cmd_rollout(args: argparse.Namespace) -> int:
    result = run(args)
    print(json.dumps(result), flush=True)
    return 0 if result.get("greedy_identical") else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workers.tlt.bench.rollout", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    return cmd_rollout(args)


if __name__ == "__main__":
    raise SystemExit(main())
