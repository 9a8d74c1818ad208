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
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="smollm2-mathmix-cpu", help="the policy")
    p.add_argument("--max-tokens", type=int, default=10, help="largest T (tokens per pass) timed")
    p.add_argument("--passes", type=int, default=40, help="passes timed per T (after 3 untimed)")
    p.add_argument("--keys", type=int, default=400, help="context tokens in the KV cache")


def cmd_verify(args: argparse.Namespace) -> int:
    import torch

    from ..config import preset
    from ..models.linear import cpu_flags, cpu_name, set_decode_threads, tune
    from ..models.policies import prepare_policy_folder
    from ..models.transformer import Transformer
    from ..trainer import lendable_cores, resolve_dtype
    from .e2e import parse_overrides

    if args.max_tokens < 1 or args.passes < 1 or args.keys < 1:
        raise SystemExit("--max-tokens, --passes and --keys must be at least 1")
    # the dtype a CPU run of the preset decodes in
    cfg = resolve_dtype(preset(args.preset, parse_overrides(args.set)), "cpu")
    dtype = getattr(torch, cfg.model.dtype)
    target = Transformer.from_pretrained(prepare_policy_folder(cfg), dtype=dtype).eval()
    set_decode_threads(1, lendable_cores(cfg, "cpu"))  # the thread counts a rollout worker tunes at
    tune(target)
    n, V = args.keys, target.config.vocab_size
    S = n + args.max_tokens
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, V, (1, S), generator=gen)
    cache = target.new_cache(1, S)
    keys = torch.arange(S)
    Ts = list(range(1, args.max_tokens + 1))
    times: dict[int, list[float]] = {T: [] for T in Ts}
    print(f"[bench verify] {args.passes} passes per T, T = 1..{args.max_tokens}, {n} context tokens on "
          f"{torch.get_num_threads()} threads", file=sys.stderr, flush=True)
    with torch.inference_mode():
        target(seq[:, :n], torch.arange(n)[None], cache, write_pos=torch.arange(n)[None], logits=False)
        for i in range(args.passes + 3):
            for T in (Ts if i % 2 else Ts[::-1]):
                pos = torch.arange(n, n + T)[None]
                mask = (keys[None, :n + T] <= pos[0, :, None])[None]  # [1, T, n + T]: a chain after the context
                t = time.perf_counter()
                target(seq[:, n:n + T], pos, cache, write_pos=pos, mask=mask)
                if i >= 3:  # the first passes pack weights and fault pages in
                    times[T].append(time.perf_counter() - t)
    ms = {T: statistics.median(v) * 1e3 for T, v in times.items()}
    out = {"bench": "verify", "preset": args.preset, "cpu": cpu_name(), "cpu_flags": cpu_flags(),
           "threads": torch.get_num_threads(), "dtype": str(dtype).removeprefix("torch."), "keys": n,
           "passes": args.passes, "verify_ms": {T: round(v, 3) for T, v in ms.items()},
           "ratio_to_decode": {T: round(v / ms[1], 3) for T, v in ms.items()}}
    print(json.dumps(out))
    return 0
