"""docker-compose.yml is valid (checked by Debian's docker-compose with .env.example) and every
service command names something that exists in this project."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = [ROOT, ROOT / "platform"]  # pyproject: packages.find where = [".", "platform"]
APP_SERVICES = {"web", "worker", "beat", "ray-head", "ray-gpu-worker"}


def _compose_binary() -> str:
    found = shutil.which("docker-compose") or next(
        (p for p in ("/usr/bin/docker-compose", "/usr/local/bin/docker-compose") if os.access(p, os.X_OK)),
        None,
    )
    if not found:
        pytest.skip("docker-compose not found (scripts/setup.sh installs Debian's docker-compose as root)")
    return found


@pytest.fixture(scope="module")
def compose() -> dict:
    # A clean environment, so only .env.example feeds the interpolation.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp")}
    proc = subprocess.run(
        [_compose_binary(), "--env-file", ".env.example", "--profile", "gpu", "-f", "docker-compose.yml", "config"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def _module_exists(dotted: str) -> bool:
    parts = dotted.split(".")
    for root in SOURCE_ROOTS:
        base = root.joinpath(*parts)
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return True
    return False


def _commands(service: dict) -> list[list[str]]:
    """A service's command as argv lists; `sh -c "a && b"` becomes [a..], [b..]."""
    command = service.get("command")
    if command is None:
        return []
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    if argv[:2] in (["sh", "-c"], ["bash", "-c"]):
        return [shlex.split(part) for part in re.split(r"&&|;|\|\|", argv[2]) if part.strip()]
    return [argv]


def _referenced_names(argv: list[str]) -> list[str]:
    """What an argv needs from the project, as 'module:x', 'file:x' or 'ok' entries."""
    if argv and argv[0] == "exec":
        argv = argv[1:]
    prog, args = argv[0], argv[1:]
    if prog in {"python", "python3"}:
        if args[:1] == ["-m"]:
            return [f"module:{args[1]}"]
        return [f"file:{args[0]}"]
    if prog == "gunicorn":
        app = next(a for a in args if re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+(:\w+)?", a))
        return [f"module:{app.split(':')[0]}"]
    if prog == "celery":
        return [f"module:{args[args.index('-A') + 1].split(':')[0]}"]
    if prog.startswith(("scripts/", "./scripts/", "/app/scripts/")):
        return [f"file:{prog.removeprefix('/app/').removeprefix('./')}"]
    if prog in {"ray", "redis-server"}:
        return ["ok"]
    raise AssertionError(f"unknown program in a service command: {argv}")


def test_compose_defines_the_platform_services(compose):
    assert set(compose["services"]) == {"postgres", "redis", *APP_SERVICES}
    assert {"pgdata", "artifacts", "runs", "teams", "models"} <= set(compose["volumes"])


def test_every_service_command_names_something_in_the_project(compose):
    missing = []
    for name, service in compose["services"].items():
        for argv in _commands(service):
            for ref in _referenced_names(argv):
                kind, _, target = ref.partition(":")
                if kind == "module" and not _module_exists(target):
                    missing.append(f"{name}: module {target}")
                if kind == "file" and not (ROOT / target).is_file():
                    missing.append(f"{name}: file {target}")
        settings = service.get("environment", {}).get("DJANGO_SETTINGS_MODULE")
        if settings and not _module_exists(settings):
            missing.append(f"{name}: settings module {settings}")
    assert not missing, missing


def test_web_runs_gunicorn_after_migrate_and_beat_runs_as_its_own_service(compose):
    web = compose["services"]["web"]["command"]
    web = web if isinstance(web, str) else " ".join(web)
    assert "runserver" not in web
    assert web.index("manage.py migrate") < web.index("gunicorn tltweb.wsgi")
    worker = compose["services"]["worker"]["command"]
    assert "worker" in worker and "-B" not in worker and "--beat" not in worker  # a kill -9 cannot orphan beat
    beat = compose["services"]["beat"]["command"]
    assert beat[:4] == ["celery", "-A", "workers.celery_app", "beat"]
    assert compose["services"]["beat"].get("deploy", {}).get("replicas", 1) == 1


def test_team_data_and_models_folders_are_configured_for_every_app_service(compose):
    for name in APP_SERVICES:
        env = compose["services"][name]["environment"]
        assert env["TLT_DATA_DIR"] and env["TLT_MODELS_DIR"], name


def test_ray_head_uses_gcs_port_6380_and_the_gpu_worker_joins_it(compose):
    head = compose["services"]["ray-head"]["command"]
    assert "--head" in head and "--port=6380" in head and "--dashboard-port=8265" in head
    gpu = compose["services"]["ray-gpu-worker"]
    assert "--address=ray-head:6380" in gpu["command"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)


def test_only_the_control_plane_holds_database_credentials(compose):
    for name in ("web", "worker", "beat"):
        assert compose["services"][name]["environment"]["DATABASE_URL"].startswith("postgres://")
    for name in ("ray-head", "ray-gpu-worker"):
        env = compose["services"][name].get("environment", {})
        assert "DATABASE_URL" not in env and "SECRET_KEY" not in env, name


def test_app_services_share_one_image_definition(compose):
    text = (ROOT / "docker-compose.yml").read_text()
    assert text.count("&app\n") == 1 and text.count("<<: *app\n") == len(APP_SERVICES)
    images = {compose["services"][s]["image"].split(":")[0] for s in APP_SERVICES - {"ray-gpu-worker"}}
    assert len(images) == 1


def test_stateful_services_have_health_checks(compose):
    for name in ("postgres", "redis", "web", "worker", "ray-head"):
        assert compose["services"][name].get("healthcheck", {}).get("test"), name
