"""One metering pass over a cluster: read its GPU samples, tie them to runs, sum up node findings.

Sources are chosen per cluster in ``pipeline.yaml`` (``metering.clusters``) from the table in
:mod:`hybridflow.metering.sources`: the local stand-in exporter, direct dcgm-exporter scrapes, or a
Prometheus that already scrapes them. A pass covers one window (a DAG run's data interval) and stamps
direct readings with the window's end, so clearing and re-running that run produces the same sample
keys (the ledger upserts them). A direct scrape can only read the present: a re-run long after its
window is skipped with a reason instead of recording today's values under an old time; Prometheus
sources read the window itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from hybridflow.config import Cluster, MeteringCluster, MeteringSettings
from hybridflow.metering.records import GpuSample, XidCount
from hybridflow.metering.sources import ConnectionLookup, Endpoint, open_source, scrape_settings

__all__ = ["ClusterReading", "ConnectionLookup", "Endpoint", "NodeFinding", "attribute", "gang_owner",
           "known_gangs", "known_runs", "node_findings", "read_cluster", "run_key_of", "scrape_settings",
           "source_of"]

# The train task names its gang "train-<run_key>"; Kubernetes pods of the gang add a suffix.
GANG_PREFIX = "train-"


@dataclass(frozen=True, slots=True)
class NodeFinding:
    """What a pass saw of one node's health: non-zero Xid codes (the last Xid of each GPU and those
    an exporter counted in its window), ECC error totals, exporter answered; ``detail`` says why."""

    cluster: str
    node: str
    xid_codes: tuple[int, ...]
    ecc_sbe: int
    ecc_dbe: int
    probe_ok: bool
    detail: str = ""


@dataclass
class ClusterReading:
    cluster: str
    samples: list[GpuSample] = field(default_factory=list)
    findings: list[NodeFinding] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    skipped: str | None = None
    xid_counts: list[XidCount] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # seen but not metered: GPUs without a node or fields


def source_of(cluster: Cluster, metering: MeteringSettings) -> MeteringCluster | None:
    """The cluster's configured source; local clusters default to the stand-in exporter."""
    configured = metering.clusters.get(cluster.name)
    if configured is not None:
        return configured
    return MeteringCluster(source="local") if cluster.on_this_machine else None


def read_cluster(cluster: Cluster, metering: MeteringSettings, *, window_end: datetime,
                 window: timedelta, now: datetime, state_dir: Path,
                 lookup: ConnectionLookup | None = None) -> ClusterReading:
    """Samples and node findings of one cluster for the window ending at ``window_end``."""
    reading = ClusterReading(cluster.name)
    src = source_of(cluster, metering)
    if src is None:
        reading.skipped = (f"no metering source for {cluster.backend} cluster {cluster.name}; add "
                           f"metering.clusters.{cluster.name} (exporters or prometheus) to pipeline.yaml")
        return reading
    source = open_source(cluster, src, metering, state_dir=state_dir, lookup=lookup)
    if not source.reads_past and now - window_end > window:
        reading.skipped = (f"{cluster.name}: this run's window ended at {window_end.isoformat()}, more than "
                           f"{window} ago; an exporter only shows the present, so nothing is recorded for it "
                           "(a prometheus source can fill past windows)")
        return reading
    got = source.read(window_end=window_end, window=window)
    reading.samples = got.page.samples
    reading.xid_counts = got.page.xid_counts
    reading.warnings = got.page.warnings
    reading.errors = got.errors
    reading.findings = node_findings(reading.samples, xid_counts=reading.xid_counts, failed=got.failed,
                                     cluster=cluster.name)
    return reading


def node_findings(samples: Iterable[GpuSample], *, xid_counts: Iterable[XidCount] = (),
                  failed: Iterable[tuple[str, str]] = (), cluster: str | None = None) -> list[NodeFinding]:
    """Per node: the distinct non-zero Xid codes and the ECC totals over its GPUs (latest reading
    of each GPU), the Xids an exporter counted in its window at any reading of the pass, plus a
    failed probe for each exporter that did not answer."""
    latest: dict[tuple[str, str, str, str], GpuSample] = {}
    for s in samples:
        key = (s.cluster, s.node, s.gpu_uuid, s.mig_instance or "")
        if key not in latest or latest[key].ts <= s.ts:
            latest[key] = s
    per_node: dict[tuple[str, str], list[GpuSample]] = {}
    for s in latest.values():
        per_node.setdefault((s.cluster, s.node), []).append(s)
    counted: dict[tuple[str, str], dict[tuple[str, int], XidCount]] = {}
    for c in xid_counts:
        worst = counted.setdefault((c.cluster, c.node), {})
        if (c.gpu_uuid, c.xid) not in worst or worst[(c.gpu_uuid, c.xid)].count < c.count:
            worst[(c.gpu_uuid, c.xid)] = c
        per_node.setdefault((c.cluster, c.node), [])
    out = []
    for (cl, node), gpus in sorted(per_node.items()):
        seen = counted.get((cl, node), {})
        xids = tuple(sorted({s.xid for s in gpus if s.xid} | {xid for _, xid in seen}))
        out.append(NodeFinding(cl, node, xids, sum(s.ecc_sbe or 0 for s in gpus),
                               sum(s.ecc_dbe or 0 for s in gpus), True, _counted_detail(seen.values())))
    for host, reason in failed:
        out.append(NodeFinding(cluster or "", host, (), 0, 0, False, reason))
    return out


def _counted_detail(counts: Iterable[XidCount]) -> str:
    parts = [f"Xid {c.xid} x{c.count} on {c.gpu_uuid}"
             + (f" within {c.window_ms / 1000:g} s" if c.window_ms else "")
             for c in sorted(counts, key=lambda c: (c.gpu_uuid, c.xid))]
    return "; ".join(parts)


def run_key_of(pod: str | None, run_keys: Iterable[str]) -> str | None:
    """The run whose gang the pod belongs to: pod ``train-<run_key>`` or ``train-<run_key>-...``;
    the longest matching run key wins (one key may prefix another)."""
    if not pod or not pod.startswith(GANG_PREFIX):
        return None
    rest = pod[len(GANG_PREFIX):]
    matches = [k for k in run_keys if rest == k or rest.startswith(f"{k}-")]
    return max(matches, key=len) if matches else None


def gang_owner(pod: str | None, gangs: Mapping[str, str]) -> str | None:
    """The run of the Kubernetes gang job the pod belongs to (``<job>-master-0``, ``<job>-3-x7k2q``):
    ``gangs`` maps job name -> run key; the longest matching job name wins."""
    if not pod:
        return None
    matches = [g for g in gangs if pod == g or pod.startswith(f"{g}-")]
    return gangs[max(matches, key=len)] if matches else None


def known_gangs(private_root: Path) -> dict[str, str]:
    """Gang job name -> run key, from the runs' training attempts: a Kubernetes job's name is a
    DNS label derived from the run, not ``train-<run_key>`` itself."""
    gangs: dict[str, str] = {}
    for path in (private_root / "runs").glob("*/train-attempts.json"):
        try:
            attempts = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being rewritten: the next collection sees it
        for attempt in attempts:
            if attempt.get("gang"):
                gangs[attempt["gang"]] = path.parent.name
    return gangs


def known_runs(private_root: Path) -> dict[str, str | None]:
    """Run key -> project of the runs on record (finished) and in progress (a run folder, no
    record yet: project unknown)."""
    from hybridflow.records import read_records

    runs: dict[str, str | None] = {p.name: None for p in (private_root / "runs").glob("*") if p.is_dir()}
    for rec in read_records(private_root):
        runs[rec["run_key"]] = rec.get("project")
    return runs


def attribute(samples: Iterable[GpuSample], runs: Mapping[str, str | None],
              namespaces: Iterable[str] = (), gangs: Mapping[str, str] | None = None) -> dict[tuple, str]:
    """Sample key -> run key, for samples whose pod is a run's gang. ``runs`` maps run key ->
    project (None while unknown), ``gangs`` Kubernetes gang job name -> run key; the pod's
    namespace must be unset, the run's project (local stand-in) or one of ``namespaces`` (the
    Kubernetes clusters' gang namespaces)."""
    allowed = set(namespaces)
    gangs = {g: k for g, k in (gangs or {}).items() if k in runs}
    out = {}
    for s in samples:
        key = run_key_of(s.pod, runs) or gang_owner(s.pod, gangs)
        if key is not None and (s.namespace is None or runs[key] in (None, s.namespace) or s.namespace in allowed):
            out[s.key()] = key
    return out
