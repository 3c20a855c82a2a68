"""Cluster backends: where gang jobs run. :func:`gang_backend` is the one place that picks the
implementation for a cluster of the estate (``backend`` in clusters.yaml); everything else talks to
the :class:`~hybridflow.backends.base.GangBackend` it returns."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.backends.base import (
    ClusterLoad,
    ConnectionProblem,
    GangBackend,
    GangJob,
    GangRemnant,
    QueueStanding,
)

if TYPE_CHECKING:
    from hybridflow.config import Cluster, Estate

__all__ = ["ClusterLoad", "ConnectionProblem", "GangBackend", "GangJob", "GangRemnant", "QueueStanding", "estate_load",
           "gang_backend", "node_actions", "probe_connection"]


def gang_backend(cluster: Cluster, estate: Estate, state_dir: Path, *, hook: Any = None) -> GangBackend:
    """The backend of ``cluster``, set up from the pipeline's training and placement settings
    (``state_dir``: where local clusters keep their slot pools and job records)."""
    training = estate.pipeline.training
    if cluster.backend == "kubernetes":
        from hybridflow.backends.k8s.backend import KubernetesGangBackend

        placement = estate.pipeline.placement
        # The scheduler restarts an evicted gang itself (resuming from its checkpoint) this many times.
        return KubernetesGangBackend(cluster, image=cluster.image or "", max_retry=training.preemption_retries,
                                     grace_s=training.preemption_grace_s, hook=hook,
                                     read_timeout_s=placement.cluster_read_timeout_s,
                                     cache_s=placement.cluster_load_cache_s,
                                     api_outage_s=training.kubernetes_api_outage_s,
                                     queue_teams={estate.queue_of(team): team for team in estate.teams})
    from hybridflow.backends.local import LocalGangBackend

    return LocalGangBackend(state_dir, cluster.name, cluster.total_gpus, grace_s=training.preemption_grace_s,
                            critical_preempts_batch=estate.pipeline.admission.critical_preempts_batch)


def probe_connection(cluster: Cluster, timeout_s: float) -> ConnectionProblem | None:
    """Why ``cluster``'s backend cannot reach the cluster now (its Connection, credentials, API server),
    with the fix; None when it answers within ``timeout_s``, or runs its gangs on this machine."""
    if cluster.backend == "kubernetes":
        from hybridflow.backends.k8s.probe import probe

        return probe(cluster, timeout_s)
    return None


def node_actions(cluster: Cluster, hook_factory: Any) -> Any:
    """What steers ``cluster``'s scheduler away from an unhealthy node (``cordon(node, reason)``,
    ``restart_gangs_on(node)``, ``uncordon(node)``; each returns what it did), through the hook
    ``hook_factory(conn_id)`` makes; None where there is no scheduler to steer (gangs run on this machine)."""
    if cluster.backend == "kubernetes":
        from hybridflow.backends.k8s.nodes import KubernetesNodeActions

        return KubernetesNodeActions(hook_factory(cluster.conn_id), cluster.k8s_namespace)
    return None


def estate_load(estate: Estate, state_dir: Path) -> dict[str, ClusterLoad]:
    """Every cluster's load, read in parallel (each Kubernetes read is bounded by its timeout)."""
    clusters = sorted(estate.clusters.values(), key=lambda c: c.name)
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(clusters)))) as pool:
        loads = list(pool.map(lambda c: _load(c, estate, state_dir), clusters))
    return {load.cluster: load for load in loads}


def _load(cluster: Cluster, estate: Estate, state_dir: Path) -> ClusterLoad:
    try:
        return gang_backend(cluster, estate, state_dir).load()
    except Exception as exc:  # noqa: BLE001 - a cluster we cannot read is unknown, not an error
        return ClusterLoad.unknown(cluster.name, cluster.total_gpus, f"{type(exc).__name__}: {exc}")


def team_usage(loads: dict[str, ClusterLoad]) -> dict[str, int]:
    """GPUs each team holds across the estate."""
    usage: dict[str, int] = {}
    for load in loads.values():
        for team, gpus in load.teams.items():
            usage[team] = usage.get(team, 0) + int(gpus)
    return usage


def team_held_outside(estate: Estate, state_dir: Path, team: str) -> int:
    """GPUs ``team`` holds on clusters whose gangs this machine does not launch (their schedulers'
    own count), for the team's estate-wide cap on the local backend's slot pools."""
    outside = [c for c in estate.clusters.values() if not gang_backend(c, estate, state_dir).supervised_by_task]
    return sum(int(_load(c, estate, state_dir).teams.get(team, 0)) for c in outside)
