"""Benchmarks that print the headline TLT figures; the LAST stdout line is one JSON object.

    python -m workers.tlt.bench e2e [--preset tiny-cpu|smollm2-cpu] [--steps N] [--out DIR]
                                    [--set drafter.warmup_steps=800 ...]   # preset overrides
    python -m workers.tlt.bench rollout ...        # rollout engine: SD vs plain in the tail

e2e trains the same config twice in one invocation, same seed, on the same machine and Ray
instance: the baseline (run.tlt false: no SD, no spot training) and TLT. It reports

    e2e_speedup          baseline mean step time / TLT mean step time
    rollout_share        rollout time / step time in the baseline (the part TLT can shrink)
    rollout_speedup      baseline / TLT mean rollout time: TLT's own effect, free of the learner's
                         cost, which varies with the rewards (zero-advantage groups are skipped)
    idle_reclaimed_frac  idle worker-seconds used for drafter training, TLT run
    acceptance_length    mean tokens per verify pass while SD was on, TLT run
    acceptance_by_step   the same per step (it should rise as spot training adapts the drafter)
    reward_tlt / reward_baseline   mean reward of each run (same curves expected)
    profile_s            mean seconds per step of each phase (sync, rollout, its tail, learner), both runs
    setup_s / wall_s     one-off costs outside the steps (policy, drafter warm-up, actors); whole runs
    loadavg_start/_end   the machine's load: figures from a shared machine are only as good as this

The baseline is the strong one: the same engine and batching (finished rows leave the batch), SD
and spot training off. Step means skip the first step (one-off warm-up costs).

Benchmarks measure; tests check correctness, never timings.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("workers.tlt.bench")


# --- e2e --------------------------------------------------------------------------------------


def _train(cfg, out: Path) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Run one config; returns every step's scalars and the setup seconds (policy, drafter_warmup, actors)."""
    from .metrics import ConsoleSink, JsonlSink, Tracking
    from .trainer import Trainer

    tracking = Tracking([ConsoleSink(), JsonlSink(out / "metrics.jsonl")])
    trainer = Trainer(cfg, out, tracking)
    try:
        trainer.setup()
        trainer.run()
        return [h.scalars for h in trainer.history], dict(trainer.setup_s)
    finally:
        trainer.close()
        tracking.close()


def _mean(rows: list[dict[str, float]], key: str, skip: int = 0) -> float:
    vals = [r[key] for r in rows[skip:] if key in r] or [r[key] for r in rows if key in r]
    return float(sum(vals) / len(vals)) if vals else 0.0


def e2e(preset_name: str, steps: int | None, out: Path, overrides: dict[str, dict[str, Any]] | None = None,
        warm_skip: int = 1) -> dict[str, Any]:
    """Baseline then TLT on one Ray instance; returns the figures (see the module doc)."""
    import ray

    from .config import load_config, preset
    from .trainer import ensure_ray

    base = preset(preset_name, overrides)
    data = base.model_dump(mode="json")
    if steps is not None:
        data["run"]["steps"] = steps
    data["run"]["checkpoint_interval"] = 0
    load_start = os.getloadavg()
    started = ensure_ray(num_cpus=max(data["rollout"]["num_workers"], os.cpu_count() or 1))
    try:
        runs, setup, wall = {}, {}, {}
        for name, tlt in (("baseline", False), ("tlt", True)):
            d = json.loads(json.dumps(data))
            d["run"]["tlt"] = tlt
            t = time.perf_counter()
            runs[name], setup[name] = _train(load_config(d), out / name)
            wall[name] = time.perf_counter() - t
            log.info("%s: %d steps in %.1fs (setup %s)", name, len(runs[name]), wall[name],
                     {k: round(v, 1) for k, v in setup[name].items()})
    finally:
        if started:
            ray.shutdown()
    b, t = runs["baseline"], runs["tlt"]
    skip = warm_skip if len(b) > warm_skip else 0  # the first step pays one-off warm-up costs
    base_step, tlt_step = _mean(b, "timing_s/step", skip), _mean(t, "timing_s/step", skip)
    base_roll, tlt_roll = _mean(b, "timing_s/rollout", skip), _mean(t, "timing_s/rollout", skip)
    # where the step time goes (mean seconds per step, after the skipped warm-up steps)
    phases = ("sync", "rollout", "reward", "learner", "buffer")
    profile = {name: {p: round(_mean(rows, f"timing_s/{p}", skip), 4) for p in phases}
               for name, rows in runs.items()}
    for name, rows in runs.items():
        profile[name]["rollout_tail"] = round(_mean(rows, "rollout/tail_s", skip), 4)
    return {
        "bench": "e2e",
        "preset": preset_name,
        "steps": len(t),
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "e2e_speedup": base_step / tlt_step if tlt_step > 0 else 0.0,
        "step_s_baseline": base_step,
        "step_s_tlt": tlt_step,
        "rollout_share": base_roll / base_step if base_step > 0 else 0.0,
        "rollout_share_tlt": tlt_roll / tlt_step if tlt_step > 0 else 0.0,
        "rollout_speedup": base_roll / tlt_roll if tlt_roll > 0 else 0.0,
        "idle_reclaimed_frac": (sum(r["idle/reclaimed_s"] for r in t) / max(sum(r["idle/worker_s"] for r in t), 1e-9)),
        "idle_worker_s_tlt": sum(r["idle/worker_s"] for r in t),
        "acceptance_length": _mean(t, "spec/acceptance_length"),
        "acceptance_by_step": [round(r.get("spec/acceptance_length", 0.0), 3) for r in t],
        "tail_tokens_per_s_sd": _mean(t, "rollout/tail_tokens_per_s_sd"),
        "tail_tokens_per_s_no_sd": _mean(b, "rollout/tail_tokens_per_s_no_sd"),
        "reward_tlt": _mean(t, "reward/mean"),
        "reward_baseline": _mean(b, "reward/mean"),
        "reward_by_step_tlt": [round(r["reward/mean"], 4) for r in t],
        "reward_by_step_baseline": [round(r["reward/mean"], 4) for r in b],
        "drafter_steps_tlt": sum(r.get("drafter/steps", 0.0) for r in t),
        "drafter_accuracy_by_step": [round(r.get("drafter/accuracy", 0.0), 3) for r in t],
        "drafter_updates_tlt": sum(r.get("drafter/updates", 0.0) for r in t),
        "drafter_dropped_updates_tlt": sum(r.get("drafter/dropped_updates", 0.0) for r in t),
        "len_max_by_step": [int(r.get("rollout/len_max", 0)) for r in t],
        "profile_s": profile,
        # one-off costs outside the steps: the SFT'd policy (cached after the first run), the TLT
        # drafter's offline warm-up, actor start; and each run's whole wall time, setup included
        "setup_s": {name: {k: round(v, 2) for k, v in s.items()} for name, s in setup.items()},
        "wall_s": {name: round(v, 1) for name, v in wall.items()},
    }


def parse_overrides(items: list[str]) -> dict[str, dict[str, Any]]:
    """["drafter.lr=2e-3", "spec.strategies=[[4,1,4]]"] -> {"drafter": {"lr": ...}, "spec": {...}}
    (values are YAML; the config validates them and names a bad field)."""
    import yaml

    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        section, dot, field = key.partition(".")
        if not (sep and dot and section and field):
            raise SystemExit(f"--set {item!r}: expected section.field=value")
        out.setdefault(section, {})[field] = yaml.safe_load(value)
    return out


def cmd_e2e(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="tlt-bench-e2e-"))
    result = e2e(args.preset, args.steps, out, overrides=parse_overrides(args.set))
    result["out"] = str(out)
    print(json.dumps(result), flush=True)
    return 0


# --- rollout ----------------------------------------------------------------------------------
# The rollout-engine benchmark (SD vs plain decoding in the tail) is its own subcommand: add its
# arguments in `add_rollout_parser` and its body in `cmd_rollout`. It must also end with one JSON line.


def add_rollout_parser(sub: argparse._SubParsersAction) -> None:
    from .bench_rollout import add_arguments

    p = sub.add_parser("rollout", help="rollout engine: SD vs plain decoding in the tail")
    add_arguments(p)
    p.set_defaults(func=cmd_rollout)


def cmd_rollout(args: argparse.Namespace) -> int:
    from .bench_rollout import cmd_rollout as run_rollout  # lazy: torch + transformers only

    return run_rollout(args)


# --- entry ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.tlt.bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("e2e", help="end-to-end RL steps: TLT vs baseline, same seed")
    p.add_argument("--preset", default="tiny-cpu", choices=["tiny-cpu", "smollm2-cpu"])
    p.add_argument("--steps", type=int, help="RL steps per run (default: the preset's)")
    p.add_argument("--out", help="folder for both runs' metrics (default: a temp folder)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a preset field for both runs (repeatable), e.g. drafter.warmup_steps=800")
    p.set_defaults(func=cmd_e2e)
    add_rollout_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
