"""What every estate file model shares, and the names of the estate's files under ``config/``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

CLUSTERS_FILE = "clusters.yaml"
PROJECTS_FILE = "projects.yaml"
PIPELINE_FILE = "pipeline.yaml"
DATASETS_FILE = "datasets.yaml"
MODELS_FILE = "models.yaml"


class _Model(BaseModel):
    # Frozen: the estate is shared (and cached) across tasks; extra=forbid: a typo is an error, not a no-op.
    model_config = ConfigDict(extra="forbid", frozen=True)

