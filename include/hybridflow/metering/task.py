"""The gpu_metering DAG's task unit: one cluster's pass from its source into the ledger and node health."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict
from datetime import datetime

from hybridflow.metering.collect import (
    ConnectionLookup,
    Endpoint,
    NodeFinding,
    attribute,
    known_gangs,
    known_runs,
    read_cluster,
)
from hybridflow.metering.dcgm import DcgmError
from hybridflow.metering.records import GpuSample

log = logging.getLogger(__name__)

StoreSamples = Callable[[Iterable[GpuSample], Mapping[tuple, str]], int]
ReportFindings = Callable[[Iterable[NodeFinding]], object]


def connection_endpoint(conn_id: str) -> Endpoint:
    """Base URL and basic-auth credentials of an Airflow Connection (http/https)."""
    from airflow.sdk import BaseHook

    conn = BaseHook.get_connection(conn_id)
    host = conn.host or ""
    if not host:
        raise DcgmError(f"connection {conn_id!r} has no host; set it to the exporter's or Prometheus' base URL")
    if "://" not in host:
        scheme = conn.schema if conn.schema in ("http", "https") else "http"
        host = f"{scheme}://{host}"
    url = f"{host.rstrip('/')}:{conn.port}" if conn.port else host
    auth = (conn.login, conn.password or "") if conn.login else None
    return Endpoint(url, auth)


def default_sinks() -> tuple[StoreSamples, ReportFindings]:
    """The ledger's sample store and node health's findings intake."""
    import importlib

    found = []
    for module, name in (("hybridflow.ledger", "store_samples"), ("hybridflow.nodehealth", "report_findings")):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError) as exc:
            raise DcgmError(f"{module}.{name} is not available ({exc}); metering needs the ledger and "
                            "node health installed with this package") from exc
    return found[0], found[1]


def meter_cluster(cluster_name: str, *, window_start: datetime, window_end: datetime, now: datetime,
                  lookup: ConnectionLookup | None = connection_endpoint,
                  sinks: tuple[StoreSamples, ReportFindings] | None = None) -> dict:
    """Read, store and report one cluster's GPU samples for [window_start, window_end).

    Stores what was read even when some exporters failed (their nodes are reported as failed
    probes), and raises only when the cluster gave nothing at all, so the run shows the outage.
    Returns a small summary for XCom.
    """
    from hybridflow.config import load_estate
    from hybridflow.settings import get_settings

    settings = get_settings()
    estate = load_estate(settings.config_dir)
    if cluster_name not in estate.clusters:
        raise DcgmError(f"cluster {cluster_name!r} is not in clusters.yaml; use one of {sorted(estate.clusters)}")
    cluster = estate.clusters[cluster_name]
    reading = read_cluster(cluster, estate.pipeline.metering, window_end=window_end,
                           window=window_end - window_start, now=now, state_dir=settings.state_dir,
                           lookup=lookup)
    summary = {"cluster": cluster_name, "window_end": window_end.isoformat(), "samples": len(reading.samples),
               "attributed": 0, "stored": 0, "errors": reading.errors, "warnings": reading.warnings,
               "skipped": reading.skipped,
               "nodes": len(reading.findings),
               "unhealthy": [f.node for f in reading.findings if f.xid_codes or f.ecc_dbe or not f.probe_ok]}
    if reading.skipped:
        log.warning("metering skipped: %s", reading.skipped)
        return summary
    store, report = sinks or default_sinks()
    namespaces = {c.k8s_namespace for c in estate.clusters.values() if c.runs_pods}
    owners = attribute(reading.samples, known_runs(settings.private_root), namespaces,
                       known_gangs(settings.private_root))
    summary["attributed"] = len(owners)
    summary["stored"] = store(reading.samples, owners)
    report(reading.findings)
    for error in reading.errors:
        log.warning("metering %s: %s", cluster_name, error)
    for finding in reading.findings:
        if finding.xid_codes or finding.ecc_dbe:
            log.warning("node %s/%s: %s", finding.cluster, finding.node, asdict(finding))
    if reading.errors and not reading.samples:
        raise DcgmError(f"cluster {cluster_name}: no exporter answered:\n  " + "\n  ".join(reading.errors))
    return summary


def serving_sink() -> Callable[..., int]:
    """The ledger's store of serving samples (one metering window replaced as a whole)."""
    import importlib

    try:
        return importlib.import_module("hybridflow.ledger.inference").store_serving_samples
    except (ImportError, AttributeError) as exc:
        raise DcgmError(f"hybridflow.ledger.inference.store_serving_samples is not available ({exc}); metering "
                        "needs the ledger installed with this package") from exc


def meter_serving_window(*, window_start: datetime, window_end: datetime, now: datetime,
                         store: Callable[..., int] | None = None) -> dict:
    """Sample the model versions that served during [window_start, window_end) (hybridflow.metering.serving)
    into the ledger; returns a summary for XCom."""
    from hybridflow.metering.serving import meter_serving

    summary = meter_serving(store or serving_sink(), window_start=window_start, window_end=window_end, now=now)
    if summary.get("skipped"):
        log.warning("serving metering skipped: %s", summary["skipped"])
    return summary
