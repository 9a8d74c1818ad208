"""What a verify pass of T tokens costs against a decode step (T = 1), on this CPU, side by side in
one process. The LAST stdout line is one JSON object.

    python -m workers.tlt.bench verify [--preset smollm2-mathmix-cpu] [--max-tokens 10] [--passes 40] [--keys 400]
                                       [--set model.dtype=bfloat16 ...]   # preset overrides

The preset's policy, its kernels tuned as a rollout tunes them, one sequence with a context of
--keys tokens in its KV cache; each timed pass writes T tokens after it (a chain: each sees the
context and the tokens before it) and computes their logits, as the engine's verify pass does.
T = 1 is a plain decode step. The T's take turns, so all see the same machine.

Reports the median milliseconds per T and `ratio_to_decode` (ms / the T = 1 ms). A draft of d
tokens is verified in a pass of T = d + 1, so the ratio is what SD must beat in tokens per pass
(acceptance), before the draft's own cost (`bench draft`). On the CPU's few-row kernel
(csrc/gemv.cpp) up to 6 rows share each loaded weight (12 with AVX-512): the step from T = 6 to 7
(13) is a second tile.

`decode_check` (run by `bench e2e`) times the same way, on the tuned kernels and on each other kernel
the tuner could have chosen, a decode step and passes of every size the baseline's rollouts ran.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="smollm2-mathmix-cpu", help="the policy")
    p.add_argument("--max-tokens", type=int, default=10, help="largest T (tokens per pass) timed")
    p.add_argument("--passes", type=int, default=40, help="passes timed per T (after 3 untimed)")
    p.add_argument("--keys", type=int, default=400, help="context tokens in the KV cache")


def cmd_verify(args: argparse.Namespace) -> int:
    import torch

    from ..config import preset
    from ..models.linear import cpu_flags, cpu_name
    from .e2e import parse_overrides

    if args.max_tokens < 1 or args.passes < 1 or args.keys < 1:
        raise SystemExit("--max-tokens, --passes and --keys must be at least 1")
    target, dtype = _tuned_policy(preset(args.preset, parse_overrides(args.set)))
    Ts = list(range(1, args.max_tokens + 1))
    print(f"[bench verify] {args.passes} passes per T, T = 1..{args.max_tokens}, {args.keys} context tokens on "
          f"{torch.get_num_threads()} threads", file=sys.stderr, flush=True)
    ms = time_passes(target, {T: (T, None) for T in Ts}, args.passes, args.keys)
    out = {"bench": "verify", "preset": args.preset, "cpu": cpu_name(), "cpu_flags": cpu_flags(),
           "threads": torch.get_num_threads(), "dtype": str(dtype).removeprefix("torch."), "keys": args.keys,
           "passes": args.passes, "verify_ms": {T: round(v, 3) for T, v in ms.items()},
           "ratio_to_decode": {T: round(v / ms[1], 3) for T, v in ms.items()}}
    print(json.dumps(out))
    return 0


def _tuned_policy(cfg):
    """cfg's policy in the dtype a CPU run decodes in, its kernels tuned as a rollout worker tunes them
    (at the thread counts it decodes on; cached, so the same choice the workers made)."""
    import torch

    from ..models.linear import set_decode_threads, tune
    from ..models.policies import prepare_policy_folder
    from ..models.transformer import Transformer
    from ..trainer import lendable_cores, resolve_dtype

    cfg = resolve_dtype(cfg, "cpu")
    dtype = getattr(torch, cfg.model.dtype)
    target = Transformer.from_pretrained(prepare_policy_folder(cfg), dtype=dtype).eval()
    set_decode_threads(1, lendable_cores(cfg, "cpu"))
    tune(target)
    return target, dtype


def time_passes(target, ways: dict[Any, tuple[int, Callable[[], object] | None]], passes: int,
                keys: int) -> dict[Any, float]:
    """Median milliseconds of one sequence's pass of T tokens after `keys` context tokens, per way:
    (T, and a call that readies the model for it, or None). Each pass writes its T tokens after the
    context (a chain: each sees the context and the tokens before it) and computes their logits, as
    the engine's verify pass does; T = 1 is a plain decode step. The ways take turns, so all see
    the same machine, after 3 untimed rounds (they pack weights and fault pages in)."""
    import torch

    S = keys + max(T for T, _ in ways.values())
    seq = torch.randint(0, target.config.vocab_size, (1, S), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache(1, S)
    at = torch.arange(S)
    order = list(ways)
    times: dict[Any, list[float]] = {w: [] for w in order}
    with torch.inference_mode():
        target(seq[:, :keys], at[None, :keys], cache, write_pos=at[None, :keys], logits=False)
        for i in range(passes + 3):
            for w in (order if i % 2 else order[::-1]):
                T, ready = ways[w]
                if ready is not None:
                    ready()
                pos = at[None, keys:keys + T]
                mask = (at[None, :keys + T] <= pos[0, :, None])[None]  # [1, T, keys + T]
                t = time.perf_counter()
                target(seq[:, keys:keys + T], pos, cache, write_pos=pos, mask=mask)
                if i >= 3:
                    times[w].append(time.perf_counter() - t)
    return {w: statistics.median(v) * 1e3 for w, v in times.items()}


def decode_check(cfg, profile: dict[str, dict[str, int]] | None = None, passes: int = 20,
                 keys: int = 400) -> dict[str, Any]:
    """Does plain decoding run on its fastest kernels? An A/B is only as fair as its baseline's kernels
    (README, "The tuner's kernels slowed the baseline more than TLT"), so `bench e2e` ends by timing
    cfg's policy on the kernels the tuner gave the rollout workers (`tuned`: cached, the same choice)
    against each kernel it could have given every layer, at each thread count a worker decodes on:
    a decode step (T = 1), and a pass of T = r tokens for each product size r of at most
    MAX_FEW_ROWS rows in `profile` ({threads: {rows: passes}}, the baseline's RolloutMetrics.
    passes_by_rows; larger products take the bulk kernel whatever the few-row one). A pass of r
    tokens of one sequence stands in for a step of r sequences: the same products, attention aside.

    Returns {"decode_ms": {threads: {"tuned": ms, kernel: ms, ...}} (T = 1), "pass_ms": {threads:
    {rows: {...}}}, and "tuned_vs_fastest": with a profile, the baseline's few-row passes timed on
    the tuned kernels over the same passes on the fastest single kernel ("profile_s": the seconds
    each would have taken); without one, the largest such ratio of a decode step}. Where a CPU's
    kernels rank differently by rows (AMX: gemv leads at one row, oneDNN from two), only the
    profile says which the baseline needed."""
    import torch

    from ..models.linear import MAX_FEW_ROWS, decode_threads, model_candidates, set_kernels

    target, _ = _tuned_policy(cfg)
    tuned = set_kernels(target, None)
    readies = {"tuned": lambda: set_kernels(target, tuned)}
    readies.update({k: (lambda k=k: set_kernels(target, k)) for k in model_candidates(target)})
    few = {str(t): {str(r): int(n) for r, n in by_rows.items() if int(r) <= MAX_FEW_ROWS}
           for t, by_rows in (profile or {}).items()}
    own, pass_ms = torch.get_num_threads(), {}
    try:
        for threads in sorted({str(t) for t in decode_threads()} | set(few), key=int):
            torch.set_num_threads(int(threads))
            rows = sorted({1, *map(int, few.get(threads, {}))})
            ms = time_passes(target, {(w, r): (r, ready) for w, ready in readies.items() for r in rows}, passes, keys)
            pass_ms[threads] = {str(r): {w: round(ms[w, r], 3) for w in readies} for r in rows}
    finally:
        torch.set_num_threads(own)
        set_kernels(target, tuned)
    out: dict[str, Any] = {"decode_ms": {t: by_rows["1"] for t, by_rows in pass_ms.items()}, "pass_ms": pass_ms}
    if any(n for by_rows in few.values() for n in by_rows.values()):
        out["profile_s"] = {w: round(sum(n * pass_ms[t][r][w] for t, by_rows in few.items()
                                         for r, n in by_rows.items()) / 1e3, 3) for w in readies}
        out["tuned_vs_fastest"] = round(out["profile_s"]["tuned"] / min(
            s for w, s in out["profile_s"].items() if w != "tuned"), 3)
    else:
        out["tuned_vs_fastest"] = round(max(ms["tuned"] / min(v for w, v in ms.items() if w != "tuned")
                                            for ms in out["decode_ms"].values()), 3)
    return out
