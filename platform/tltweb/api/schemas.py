"""Request bodies of the JSON API, validated at the boundary by small pydantic models."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LaunchBody(_Body):
    team: int | None = Field(None, description="Team id; defaults to the user's only editable team.")
    name: str = Field("", max_length=200)
    preset: str = Field("", max_length=50)
    config_yaml: str = Field("", max_length=200_000, description="Full config YAML; empty: the preset's.")
    tags: list[str] = Field(default_factory=list, max_length=20)
    notes: str = Field("", max_length=20_000)


class RunPatchBody(_Body):
    name: str | None = Field(None, max_length=200)
    tags: list[str] | None = Field(None, max_length=20)
    notes: str | None = Field(None, max_length=20_000)


def _finite(value: Any) -> Any:
    """NaN/inf are not JSON (PostgreSQL refuses them): store them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


class MetricsBody(_Body):
    step: int = Field(ge=0, le=10_000_000)
    scalars: dict[str, float | None] = Field(default_factory=dict)
    series: dict[str, Any] = Field(default_factory=dict)

    @field_validator("scalars", "series")
    @classmethod
    def _clean(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _finite(value)


class ArtifactForm(_Body):
    kind: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,29}$")
    step: int = Field(ge=0, le=10_000_000)
    size: int = Field(ge=0, description="Bytes the sender measured; a file that differs is refused.")
    sha256: str = Field(pattern=r"^[0-9a-fA-F]{64}$", description="SHA-256 the sender measured (hex).")
