"""The run's data where its cluster reads it: in place on a private cluster whose gangs read private
storage, else copied into the cluster's cache (a private Kubernetes cluster's pods read its own
on-prem bucket). The staging guard re-reads the catalogue, and the staged copy must be the version
the validation step checked."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from hybridflow.settings import Settings

log = logging.getLogger(__name__)


def stage_data(run: Mapping[str, Any], placement: Mapping[str, Any], settings: Settings) -> dict:
    """Stage the run's validated dataset for ``placement``'s cluster; the train task's data source."""
    from hybridflow import rundata
    from hybridflow.backends import gang_backend
    from hybridflow.config import load_estate
    from hybridflow.datasets import locate
    from hybridflow.placement.places import cache_store_spec
    from hybridflow.request import AdmittedRun
    from hybridflow.sovereignty import Destination
    from hybridflow.staging import StagingSettings, index_path_for, read_manifest, stage_dataset
    from hybridflow.storage.objectstore import open_store

    started = time.monotonic()
    estate = load_estate(settings.config_dir)
    admitted = AdmittedRun.from_xcom(dict(run))
    entry = estate.datasets.get(admitted.dataset)
    roots = estate.file_roots(settings.home)
    cluster = estate.clusters[placement["cluster"]]
    version = rundata.read_version(settings.private_root, run["run_key"])
    if cluster.location == "private" and gang_backend(cluster, estate, settings.state_dir).reads_private_storage:
        log.info("Cluster %s is private: the data is read where it lives (%s), nothing to stage.",
                 placement["cluster"], entry.location)
        source, _ = rundata.source_where_it_lives(entry, settings.private_root, run["run_key"], roots)
        return {"source": source, "staged": False, "version": version.version, "seconds": 0.0}
    spec = cache_store_spec(cluster)
    target = open_store(spec)
    location = locate(entry, settings.private_root, roots)
    result = stage_dataset(
        location.source(entry.name),
        target,
        destination=Destination(cluster.location, cluster.areas, cluster.name),
        catalogue=settings.config_dir / "datasets.yaml",
        dataset=entry.name,
        raised=admitted.classification,
        run_key=run["run_key"],
        settings=StagingSettings.from_config(estate.pipeline.staging),
        index_path=index_path_for(settings.state_dir, location.uri if location.path is None else str(location.path)),
        log=log,
    )
    rundata.check_staged(version, read_manifest(target, result.manifest_key), entry.name)
    rundata.write_staging(settings.private_root, run["run_key"], result.to_xcom())
    record_staged(run["run_key"], admitted.project, cluster.name, result)
    return {
        "source": {"kind": "manifest", "store": spec.to_dict(), "manifest_key": result.manifest_key},
        "staged": True,
        "version": version.version,
        "staging": result.to_xcom(),
        "seconds": round(time.monotonic() - started, 3),
    }


def record_staged(run_key: str, project: str, cluster: str, result) -> None:
    """The bytes this stage sent, in the ledger for the project's transfer quota. Recorded with 0 bytes
    too: the row ties the version in the cache to the project (its storage quota). Keyed by run,
    cluster and version, so a cleared stage task is not counted again."""
    from datetime import UTC, datetime

    from hybridflow.ledger.engine import default_engine
    from hybridflow.ledger.transfers import Transfer, record_transfer

    record_transfer(default_engine(), Transfer(
        key=f"staging/{cluster}/{result.dataset}/{result.version}/{run_key}", day=datetime.now(UTC).date(),
        project=project, kind="staging", cluster=cluster, bytes=result.bytes_copied, run_key=run_key,
        dataset=result.dataset, version=result.version,
    ))
