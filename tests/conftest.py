"""Shared fixtures: three users on one team (alice owns it, bob is a member, charlie is an outsider),
runs with ingestion tokens, and, for the integration and browser tests, a real Celery worker
subprocess against the test database and a real Ray head.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from early_exit import pytest_sessionstart, pytest_unconfigure  # noqa: F401 - how the process ends

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


@pytest.fixture
def alice_team(alice, team):
    return alice, team


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
    settings.TLT_DATA_DIR = tmp_path / "data"
    settings.TLT_MODELS_DIR = tmp_path / "models"
    # Launching asks the Ray cluster for its size; tests of that (and the integration tests) turn it on.
    settings.TLT_LAUNCH_CHECK_CLUSTER = False


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
         "--temp-dir", "/tmp/ray-tlt-6380",  # its own ray_current_cluster: jobs' drivers join this head (scripts/lib.sh)
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


class Gate:
    """A TCP forwarder in front of the live server: the address trainers use to reach the web app.

    `stop()` closes the listening socket and cuts every connection (clients get "connection refused",
    exactly as when the web app is stopped); `start()` opens it again on the same port.
    `cut_next_after(n)`: the next connection is cut after n bytes of request (an upload broken midway).
    """

    def __init__(self, upstream: tuple[str, int]):
        import threading

        self.upstream = upstream
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self._cut_after: int | None = None
        self.start()

    def cut_next_after(self, nbytes: int) -> None:
        self._cut_after = nbytes

    def start(self) -> None:
        import threading

        deadline = time.monotonic() + 30
        while True:  # the port may be held for a moment (e.g. as the source port of a client's retry)
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                listener.bind(("127.0.0.1", self.port))
                break
            except OSError:
                listener.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        if listener is not None:
            listener.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    @property
    def is_open(self) -> bool:
        return self._listener is not None

    def _accept(self, listener: socket.socket) -> None:
        import threading

        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    server.close()
                    return
                self._conns += [client, server]
                limit, self._cut_after = self._cut_after, None
            threading.Thread(target=self._pipe, args=(client, server, limit), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, None), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while data := src.recv(1 << 16):
                if limit is not None and sent + len(data) >= limit:
                    dst.sendall(data[: limit - sent])
                    break  # cut midway: both sides see the connection die
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@pytest.fixture(scope="session")
def ingest_gate(live_server):
    """The web app as the trainers see it (TLT_PUBLIC_URL of the Celery worker): a Gate to live_server."""
    from urllib.parse import urlsplit

    parts = urlsplit(live_server.url)
    gate = Gate((parts.hostname, parts.port))
    yield gate
    gate.stop()


def pids_alive(pids) -> list[int]:
    """The pids among `pids` that still run (zombies count as gone)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def pids_matching(*needles: str) -> list[int]:
    """Pids of live processes whose command line contains every needle (read from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmd and all(n in cmd for n in needles):
            out.append(int(entry.name))
    return pids_alive(out)


class CeleryProcs:
    """The Celery worker and the beat scheduler, each a process (and process group) of its own, as in
    scripts/dev.sh and compose: the fault tests kill -9 the worker and start it again."""

    def __init__(self, env: dict[str, str], work: Path):
        self.env, self.work = env, work
        self.log = ROOT / "test-artifacts" / "celery-worker.log"
        self.beat_log = ROOT / "test-artifacts" / "celery-beat.log"
        self.log.parent.mkdir(exist_ok=True)
        self.log.write_text("")
        self.hostname = f"test-{os.getpid()}@%h"
        self.worker: subprocess.Popen | None = None
        self.beat: subprocess.Popen | None = None

    def start_worker(self) -> subprocess.Popen:
        offset = self.log.stat().st_size
        with open(self.log, "a") as log:
            self.worker = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker", "--pool=solo",
                 "--loglevel=INFO", "--hostname", self.hostname],
                cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while "ready." not in self.log.read_text()[offset:]:
            if self.worker.poll() is not None or time.monotonic() > deadline:
                self.worker.kill()
                pytest.fail("the Celery worker did not start:\n" + self.log.read_text()[-3000:])
            time.sleep(0.5)
        return self.worker

    def start_beat(self) -> subprocess.Popen:
        with open(self.beat_log, "w") as log:
            self.beat = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "workers.celery_app", "beat", "--loglevel=INFO",
                 "--schedule", str(self.work / "beat-schedule")],
                cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        return self.beat

    def kill_worker(self) -> int:
        """SIGKILL the worker (no shutdown handlers run); returns its pid once it is reaped."""
        pid = self.worker.pid
        self.worker.kill()
        self.worker.wait(timeout=30)
        return pid

    @staticmethod
    def _stop(proc: subprocess.Popen | None) -> None:
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def stop(self) -> None:
        self._stop(self.worker)
        self._stop(self.beat)


@pytest.fixture(scope="session")
def celery_worker_proc(django_db_setup, django_db_blocker, live_server, ingest_gate, ray_head, tmp_path_factory):
    """A real Celery worker and a separate beat process on the test database; trainers reach the
    live server through `ingest_gate` (TLT_PUBLIC_URL), which the outage test closes for a while."""
    from django.conf import settings
    from workers.celery_app import app

    work = tmp_path_factory.mktemp("celery")
    env = {
        **os.environ,
        "DATABASE_URL": _database_url(settings.DATABASES["default"]),
        "TLT_PUBLIC_URL": ingest_gate.url,
        "RAY_ADDRESS": ray_head,
        "TLT_ARTIFACT_DIR": str(work / "artifacts"),
        "TLT_RUNS_DIR": str(work / "runs"),
        "TLT_DATA_DIR": str(work / "data"),
        "TLT_MODELS_DIR": str(work / "models"),
        "TLT_SYNC_INTERVAL_S": "2",
        "TLT_WEBHOOK_ALLOW_PRIVATE": "1",  # the tests' webhook receivers listen on loopback
        "TLT_RESUBMIT_AFTER_S": "20",
        # delivery from the trainers' spools: short back-off so a test sees the platform come back soon
        "TLT_INGEST_MAX_WAIT_S": "2",
        "TLT_INGEST_PAUSE_S": "2",
        "TLT_INGEST_RETRY_S": "30",
        "TLT_INGEST_DRAIN_S": "300",
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
    procs = CeleryProcs(env, work)
    procs.start_worker()
    procs.start_beat()
    yield procs
    procs.stop()


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
