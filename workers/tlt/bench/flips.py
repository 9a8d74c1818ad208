"""Does a keyed sample depend on anything but (seed, sample, position) and the policy? Only through
float rounding, and this measures how often. The LAST stdout line is one JSON object.

    python -m workers.tlt.bench flips [--preset smollm2-mathmix-cpu] [--rows 16] [--max-new-tokens 256]

The preset's policy answers `--rows` of its task's long prompts (mathmix: word problems) by plain
decoding, then the same rows, with the same keys, three more ways: beside as many other rows (twice
the batch), the first half alone (half the batch), and with SD from the first token (a forced
4-deep chain of an untrained drafter: every pass is a 5-token verify that accepts almost nothing,
so the emitted tokens come from verify-pass logits). Each comparison reports the rows whose tokens
differ from the first run's and the position of each first difference.

Sampling is a race with noise keyed by (seed, sample, position, token) (rollout/sampling.py), so
every way draws the same tokens where the arithmetic gives bit-identical p. A batch of another size
runs other matrix-product blockings, and a verify pass multi-token products and a tree mask; each
moves p in its last bits, which moves a drawn token when two racers finish that close together. Where the
plain comparisons differ as the SD one does, batch composition alone explains SD's differences: SD
is then lossless in distribution and equal to plain decoding up to the rounding plain decoding has
anyway. Benchmarks measure; tests check correctness, never timings.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Sequence


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="smollm2-mathmix-cpu", help="policy, task and sampling")
    p.add_argument("--rows", type=int, default=16, help="answers compared (even: the half-batch run takes half)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="length cap of each answer")
    p.add_argument("--seed", type=int, default=11, help="the sampling seed every run shares")


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts); None: equal."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


def cmd_flips(args: argparse.Namespace) -> int:
    from ..config import preset
    from ..learn.drafter_warmup import stop_ids
    from ..models.drafter import Drafter
    from ..models.linear import cpu_name
    from ..models.policies import prepare_policy_folder
    from ..models.transformer import Transformer
    from ..rollout.engine import SpecPolicy, generate
    from ..rollout.sampling import sampling_params
    from ..trainer import make_run_task

    if args.rows < 2:
        raise SystemExit("--rows must be at least 2")
    overrides = {"task": {"hard_fraction": 1.0}} if preset(args.preset).task.kind == "mathmix" else {}
    cfg = preset(args.preset, overrides)
    folder = prepare_policy_folder(cfg)
    policy = Transformer.from_pretrained(folder).eval()
    task = make_run_task(cfg, folder)
    sampling = sampling_params(cfg.rollout)
    if sampling.greedy:
        raise SystemExit(f"preset {args.preset} decodes greedily: no keyed draws to compare")
    eos = stop_ids(policy, task)
    prompts = [p.ids for p in task.sample_prompts(2 * args.rows, random.Random(args.seed))]
    n = args.rows

    def answers(rows: list[list[int]], what: str, **kw) -> list[list[int]]:
        t = time.perf_counter()
        res = generate(policy, rows, sampling, max_new_tokens=args.max_new_tokens, eos_ids=eos, seed=args.seed,
                       harvest_hidden=False, **kw)
        print(f"[bench flips] {what}: {len(rows)} rows in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
        return [list(toks) for toks in res.tokens]

    plain = answers(prompts[:n], "plain")
    others = {
        "plain_twice_the_batch": answers(prompts, "plain, twice the batch")[:n],
        "plain_half_the_batch": answers(prompts[:n // 2], "plain, half the batch"),
        "sd_verify_passes": answers(prompts[:n], "SD, forced 4-deep chain", drafter=Drafter.for_target(policy),
                                    spec=SpecPolicy.from_config(cfg.spec, threshold=2 * n, arm="d4k1v4")),
    }
    out = {"bench": "flips", "preset": args.preset, "cpu": cpu_name(), "rows": n, "seed": args.seed,
           "temperature": sampling.temperature, "tokens": sum(map(len, plain))}
    for name, got in others.items():
        first = [first_difference(a, b) for a, b in zip(plain, got)]
        out[name] = {"rows": len(got), "rows_differing": sum(f is not None for f in first),
                     "first_difference": {i: f for i, f in enumerate(first) if f is not None}}
    print(json.dumps(out))
    return 0
