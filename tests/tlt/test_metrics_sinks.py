"""Progress through the sinks: Tracking fans it out, throttled; the console and JSONL sinks write it."""

from __future__ import annotations

import io
import json

from workers.tlt.metrics import ConsoleSink, JsonlSink, Tracking


class Recorder:
    def __init__(self):
        self.calls = []

    def log(self, step, scalars, series):
        pass

    def artifact(self, kind, step, path):
        pass

    def progress(self, phase, done, total, message=""):
        self.calls.append((phase, done, total, message))

    def close(self):
        pass


class OldSink:
    """A sink written before progress existed: Tracking must not trip over it."""

    def log(self, step, scalars, series):
        pass

    def artifact(self, kind, step, path):
        pass

    def close(self):
        pass


def test_tracking_forwards_each_phases_first_and_last_update_and_throttles_the_rest():
    rec = Recorder()
    tracking = Tracking([rec, OldSink()], progress_interval_s=3600)
    for done in range(301):
        tracking.progress("policy", done, 300, f"SFT step {done}")
    tracking.progress("drafter_warmup", 0, 200)
    tracking.progress("drafter_warmup", 7, 200)  # throttled
    assert [(c[0], c[1]) for c in rec.calls] == [("policy", 0), ("policy", 300), ("drafter_warmup", 0)]


def test_tracking_forwards_everything_without_a_throttle():
    rec = Recorder()
    tracking = Tracking([rec], progress_interval_s=0)
    for done in range(5):
        tracking.progress("rl", done, 4)
    assert [c[1] for c in rec.calls] == [0, 1, 2, 3, 4]


def test_the_console_sink_prints_one_line_per_update():
    out = io.StringIO()
    ConsoleSink(out).progress("actors", 1, 2, "starting 2 rollout workers")
    assert out.getvalue() == "progress actors 1/2 starting 2 rollout workers\n"


def test_the_jsonl_sink_writes_a_progress_record(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.progress("rl", 3, 10, "step 3/10")
    sink.close()
    rec = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert rec["progress"]["phase"] == "rl" and rec["progress"]["done"] == 3 and rec["progress"]["total"] == 10
