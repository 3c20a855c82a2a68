"""How a gang's pods ended, read from the API: which ranks were preempted and which one failed.

Failed pods stay in the API until their job is deleted (the Job controller and Volcano's
``TerminateJob`` keep them), so their exit codes tell preemption (exit ``PREEMPTED_EXIT`` after a
final checkpoint, or condition DisruptionTarget: evicted, preempted, drained) from an application
failure (any other non-zero exit). A rank is the Job completion index (Kueue) or, on Volcano, 0 for
the master and 1 + the task index for a worker (as the pytorch plugin numbers them).

A Kueue eviction (preemption by a higher-priority Workload, a node failure...) leaves no failed pod:
Kueue suspends the Job, whose controller deletes its pods without counting them as failed, and
admits it again later. Those restarts are read from the Workload instead
(``status.schedulingStats.evictions``), and added to the pods' own. The two must never see the same
restart: on a real cluster the pods a suspension deletes stay in the API while they terminate, and
report Failed with exit 75 once their workers checkpointed, so a pod being deleted is not counted
here (it is either part of an eviction the Workload counts, or a pod whose job is going away).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from hybridflow.backends.k8s.load import KUEUE_GROUP, KUEUE_VERSION
from hybridflow.backends.k8s.manifests import CONTAINER, GANG_LABEL, PREEMPTED_EXIT

_INDEX = "batch.kubernetes.io/job-completion-index"
_VOLCANO_INDEX, _VOLCANO_TASK = "volcano.sh/task-index", "volcano.sh/task-spec"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"  # Kueue's label on a Job's Workload
# Evictions that end the workload rather than restart the gang (spec.active set false).
_NOT_RESTARTS = frozenset({"InactiveWorkload", "Deactivated"})


@dataclass(frozen=True)
class PodEnd:
    """A failed pod of the gang: its rank, the worker's exit code (None if it never ran to an end)
    and whether it was preempted rather than failed."""

    pod: str
    rank: int
    exit_code: int | None
    preempted: bool
    message: str


def _rank(meta: Any) -> int:
    annotations, labels = meta.annotations or {}, meta.labels or {}
    if _INDEX in annotations:
        return int(annotations[_INDEX])
    index = int(annotations.get(_VOLCANO_INDEX) or 0)
    return index if labels.get(_VOLCANO_TASK) == "master" else 1 + index


def failed_pods(hook: Any, namespace: str, name: str, *, timeout: float) -> list[PodEnd]:
    """The failed pods of gang job ``name``, by pod name."""
    listing = hook.core_v1_client.list_namespaced_pod(namespace=namespace, label_selector=f"{GANG_LABEL}={name}",
                                                      _request_timeout=timeout)
    ends = []
    for pod in listing.items or []:
        status = pod.status
        if status is None or status.phase != "Failed" or pod.metadata.deletion_timestamp is not None:
            continue
        disrupted = any(c.type == "DisruptionTarget" and c.status == "True" for c in status.conditions or [])
        ended = next((c.state.terminated for c in status.container_statuses or []
                      if c.name == CONTAINER and c.state and c.state.terminated), None)
        code = ended.exit_code if ended else None
        message = (ended.message or ended.reason or "") if ended else (status.message or status.reason or "")
        ends.append(PodEnd(pod.metadata.name, _rank(pod.metadata), code, disrupted or code == PREEMPTED_EXIT,
                           message.strip()))
    return sorted(ends, key=lambda e: e.pod)


def restarts(ends: list[PodEnd]) -> int:
    """Gang restarts the pods show: the most preempted pods any one rank has had."""
    return max(Counter(e.rank for e in ends if e.preempted).values(), default=0)


def application_failure(ends: list[PodEnd]) -> PodEnd | None:
    """The rank whose worker failed (non-zero exit other than preemption), if any."""
    return next((e for e in ends if not e.preempted and e.exit_code), None)


@dataclass(frozen=True)
class Evictions:
    """How often Kueue evicted a gang's Workload (each eviction is a gang restart from its
    checkpoint), and while it waits to be admitted again, why it was evicted."""

    count: int = 0
    waiting: str = ""


def kueue_evictions(hook: Any, namespace: str, job_uid: str | None, *, timeout: float) -> Evictions:
    """The evictions of the Workload of the Kueue Job with uid ``job_uid``. A cluster whose Workloads
    cannot be read (no such CRD, or no RBAC to list them) shows none: its pods still count."""
    if not job_uid:
        return Evictions()
    try:
        listing = hook.custom_object_client.list_namespaced_custom_object(
            group=KUEUE_GROUP, version=KUEUE_VERSION, namespace=namespace, plural="workloads",
            label_selector=f"{JOB_UID_LABEL}={job_uid}", _request_timeout=timeout)
    except Exception as exc:
        if getattr(exc, "status", None) in (403, 404):
            return Evictions()
        raise
    count, waiting = 0, ""
    for wl in listing.get("items") or []:
        status = wl.get("status") or {}
        stats = (status.get("schedulingStats") or {}).get("evictions") or []
        counted = sum(int(e.get("count") or 0) for e in stats if e.get("reason") not in _NOT_RESTARTS)
        evicted = next((c for c in status.get("conditions") or []
                        if c.get("type") == "Evicted" and c.get("status") == "True"), None)
        if evicted is not None and evicted.get("reason") not in _NOT_RESTARTS:
            counted = max(counted, 1)  # a Kueue without schedulingStats still shows the eviction under way
            waiting = (f"evicted by Kueue ({evicted.get('reason')}: {evicted.get('message') or 'no message'}); "
                       "suspended until Kueue admits it again, then it resumes from its checkpoint")
        count += counted
    return Evictions(count, waiting)
