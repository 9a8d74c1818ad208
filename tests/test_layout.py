"""The repository's shape: the stdlib `platform` is never shadowed, the ML library stays free of
Django and Celery, and the top-level layout and scripts the README promises exist."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str) -> dict:
    """Run `code` in a fresh interpreter with cwd at the repo root; it prints one JSON object."""
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_platform_from_the_repo_root_gives_the_stdlib_module():
    # `python -c` puts the cwd first on sys.path: the exact spot where a package would shadow it.
    got = _python(
        "import json, platform; "
        "print(json.dumps({'file': getattr(platform, '__file__', None), "
        "'has_system': callable(getattr(platform, 'system', None))}))"
    )
    assert got["has_system"], "platform.system is missing: `platform` is not the stdlib module"
    assert got["file"] and not Path(got["file"]).resolve().is_relative_to(ROOT), got["file"]


def test_platform_folder_is_a_source_root_not_a_package():
    assert (ROOT / "platform").is_dir()
    assert not (ROOT / "platform" / "__init__.py").exists()
    assert (ROOT / "platform" / "tltweb" / "__init__.py").is_file()


def test_no_top_level_module_or_package_is_named_like_a_stdlib_module():
    # Top level = not inside a package: such a name lands on sys.path (repo root, platform/, or a
    # test folder pytest inserts) and shadows the stdlib module of the same name.
    skip = {".venv", ".git", "var", "build", "node_modules", "test-artifacts", "__pycache__"}
    shadowing = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.endswith(".egg-info")]
        here = Path(dirpath)
        top_level = not (here / "__init__.py").exists()  # names here are importable at top level
        if not top_level:
            continue
        names = [(d, here / d) for d in dirnames if (here / d / "__init__.py").exists()]
        names += [(f[:-3], here / f) for f in filenames if f.endswith(".py")]
        for name, path in names:
            if name in sys.stdlib_module_names:
                shadowing.append(str(path.relative_to(ROOT)))
    assert not shadowing, f"these shadow standard-library modules: {shadowing}"


def test_the_tlt_library_imports_neither_django_nor_celery():
    # Import every module of workers.tlt (those needing an optional GPU-only package are skipped).
    got = _python(
        """
import importlib, json, pkgutil, sys
import workers.tlt
optional = {"vllm", "triton", "flash_attn"}
skipped = []
for info in pkgutil.walk_packages(workers.tlt.__path__, "workers.tlt."):
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in optional:
            raise
        skipped.append(info.name)
bad = sorted(m for m in sys.modules if m.split(".")[0] in {"django", "celery", "kombu", "tltweb"})
print(json.dumps({"bad": bad, "skipped": skipped}))
"""
    )
    assert got["bad"] == [], f"workers.tlt pulled in the control plane: {got['bad'][:10]}"


@pytest.mark.parametrize(
    "path",
    [
        "manage.py",
        "pyproject.toml",
        "README.md",
        "docker-compose.yml",
        "Dockerfile",
        ".env.example",
        ".ci/run",
        "platform/tltweb/settings.py",
        "workers/__init__.py",
        "workers/tlt/__init__.py",
        "templates",
        "static",
        "tests",
    ],
)
def test_top_level_layout_exists(path):
    assert (ROOT / path).exists(), f"{path} is missing"


def test_workers_package_init_is_empty():
    assert (ROOT / "workers" / "__init__.py").read_text().strip() == ""


@pytest.mark.parametrize("script", ["scripts/setup.sh", "scripts/dev.sh", "scripts/test.sh", ".ci/run"])
def test_scripts_are_executable_and_parse(script):
    path = ROOT / script
    assert path.is_file()
    assert path.stat().st_mode & 0o111, f"{script} is not executable"
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "set -euo pipefail" in path.read_text()


def test_scripts_never_use_rays_redis_port():
    # Redis owns 6379 everywhere; a Ray head there would collide with the Celery broker.
    for path in [*(ROOT / "scripts").glob("*.sh"), ROOT / "docker-compose.yml"]:
        text = path.read_text()
        assert "--port 6379" not in text and "--port=6379" not in text, path
