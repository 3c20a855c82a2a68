"""Draining a cluster declared down: its running gangs checkpoint and stop, where it still answers,
and what serves from it is reported.

Gangs are stopped with their backend's ``stop`` (the path a budget freeze takes): local gangs get
SIGTERM and commit a final checkpoint within ``training.preemption_grace_s``; Kubernetes gang jobs
are annotated with the reason, then deleted with their pods (SIGTERM: the same final checkpoint).
A stopped gang is never relaunched, so nothing of it starts again on the fenced cluster; its train
task fails naming the reason, and the newest checkpoint stays in the run's checkpoint places. A
cluster whose backend does not answer is recorded as such: its gangs could not be checkpointed.

Serving: on the local target the model gateway's endpoints are moved to model servers on the
disaster-recovery side, started from the replicated models (:mod:`hybridflow.dr.failover.serving`,
which also says which cluster hosts serving); an inference pool on ``serving.kubernetes.cluster`` is
served from the DR cluster's pool (``clusters.<dr>.dr.serving``, :mod:`hybridflow.dr.failover.serving_k8s`).

**Resumable.** The drain is a step of its own, kept with the fence record (``drain``, with
``complete`` and ``failures``). An error in one part (a corrupt DR manifest, a store error, a full
disk) is kept as that part's outcome and the others still run; the outcome is recorded, and then
:class:`DrainIncomplete` names every failure and how to rerun. A rerun of ``cluster down`` on the
cluster, fenced already, drains again whatever is not complete (a drain never recorded, e.g. its
process was killed, counts as not complete); what was done is not done twice (a stopped gang is not
found again, an endpoint served on the DR side already is left as it is).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from hybridflow.errors import HybridFlowError

log = logging.getLogger(__name__)


class DrainIncomplete(HybridFlowError):
    """The cluster is fenced, but part of its drain failed: ``failures`` names each part, ``out`` is
    what ``fence_and_drain`` would have returned. Running the declaration again drains what is left."""

    def __init__(self, cluster: str, reason: str, failures: list[str], out: dict[str, Any]) -> None:
        self.cluster, self.failures, self.out = cluster, list(failures), out
        super().__init__(
            f"{cluster} is declared down (no new placements), but its drain did not complete:\n"
            + "\n".join(f"  - {f}" for f in failures)
            + f"\nonce the cause is fixed, run `hybridflow cluster down {cluster} --reason {reason!r}` again (or "
            "clear the cluster_fence task): the fence stands and the drain is retried, what it did already is not "
            "done twice")


def needs_drain(record: dict[str, Any]) -> bool:
    """Whether the fence ``record`` still needs its drain: none recorded (never run, or cut short
    before it was kept), or one that did not complete."""
    drain = record.get("drain")
    return not isinstance(drain, dict) or drain.get("complete") is False


def failures_of(outcome: dict[str, Any]) -> list[str]:
    """Each part of a drain ``outcome`` that failed, as ``what: error``."""
    failed = []
    gangs, serving = outcome.get("gangs") or {}, outcome.get("serving") or {}
    if gangs.get("failed"):
        failed.append(f"gangs: {gangs.get('error')}")
    if serving.get("failed"):
        failed.append(f"serving: {serving.get('error')}")
    for endpoint, moved in sorted((serving.get("endpoints") or {}).items()):
        if isinstance(moved, dict) and moved.get("state") == "failed":
            failed.append(f"endpoint {endpoint}: {moved.get('error')}")
    return failed


def _default_backend(cluster: Any, estate: Any, state_dir: Any) -> Any:
    from hybridflow.backends import gang_backend

    return gang_backend(cluster, estate, state_dir)


def checkpoint_gangs(cluster_name: str, reason: str, estate: Any, state_dir: Any, *,
                     backend_factory: Callable[[Any, Any, Any], Any] = _default_backend) -> dict[str, Any]:
    """Stop every running gang of the cluster with ``reason`` (each commits a final checkpoint
    first). ``answered`` False: the cluster could not be asked, ``error`` says why."""
    cluster = estate.clusters[cluster_name]
    stopped: list[str] = []
    gone: list[str] = []
    try:
        backend = backend_factory(cluster, estate, state_dir)
        for name in backend.find_gangs({}):
            (stopped if backend.stop(name, reason) else gone).append(name)
    except Exception as exc:  # noqa: BLE001 - a down cluster may well not answer; the fence stands anyway
        log.warning("cluster %s declared down: its gangs could not be stopped (%s: %s)%s", cluster_name,
                    type(exc).__name__, exc, f"; stopped so far: {', '.join(stopped)}" if stopped else "")
        return {"answered": False, "error": f"{type(exc).__name__}: {exc}", "stopped": stopped, "gone": gone}
    for name in stopped:
        log.info("cluster %s declared down: gang %s checkpointed and stopped", cluster_name, name)
    return {"answered": True, "stopped": stopped, "gone": gone}


def serving_on(cluster_name: str, estate: Any) -> dict[str, Any]:
    """Which serving entry, if any, runs on the cluster, when nothing can be moved: a Kubernetes target
    without ``serving.kubernetes`` (a pool that has one moves, see :mod:`hybridflow.dr.failover.serving_k8s`)."""
    serving = estate.pipeline.serving
    pool = serving.kubernetes
    where = f"the inference pool is on {pool.cluster}" if pool is not None else (
        "the model gateway serves from this machine (serving.target local), which is no cluster of clusters.yaml")
    return {"entry": None, "drained": False, "note": f"no serving entry on {cluster_name}: {where}"}


def drain(cluster_name: str, reason: str, estate: Any, state_dir: Any, *,
          backend_factory: Callable[[Any, Any, Any], Any] = _default_backend, dr_spec: Any = None) -> dict[str, Any]:
    """Checkpoint and stop the cluster's gangs, and drain its serving entry to the DR side
    (:func:`hybridflow.dr.failover.serving.fail_over`; ``dr_spec`` replaces the DR store); the
    outcome is what :func:`hybridflow.fencing.record_drain` keeps with the fence."""
    from hybridflow.dr.failover.serving import fail_over

    # Each part runs whatever the other did: a serving error must not leave gangs running, nor the reverse.
    try:
        gangs = checkpoint_gangs(cluster_name, f"cluster {cluster_name} declared down: {reason}", estate, state_dir,
                                 backend_factory=backend_factory)
    except Exception as exc:  # noqa: BLE001 - kept as the part's outcome; the declaration fails at the end
        log.exception("cluster %s declared down: stopping its gangs failed", cluster_name)
        gangs = {"answered": False, "failed": True, "error": f"{type(exc).__name__}: {exc}", "stopped": [], "gone": []}
    try:
        serving = fail_over(cluster_name, estate, state_dir, dr_spec=dr_spec)
    except Exception as exc:  # noqa: BLE001 - as above
        log.exception("cluster %s declared down: its serving failover failed", cluster_name)
        serving = {"entry": None, "drained": False, "failed": True, "error": f"{type(exc).__name__}: {exc}"}
    outcome = {"at": datetime.now(UTC).isoformat(timespec="seconds"), "gangs": gangs, "serving": serving}
    failures = failures_of(outcome)
    return {**outcome, "complete": not failures, "failures": failures}


def fence_and_drain(cluster_name: str, reason: str, *, by: str | None = None, estate: Any = None,
                    state_dir: Any = None, backend_factory: Callable[[Any, Any, Any], Any] = _default_backend,
                    dr_spec: Any = None) -> dict[str, Any]:
    """``hybridflow cluster down``: fence first (no new placements from this moment), then drain and
    keep the outcome with the fence. A cluster down already is not fenced again, and drained again
    only while its drain is not complete; :class:`DrainIncomplete` (after the outcome is kept) names
    each part that failed."""
    from hybridflow.fencing import declare_down, record_drain, state_path

    if estate is None:
        from hybridflow.config import load_estate
        from hybridflow.settings import get_settings

        estate = load_estate(get_settings().config_dir)
    if state_dir is None:
        from hybridflow.settings import get_settings

        state_dir = get_settings().state_dir
    path = state_path(state_dir)
    change = declare_down(cluster_name, reason, by=by, estate=estate, path=path)
    out = change.to_dict()
    if needs_drain(change.record):
        outcome = drain(cluster_name, change.record["reason"], estate, state_dir, backend_factory=backend_factory,
                        dr_spec=dr_spec)
        record_drain(cluster_name, outcome, path=path)
        out["record"]["drain"] = outcome
        if outcome["failures"]:
            raise DrainIncomplete(cluster_name, change.record["reason"], outcome["failures"], out)
    return out
