"""The JSON API's bodies and answers as pydantic models: they validate requests at the boundary,
shape the responses, and are where /api/openapi.json comes from (django-ninja derives it)."""

from __future__ import annotations

import math
import uuid
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from workers.tlt.metrics import SAMPLES_KEY

MAX_SAMPLES_PER_STEP = 64  # the trainer sends up to 8; more is a bug, not a reason to store megabytes


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _example(**example: Any) -> ConfigDict:
    """A body's example: shown in /api/docs and sent by the tests generated from the document."""
    return ConfigDict(extra="forbid", json_schema_extra={"examples": [example]})


# ---- user API: requests ----

class LaunchBody(_Body):
    model_config = _example(preset="tiny-cpu", name="tiny run from the API", tags=["api"])

    team: int | None = Field(None, description="Team id; defaults to the user's only editable team.")
    name: str = Field("", max_length=200)
    preset: str = Field("", max_length=50)
    config_yaml: str = Field("", max_length=200_000, description="Full config YAML; empty: the preset's.")
    tags: list[str] = Field(default_factory=list, max_length=20)
    notes: str = Field("", max_length=20_000)


class RunPatchBody(_Body):
    model_config = _example(name="renamed run", tags=["baseline", "v2"], notes="what changed")

    name: str | None = Field(None, max_length=200, description="New name; must not be blank.")
    tags: list[str] | None = Field(None, max_length=20)
    notes: str | None = Field(None, max_length=20_000)

    @field_validator("name")
    @classmethod
    def _name_not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be blank")
        return value


class TeamCreateBody(_Body):
    model_config = _example(name="Reasoning lab")

    name: str = Field(min_length=1, max_length=100)

    @field_validator("name")
    @classmethod
    def _strip(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be blank")
        return value.strip()


class MemberBody(_Body):
    model_config = _example(username="charlie", role="viewer")

    username: str = Field(min_length=1, max_length=150, description="An existing user's username.")
    role: Literal["viewer", "editor", "owner"] = "viewer"


# ---- ingestion (the trainer): requests ----

def _finite(value: Any) -> Any:
    """NaN/inf are not JSON (PostgreSQL refuses them): store them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


class RolloutSampleIn(_Body):
    """One stored response: the contract of the series "rollout/samples" (a list of these)."""

    sample: int = Field(ge=0, le=10_000_000, description="index of the response in the step's rollout")
    prompt: str = Field(max_length=100_000)
    tokens: list[str] = Field(max_length=100_000, description="the response, token by token (decoded text)")
    from_draft: list[Literal[0, 1]] = Field(
        max_length=100_000, description="per token: 1 = proposed by the drafter and accepted (SD on)"
    )
    reward: float | None = None
    length: int = Field(ge=0, le=10_000_000, description="response length in tokens")
    truncated: bool = Field(False, description="stopped by the length limit, not by EOS")

    @model_validator(mode="after")
    def _aligned(self) -> "RolloutSampleIn":
        if len(self.from_draft) != len(self.tokens):
            raise ValueError(f"from_draft has {len(self.from_draft)} entries for {len(self.tokens)} tokens")
        return self


_SAMPLES = TypeAdapter(list[RolloutSampleIn])


class MetricsBody(_Body):
    model_config = _example(
        step=1, scalars={"reward/mean": 0.42, "spec/acceptance_length": 3.1},
        series={"rollout/lengths": [12, 40, 190], SAMPLES_KEY: [{
            "sample": 0, "prompt": "3 + 4 = ?", "tokens": [" 7", "</s>"], "from_draft": [1, 0], "reward": 1.0,
            "length": 2, "truncated": False}]},
    )

    step: int = Field(ge=0, le=10_000_000)
    scalars: dict[str, float | None] = Field(default_factory=dict)
    series: dict[str, Any] = Field(
        default_factory=dict,
        description='Per-step structures; "rollout/samples" is a list of RolloutSampleIn (at most 64).',
    )

    @field_validator("scalars", "series")
    @classmethod
    def _clean(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _finite(value)

    @field_validator("series")
    @classmethod
    def _samples(cls, value: dict[str, Any]) -> dict[str, Any]:
        if SAMPLES_KEY not in value:
            return value
        raw = value[SAMPLES_KEY]
        if isinstance(raw, list) and len(raw) > MAX_SAMPLES_PER_STEP:
            raise ValueError(f"{SAMPLES_KEY}: at most {MAX_SAMPLES_PER_STEP} samples per step")
        try:
            samples = _SAMPLES.validate_python(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"{SAMPLES_KEY}.{where}: {first['msg']}") from None
        return {**value, SAMPLES_KEY: [s.model_dump() for s in samples]}


ARTIFACT_KIND_PATTERN = r"^[a-z][a-z0-9_-]{0,29}$"
SHA256_PATTERN = r"^[0-9a-fA-F]{64}$"


class ArtifactForm(_Body):
    kind: str = Field(pattern=ARTIFACT_KIND_PATTERN)
    step: int = Field(ge=0, le=10_000_000)
    size: int = Field(ge=0, description="Bytes the sender measured; a file that differs is refused.")
    sha256: str = Field(pattern=SHA256_PATTERN, description="SHA-256 the sender measured (hex).")


class ProgressBody(_Body):
    """The trainer's progress through a phase: setup (policy, drafter_warmup, actors) or rl."""

    model_config = _example(phase="policy", done=120, total=300, message="SFT step 120/300")

    phase: str = Field(pattern=r"^[a-z][a-z0-9_]{0,29}$", description="policy | drafter_warmup | actors | rl")
    done: int = Field(ge=0, le=1_000_000_000)
    total: int = Field(ge=0, le=1_000_000_000)
    message: str = Field("", max_length=500)


# ---- answers ----

class ErrorOut(BaseModel):
    error: str = Field(description="what went wrong, for a person")
    errors: dict[str, str] | None = Field(None, description="field -> message, for a bad request")


class PhaseTimeOut(BaseModel):
    phase: str
    label: str
    seconds: float


class ProgressOut(BaseModel):
    phase: str
    label: str
    done: int
    total: int
    fraction: float | None
    message: str
    elapsed_s: float
    rate_per_s: float | None
    eta_s: float | None = Field(description="seconds left in this phase at its rate so far; null: unknown")
    updated_at: datetime
    history: list[PhaseTimeOut] = Field(description="finished phases and how long each took")


class RunOut(BaseModel):
    id: uuid.UUID
    name: str
    team: int
    team_name: str
    creator: str | None
    preset: str
    state: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    tags: list[str]
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    url: str
    step: int | None = Field(description="the newest step with metrics")
    steps_total: int | None = Field(description="run.steps of the config")
    phase: str = Field(description="what an active run is doing now (setup phase or RL training)")
    phase_fraction: float | None = Field(description="share of the current setup phase done (null in RL)")
    duration_s: float | None
    reward: float | None = Field(description="reward/mean of the newest step")
    acceptance: float | None = Field(description="spec/acceptance_length of the newest step")
    tlt_speedup: float | None = Field(description="with an A/B partner: baseline step time / TLT step time over "
                                                  "the steps both ran (the pair page's e2e_speedup)")
    progress: ProgressOut | None
    attempt: int = Field(description="0 for the first Ray job; each resume (automatic or a click) adds one")
    resumable: bool = Field(description="failed (not by a bad config) or cancelled and stopped: POST .../resume")
    tlt: bool = Field(description="run.tlt: TLT on (SD in the tail, spot drafter training) or the plain baseline")
    alerts: int = Field(description="alerts raised on the run (losslessness audit, drafter health)")
    ab_partner: uuid.UUID | None = Field(description="the run's A/B partner (its baseline control or TLT treatment)")


class AttemptOut(BaseModel):
    """An earlier attempt of a run: its Ray job, how it ended, who resumed it."""

    attempt: int
    submission_id: str
    state: str
    failure: str | None = Field(description="infra | trainer | submit | config (failed attempts)")
    error: str | None
    finished_at: datetime | None
    resumed_by: str = Field(description='"auto" or the username that clicked Resume')


class RunDetailOut(RunOut):
    notes: str
    config: dict[str, Any]
    config_yaml: str
    error: str
    log_tail: str
    log_url: str | None = Field(description="the whole job log (text/plain), once the run has ended")
    submission_id: str = Field(description="the Ray job of the current attempt")
    failure: Literal["", "infra", "trainer", "submit", "config"] = Field(
        description="why a failed run failed: infra is resumed automatically, config never"
    )
    auto_resumes: int
    attempts: list[AttemptOut] = Field(description="the earlier attempts, oldest first")
    alert_list: list["AlertOut"] = Field(description="the run's alerts, oldest first")
    latest_drafter_url: str | None = Field(description="download of the newest drafter checkpoint")


class RunListOut(BaseModel):
    runs: list[RunOut]


class StepScalarsOut(BaseModel):
    step: int
    scalars: dict[str, float | None]


class MetricsOut(BaseModel):
    state: str
    active: bool
    attempt: int = Field(description="the run's current attempt (the page reloads when it changes)")
    error: str
    steps: list[StepScalarsOut]
    last_step: int
    progress: ProgressOut | None
    alerts: list["AlertOut"] = Field(description="the run's alerts, oldest first (the page's banner)")


class StepRecordOut(BaseModel):
    step: int
    scalars: dict[str, float | None]
    series: dict[str, Any]


class AlertOut(BaseModel):
    kind: Literal["greedy_mismatch", "acceptance_collapse", "drafter_stale"]
    title: str
    message: str
    step: int = Field(description="the step at which it was raised")
    created_at: datetime
    webhook: str | None = Field(description="the team webhook's delivery: pending | sent | failed (null: no webhook)")


class ArtifactOut(BaseModel):
    id: int
    kind: str
    step: int
    filename: str
    size: int
    sha256: str
    content_sha256: str = Field(description="the drafter version: hash of the archive without its model card")
    created_at: datetime
    download_url: str
    model_card: dict[str, Any] | None = Field(description="export.model_card of a drafter, when it carries one")


class DrafterVersionOut(BaseModel):
    version: int = Field(description="1 for the run's first distinct drafter, counting up")
    content_sha256: str
    steps: list[int] = Field(description="checkpoints holding this exact drafter")
    first_step: int
    last_step: int
    artifact: ArtifactOut = Field(description="the version's newest checkpoint")
    model_card: dict[str, Any] | None


class DrafterListOut(BaseModel):
    latest_url: str | None = Field(description="download of the newest drafter checkpoint")
    versions: list[DrafterVersionOut] = Field(description="newest first; checkpoints deduplicated by content hash")


class TeamDrafterOut(DrafterVersionOut):
    run: uuid.UUID
    run_name: str


class TeamDrafterGroupOut(BaseModel):
    base_model: str
    versions: list[TeamDrafterOut]


class TeamDraftersOut(BaseModel):
    groups: list[TeamDrafterGroupOut]


class PairCurveOut(BaseModel):
    id: uuid.UUID
    name: str
    state: str
    tlt: bool
    step: list[int]
    wall_s: list[float] = Field(description="seconds of training (summed step times) at each step's end")
    reward: list[float | None] = Field(description="reward/mean per step (null: not measured)")
    accuracy: list[float | None] = Field(description="reward/accuracy per step")
    length: list[float | None] = Field(description="rollout/len_mean per step (tokens)")


class ParityOut(BaseModel):
    test: str
    alpha: float
    steps: int
    min_steps: int
    mean_difference: float | None = Field(description="mean of TLT - baseline reward over paired steps")
    sd_difference: float | None
    p_value: float | None
    within_noise: bool | None = Field(description="p >= alpha; null with fewer than min_steps paired steps")
    verdict: Literal["within noise", "differs", "too few steps"]


class PairOut(BaseModel):
    tlt: PairCurveOut
    baseline: PairCurveOut
    steps_compared: int
    e2e_speedup: float | None = Field(description="baseline step time / TLT step time over the steps both ran")
    rollout_speedup: float | None = Field(description="the same for the rollout phase (s)")
    rollout_share: float | None = Field(description="the baseline's rollout time / step time (r)")
    amdahl_bound: float | None = Field(description="1 / ((1 - r) + r / s)")
    e2e_efficiency: float | None = Field(description="e2e_speedup / amdahl_bound")
    idle_worker_s: float
    idle_reclaimed_s: float
    idle_reclaimed_frac: float | None
    logprob_mismatch_max: dict[str, float | None]
    reward_parity: ParityOut
    url: str = Field(description="the pair's page")


class ArtifactListOut(BaseModel):
    artifacts: list[ArtifactOut]


class SampleOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    sample: int
    prompt: str
    tokens: list[str]
    from_draft: list[int]
    drafted: int = Field(description="tokens proposed by the drafter and accepted")
    reward: float | None
    length: int
    truncated: bool


class SamplesOut(BaseModel):
    step: int | None = Field(description="the step shown (default: the newest with samples)")
    steps: list[int] = Field(description="every step with stored samples")
    samples: list[SampleOut]


class IngestOut(BaseModel):
    ok: bool
    step: int


class ProgressIngestOut(BaseModel):
    ok: bool
    progress: ProgressOut


class TeamOut(BaseModel):
    id: int
    name: str
    role: str


class TeamListOut(BaseModel):
    teams: list[TeamOut]


class MemberOut(BaseModel):
    username: str
    role: str


RunDetailOut.model_rebuild()
MetricsOut.model_rebuild()
