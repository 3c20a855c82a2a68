"""The task units of the ``dr_replication`` and ``dr_reconciliation`` DAGs.

Both go over every ``role: dr`` cluster of the estate; with none configured they log that and
return without touching anything. Whatever they find wrong (a source object missing or changed, a
Connection missing, drift that could not be repaired) fails the task with every item named, after
all that could be done was done; running again is safe (nothing is copied twice, nothing deleted).
"""

from __future__ import annotations

from typing import Any

from hybridflow.dr.replication.replicas import logger
from hybridflow.errors import HybridFlowError

NO_DR = "no cluster in clusters.yaml has role: dr; nothing to replicate or reconcile (docs/disaster-recovery.md)"


class DrNotReady(HybridFlowError):
    """The DR side is not (wholly) ready; the message names each item and its fix."""


def _estate():
    from hybridflow.config import load_estate
    from hybridflow.settings import get_settings

    settings = get_settings()
    return load_estate(settings.config_dir), settings


def _fail_with(lines: list[str], what: str) -> None:
    if lines:
        shown = "\n".join(f"  - {line}" for line in lines[:50])
        more = f"\n  (+{len(lines) - 50} more)" if len(lines) > 50 else ""
        raise DrNotReady(f"{what}:\n{shown}{more}")


def configured_scope(cluster, settings, log: Any = logger, estate=None) -> tuple[list[str] | None, list[str] | None]:
    """(endpoints, datasets) of the cluster's ``dr.replicate`` for :func:`~hybridflow.dr.replication.replicate.replicate`:
    None where the list is empty (everything served, each endpoint's dataset). A configured endpoint
    not served yet has nothing to copy: it is logged and left out, not an error. ``estate`` picks
    where served endpoints are found (its deploy target; without it, the local model gateway)."""
    from pathlib import Path

    from hybridflow.dr.replication.scope import served_endpoints
    from hybridflow.dr.replication.sources import served_endpoint_names

    wanted = cluster.dr.replicate if cluster.dr is not None else None
    if wanted is None:
        return None, None
    endpoints = None
    if wanted.endpoints:
        served = set(served_endpoint_names(estate, settings) if estate is not None
                     else served_endpoints(Path(settings.state_dir) / "serving"))
        endpoints = [e for e in wanted.endpoints if e in served]
        for e in wanted.endpoints:
            if e not in served:
                log.warning("DR cluster %s: endpoint %s (dr.replicate.endpoints) is not served yet; nothing of it "
                            "to replicate", cluster.name, e)
    return endpoints, list(wanted.datasets) or None


def replication_task(*, lookup=None, log: Any = logger) -> dict[str, Any]:
    """Replicate to every DR cluster and check what each needs for a takeover."""
    from datetime import UTC, datetime

    from hybridflow.dr.replication.readiness import check_readiness
    from hybridflow.dr.replication.replicate import replicate
    from hybridflow.dr.replication.scope import dr_clusters
    from hybridflow.dr.replication.usage import record_replicated

    estate, settings = _estate()
    clusters = dr_clusters(estate)
    if not clusters:
        log.info(NO_DR)
        return {"status": "no dr cluster", "clusters": []}
    out, trouble = [], []
    for cluster in clusters:
        missing = check_readiness(cluster, estate, lookup=lookup)
        for m in missing:
            log.warning("DR cluster %s is not ready: %s", cluster.name, m)
        trouble += [f"{cluster.name}: {m}" for m in missing]
        if any(m.field.endswith(".cache.conn_id") for m in missing):
            out.append({"cluster": cluster.name, "readiness": [m.to_dict() for m in missing]})
            continue  # its store cannot be opened; the other DR clusters still get their copy
        endpoints, datasets = configured_scope(cluster, settings, log, estate)
        report = replicate(estate, settings, cluster=cluster.name, endpoints=endpoints, datasets=datasets, log=log)
        record_replicated(report, settings.private_root, datetime.now(UTC).date())  # the transfer quotas' bytes
        trouble += [f"{cluster.name}: {p}" for p in report.all_problems]
        out.append({**report.to_dict(), "readiness": [m.to_dict() for m in missing]})
    _fail_with(trouble, "the DR side is not wholly ready (everything else was replicated)")
    return {"status": "replicated", "clusters": out}


def reconciliation_task(*, log: Any = logger) -> dict[str, Any]:
    """Reconcile every DR cluster's store with its manifests, repairing from healthy sources."""
    from hybridflow.dr.replication.reconcile import reconcile
    from hybridflow.dr.replication.replicate import healthy_sources
    from hybridflow.dr.replication.scope import dr_cluster, dr_clusters
    from hybridflow.placement.places import cache_store_spec
    from hybridflow.storage.objectstore import open_store

    estate, settings = _estate()
    clusters = dr_clusters(estate)
    if not clusters:
        log.info(NO_DR)
        return {"status": "no dr cluster", "clusters": []}
    out, trouble = [], []
    for cluster in clusters:
        dr = dr_cluster(estate, cluster.name)
        endpoints, datasets = configured_scope(dr, settings, log, estate)  # repaired from what replication copies
        sources = healthy_sources(estate, settings, cluster=dr.name, endpoints=endpoints, datasets=datasets)
        report = reconcile(open_store(cache_store_spec(dr)), sources, log=log)
        trouble += [f"{dr.name}: {p}" for p in report.unrepaired]
        out.append({"cluster": dr.name, **report.to_dict()})
    _fail_with(trouble, "drift in the DR store that could not be repaired by copying")
    return {"status": "reconciled", "clusters": out}
