"""Shared fixtures: three users on one team (alice owns it, bob is a member, charlie is an outsider),
runs with ingestion tokens, and, for the integration and browser tests, a real Celery worker
subprocess against the test database and a real Ray head.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PASSWORD = "correct-horse-battery"


# ---------- users, teams, runs ----------

@pytest.fixture
def alice(db):
    from django.contrib.auth.models import User

    return User.objects.create_user("alice", password=PASSWORD)


@pytest.fixture
def team(alice):
    from tltweb.accounts.services import team_create

    return team_create(name="Alice's lab", owner=alice)


def member_add(team, user, role):
    from tltweb.accounts.models import Member

    Member.objects.update_or_create(team=team, user=user, defaults={"role": role})


@pytest.fixture
def bob(team):
    """A team member; viewer unless a test raises his role with member_add."""
    from django.contrib.auth.models import User

    user = User.objects.create_user("bob", password=PASSWORD)
    member_add(team, user, "viewer")
    return user


@pytest.fixture
def charlie(db):
    """An outsider with a team of his own."""
    from django.contrib.auth.models import User
    from tltweb.accounts.services import team_create

    user = User.objects.create_user("charlie", password=PASSWORD)
    team_create(name="Charlie's lab", owner=user)
    return user


@pytest.fixture(autouse=True)
def _test_settings(settings, tmp_path):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast fixtures
    settings.TLT_ARTIFACT_DIR = tmp_path / "artifacts"
    settings.TLT_RUNS_DIR = tmp_path / "runs"


def run_make(team, creator, **fields):
    from tltweb.runs.models import Run
    from workers.tlt.config import preset

    cfg = preset("tiny-cpu")
    defaults = dict(name="tiny run", preset="tiny-cpu", config=cfg.model_dump(mode="json"), config_yaml=cfg.to_yaml())
    defaults.update(fields)
    return Run.objects.create(team=team, creator=creator, **defaults)


@pytest.fixture
def run(team, alice):
    return run_make(team, alice, tags=["baseline"])


@pytest.fixture
def run_token(run):
    from tltweb.runs.services import run_token_rotate

    return run_token_rotate(run=run)


def metrics_record_fake(step: int) -> dict:
    """A record shaped like the trainer's (workers/tlt/metrics.py)."""
    return {
        "step": step,
        "scalars": {
            "reward/mean": 0.1 * step, "reward/accuracy": 0.05 * step, "rollout/len_p50": 40.0, "rollout/len_p90": 90.0,
            "rollout/len_p99": 150.0, "rollout/len_max": 190.0, "rollout/logprob_mismatch": 0.001,
            "spec/acceptance_length": 2.0 + step / 10, "spec/switch_on_s": 1.5, "drafter/loss": 1.0 / (step + 1),
            "drafter/accuracy": 0.4, "idle/worker_s": 3.0, "idle/reclaimed_s": 2.0, "idle/reclaimed_frac": 2 / 3,
            "timing_s/step": 5.0, "timing_s/rollout": 4.0, "timing_s/reward": 0.1, "timing_s/learner": 0.8,
            "timing_s/sync": 0.1, "rollout/tail_tokens_per_s_sd": 300.0, "rollout/tail_tokens_per_s_no_sd": 180.0,
        },
        "series": {
            "rollout/lengths": [20, 30, 35, 40, 41, 60, 90, 190],
            "rollout/running": {"t": [0, 1, 1.5, 2, 3], "running": [8, 6, 3, 2, 0], "sd": [0, 0, 1, 1, 1]},
            "spec/accept_by_position": [0.8, 0.6, 0.4, 0.2],
            "spec/strategy": {"1": {"4x1x4": 3}, "2-4": {"4x1x4": 1, "6x1x6": 2}},
            "idle/timeline": [
                {"worker": 0, "segments": [["generate", 0, 3], ["idle", 3, 3.5], ["drafter", 3.5, 4]]},
                {"worker": 1, "segments": [["generate", 0, 1.5], ["drafter", 1.5, 4]]},
            ],
            "rollout/samples": rollout_samples_fake(step),
        },
    }


def rollout_samples_fake(step: int, n: int = 4) -> list[dict]:
    """The series "rollout/samples" as the trainer sends it: a few responses of the step, with the
    tokens the drafter proposed and the target accepted marked 1 in from_draft."""
    out = []
    for i in range(n):
        tokens = ["<think>", " 3", " +", " 4", " =", " 7", "</think>", " 7"][: 4 + i] + (["…"] * (3 * i))
        out.append({
            "sample": i,
            "prompt": f"step {step} problem {i}: 3 + 4 = ?",
            "tokens": tokens,
            "from_draft": [1 if (j % 3 == 1 and i % 2 == 0) else 0 for j in range(len(tokens))],
            "reward": 1.0 if i % 2 == 0 else 0.0,
            "length": len(tokens),
            "truncated": i == n - 1,
        })
    return out


# ---------- real services: Ray head and Celery worker ----------

def _ray_up(address: str) -> bool:
    import requests
    from tltweb.runs.dispatch import ray_auth_headers

    try:
        return requests.get(address.rstrip("/") + "/api/version", headers=ray_auth_headers(), timeout=2).ok
    except requests.RequestException:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_head():
    """The Ray job API at RAY_ADDRESS; starts a local head (and stops it) when none answers."""
    from django.conf import settings

    address = settings.RAY_ADDRESS
    if _ray_up(address):
        yield address
        return
    ray_bin = Path(sys.executable).with_name("ray")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [str(ray_bin), "start", "--head", "--block", "--port", "6380", "--dashboard-port", "8265",
         # a free job-agent port: the default 52365 may be held by another Ray on this host
         "--dashboard-agent-listen-port", str(_free_port()), "--num-cpus", "2", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not _ray_up(address):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"could not start a Ray head for {address}")
        time.sleep(1)
    yield address
    proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its Ray processes on SIGTERM
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def _database_url(db: dict) -> str:
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    auth = db["USER"] + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
    return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


@pytest.fixture(scope="session")
def celery_worker_proc(django_db_setup, django_db_blocker, live_server, ray_head, tmp_path_factory):
    """A real `celery worker -B` subprocess on the test database, with live_server as TLT_PUBLIC_URL."""
    from django.conf import settings
    from workers.celery_app import app

    work = tmp_path_factory.mktemp("celery")
    env = {
        **os.environ,
        "DATABASE_URL": _database_url(settings.DATABASES["default"]),
        "TLT_PUBLIC_URL": live_server.url,
        "RAY_ADDRESS": ray_head,
        "TLT_ARTIFACT_DIR": str(work / "artifacts"),
        "TLT_RUNS_DIR": str(work / "runs"),
        "TLT_SYNC_INTERVAL_S": "2",
        "PYTHONUNBUFFERED": "1",
    }
    if settings.CELERY_BROKER_URL.startswith("filesystem://"):
        # A private queue folder: no stale message from another session reaches this worker.
        env["CELERY_FS_DIR"] = str(work / "broker")
        for sub in ("queue", "processed"):
            (work / "broker" / sub).mkdir(parents=True)
        app.conf.broker_transport_options = {
            "data_folder_in": str(work / "broker" / "queue"),
            "data_folder_out": str(work / "broker" / "queue"),
            "data_folder_processed": str(work / "broker" / "processed"),
            "control_folder": str(work / "broker" / "control"),  # default: ./control in the cwd
        }
    if app._pool is not None:  # forget producer connections made with the old broker options
        app._pool.force_close_all()
        app._pool = None
    log_path = ROOT / "test-artifacts" / "celery-worker.log"
    log_path.parent.mkdir(exist_ok=True)
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker", "-B", "--pool=solo",
         "--loglevel=INFO", "--schedule", str(work / "beat-schedule"), "--hostname", f"test-{os.getpid()}@%h"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while "ready." not in log_path.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the Celery worker did not start:\n" + log_path.read_text()[-3000:])
        time.sleep(0.5)
    yield {"proc": proc, "log": log_path, "env": env}
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


# ---------- browser ----------

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]


@pytest.fixture(scope="module")
def browser():
    playwright = pytest.importorskip("playwright.sync_api")
    if not Path("/usr/bin/chromium").exists():
        pytest.skip("Debian chromium is not installed at /usr/bin/chromium")
    # Playwright's sync API keeps an asyncio loop on this thread; the ORM calls in the test body are
    # still plain synchronous code, so tell Django's async-safety check so.
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with playwright.sync_playwright() as pw:
            b = pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS, headless=True)
            yield b
            b.close()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
    pg = context.new_page()
    pg.set_default_timeout(20_000)
    yield pg
    context.close()


@pytest.fixture(scope="session")
def screenshots():
    folder = ROOT / "test-artifacts" / "screenshots"
    folder.mkdir(parents=True, exist_ok=True)
    return folder
