"""`manage.py tlt_demo` is idempotent: the login is printed once, the demo run launched once."""

from io import StringIO

from django.core.management import call_command

from tltweb.runs.models import Run


def test_tlt_demo_creates_the_user_team_and_run_once(db):
    first, second = StringIO(), StringIO()
    call_command("tlt_demo", stdout=first)
    call_command("tlt_demo", stdout=second)
    assert "demo login" in first.getvalue() and "demo login" not in second.getvalue()
    run = Run.objects.get()
    assert run.preset == "tiny-cpu" and run.team.name == "Demo team" and run.creator.username == "demo"
