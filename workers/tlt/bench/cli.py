"""Benchmarks that print the headline TLT figures; the LAST stdout line is one JSON object.

    python -m workers.tlt.bench e2e [--preset smollm2-mathmix-cpu|tiny-cpu|smollm2-cpu] [--steps N]
                                    [--static-drafter | --no-static-drafter] [--out DIR]
                                    [--set drafter.warmup_steps=800 ...]   # preset overrides
    python -m workers.tlt.bench e2e --summarize DIR      # the figures of a bench already run there
    python -m workers.tlt.bench rollout ...        # rollout engine: SD vs plain in the tail
    python -m workers.tlt.bench learner ...        # learner group: 1 vs 2 ranks, sync paths
    python -m workers.tlt.bench coupling [--set drafter.warmup_prompts=2048 ...]   # drafter/target
                                                   # agreement by coupling rule; --recipes: warm-up recipes
    python -m workers.tlt.bench flips ...          # keyed samples vs batch composition and SD (rounding)
    python -m workers.tlt.bench draft ...          # one draft's cost: float32 weights vs bfloat16 copies
    python -m workers.tlt.bench verify ...         # a verify pass of T tokens vs a decode step

Each subcommand's LAST stdout line is one JSON object; e2e.py, rollout.py and learner.py say what
they measure. Benchmarks measure; tests check correctness, never timings.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

from .e2e import STATIC_BY_DEFAULT, e2e, parse_overrides, summarize


def cmd_e2e(args: argparse.Namespace) -> int:
    if args.summarize:  # the figures of a bench already run (or cut short), from its folder
        out = Path(args.summarize)
        result = summarize(out, args.preset)
    else:
        out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="tlt-bench-e2e-"))
        result = e2e(args.preset, args.steps, out, overrides=parse_overrides(args.set), static=args.static_drafter)
    result["out"] = str(out)
    print(json.dumps(result), flush=True)
    return 0


# --- rollout ----------------------------------------------------------------------------------
# The rollout-engine benchmark (SD vs plain decoding in the tail) is its own subcommand: add its
# arguments in `add_rollout_parser` and its body in `cmd_rollout`. It must also end with one JSON line.


def add_rollout_parser(sub: argparse._SubParsersAction) -> None:
    from .rollout import add_arguments

    p = sub.add_parser("rollout", help="rollout engine: SD vs plain decoding in the tail")
    add_arguments(p)
    p.set_defaults(func=cmd_rollout)


def cmd_rollout(args: argparse.Namespace) -> int:
    from .rollout import cmd_rollout as run_rollout  # lazy: torch + transformers only

    return run_rollout(args)


def add_learner_parser(sub: argparse._SubParsersAction) -> None:
    from .learner import add_arguments, cmd_learner

    p = sub.add_parser("learner", help="learner group: 1 vs 2 FSDP2 ranks, object-store vs bucketed sync")
    add_arguments(p)
    add_set_argument(p)
    p.set_defaults(func=cmd_learner)


def add_coupling_parser(sub: argparse._SubParsersAction) -> None:
    from .coupling import add_arguments, cmd_coupling

    p = sub.add_parser("coupling", help="drafter/target agreement by coupling rule (the headroom under sampling)")
    add_arguments(p)
    add_set_argument(p)  # another drafter recipe: drafter.warmup_prompts=2048
    p.set_defaults(func=cmd_coupling)


def add_flips_parser(sub: argparse._SubParsersAction) -> None:
    from .flips import add_arguments, cmd_flips

    p = sub.add_parser("flips", help="keyed samples under another batch composition and under SD (rounding)")
    add_arguments(p)
    p.set_defaults(func=cmd_flips)


def add_draft_parser(sub: argparse._SubParsersAction) -> None:
    from .draft import add_arguments, cmd_draft

    p = sub.add_parser("draft", help="one speculative draft's cost: the drafter's float32 weights vs bfloat16 copies")
    add_arguments(p)
    p.set_defaults(func=cmd_draft)


def add_verify_parser(sub: argparse._SubParsersAction) -> None:
    from .verify import add_arguments, cmd_verify

    p = sub.add_parser("verify", help="a verify pass of T tokens against a decode step, T = 1..10")
    add_arguments(p)
    add_set_argument(p)
    p.set_defaults(func=cmd_verify)


def add_set_argument(p: argparse.ArgumentParser, scope: str = "") -> None:
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help=f"override a preset field {scope}(repeatable; YAML values), e.g. drafter.warmup_steps=800")


# --- entry ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.tlt.bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("e2e", help="end-to-end RL steps: TLT vs baseline, same seed")
    p.add_argument("--preset", default="smollm2-mathmix-cpu",
                   choices=["smollm2-mathmix-cpu", "tiny-cpu", "smollm2-cpu"])
    p.add_argument("--steps", type=int, help="RL steps per run (default: the preset's)")
    p.add_argument("--out", help="a new folder for the arms' metrics (default: a temp folder)")
    p.add_argument("--summarize", metavar="OUT", help="print the figures of the bench whose --out was OUT (one "
                   "that was cut short too: what its arms logged), without running anything")
    add_set_argument(p, "for every arm ")
    p.add_argument("--static-drafter", action=argparse.BooleanOptionalAction, default=None,
                   help="also run TLT with the drafter frozen after warm-up (default: on for "
                        f"{', '.join(sorted(STATIC_BY_DEFAULT))})")
    p.set_defaults(func=cmd_e2e)
    add_rollout_parser(sub)
    add_learner_parser(sub)
    add_coupling_parser(sub)
    add_flips_parser(sub)
    add_draft_parser(sub)
    add_verify_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    return args.func(args)

