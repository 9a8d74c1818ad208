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
    assert run.preset == "smollm2-mathmix-cpu" and run.team.name == "Demo team" and run.creator.username == "demo"


def test_tlt_demo_still_creates_the_login_when_ray_does_not_answer(db, settings):
    import socket
    from io import StringIO

    from django.contrib.auth.models import User
    from django.core.management import call_command

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings.TLT_LAUNCH_CHECK_CLUSTER = True
    settings.RAY_ADDRESS = f"http://127.0.0.1:{port}"
    out, err = StringIO(), StringIO()
    call_command("tlt_demo", stdout=out, stderr=err)
    assert "demo login" in out.getvalue() and "not launched" in err.getvalue()
    assert User.objects.filter(username="demo").exists()
