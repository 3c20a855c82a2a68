"""The estate description under ``config/``: clusters, projects, pipeline-wide defaults, and the
dataset catalogue and model registry (``hybridflow.config.catalogue``, ``hybridflow.config.registry``).

``load_estate`` parses ``clusters.yaml``, ``projects.yaml``, ``pipeline.yaml``, ``datasets.yaml`` and
``models.yaml`` into frozen pydantic models and cross-checks them. Any problem raises :class:`~hybridflow.errors.ConfigError` whose message
names the file, the key path (``clusters.cloud-east.node_pools[0].gpus``) and what to change, so an
operator can fix the YAML without reading this code.

The package: ``base`` (shared model base, file names), ``clusters``, ``projects`` and ``pipeline`` (one
module per file's models), ``estate`` (the parsed whole), ``reading`` (one YAML file into its model),
``checks`` (cross-file checks) and ``loading`` (``load_estate`` and its cache).
"""

from __future__ import annotations

from hybridflow.config.base import (
    CLUSTERS_FILE,
    DATASETS_FILE,
    MODELS_FILE,
    PIPELINE_FILE,
    PROJECTS_FILE,
    _Model,
)
from hybridflow.config.checks import (
    _LABEL_KEY_RE,
    _LABEL_VALUE_RE,
    _NAME_RE,
    _check_backend,
    _check_checkpoint_places,
    _check_clusters,
    _check_metering,
    _check_node_pools,
    _check_projects,
    _check_serving,
)
from hybridflow.config.clusters import (
    CacheConfig,
    CheckpointPlace,
    Cluster,
    ClustersFile,
    NodePool,
    PricingClass,
)
from hybridflow.config.estate import Estate
from hybridflow.config.loading import _cache, _cache_lock, _parse, _stat, load_estate
from hybridflow.config.pipeline import (
    AdmissionSettings,
    DataSettings,
    DefaultsSettings,
    KubernetesServing,
    MeteringCluster,
    MeteringSettings,
    PipelineConfig,
    PlacementSettings,
    ServingSettings,
    StagingConfig,
    TrainingSettings,
)
from hybridflow.config.projects import GpuType, Project, ProjectsFile, Team
from hybridflow.config.reading import (
    _M,
    _allowed_keys,
    _construct_mapping,
    _describe,
    _read_yaml,
    _UniqueKeyLoader,
    _unwrap,
    _validate,
    key_path,
)

__all__ = [
    "CLUSTERS_FILE",
    "DATASETS_FILE",
    "MODELS_FILE",
    "PIPELINE_FILE",
    "PROJECTS_FILE",
    "AdmissionSettings",
    "CacheConfig",
    "CheckpointPlace",
    "Cluster",
    "ClustersFile",
    "DataSettings",
    "DefaultsSettings",
    "Estate",
    "GpuType",
    "KubernetesServing",
    "MeteringCluster",
    "MeteringSettings",
    "NodePool",
    "PipelineConfig",
    "PlacementSettings",
    "PricingClass",
    "Project",
    "ProjectsFile",
    "ServingSettings",
    "StagingConfig",
    "Team",
    "TrainingSettings",
    "_LABEL_KEY_RE",
    "_LABEL_VALUE_RE",
    "_M",
    "_NAME_RE",
    "_Model",
    "_UniqueKeyLoader",
    "_allowed_keys",
    "_cache",
    "_cache_lock",
    "_check_backend",
    "_check_checkpoint_places",
    "_check_clusters",
    "_check_metering",
    "_check_node_pools",
    "_check_projects",
    "_check_serving",
    "_construct_mapping",
    "_describe",
    "_parse",
    "_read_yaml",
    "_stat",
    "_unwrap",
    "_validate",
    "key_path",
    "load_estate",
]
