"""``projects.yaml``: GPU types, teams (caps, guaranteed shares, queues) and projects."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from hybridflow.config.base import _Model


class GpuType(_Model):
    memory_gib: int = Field(gt=0)


class Team(_Model):
    # Most GPUs the team's runs may hold at once across the estate (None: no cap beyond projects').
    gpu_cap: int | None = Field(default=None, ge=1)
    # Share of private GPU capacity guaranteed to the team: its idle part is billed to the team.
    guaranteed_share: float = Field(default=0.0, ge=0, le=1)
    # Queue of the team on Kubernetes gang schedulers (Volcano queue / Kueue LocalQueue); default: the team name.
    queue: str | None = Field(default=None, min_length=1)


class Project(_Model):
    team: str = Field(min_length=1)
    max_workers: int = Field(ge=1)
    # Quotas (None: no quota), in GiB: the bytes the project holds in the cloud caches and the DR
    # store, and the bytes staged, replicated and served out per calendar month (UTC); admission
    # refuses a run whose staging would pass either (hybridflow.budgets.quotas).
    storage_gib: float | None = None
    transfer_gib_per_month: float | None = None

    @field_validator("storage_gib", "transfer_gib_per_month", mode="before")
    @classmethod
    def _gib(cls, value: Any, info) -> Any:
        # Checked before pydantic's own coercion, which would take the string "500" and say nothing
        # about the unit for "500GB".
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{info.field_name} is a number of GiB without a unit, e.g. {info.field_name}: 500; "
                             "remove the unit (1 TiB is 1024)")
        if value <= 0:
            raise ValueError(f"{info.field_name} is a number of GiB greater than 0, e.g. {info.field_name}: 500; "
                             "remove the key for no quota")
        return float(value)


class ProjectsFile(_Model):
    gpu_types: dict[str, GpuType] = Field(min_length=1)
    teams: dict[str, Team] = Field(min_length=1)
    projects: dict[str, Project] = Field(min_length=1)
