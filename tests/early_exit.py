"""A pytest plugin that ends the pytest process itself once pytest has reported, with pytest's
own exit status (tests/conftest.py imports its hooks; test_exit_status.py loads it with -p)."""

from __future__ import annotations

import os
import sys

import pytest


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave without the interpreter's teardown once pytest has reported.

    A CI run passed every test and then died of a segmentation fault while Python freed its
    modules (exit status 139). Its stack was not caught; the likely culprit is that this process
    starts and stops several local Ray instances (the trainer and learner tests), and Ray's native
    core worker is not made to be torn down and started again in one process (ray-project/ray#31145).
    By now every fixture has stopped what it started and the summary is printed, so nothing is left
    to free but memory; the exit status is pytest's own. scripts/test.sh sets PYTHONFAULTHANDLER, so a crash before this point still
    prints every thread's stack.
    """
    session = _SESSIONS.get(config)
    if session is None:  # pytest stopped before a session began (a usage error): its own exit
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(session.exitstatus))


_SESSIONS: dict[pytest.Config, pytest.Session] = {}


def pytest_sessionstart(session: pytest.Session) -> None:
    _SESSIONS[session.config] = session
