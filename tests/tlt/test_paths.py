"""The trainer opens config paths only inside the roots its job was given (workers/tlt/paths.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers.tlt.config import ConfigError, preset
from workers.tlt.paths import PathRoots, config_paths_resolve

ROOT = Path(__file__).resolve().parents[2]


def _cfg(task_path: str = "", model_path: str = ""):
    overrides = {}
    if task_path:
        overrides["task"] = {"kind": "jsonl", "path": task_path}
    if model_path:
        overrides["model"] = {"source": "hf", "path": model_path}
    return preset("tiny-cpu", overrides)


@pytest.fixture
def roots(tmp_path):
    data, models = tmp_path / "data" / "7", tmp_path / "models"
    data.mkdir(parents=True)
    models.mkdir()
    return PathRoots(data=(data,), models=(models, data))


def test_without_roots_nothing_is_restricted():
    cfg = _cfg("/etc/passwd")
    assert config_paths_resolve(cfg, None) is cfg
    assert PathRoots.from_env({}) is None


def test_relative_paths_resolve_inside_the_first_root(roots):
    cfg = config_paths_resolve(_cfg("sets/a.jsonl", "qwen"), roots)
    assert cfg.task.path == str(roots.data[0].resolve() / "sets" / "a.jsonl")
    assert cfg.model.path == str(roots.models[0].resolve() / "qwen")


@pytest.mark.parametrize("task_path", ["/etc/passwd", "../8/x.jsonl", "sets/../../../etc/passwd", "/"])
def test_paths_outside_the_roots_are_refused_naming_the_field(roots, task_path):
    with pytest.raises(ConfigError) as err:
        config_paths_resolve(_cfg(task_path), roots)
    assert list(err.value.errors) == ["task.path"] and "outside" in err.value.errors["task.path"]


def test_a_symlink_pointing_out_is_refused(roots):
    (roots.data[0] / "link.jsonl").symlink_to("/etc/passwd")
    with pytest.raises(ConfigError):
        config_paths_resolve(_cfg("link.jsonl"), roots)


def test_both_fields_are_reported_at_once(roots):
    with pytest.raises(ConfigError) as err:
        config_paths_resolve(_cfg("/etc/passwd", "/root"), roots)
    assert set(err.value.errors) == {"task.path", "model.path"}


def test_roots_come_from_the_environment(roots):
    env = roots.to_env()
    assert PathRoots.from_env(env) == roots
    assert PathRoots.from_env({"TLT_DATA_ROOTS": ""}) == PathRoots(data=(), models=())


def test_the_trainer_refuses_a_path_outside_its_roots_before_opening_anything(tmp_path):
    env = {**os.environ, "TLT_CONFIG": _cfg("/etc/passwd").to_yaml(), "TLT_DATA_ROOTS": str(tmp_path / "data"),
           "TLT_MODEL_ROOTS": str(tmp_path / "models")}
    env.pop("TLT_INGEST_URL", None)
    proc = subprocess.run([sys.executable, "-m", "workers.tlt.train", "--out", str(tmp_path / "out")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "task.path" in proc.stderr and "outside" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing was created, let alone opened
