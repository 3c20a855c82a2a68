"""Which cluster is the DR side and what it must hold: the DR cluster of ``clusters.yaml``, the
endpoints and datasets to keep there, and the critical training running now.

Without names, the endpoints are every endpoint the deploy target serves or served (the local
model gateway's, or those with a bundle on the Kubernetes target's models volume), the datasets the ones
their models are registered with, and the runs every critical run whose gang is running on a
cluster other than the DR one (with the dataset version it trains on).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.errors import HybridFlowError

logger = logging.getLogger("hybridflow.dr")


class ReplicationError(HybridFlowError):
    """Replication was asked for something the estate cannot give; ``field`` names the input at fault.
    Raised before anything is read or written."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class NoDrCluster(ReplicationError):
    """No cluster of the estate has role: dr."""


def dr_clusters(estate) -> list:
    return [c for c in estate.clusters.values() if c.is_dr]


def dr_cluster(estate, name: str | None = None):
    """The DR cluster named ``name`` (default: the estate's only one), with a store to copy into."""
    drs = dr_clusters(estate)
    names = ", ".join(sorted(c.name for c in drs)) or "none"
    if name is None:
        if not drs:
            raise NoDrCluster("cluster", "no cluster in clusters.yaml has role: dr, so there is nothing to replicate "
                                         "to; add one (role: dr, dr: {min_gpus: N}, cache: {conn_id, bucket}), see "
                                         "docs/placement.md")
        if len(drs) > 1:
            raise ReplicationError("cluster", f"clusters.yaml has several dr clusters ({names}); name the one to "
                                              "replicate to")
        cluster = drs[0]
    elif name not in estate.clusters:
        raise ReplicationError("cluster", f"{name!r} is not in clusters.yaml; dr clusters: {names}")
    else:
        cluster = estate.clusters[name]
        if not cluster.is_dr:
            raise ReplicationError("cluster", f"{name!r} has role {cluster.role}, not dr; replicate to a dr cluster "
                                              f"({names})")
    if cluster.cache is None:
        raise ReplicationError(f"clusters.{cluster.name}.cache", "a dr cluster needs cache: {conn_id, bucket}, the "
                                                                 "object store its takeover reads; add it to clusters.yaml")
    return cluster


@dataclass(frozen=True)
class CriticalRun:
    run_key: str
    cluster: str  # where its gang runs
    gang: str


@dataclass
class Scope:
    endpoints: list[str]
    datasets: list[str]
    runs: list[CriticalRun]
    # (cluster, what) of what could not be looked at (a cluster unreachable)
    problems: list[tuple[str, str]] = field(default_factory=list)
    # endpoint -> its version records, newest first (what serves now first), as the deploy target keeps them
    versions: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    serving_problems: list[Any] = field(default_factory=list)  # Problems of the serving target (API unreachable)


def served_endpoints(serving_root: Path) -> list[str]:
    return sorted(p.parent.name for p in Path(serving_root).glob("*/active.json"))


def _running_attempt(private_root: Path, run_key: str) -> dict[str, Any] | None:
    from hybridflow.training.attempts import ATTEMPTS_FILE, read_attempts

    attempts = read_attempts(Path(private_root) / "runs" / run_key / ATTEMPTS_FILE)
    return attempts[-1] if attempts and attempts[-1].get("outcome") == "running" else None


def running_critical_runs(estate, settings, dr_name: str,
                          log: Any = logger) -> tuple[list[CriticalRun], list[tuple[str, str]]]:
    """Critical runs with a running gang on a cluster other than ``dr_name``: the gangs labelled
    priority=critical there, matched to the run folder whose running attempt names that gang."""
    from hybridflow.backends import gang_backend

    gangs: dict[tuple[str, str], None] = {}
    problems: list[tuple[str, str]] = []
    for cluster in estate.clusters.values():
        if cluster.name == dr_name:
            continue
        try:
            for name in gang_backend(cluster, estate, settings.state_dir).find_gangs({"priority": "critical"}):
                gangs[(cluster.name, name)] = None
        except Exception as exc:  # noqa: BLE001 - one unreachable cluster must not stop the others
            problems.append((cluster.name, f"cannot list its critical gangs ({type(exc).__name__}: {exc})"))
    runs = []
    for folder in sorted((Path(settings.private_root) / "runs").glob("*/")):
        attempt = _running_attempt(settings.private_root, folder.name)
        if attempt and (attempt.get("cluster"), attempt.get("gang")) in gangs:
            runs.append(CriticalRun(folder.name, attempt["cluster"], attempt["gang"]))
    return runs, problems


def scope_of(estate, settings, dr, *, endpoints: Sequence[str] | None = None, datasets: Sequence[str] | None = None,
             runs: Sequence[CriticalRun] | None = None, log: Any = logger) -> Scope:
    """What to keep on ``dr``; names given are checked against the estate first (ReplicationError
    naming ``endpoints`` or ``datasets``)."""
    from hybridflow.dr.replication.sources import endpoint_versions, served_endpoint_names

    served = served_endpoint_names(estate, settings)
    if endpoints is not None:
        unknown = sorted(set(endpoints) - set(served))
        if unknown:
            raise ReplicationError("endpoints", f"{', '.join(unknown)} not served here (served: "
                                                f"{', '.join(served) or 'none'}); name served endpoints")
    if datasets is not None:
        unknown = sorted(set(datasets) - set(estate.datasets.datasets))
        if unknown:
            raise ReplicationError("datasets", f"{', '.join(unknown)} not in datasets.yaml; use one of: "
                                               f"{', '.join(sorted(estate.datasets.datasets))}")
    chosen = list(served if endpoints is None else endpoints)
    problems: list[tuple[str, str]] = []
    if runs is None:
        found, problems = running_critical_runs(estate, settings, dr.name, log)
    else:
        found = list(runs)
    serving_problems: list[Any] = []
    # Asked once per pass: on Kubernetes each endpoint costs a call to the serving cluster's API server.
    versions = {e: endpoint_versions(estate, settings, e, serving_problems) for e in chosen}
    if datasets is None:
        names: set[str] = set()
        for endpoint in chosen:
            for record in versions[endpoint][:1]:
                model = estate.models.models.get(str(record.get("model")))
                if model is not None:
                    names.add(model.dataset)
        datasets = sorted(names)
    return Scope(endpoints=chosen, datasets=list(datasets), runs=found, problems=problems, versions=versions,
                 serving_problems=serving_problems)
