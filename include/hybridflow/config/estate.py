"""The parsed estate: every cluster, team, project, GPU type, pipeline setting, dataset and model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hybridflow.config.clusters import Cluster
from hybridflow.config.pipeline import PipelineConfig
from hybridflow.config.projects import GpuType, Project, Team

if TYPE_CHECKING:
    from hybridflow.config.catalogue import Catalogue
    from hybridflow.config.registry import Registry


@dataclass(frozen=True)
class Estate:
    config_dir: Path
    clusters: dict[str, Cluster]
    projects: dict[str, Project]
    teams: dict[str, Team]
    gpu_types: dict[str, GpuType]
    pipeline: PipelineConfig
    datasets: Catalogue
    models: Registry

    @property
    def private_clusters(self) -> list[Cluster]:
        return [c for c in self.clusters.values() if c.is_private]

    @property
    def public_clusters(self) -> list[Cluster]:
        return [c for c in self.clusters.values() if not c.is_private]

    def queue_of(self, team: str) -> str:
        """The team's queue on Kubernetes gang schedulers (Volcano queue, Kueue LocalQueue)."""
        return self.teams[team].queue or team

    def offered_gpu_models(self) -> list[str]:
        return sorted({m for c in self.clusters.values() for m in c.gpu_models})

    def known_areas(self) -> list[str]:
        """Every region and jurisdiction of the estate's clusters."""
        return sorted({a for c in self.clusters.values() for a in c.areas})

    def file_roots(self, home: Path) -> list[Path]:
        """pipeline.yaml data.file_roots as absolute, resolved folders."""
        return [(Path(r) if Path(r).is_absolute() else home / r).resolve() for r in self.pipeline.data.file_roots]
