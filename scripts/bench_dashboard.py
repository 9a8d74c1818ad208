#!/usr/bin/env python
"""Load benchmark of the run page's polling: N dashboard viewers watch one running run for a while.

    .venv/bin/python scripts/bench_dashboard.py                      # 20 viewers, 60 s, gunicorn 3x4
    .venv/bin/python scripts/bench_dashboard.py --viewers 50 --duration 120 --database-url postgres://...

It builds a fresh database (SQLite in a temporary folder unless --database-url names an empty one),
creates a team, a running run with --initial-steps steps of metrics and one API token per viewer,
starts gunicorn on 127.0.0.1 as compose does, and then for --duration seconds:

- a "trainer" (the real HttpSink of workers/tlt/metrics.py) posts one step every --step-every seconds
  to the run's ingestion endpoint;
- each viewer does what static/js/run_detail.js does in a visible tab: GET /api/runs/<id>/metrics?since=
  <last step> every --interval seconds and, when new steps arrived, GET /api/runs/<id>/metrics/<step>.

Everything stays on 127.0.0.1 and every loop ends at the deadline. Progress goes to stderr; the last
stdout line is one JSON object: requests, errors, p50/p95/p99/max latency in ms (all requests, the
metrics endpoint alone, the step endpoint, the ingestion posts), steps posted and seen.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(f"[bench-dashboard] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return round((ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)) * 1000, 2)


def summary(latencies: list[float]) -> dict[str, float | None]:
    return {"n": len(latencies), "p50_ms": percentile(latencies, 50), "p95_ms": percentile(latencies, 95),
            "p99_ms": percentile(latencies, 99), "max_ms": round(max(latencies) * 1000, 2) if latencies else None}


def setup_world(env: dict[str, str], viewers: int, initial_steps: int) -> dict:
    """Migrate the fresh database and create the team, the running run and the tokens (in this process)."""
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True)
    os.environ.update(env)
    sys.path.insert(0, str(ROOT / "platform"))
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.contrib.auth.models import User
    from django.utils import timezone

    from tltweb.accounts.services import api_token_create, team_create
    from tltweb.runs.models import Run
    from tltweb.runs.services import metrics_record, run_token_rotate
    from workers.tlt.config import preset

    owner = User.objects.create_user("bench-owner", password=secrets.token_urlsafe(16))
    team = team_create(name="bench", owner=owner)
    cfg = preset("tiny-cpu")
    run = Run.objects.create(team=team, creator=owner, name="bench run", preset="tiny-cpu", state="running",
                             started_at=timezone.now(), config=cfg.model_dump(mode="json"), config_yaml=cfg.to_yaml())
    for step in range(1, initial_steps + 1):
        scalars, series = fake_record(step)
        metrics_record(run=run, step=step, scalars=scalars, series=series)
    tokens = [api_token_create(user=owner, name=f"viewer {i}")[1] for i in range(viewers)]
    return {"run_id": str(run.id), "ingest_token": run_token_rotate(run=run), "tokens": tokens}


def fake_record(step: int) -> tuple[dict, dict]:
    """A record of the size a tiny-cpu step has: 23 scalars, 64 lengths, timelines of 2 workers."""
    scalars = {f"section/metric_{i}": 0.01 * step * i for i in range(23)}
    scalars["reward/mean"] = 0.1 + 0.01 * step
    series = {
        "rollout/lengths": [20 + (7 * i * step) % 170 for i in range(64)],
        "rollout/running": {"t": [i * 0.1 for i in range(60)], "running": list(range(60, 0, -1)), "sd": [0] * 40 + [1] * 20},
        "idle/timeline": [{"worker": w, "segments": [["generate", 0, 3.0 + w], ["idle", 3.0 + w, 4], ["drafter", 4, 5]]}
                          for w in range(2)],
    }
    return scalars, series


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--viewers", type=int, default=20)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of polling")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between a viewer's polls (run_detail.js: 2)")
    parser.add_argument("--step-every", type=float, default=1.0, help="seconds between the trainer's steps")
    parser.add_argument("--initial-steps", type=int, default=50)
    parser.add_argument("--gunicorn-workers", type=int, default=3)
    parser.add_argument("--gunicorn-threads", type=int, default=4)
    parser.add_argument("--database-url", default="", help="an empty database to use instead of a fresh SQLite file")
    args = parser.parse_args(argv)

    import requests

    from workers.tlt.metrics import HttpSink

    work = Path(tempfile.mkdtemp(prefix="tlt-bench-dashboard-"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "DATABASE_URL": args.database_url or f"sqlite:///{work / 'db.sqlite3'}",
        "DEBUG": "false", "SECRET_KEY": secrets.token_urlsafe(40), "ALLOWED_HOSTS": "127.0.0.1",
        "SECURE_SSL_REDIRECT": "false", "SESSION_COOKIE_SECURE": "false", "CSRF_COOKIE_SECURE": "false",
        "TLT_VAR_DIR": str(work), "TLT_ARTIFACT_DIR": str(work / "artifacts"), "CELERY_FS_DIR": str(work / "celery"),
        "TLT_LOGIN_FAILURE_LIMIT": "1000000", "LOG_LEVEL": "WARNING", "PYTHONPATH": str(ROOT / "platform"),
        "DJANGO_SETTINGS_MODULE": "tltweb.settings",
    }
    env.pop("CELERY_BROKER_URL", None)
    log(f"database and fixtures in {work}")
    world = setup_world(env, args.viewers, args.initial_steps)
    gunicorn = Path(sys.executable).with_name("gunicorn")
    server = subprocess.Popen(
        [str(gunicorn), "tltweb.wsgi:application", "--bind", f"127.0.0.1:{port}", "--workers", str(args.gunicorn_workers),
         "--threads", str(args.gunicorn_threads), "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=sys.stderr, stderr=sys.stderr, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(base + "/login/", timeout=2).ok:
                    break
            except requests.RequestException:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("gunicorn did not start")
            time.sleep(0.3)
        log(f"gunicorn {args.gunicorn_workers}x{args.gunicorn_threads} on {base}; {args.viewers} viewers for {args.duration:.0f} s")
        result = run_load(base, world, args, HttpSink)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    print(json.dumps(result))
    return 0 if result["errors"] == 0 else 1


def run_load(base: str, world: dict, args: argparse.Namespace, sink_class) -> dict:
    import requests

    run_id = world["run_id"]
    lock = threading.Lock()
    lat: dict[str, list[float]] = {"metrics": [], "step": [], "ingest": []}
    errors: list[str] = []
    posted = [args.initial_steps]
    seen_last: list[int] = []
    stop_at = time.monotonic() + args.duration

    def record(kind: str, seconds: float, error: str | None = None) -> None:
        with lock:
            lat[kind].append(seconds)
            if error:
                errors.append(error)

    def trainer() -> None:
        sink = sink_class(f"{base}/api/ingest/runs/{run_id}/", world["ingest_token"], retry_s=5, max_wait_s=1)
        step = args.initial_steps
        while time.monotonic() < stop_at:
            step += 1
            scalars, series = fake_record(step)
            t = time.perf_counter()
            try:
                sink.log(step, scalars, series)
                record("ingest", time.perf_counter() - t)
                posted[0] = step
            except Exception as exc:  # reported, never raised: the load goes on
                record("ingest", time.perf_counter() - t, f"ingest step {step}: {exc}")
            time.sleep(max(0.0, args.step_every - (time.perf_counter() - t)))
        sink.close()

    def viewer(token: str, offset: float) -> None:
        session = requests.Session()
        session.headers["Authorization"] = f"Bearer {token}"
        last = -1
        time.sleep(offset)  # viewers opened the page at different moments
        while time.monotonic() < stop_at:
            t = time.perf_counter()
            try:
                resp = session.get(f"{base}/api/runs/{run_id}/metrics", params={"since": last}, timeout=30)
                record("metrics", time.perf_counter() - t, None if resp.ok else f"metrics HTTP {resp.status_code}")
                data = resp.json() if resp.ok else {"steps": []}
            except (requests.RequestException, ValueError) as exc:
                record("metrics", time.perf_counter() - t, f"metrics: {exc}")
                data = {"steps": []}
            if data["steps"]:
                last = data["last_step"]
                t2 = time.perf_counter()
                try:
                    resp = session.get(f"{base}/api/runs/{run_id}/metrics/{last}", timeout=30)
                    record("step", time.perf_counter() - t2, None if resp.ok else f"step HTTP {resp.status_code}")
                except requests.RequestException as exc:
                    record("step", time.perf_counter() - t2, f"step: {exc}")
            time.sleep(max(0.0, args.interval - (time.perf_counter() - t)))
        with lock:
            seen_last.append(last)
        session.close()

    threads = [threading.Thread(target=trainer, name="trainer")]
    threads += [threading.Thread(target=viewer, args=(tok, args.interval * i / max(1, len(world["tokens"]))), name=f"viewer-{i}")
                for i, tok in enumerate(world["tokens"])]
    for th in threads:
        th.start()
    for th in threads:
        th.join(args.duration + 120)
    viewers = lat["metrics"] + lat["step"]
    return {
        "viewers": args.viewers, "duration_s": args.duration, "interval_s": args.interval,
        "server": f"gunicorn {args.gunicorn_workers}x{args.gunicorn_threads}",
        "requests": len(viewers) + len(lat["ingest"]), "errors": len(errors), "error_samples": errors[:5],
        "p50_ms": percentile(viewers, 50), "p95_ms": percentile(viewers, 95), "p99_ms": percentile(viewers, 99),
        "metrics_endpoint": summary(lat["metrics"]), "step_endpoint": summary(lat["step"]), "ingest": summary(lat["ingest"]),
        "steps_posted": posted[0] - args.initial_steps,
        "viewers_up_to_date": sum(1 for s in seen_last if s >= posted[0] - 2),
        "mean_requests_per_s": round(len(viewers) / args.duration, 1),
        "stdev_ms": round(statistics.pstdev(viewers) * 1000, 2) if len(viewers) > 1 else None,
    }


if __name__ == "__main__":
    raise SystemExit(main())
