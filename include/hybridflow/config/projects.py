"""``projects.yaml``: GPU types, teams (caps, guaranteed shares, queues) and projects."""

from __future__ import annotations

from pydantic import Field

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


class ProjectsFile(_Model):
    gpu_types: dict[str, GpuType] = Field(min_length=1)
    teams: dict[str, Team] = Field(min_length=1)
    projects: dict[str, Project] = Field(min_length=1)
