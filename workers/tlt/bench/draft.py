"""What one speculative draft costs on this CPU, from the drafter's float32 weights and from their
bfloat16 copies (spec.draft_bf16), side by side in one process. The LAST stdout line is one JSON object.

    python -m workers.tlt.bench draft [--preset smollm2-mathmix-cpu] [--depth 4] [--drafts 120] [--keys 200]

The preset's policy and two drafters of its shape, one per precision, both prepared as a rollout
prepares them (SpecPolicy.drafting_head: tuned kernels, the preset's reduced draft vocabulary), draft
chains of --depth tokens (sampled at the preset's temperature) after a context of --keys tokens that
grows by `depth - 1` per draft, as accepted tokens grow it; the two take turns. Between any two drafts every
target weight multiplies the rows of a verify pass, as in a rollout, so each draft finds the
drafter's weights where a rollout finds them, not warm in the cache. A draft's cost does not depend
on what the drafter learned, so the drafters are untrained (hidden states are random too).

Reports the median milliseconds of each, their ratio (`speedup`), and the part of each spent in
the kernels (`kernel_ms`: products and attention, ours in cpu_kernels.py or oneDNN's where the
tuner chose it); the rest is PyTorch's small ops and the Python around them. Benchmarks measure;
tests check correctness, never timings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Iterator


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="smollm2-mathmix-cpu", help="policy, draft vocabulary and temperature")
    p.add_argument("--depth", type=int, default=4, help="tokens per drafted chain")
    p.add_argument("--drafts", type=int, default=120, help="drafts timed per precision (after 10 untimed)")
    p.add_argument("--keys", type=int, default=200, help="context length at the first draft")


@contextmanager
def kernel_clock() -> Iterator[list[float]]:
    """Seconds spent inside the products' and attention's kernels while the block runs: [total]. Ours
    (cpu_kernels.linear, cpu_kernels.attention) and oneDNN's (linear._onednn), which the tuner may
    choose for a layer instead."""
    from ..models import cpu_kernels, linear

    sites = [(cpu_kernels, "linear"), (cpu_kernels, "attention"), (linear, "_onednn")]
    spent, real = [0.0], {(module, name): getattr(module, name) for module, name in sites}

    def timed(fn):
        def call(*args):
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[0] += time.perf_counter() - t
        return call

    for (module, name), fn in real.items():
        setattr(module, name, timed(fn))
    try:
        yield spent
    finally:
        for (module, name), fn in real.items():
            setattr(module, name, fn)


def cmd_draft(args: argparse.Namespace) -> int:
    import torch

    from ..config import preset
    from ..models import cpu_kernels
    from ..models.drafter import Drafter
    from ..models.linear import cpu_flags, cpu_name, set_decode_threads, tune
    from ..models.policies import prepare_policy_folder
    from ..models.transformer import Transformer
    from ..rollout.engine import SpecPolicy
    from ..rollout.sampling import sampling_params
    from ..rollout.speculative import draft
    from ..trainer import lendable_cores

    if args.depth < 1 or args.drafts < 1 or args.keys < 2:
        raise SystemExit("--depth and --drafts must be at least 1, --keys at least 2")
    if not cpu_kernels.available():
        raise SystemExit("our CPU kernels cannot be built here: drafting runs PyTorch's kernels in float32 either way")
    cfg = preset(args.preset)
    target = Transformer.from_pretrained(prepare_policy_folder(cfg)).eval()  # float32
    set_decode_threads(1, lendable_cores(cfg, "cpu"))  # the thread counts a rollout worker tunes at
    tune(target)
    V, H = target.config.vocab_size, target.config.hidden_size
    ids = list(range(min(cfg.spec.draft_vocab or V, V)))  # which ids does not change a draft's cost
    ways = {}
    for name, bf16 in (("float32", False), ("bfloat16", True)):
        drafter = Drafter.for_target(target).eval()
        head = SpecPolicy(draft_ids=ids, draft_bf16=bf16).drafting_head(drafter, V)
        ways[name] = (drafter, head)
    params = sampling_params(cfg.rollout)
    L = args.keys + (args.drafts + 10) * args.depth + args.depth + 2
    gen = torch.Generator().manual_seed(0)
    hid, seq = torch.randn(1, L, H, generator=gen), torch.randint(0, V, (1, L), generator=gen)
    caches = {name: drafter.new_cache(1, L) for name, (drafter, _) in ways.items()}
    vtoks, vpos = seq[:, :args.depth + 1], torch.arange(args.depth + 1)[None]
    times: dict[str, list[float]] = {name: [] for name in ways}
    kernel: dict[str, list[float]] = {name: [] for name in ways}
    print(f"[bench draft] {args.drafts + 10} drafts per precision, depth {args.depth}", file=sys.stderr, flush=True)
    with torch.inference_mode(), kernel_clock() as spent:
        n = args.keys
        for i in range(args.drafts + 10):
            n += max(1, args.depth - 1)
            for name in (("float32", "bfloat16") if i % 2 else ("bfloat16", "float32")):
                target(vtoks, vpos, target.new_cache(1, args.depth + 1))  # a verify pass's worth of weights
                drafter, head = ways[name]
                keys = torch.randint(-(1 << 63), (1 << 63) - 1, (1,), generator=gen)
                spent[0], t = 0.0, time.perf_counter()
                draft(drafter, caches[name], hid, seq, torch.tensor([n]), n, depth=args.depth, topk=1,
                      verify=args.depth, params=params, keys=keys, head=head)
                if i >= 10:  # the first drafts pack weights and fault pages in
                    times[name].append(time.perf_counter() - t)
                    kernel[name].append(spent[0])
    ms = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    out = {"bench": "draft", "preset": args.preset, "cpu": cpu_name(), "cpu_flags": cpu_flags(),
           "threads": torch.get_num_threads(), "depth": args.depth, "drafts": args.drafts,
           "draft_vocab": len(ids), "keys": [args.keys, n],
           "draft_ms": {name: round(v, 3) for name, v in ms.items()},
           "kernel_ms": {name: round(statistics.median(v) * 1e3, 3) for name, v in kernel.items()},
           "speedup": round(ms["float32"] / ms["bfloat16"], 3)}
    print(json.dumps(out))
    return 0
