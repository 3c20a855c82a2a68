"""How a gang's pods ended, read from the API: which ranks were preempted and which one failed.

Failed pods stay in the API until their job is deleted (the Job controller and Volcano's
``TerminateJob`` keep them), so their exit codes tell preemption (exit ``PREEMPTED_EXIT`` after a
final checkpoint, or condition DisruptionTarget: evicted, preempted, drained) from an application
failure (any other non-zero exit). A rank is the Job completion index (Kueue) or, on Volcano, 0 for
the master and 1 + the task index for a worker (as the pytorch plugin numbers them).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from hybridflow.backends.k8s.manifests import CONTAINER, GANG_LABEL, PREEMPTED_EXIT

_INDEX = "batch.kubernetes.io/job-completion-index"
_VOLCANO_INDEX, _VOLCANO_TASK = "volcano.sh/task-index", "volcano.sh/task-spec"


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
        if status is None or status.phase != "Failed":
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
