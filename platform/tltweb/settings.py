"""Django settings, read from the environment (see tltweb.env for the typed readers).

Defaults give a working single-machine dev setup with no services: SQLite and the Celery
filesystem broker under the git-ignored var/ folder, DEBUG on (as healthchecks does), a secret
key generated once into var/secret_key. Production (compose) sets DEBUG=0, and then SECRET_KEY
is required and the HTTPS settings below apply.

Variables: DEBUG, SECRET_KEY, ALLOWED_HOSTS, CSRF_TRUSTED_ORIGINS, DATABASE_URL,
CELERY_BROKER_URL, CELERY_FS_DIR, RAY_ADDRESS, TLT_PUBLIC_URL, TLT_ARTIFACT_DIR, TLT_RUNS_DIR,
TLT_DATA_DIR, TLT_MODELS_DIR, TLT_LAUNCH_CHECK_CLUSTER, TLT_AUTO_RESUME_MAX, TLT_RESUBMIT_AFTER_S,
TLT_INGEST_RETRY_S, TLT_INGEST_MAX_WAIT_S, TLT_INGEST_DRAIN_S, TLT_INGEST_PAUSE_S,
TLT_LOGIN_FAILURE_LIMIT, TLT_LOGIN_COOLOFF_MIN, TLT_JOB_PYTHON, TLT_JOB_WORKDIR,
TLT_SYNC_INTERVAL_S, TLT_VAR_DIR, TLT_MLFLOW_TRACKING_URI, TLT_MLFLOW_EXPERIMENT,
TLT_MLFLOW_ARTIFACTS, TLT_DRAFTER_STALE_STEPS, TLT_WEBHOOK_TIMEOUT_S,
TLT_WEBHOOK_ALLOW_PRIVATE, SECURE_SSL_REDIRECT, SECURE_HSTS_SECONDS, SESSION_COOKIE_SECURE,
CSRF_COOKIE_SECURE, SERVE_STATIC.
"""

from __future__ import annotations

import secrets
import sys
from datetime import timedelta
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from tltweb.env import database_from_url, env_bool, env_int, env_list, env_str

BASE_DIR = Path(__file__).resolve().parents[2]  # the repository root (platform/tltweb/settings.py)
VAR_DIR = Path(env_str("TLT_VAR_DIR", str(BASE_DIR / "var")))
try:
    VAR_DIR.mkdir(parents=True, exist_ok=True)
except OSError:  # a read-only image: fine as long as nothing below needs var/ (SECRET_KEY set, no sqlite)
    pass

DEBUG = env_bool("DEBUG", True)


def _secret_key() -> str:
    key = env_str("SECRET_KEY", "")
    if key:
        return key
    if not DEBUG:
        raise ImproperlyConfigured("SECRET_KEY must be set when DEBUG is off")
    path = VAR_DIR / "secret_key"
    if not path.exists():
        path.write_text(secrets.token_urlsafe(50))
        path.chmod(0o600)
    return path.read_text().strip()


SECRET_KEY = _secret_key()
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "tltweb.accounts",
    "tltweb.runs",
    "tltweb.api",
    "axes",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "axes.middleware.AxesMiddleware",  # last: turns a locked-out login into the lockout response
]

# --- Login throttling (django-axes): after TLT_LOGIN_FAILURE_LIMIT wrong passwords for one username from
# one address, that pair is locked out for TLT_LOGIN_COOLOFF_MIN minutes (browser and admin login; the
# JSON API counts invalid personal tokens per address the same way, tltweb.api.auth).
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]
AXES_FAILURE_LIMIT = env_int("TLT_LOGIN_FAILURE_LIMIT", 5, minimum=1)
AXES_COOLOFF_TIME = timedelta(minutes=env_int("TLT_LOGIN_COOLOFF_MIN", 15, minimum=1))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_CALLABLE = "tltweb.accounts.lockout.lockout_response"  # 429: JSON under /api/, a page elsewhere
AXES_VERBOSE = False

ROOT_URLCONF = "tltweb.urls"
WSGI_APPLICATION = "tltweb.wsgi.application"
CSRF_FAILURE_VIEW = "tltweb.handlers.csrf_failure"  # JSON under /api/, Django's page elsewhere

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "tltweb.accounts.context_processors.permissions",
            ],
        },
    },
]

DATABASES = {"default": database_from_url(env_str("DATABASE_URL", f"sqlite:///{VAR_DIR / 'db.sqlite3'}"))}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # A file (not :memory:) so a Celery worker subprocess in the integration tests sees the test DB.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / "test_db.sqlite3")}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "run-list"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = VAR_DIR / "staticfiles"
# gunicorn in compose has no separate static server; Django's static view is enough for this app.
SERVE_STATIC = env_bool("SERVE_STATIC", True)

# --- HTTPS (compose/production: behind a TLS proxy) ---
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", not DEBUG)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0 if DEBUG else 31_536_000, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", True)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", True)
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", not DEBUG)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", not DEBUG)
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^api/ingest/"]  # probes and in-cluster trainers speak plain HTTP

# --- Celery (workers/celery_app.py reads every CELERY_* name) ---
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", "filesystem://")
CELERY_FS_DIR = Path(env_str("CELERY_FS_DIR", str(VAR_DIR / "celery")))
if CELERY_BROKER_URL.startswith("filesystem://"):
    for sub in ("queue", "processed", "control"):
        (CELERY_FS_DIR / sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(CELERY_FS_DIR / "queue"),
        "data_folder_out": str(CELERY_FS_DIR / "queue"),
        "data_folder_processed": str(CELERY_FS_DIR / "processed"),
        "control_folder": str(CELERY_FS_DIR / "control"),  # default is ./control in the cwd
        "store_processed": False,
    }
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True  # tasks are idempotent; a worker crash re-runs them
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_WORKER_REDIRECT_STDOUTS = False  # ray's job client needs real stdout/stderr (fileno)
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")
TLT_SYNC_INTERVAL_S = env_int("TLT_SYNC_INTERVAL_S", 10, minimum=1)
CELERY_BEAT_SCHEDULE = {
    "runs-sync": {"task": "workers.tasks.runs_sync", "schedule": float(TLT_SYNC_INTERVAL_S)},
}

# --- Compute plane ---
RAY_ADDRESS = env_str("RAY_ADDRESS", "http://127.0.0.1:8265")  # Ray job submission API (dashboard)
TLT_PUBLIC_URL = env_str("TLT_PUBLIC_URL", "http://127.0.0.1:8000").rstrip("/")
TLT_ARTIFACT_DIR = Path(env_str("TLT_ARTIFACT_DIR", str(VAR_DIR / "artifacts")))
TLT_RUNS_DIR = Path(env_str("TLT_RUNS_DIR", str(VAR_DIR / "runs")))  # trainer --out folders: <team id>/<run id>
# Where configs may point: task.path inside TLT_DATA_DIR/<team id>/, model.path inside TLT_MODELS_DIR
# (or the team's data folder); checked at launch and again by the trainer (workers/tlt/paths.py).
TLT_DATA_DIR = Path(env_str("TLT_DATA_DIR", str(VAR_DIR / "data")))
TLT_MODELS_DIR = Path(env_str("TLT_MODELS_DIR", str(VAR_DIR / "models")))
TLT_LAUNCH_CHECK_CLUSTER = env_bool("TLT_LAUNCH_CHECK_CLUSTER", True)  # rollout workers vs the cluster's CPUs/GPUs
TLT_AUTO_RESUME_MAX = env_int("TLT_AUTO_RESUME_MAX", 3, minimum=0)  # automatic resumes per run after a job died
TLT_RESUBMIT_AFTER_S = env_int("TLT_RESUBMIT_AFTER_S", 120, minimum=1)  # a queued run not submitted by then: again
# Delivery from the trainer's spool (passed to every job; workers/tlt/spool.py).
TLT_INGEST_RETRY_S = env_int("TLT_INGEST_RETRY_S", 600, minimum=1)  # retry one delivery this long
TLT_INGEST_MAX_WAIT_S = env_int("TLT_INGEST_MAX_WAIT_S", 60, minimum=1)  # longest back-off between attempts
TLT_INGEST_DRAIN_S = env_int("TLT_INGEST_DRAIN_S", 900, minimum=0)  # at the end, wait this long for the spool
TLT_INGEST_PAUSE_S = env_int("TLT_INGEST_PAUSE_S", 30, minimum=1)  # after a failed round, wait before the next
TLT_JOB_PYTHON = env_str("TLT_JOB_PYTHON", sys.executable)
TLT_JOB_WORKDIR = env_str("TLT_JOB_WORKDIR", str(BASE_DIR))
TLT_MAX_ARTIFACT_BYTES = env_int("TLT_MAX_ARTIFACT_BYTES", 20 * 1024**3, minimum=1)
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("DATA_UPLOAD_MAX_MEMORY_SIZE", 50 * 1024**2, minimum=1024)
# Optional MLflow mirror of every run's metrics (workers.tlt.metrics.MlflowSink), e.g.
# http://mlflow.internal:5000 or file:///shared/mlruns, as the Ray jobs reach it; empty: off.
TLT_MLFLOW_TRACKING_URI = env_str("TLT_MLFLOW_TRACKING_URI", "")
TLT_MLFLOW_EXPERIMENT = env_str("TLT_MLFLOW_EXPERIMENT", "")  # empty: the run's team name
TLT_MLFLOW_ARTIFACTS = env_bool("TLT_MLFLOW_ARTIFACTS", False)  # also copy drafter/policy zips to MLflow
# Drafter health: a TLT run whose drafter got no applied spot-training update for this many consecutive
# steps while the policy kept moving (grad norm > 0) raises a "drafter stale" alert.
TLT_DRAFTER_STALE_STEPS = env_int("TLT_DRAFTER_STALE_STEPS", 10, minimum=1)
TLT_WEBHOOK_TIMEOUT_S = env_int("TLT_WEBHOOK_TIMEOUT_S", 10, minimum=1)  # one POST of an alert to a team's webhook
# Off: team webhooks must be public addresses (no loopback, private, link-local or reserved ones), so
# a team owner cannot make the server POST into its own network. On: for a receiver inside it.
TLT_WEBHOOK_ALLOW_PRIVATE = env_bool("TLT_WEBHOOK_ALLOW_PRIVATE", False)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
}
