"""A gang job's state as its cluster reports it: :class:`GangStatus` from a Volcano Job or a
Kueue-managed batch/v1 Job, with the preemption restarts counted (:func:`read_status`, shared by the
backend's blocking wait and the trigger)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridflow.backends.base import (  # the contract's gang status, read here from the cluster's objects
    APPLICATION,
    BUDGET_SPENT,
    FAILED,
    MISSING,
    PENDING,
    RESTARTING,
    RUNNING,
    SUCCEEDED,
    GangStatus,
)
from hybridflow.backends.k8s import moves as _moves
from hybridflow.backends.k8s import pods as _pods
from hybridflow.backends.k8s.api import missing
from hybridflow.backends.k8s.manifests import VOLCANO_GROUP, VOLCANO_PLURAL, VOLCANO_VERSION

_VOLCANO_PHASES = {
    "Pending": PENDING, "Running": RUNNING, "Completing": RUNNING, "Restarting": RESTARTING,
    "Completed": SUCCEEDED, "Aborting": FAILED, "Aborted": FAILED, "Terminating": FAILED,
    "Terminated": FAILED, "Failed": FAILED,
}


def read_status(hook: Any, scheduler: str, namespace: str, name: str, *, timeout: float,
                max_retry: int | None = None) -> GangStatus:
    """The gang job's state as a :class:`GangStatus`; ``missing`` if there is no such job; preempted
    with cause ``moved`` once a gang moved off to make room has no pod left (:mod:`.moves`). Each
    call is bounded by ``timeout`` seconds.

    Volcano counts restarts itself (``retryCount``, bounded by the job's ``maxRetry``). A Kueue Job's
    podFailurePolicy ignores preempted pods, so the restarts are counted here: the pods each rank lost
    to preemption plus the Workload's evictions (:mod:`~hybridflow.backends.k8s.pods`); past
    ``max_retry`` the gang reads as failed with cause ``BUDGET_SPENT``, also while it waits to be
    admitted again."""
    try:
        if scheduler == "volcano":
            obj = hook.custom_object_client.get_namespaced_custom_object(
                group=VOLCANO_GROUP, version=VOLCANO_VERSION, namespace=namespace, plural=VOLCANO_PLURAL, name=name,
                _request_timeout=timeout)
            reason = _moves.moved_reason(obj["metadata"].get("annotations"))
            if reason is not None and volcano_status(obj).phase != SUCCEEDED:
                return _moves.moved_status(reason, _moves.live_pods(hook, namespace, name, timeout=timeout))
            return volcano_status(obj)
        job = hook.batch_v1_client.read_namespaced_job(name=name, namespace=namespace, _request_timeout=timeout)
    except Exception as exc:
        if missing(exc) == "object":  # not a 404 for a resource type or namespace the cluster lacks
            return GangStatus(MISSING, f"job {namespace}/{name} does not exist")
        raise
    status = kueue_status(job)
    reason = _moves.moved_reason(job.metadata.annotations)
    if reason is not None and status.phase != SUCCEEDED:  # moved off: its Workload's eviction is no preemption
        return _moves.moved_status(reason, _moves.live_pods(hook, namespace, name, timeout=timeout))
    evicted = _pods.kueue_evictions(hook, namespace, job.metadata.uid, timeout=timeout)
    if status.phase not in (RUNNING, SUCCEEDED, FAILED) and not evicted.count:
        return status
    lost = _pods.restarts(_pods.failed_pods(hook, namespace, name, timeout=timeout)) + evicted.count
    if status.phase in (PENDING, RUNNING) and max_retry is not None and lost > max_retry:
        return GangStatus(FAILED, f"preempted {lost} times, more than the {max_retry} restarts "
                          "training.preemption_retries allows", lost, BUDGET_SPENT)
    return GangStatus(status.phase, evicted.waiting or status.message, lost, status.cause)


def volcano_status(obj: Mapping) -> GangStatus:
    status = obj.get("status") or {}
    state = status.get("state") or {}
    phase = _VOLCANO_PHASES.get(state.get("phase") or "Pending", PENDING)
    message = "; ".join(x for x in (state.get("reason"), state.get("message")) if x)
    retries = int(status.get("retryCount") or 0)
    if state.get("phase") == "Failed":  # RestartJob (preemption, eviction) past maxRetry
        return GangStatus(FAILED, f"preempted {retries} times, more than the {max(retries - 1, 0)} restarts its "
                          f"maxRetry (training.preemption_retries) allows; {message}", retries, BUDGET_SPENT)
    return GangStatus(phase, message, retries, APPLICATION if phase == FAILED else "")


def kueue_status(job: Any) -> GangStatus:
    """A batch/v1 Job (the client's V1Job): suspended means Kueue has not admitted it (yet, or again)."""
    status = job.status
    conditions = {c.type: c for c in (status.conditions or []) if c.status == "True"} if status else {}
    failed = int(status.failed or 0) if status else 0
    if "Complete" in conditions or "SuccessCriteriaMet" in conditions:
        return GangStatus(SUCCEEDED, "", failed)
    if "Failed" in conditions or "FailureTarget" in conditions:
        cond = conditions.get("Failed") or conditions["FailureTarget"]
        return GangStatus(FAILED, "; ".join(x for x in (cond.reason, cond.message) if x), failed, APPLICATION)
    if job.spec.suspend:
        return GangStatus(PENDING, "suspended: waiting for Kueue to admit the workload", failed)
    return GangStatus(RUNNING, f"{int(status.ready or 0) if status else 0} workers ready", failed)
