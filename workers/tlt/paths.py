"""Where a run may read files: paths in a config resolve only inside the folders the operator allows.

The platform gives every job two os.pathsep-separated lists in its environment:

    TLT_DATA_ROOTS    folders `task.path` may point into (the team's data folder)
    TLT_MODEL_ROOTS   folders `model.path` may point into (the shared models folder, the team's data folder)

A relative path is taken relative to the field's first root; symlinks and `..` are resolved before
the check, and the trainer then opens the resolved path. With neither variable set (a run on a
laptop, `python -m workers.tlt.train run.yaml`) nothing is restricted. The web app runs the same
check at launch (tltweb.runs.services.run_launch), so a bad path fails before any training.

    roots = PathRoots.from_env()
    cfg = config_paths_resolve(cfg, roots)     # ConfigError({"task.path": "... outside ..."})
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from .config import ConfigError, TLTConfig

DATA_ENV = "TLT_DATA_ROOTS"
MODEL_ENV = "TLT_MODEL_ROOTS"


@dataclass(frozen=True)
class PathRoots:
    data: tuple[Path, ...] = ()
    models: tuple[Path, ...] = ()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "PathRoots | None":
        """The job's roots, or None when the environment sets neither variable (no restriction)."""
        if DATA_ENV not in environ and MODEL_ENV not in environ:
            return None

        def split(name: str) -> tuple[Path, ...]:
            return tuple(Path(p) for p in environ.get(name, "").split(os.pathsep) if p.strip())

        return cls(data=split(DATA_ENV), models=split(MODEL_ENV))

    def to_env(self) -> dict[str, str]:
        return {DATA_ENV: os.pathsep.join(map(str, self.data)), MODEL_ENV: os.pathsep.join(map(str, self.models))}


def path_resolve(value: str, roots: Sequence[Path], *, field: str) -> Path:
    """`value` resolved inside one of `roots`; ConfigError naming `field` otherwise."""
    if "\x00" in value:
        raise ConfigError({field: "contains a NUL character"})
    if not roots:
        raise ConfigError({field: "no folder is allowed for this field on this platform"})
    path = Path(value)
    resolved = Path(os.path.realpath(path if path.is_absolute() else Path(roots[0]) / path))
    for root in roots:
        real_root = Path(os.path.realpath(root))
        if resolved == real_root or resolved.is_relative_to(real_root):
            return resolved
    allowed = ", ".join(str(r) for r in roots)
    raise ConfigError({field: f"{value!r} is outside the folders this run may read ({allowed})"})


def config_paths_resolve(cfg: TLTConfig, roots: PathRoots | None) -> TLTConfig:
    """cfg with `task.path` and `model.path` resolved inside the allowed roots (cfg itself when roots is None).

    Raises ConfigError with one entry per bad field.
    """
    if roots is None:
        return cfg
    errors: dict[str, str] = {}
    task_path, model_path = cfg.task.path, cfg.model.path
    if task_path:
        try:
            task_path = str(path_resolve(task_path, roots.data, field="task.path"))
        except ConfigError as exc:
            errors.update(exc.errors)
    if model_path:
        try:
            model_path = str(path_resolve(model_path, roots.models, field="model.path"))
        except ConfigError as exc:
            errors.update(exc.errors)
    if errors:
        raise ConfigError(errors)
    return cfg.model_copy(update={
        "task": cfg.task.model_copy(update={"path": task_path}),
        "model": cfg.model.model_copy(update={"path": model_path}),
    })
