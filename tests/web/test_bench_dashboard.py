"""scripts/bench_dashboard.py runs (a few viewers for a few seconds) and prints its one JSON line.
Timings are reported by the script, never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_dashboard_load_benchmark_prints_latencies_and_sees_no_errors():
    proc = subprocess.run(
        [sys.executable, "scripts/bench_dashboard.py", "--viewers", "3", "--duration", "4", "--initial-steps", "5",
         "--gunicorn-workers", "1", "--gunicorn-threads", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["errors"] == 0, result["error_samples"]
    assert result["viewers"] == 3 and result["metrics_endpoint"]["n"] >= 3 and result["steps_posted"] >= 1
    for key in ("p50_ms", "p95_ms", "p99_ms"):
        assert result[key] is not None and result["metrics_endpoint"][key] is not None
