"""``load_estate``: parse, cross-check and cache the estate files of a config folder."""

from __future__ import annotations

import threading
from pathlib import Path

from hybridflow.config.base import CLUSTERS_FILE, DATASETS_FILE, MODELS_FILE, PIPELINE_FILE, PROJECTS_FILE
from hybridflow.config.checks import (
    _check_clusters,
    _check_dr_replicate,
    _check_metering,
    _check_projects,
    _check_reaper,
    _check_serving,
)
from hybridflow.config.clusters import ClustersFile
from hybridflow.config.estate import Estate
from hybridflow.config.pipeline import PipelineConfig
from hybridflow.config.projects import ProjectsFile
from hybridflow.config.reading import _validate
from hybridflow.errors import ConfigError

_cache_lock = threading.Lock()
_cache: dict[Path, tuple[tuple, Estate]] = {}


def load_estate(config_dir: Path, *, use_cache: bool = True) -> Estate:
    """Parse and cross-check the estate files in ``config_dir``.

    Cached per folder and keyed by the files' mtimes and sizes, so a DAG parse loop re-reads only
    after someone edits the YAML.
    """
    config_dir = Path(config_dir).resolve()
    files = [config_dir / n for n in (CLUSTERS_FILE, PROJECTS_FILE, PIPELINE_FILE, DATASETS_FILE, MODELS_FILE)]
    for f in files[:3]:
        if not f.is_file():
            raise ConfigError(f"{f}: file not found; the estate needs {', '.join(p.name for p in files[:3])}")
    # An estate that only meters or allocates may have no catalogue or registry: no dataset or model
    # is known then, and admission says so.
    stamp = tuple((st.st_mtime_ns, st.st_size) if (st := _stat(f)) else None for f in files)
    if use_cache:
        with _cache_lock:
            hit = _cache.get(config_dir)
        if hit and hit[0] == stamp:
            return hit[1]
    estate = _parse(config_dir, *files)
    with _cache_lock:
        _cache[config_dir] = (stamp, estate)
    return estate


def _stat(path: Path):
    try:
        return path.stat()
    except FileNotFoundError:
        return None


def _parse(config_dir: Path, clusters_path: Path, projects_path: Path, pipeline_path: Path, datasets_path: Path,
           models_path: Path) -> Estate:
    from hybridflow.config.catalogue import parse_catalogue
    from hybridflow.config.registry import parse_registry

    clusters_file = _validate(ClustersFile, clusters_path)
    projects_file = _validate(ProjectsFile, projects_path)
    pipeline = _validate(PipelineConfig, pipeline_path, allow_empty=True)
    for name, cluster in clusters_file.clusters.items():
        cluster._name = name
        cluster._bandwidth = pipeline.bandwidth  # its endpoint's upload cap is read from there

    problems = _check_clusters(clusters_path, clusters_file, projects_file)
    problems += _check_projects(projects_path, projects_file)
    problems += _check_metering(pipeline_path, pipeline.metering, clusters_file)
    problems += _check_serving(pipeline_path, pipeline.serving, clusters_file)
    problems += _check_reaper(pipeline_path, pipeline.reaper, clusters_file)
    if problems:
        raise ConfigError("invalid estate config:\n" + "\n".join(f"  - {p}" for p in problems))
    areas = {a for c in clusters_file.clusters.values() for a in c.areas}
    catalogue = parse_catalogue(datasets_path, areas)
    registry = parse_registry(models_path, catalogue.datasets, projects_file.projects)
    problems = _check_dr_replicate(clusters_path, clusters_file, catalogue, registry)
    if problems:
        raise ConfigError("invalid estate config:\n" + "\n".join(f"  - {p}" for p in problems))
    model = pipeline.defaults.model
    if model is not None and models_path.is_file() and model not in registry.models:
        raise ConfigError(f"{pipeline_path}: defaults.model: {model!r} is not in {MODELS_FILE}; use one of: "
                          f"{', '.join(sorted(registry.models))}")
    return Estate(
        config_dir=config_dir,
        clusters=dict(clusters_file.clusters),
        projects=dict(projects_file.projects),
        teams=dict(projects_file.teams),
        gpu_types=dict(projects_file.gpu_types),
        pipeline=pipeline,
        datasets=catalogue,
        models=registry,
    )
