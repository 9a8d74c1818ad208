"""The Celery application: `celery -A workers.celery_app worker -l info`, and beat in a process of
its own (`celery -A workers.celery_app beat`), so a killed worker never orphans the scheduler.

Every setting comes from Django settings under the CELERY_ namespace (tltweb/settings.py).
"""

import os
import sys
from pathlib import Path

_platform = Path(__file__).resolve().parents[1] / "platform"  # source root; never a package
if str(_platform) not in sys.path:
    sys.path.append(str(_platform))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tltweb.settings")

from celery import Celery  # noqa: E402
from celery.signals import worker_shutdown  # noqa: E402

app = Celery("tlt")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["workers"], related_name="tasks")


@worker_shutdown.connect
def _ray_shutdown(**_kwargs) -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
