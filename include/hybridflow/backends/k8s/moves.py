"""Making room on a Kubernetes private cluster: a gang is moved off by its scheduler's own way of
stopping a job while keeping it, so that the gang's task learns, from the job, that it was moved and
why (:func:`move`, :func:`moved_status`); :func:`make_room` chooses which gangs go.

- Kueue: the job's Workload is deactivated (``spec.active: false``). Kueue evicts it (reason
  ``Deactivated``, which is not counted as a preemption), suspends the Job, and the Job controller
  deletes its pods: each worker gets SIGTERM and commits a final checkpoint (the same path a budget
  stop and a DR failover take) before the Workload's quota is released.
- Volcano: a ``bus.volcano.sh`` Command ``AbortJob`` for the job (what ``vcctl job suspend`` sends).
  The job controller kills its pods (SIGTERM, the same checkpoint) and the job ends ``Aborted``.

Before either, the job is annotated ``hybridflow.io/moved-reason``: the backend then reads the gang as
still running ("being moved") while any pod holds on, and as preempted with that reason once they are
all gone. Its train task then deletes the job and places the run again, on a public cluster, where it
resumes from that checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from hybridflow.backends.base import PREEMPTED, RUNNING, ClusterLoad, GangStatus
from hybridflow.backends.k8s.api import describe
from hybridflow.backends.k8s.load import KUEUE_GROUP, KUEUE_VERSION, pod_gpus, quantity
from hybridflow.backends.k8s.manifests import (
    GANG_LABEL,
    GPU_RESOURCE,
    VOLCANO_GROUP,
    VOLCANO_PLURAL,
    VOLCANO_VERSION,
)
from hybridflow.backends.k8s.pods import JOB_UID_LABEL

MOVED_REASON = "hybridflow.io/moved-reason"
MOVED = "moved"  # GangStatus.cause of a gang moved off to make room
BUS_GROUP, BUS_VERSION, BUS_PLURAL = "bus.volcano.sh", "v1alpha1", "commands"
_MERGE = "application/merge-patch+json"

logger = logging.getLogger(__name__)


def moved_reason(annotations: Mapping[str, str] | None) -> str | None:
    return (annotations or {}).get(MOVED_REASON) or None


def moved_status(reason: str, pods_left: int) -> GangStatus:
    """A gang being moved: running while its pods checkpoint and end, then preempted with ``reason``."""
    if pods_left:
        return GangStatus(RUNNING, f"being moved ({reason}): {pods_left} pods still checkpointing")
    return GangStatus(PREEMPTED, reason, cause=MOVED)


def live_pods(hook: Any, namespace: str, name: str, *, timeout: float) -> int:
    """The gang's pods that have not ended yet (terminating ones included: they may still checkpoint)."""
    listing = hook.core_v1_client.list_namespaced_pod(namespace=namespace, label_selector=f"{GANG_LABEL}={name}",
                                                      _request_timeout=timeout)
    return sum(1 for p in listing.items or [] if p.status is None or p.status.phase in (None, "Pending", "Running"))


def move(backend: Any, name: str, reason: str) -> bool:
    """Stop gang ``name`` after its workers checkpoint, keeping its job so that its task reads why;
    False if there is no such gang (nothing is changed then). The job is annotated first; if the
    scheduler's stop is then refused (RBAC), the annotation is taken back and the error raised."""
    kw = {"namespace": backend.namespace, "_request_timeout": backend.API_TIMEOUT_S}
    volcano = backend.scheduler == "volcano"
    batch, custom = backend.hook.batch_v1_client, backend.hook.custom_object_client
    try:
        job = (custom.get_namespaced_custom_object(group=VOLCANO_GROUP, version=VOLCANO_VERSION, plural=VOLCANO_PLURAL,
                                                   name=name, **kw)
               if volcano else batch.read_namespaced_job(name=name, **kw))
    except Exception as exc:
        if getattr(exc, "status", None) == 404:
            return False
        raise
    workloads = [] if volcano else custom.list_namespaced_custom_object(
        group=KUEUE_GROUP, version=KUEUE_VERSION, plural="workloads", label_selector=f"{JOB_UID_LABEL}={job.metadata.uid}",
        **kw).get("items") or []
    if not volcano and not workloads:
        return False  # not (yet) Kueue's: nothing would stop it
    _annotate(backend, name, reason, kw)
    try:
        if volcano:
            custom.create_namespaced_custom_object(group=BUS_GROUP, version=BUS_VERSION, plural=BUS_PLURAL,
                                                   body=_abort_command(job, reason), **kw)
        for wl in workloads:
            custom.patch_namespaced_custom_object(
                group=KUEUE_GROUP, version=KUEUE_VERSION, plural="workloads", name=wl["metadata"]["name"],
                body={"spec": {"active": False}}, _content_type=_MERGE, **kw)
    except Exception:
        _annotate(backend, name, None, kw)  # it runs on: it must not read as being moved
        raise
    return True


def _annotate(backend: Any, name: str, reason: str | None, kw: dict) -> None:
    note = {"metadata": {"annotations": {MOVED_REASON: reason}}}  # None removes it (merge patch)
    if backend.scheduler == "volcano":
        backend.hook.custom_object_client.patch_namespaced_custom_object(
            group=VOLCANO_GROUP, version=VOLCANO_VERSION, plural=VOLCANO_PLURAL, name=name, body=note,
            _content_type=_MERGE, **kw)
    else:
        backend.hook.batch_v1_client.patch_namespaced_job(name=name, body=note, _content_type=_MERGE, **kw)


def _abort_command(job: Mapping, reason: str) -> dict:
    meta = job["metadata"]
    return {
        "apiVersion": f"{BUS_GROUP}/{BUS_VERSION}", "kind": "Command",
        "metadata": {"name": f"{meta['name'][:40]}-move-{int(time.time())}",
                     "ownerReferences": [{"apiVersion": f"{VOLCANO_GROUP}/{VOLCANO_VERSION}", "kind": "Job",
                                          "name": meta["name"], "uid": meta["uid"], "controller": True}]},
        "action": "AbortJob",
        "target": {"apiVersion": f"{VOLCANO_GROUP}/{VOLCANO_VERSION}", "kind": "Job", "name": meta["name"],
                   "uid": meta["uid"]},
        "reason": "Moved", "message": reason[:250],
    }


def running_movable(backend: Any) -> list[tuple[str, int, str]]:
    """The cluster's running gangs labelled movable and not being moved already: (name, GPUs, when
    created), newest first."""
    out = []
    for name in backend.find_gangs({"movable": "true"}):
        gpus, created, moving = _job_facts(backend, name)
        if moving or backend.status(name).phase != RUNNING:
            continue  # waiting, restarting or already being moved: nothing it holds would come free now
        out.append((name, gpus, created))
    return sorted(out, key=lambda g: g[2], reverse=True)


def _job_facts(backend: Any, name: str) -> tuple[int, str, bool]:
    """The gang job's GPUs, creation time and whether it is being moved already."""
    kw = {"name": name, "namespace": backend.namespace, "_request_timeout": backend.read_timeout_s}
    if backend.scheduler == "volcano":
        job = backend.hook.custom_object_client.get_namespaced_custom_object(
            group=VOLCANO_GROUP, version=VOLCANO_VERSION, plural=VOLCANO_PLURAL, **kw)
        gpus = sum(int(t.get("replicas") or 0) * pod_gpus(t.get("template") or {})
                   for t in job["spec"].get("tasks") or [])
        meta = job["metadata"]
        return gpus, meta.get("creationTimestamp") or "", moved_reason(meta.get("annotations")) is not None
    job = backend.hook.batch_v1_client.read_namespaced_job(**kw)
    per_pod = sum(quantity(((c.resources.limits if c.resources else None) or {}).get(GPU_RESOURCE))
                  for c in job.spec.template.spec.containers or [])
    created = job.metadata.creation_timestamp
    return (int(job.spec.parallelism or 0) * per_pod, created.isoformat() if created else "",
            moved_reason(job.metadata.annotations) is not None)


def make_room(backend: Any, name: str, load: ClusterLoad, log: Callable[[str], None] = print) -> list[str]:
    """If gang ``name`` (work that may run only on private clusters) waits first in the cluster's
    queue (``load``, read just now) and does not fit, move the newest movable gangs off until it does;
    none if even all of them would not make it fit. The names moved. An API that refuses (RBAC, an
    outage) is logged with the fix and moves nothing more: the gang waits in the queue all the same."""
    try:
        return _make_room(backend, name, load, log)
    except Exception as exc:  # noqa: BLE001 - making room is a help, never the waiting gang's failure
        what = ("patch on workloads.kueue.x-k8s.io" if backend.scheduler == "kueue"
                else "create on commands.bus.volcano.sh")
        log(f"gang {name}: could not make room on cluster {backend.cluster_name} ({describe(exc)}); it waits in "
            f"the queue. Moving gangs needs {what} in namespace {backend.namespace} for the Connection "
            f"{backend.cluster.conn_id!r}")
        return []


def _make_room(backend: Any, name: str, load: ClusterLoad, log: Callable[[str], None]) -> list[str]:
    if not load.reachable or not load.waiting or load.waiting[0][0] != name:
        return []
    need = load.waiting[0][1]
    free = load.free
    if free >= need:
        return []  # it fits: the scheduler admits it without anyone moving
    movable = running_movable(backend)
    if free + sum(g[1] for g in movable) < need:
        return []
    moved = []
    for other, gpus, _created in movable:
        if free >= need:
            break
        why = (f"making room on cluster {backend.cluster_name} for {name}, work that may run only on private "
               f"clusters ({need} GPUs, {free} free)")
        if move(backend, other, why):
            log(f"gang {name}: moving gang {other} ({gpus} GPUs) to a public cluster; it checkpoints first")
            moved.append(other)
            free += gpus
    return moved


def private_only_queued(backend: Any, waiting: tuple) -> int:
    """GPUs of the waiting gangs labelled private-only (placement keeps capacity for them); 0 when
    the gangs cannot be listed (only the ledger's arrivals count then). Bounded by the read timeout,
    as every reading of a load is."""
    if not waiting:
        return 0
    kw = {"namespace": backend.namespace, "_request_timeout": backend.read_timeout_s,
          "label_selector": f"{GANG_LABEL},hybridflow.io/private-only=true"}
    try:
        if backend.scheduler == "volcano":
            listing = backend.hook.custom_object_client.list_namespaced_custom_object(
                group=VOLCANO_GROUP, version=VOLCANO_VERSION, plural=VOLCANO_PLURAL, **kw)
            bound = {obj["metadata"]["name"] for obj in listing.get("items") or []}
        else:
            bound = {job.metadata.name for job in backend.hook.batch_v1_client.list_namespaced_job(**kw).items or []}
    except Exception as exc:  # noqa: BLE001 - a reading is never an error
        logger.warning("cluster %s: private-only gangs unreadable (%s)", backend.cluster_name, describe(exc))
        return 0
    return sum(gpus for name, gpus, *_ in waiting if name in bound)
