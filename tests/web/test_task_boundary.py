"""The services enqueue their tasks by importing them; the tasks import the services only when they
run (HackSoftware's shape): no import circle, no string dispatch, no django.setup() at import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_tasks_sets_up_no_django_and_loads_no_service():
    code = (
        "import sys, os; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'tltweb.settings');"
        "import workers.tasks;"
        "from django.apps import apps;"
        "print(apps.ready, 'tltweb.runs.services' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"], out.stdout


def test_the_services_hold_their_tasks_module_not_task_names():
    from tltweb.runs import services
    from workers import tasks

    assert services.tasks is tasks
    assert not hasattr(services, "_enqueue")


def test_a_resume_enqueues_the_submit_task_itself(alice, team, run, monkeypatch, django_capture_on_commit_callbacks):
    from tltweb.runs import services
    from tltweb.runs.models import Run
    from workers import tasks

    sent = []
    monkeypatch.setattr(tasks.run_submit, "delay", lambda run_id: sent.append(run_id))
    Run.objects.filter(pk=run.pk).update(state="failed", failure="infra")
    with django_capture_on_commit_callbacks(execute=True):
        services.run_resume(run=Run.objects.get(pk=run.pk), user=alice)
    assert sent == [str(run.id)]


def test_the_dead_helpers_are_gone():
    from tltweb.runs import selectors, services

    assert not hasattr(selectors, "metrics_steps")
    assert not hasattr(services, "run_files_delete")
