"""Train with TLT from a config file, a preset, or the TLT_CONFIG environment variable.

    python -m workers.tlt.train --preset tiny-cpu --out runs/demo
    python -m workers.tlt.train run.yaml --out runs/demo [--resume]
    TLT_CONFIG="$(cat run.yaml)" python -m workers.tlt.train --out runs/demo     # what a Ray job does

Metrics always go to the console and to OUT/metrics.jsonl; with TLT_INGEST_URL and TLT_RUN_TOKEN
set they also go to the platform (setup progress included), through a local spool (OUT/spool,
workers/tlt/spool.py) that a background thread delivers, so an absent web app never stops training;
if the spool cannot be emptied at the end the exit code is 75 and a --resume delivers the rest. With
TLT_MLFLOW_TRACKING_URI set they are mirrored to MLflow (experiment TLT_MLFLOW_EXPERIMENT, run name
TLT_RUN_NAME; TLT_MLFLOW_ARTIFACTS=1 also copies the drafter and policy zips there). A bad config,
or a task.path/model.path outside TLT_DATA_ROOTS/TLT_MODEL_ROOTS (workers/tlt/paths.py), exits with
code 2 and names the field.
SIGTERM (Ray job stop) abandons the step in flight, flushes the background checkpoint writer (so
the last checkpoint is complete; --resume continues from it) and exits 143.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from .config import ConfigError, TLTConfig, load_config, preset
from .metrics import ConsoleSink, JsonlSink, MlflowSink, Tracking
from .paths import PathRoots, config_paths_resolve
from .spool import spool_from_env

log = logging.getLogger("workers.tlt.train")

EXIT_BAD_CONFIG = 2
EXIT_TERMINATED = 143  # 128 + SIGTERM
EXIT_UNDELIVERED = 75  # EX_TEMPFAIL: trained, but the spool still holds records for the platform
EXIT_INFRA = 69  # EX_UNAVAILABLE: a Ray worker, node or object died under the trainer (the platform resumes it)


def ray_infra_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean the cluster failed the trainer, not the trainer's own code (RayTaskError is that)."""
    import ray.exceptions as rex

    names = ("RayActorError", "WorkerCrashedError", "NodeDiedError", "LocalRayletDiedError", "ObjectLostError",
             "OutOfMemoryError", "GetTimeoutError", "RaySystemError")
    return tuple(getattr(rex, n) for n in names if hasattr(rex, n))


class Terminated(Exception):
    """Raised in the main thread by the SIGTERM handler."""


def read_config(path: str | None, preset_name: str | None) -> TLTConfig:
    """The run's config: a file, else a preset, else YAML in env TLT_CONFIG (ConfigError if none)."""
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError({"config": f"no such file: {path}"})
        cfg = load_config(p.read_text())
        return cfg
    if preset_name:
        return preset(preset_name)
    text = os.environ.get("TLT_CONFIG")
    if text:
        return load_config(text)
    raise ConfigError({"config": "give a config file, --preset NAME, or YAML in the TLT_CONFIG environment variable"})


def build_tracking(out: Path, cfg: TLTConfig | None = None) -> Tracking:
    """Console and OUT/metrics.jsonl always; the platform through the spool (records, artifacts and
    progress) when the job has its ingestion URL and token; the MLflow mirror when configured."""
    sinks = [ConsoleSink(), JsonlSink(out / "metrics.jsonl")]
    url, token = os.environ.get("TLT_INGEST_URL"), os.environ.get("TLT_RUN_TOKEN")
    if url and token:
        sinks.append(spool_from_env(out, url, token))
    elif url or token:
        log.warning("TLT_INGEST_URL and TLT_RUN_TOKEN must both be set to post metrics; posting nothing")
    mlflow = mlflow_sink(cfg)
    if mlflow is not None:
        sinks.append(mlflow)
    return Tracking(sinks)


def _flatten(data: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def mlflow_sink(cfg: TLTConfig | None) -> MlflowSink | None:
    """The MLflow mirror that TLT_MLFLOW_TRACKING_URI asks for, or None (not configured, or MLflow
    unreachable or not installed: the run goes on, reported to the platform as always)."""
    uri = os.environ.get("TLT_MLFLOW_TRACKING_URI", "").strip()
    if not uri:
        return None
    tags = {"tlt.source": "tlt-platform"}
    for env, tag in (("TLT_RUN_ID", "tlt.run_id"), ("TLT_RUN_TEAM", "tlt.team")):
        if os.environ.get(env):
            tags[tag] = os.environ[env]
    try:
        return MlflowSink(
            uri,
            experiment=os.environ.get("TLT_MLFLOW_EXPERIMENT") or "tlt",
            run_name=os.environ.get("TLT_RUN_NAME", ""),
            tags=tags,
            params=_flatten(cfg.model_dump(mode="json")) if cfg is not None else None,
            upload_artifacts=os.environ.get("TLT_MLFLOW_ARTIFACTS", "").lower() in {"1", "true", "yes", "on"},
        )
    except Exception as exc:  # ImportError (no mlflow-skinny here), a server that is down, ...
        log.error("not mirroring to MLflow at %s: %s", uri, exc)
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.tlt.train", description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", help="YAML config file (default: --preset, else env TLT_CONFIG)")
    parser.add_argument("--out", required=True, help="run folder: metrics.jsonl, checkpoints/, policy.zip")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    parser.add_argument("--preset", help="a named preset (tiny-cpu, smollm2-cpu, qwen2.5-7b-gpu)")
    parser.add_argument("--steps", type=int, help="override run.steps")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    try:
        cfg = read_config(args.config, args.preset)
        if args.steps is not None:
            data = cfg.model_dump(mode="json")
            data["run"]["steps"] = args.steps
            cfg = load_config(data)
        cfg = config_paths_resolve(cfg, PathRoots.from_env())  # before anything opens a path
    except ConfigError as exc:
        print(f"error: bad config: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG

    from tqdm import tqdm

    from .trainer import Trainer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tracking = build_tracking(out, cfg)
    bar = tqdm(total=cfg.run.steps, desc="rl", unit="step", file=sys.stderr)

    def progress(step: int, scalars: dict[str, float]) -> None:
        bar.n = step
        bar.set_postfix(reward=f"{scalars.get('reward/mean', 0):.3f}", step_s=f"{scalars.get('timing_s/step', 0):.1f}")
        bar.refresh()

    trainer = Trainer(cfg, out, tracking, resume=args.resume, progress=progress)
    terminated = False

    def on_sigterm(signum, frame):  # Ray job stop: leave now; the last complete checkpoint is the resume point
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    infra_failure = False
    try:
        trainer.setup()
        bar.n = trainer.step
        bar.refresh()
        summary = trainer.run()
        log.info("done: %s", summary)
    except (Terminated, KeyboardInterrupt):
        terminated = True
        log.warning("terminated at step %d: flushing the checkpoint writer", trainer.step)
    except ray_infra_errors() as exc:  # exit 69: the platform resumes the run from its last checkpoint
        infra_failure = True
        log.error("the Ray cluster failed the trainer at step %d: %r", trainer.step, exc)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the flush short
        bar.close()
        try:
            trainer.close()  # waits for the background drafter write: checkpoints stay complete
        finally:
            tracking.close()
            signal.signal(signal.SIGTERM, previous)
    if terminated:
        return EXIT_TERMINATED
    if infra_failure:
        return EXIT_INFRA
    return EXIT_UNDELIVERED if any(getattr(s, "undelivered", 0) for s in tracking.sinks) else 0


if __name__ == "__main__":
    raise SystemExit(main())
