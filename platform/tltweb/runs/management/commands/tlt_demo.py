"""Create the demo team and user (printing the login once, when created) and launch the demo run once.

    python manage.py tlt_demo [--no-run]

Idempotent: a second call changes nothing and prints no password.
"""

from __future__ import annotations

import secrets

from django.contrib.auth.models import User
from django.core.management.base import BaseCommand
from django.db import transaction

from tltweb.accounts.models import Member, Role, Team
from tltweb.runs.models import Run
from tltweb.runs.services import run_launch
from workers.tlt.config import ConfigError

DEMO_USER = "demo"
DEMO_TEAM = "Demo team"
# The headline workload (SmolLM2-135M on mathmix's long tail), where TLT is measurably faster than its
# baseline at the same reward curve (README, "End to end"); ~37 min on 2 cores of an AVX-512 EPYC from a
# clean clone, 26.5 of them the drafter warm-up's first run (cached after; 2026-12-07). "Run baseline
# control" on its page trains the A/B partner.
DEMO_PRESET = "smollm2-mathmix-cpu"
DEMO_TAG = "demo"


class Command(BaseCommand):
    help = f"Create the demo team and user, and launch the {DEMO_PRESET} demo run once."

    def add_arguments(self, parser):
        parser.add_argument("--no-run", action="store_true", help="only the team and user")

    def handle(self, *args, no_run: bool = False, **options):
        with transaction.atomic():
            user = User.objects.filter(username=DEMO_USER).first()
            password = None
            if user is None:
                password = secrets.token_urlsafe(9)
                user = User.objects.create_user(DEMO_USER, password=password, is_staff=True, is_superuser=True)
            team, _ = Team.objects.get_or_create(name=DEMO_TEAM)
            Member.objects.get_or_create(team=team, user=user, defaults={"role": Role.OWNER})
            demo_launched = any(DEMO_TAG in (tags or []) for tags in Run.objects.filter(team=team).values_list("tags", flat=True))
        if not no_run and not demo_launched:
            try:
                run = run_launch(
                    user=user, team=team, name="Demo: SmolLM2-135M, long-tail math", preset=DEMO_PRESET, tags=[DEMO_TAG],
                    notes="GRPO with TLT on a real pretrained model and a reasoning-RL long tail, on 2 CPU cores. "
                          "Run its baseline control to see the speedup at the same reward curve.",
                )
                self.stdout.write(f"launched demo run {run.id}")
            except ConfigError as exc:  # e.g. Ray not answering yet: the platform still starts
                self.stderr.write(f"demo run not launched ({exc}); launch it from the web page")
        if password:
            self.stdout.write(self.style.SUCCESS(f"demo login: user {DEMO_USER}  password {password}"))
        else:
            self.stdout.write(f"demo user {DEMO_USER!r} exists (password shown when it was created)")

