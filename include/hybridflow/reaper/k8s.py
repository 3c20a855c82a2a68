"""Leftovers of a Kubernetes cluster's gangs: gang jobs (Volcano Jobs or batch/v1 Jobs), gang pods
whose job is gone, and credentials Secrets whose gang job is gone, in the cluster's namespace.

Only objects carrying the product's gang label (``hybridflow.io/gang``) are listed, through the
provider's ``KubernetesHook`` of the cluster's Connection, each call bounded by the cluster read
timeout. Each names its owner in annotations (:mod:`hybridflow.reaper.owners`); one without them
is kept, except a pod whose gang job is gone (nothing will ever manage it again). Each also names
the Airflow instance that made it (label ``hybridflow.io/instance``): one of another instance, or
naming none, is found with ``skip`` set and only reported, whatever its owner. Pods and Secrets
are listed before the jobs, so a gang created meanwhile is seen with its job.

A gang job is released with its pods, Secret and Service (background propagation: pods are not
orphaned); a pod or Secret on its own. Whatever is already gone is skipped.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from hybridflow.backends.base import instance_identity
from hybridflow.backends.k8s.backend import delete_gang
from hybridflow.backends.k8s.manifests import (
    GANG_LABEL,
    GPU_RESOURCE,
    INSTANCE_LABEL,
    VOLCANO_GROUP,
    VOLCANO_PLURAL,
    VOLCANO_VERSION,
)
from hybridflow.hooks.kubernetes import kubernetes_hook
from hybridflow.reaper.base import Finder, Leftover
from hybridflow.reaper.owners import not_ours, owner_from_annotations

_HOLDING = ("Pending", "Running")  # pod phases that hold their GPUs


class KubernetesGangFinder(Finder):
    """Gang jobs, stray gang pods and Secrets of one ``kubernetes`` cluster of the estate; ``instance``:
    the Airflow instance whose gangs it may release (default: this one's,
    :func:`~hybridflow.backends.base.instance_identity`)."""

    def __init__(self, cluster: Any, *, timeout_s: float, hook: Any = None, instance: str | None = None) -> None:
        self.cluster = cluster
        self.place = cluster.name
        self.namespace = cluster.k8s_namespace
        self.scheduler = cluster.scheduler
        self.timeout_s = timeout_s
        self._hook = hook
        self.instance = instance

    @property
    def hook(self) -> Any:
        if self._hook is None:
            self._hook = kubernetes_hook(self.cluster.conn_id)
        return self._hook

    def find(self, now: datetime) -> list[Leftover]:
        self._mine = self.instance or instance_identity()
        kw = {"namespace": self.namespace, "label_selector": GANG_LABEL, "_request_timeout": self.timeout_s}
        core = self.hook.core_v1_client
        secrets = [_plain(s) for s in core.list_namespaced_secret(**kw).items or []]
        pods = [_plain(p) for p in core.list_namespaced_pod(**kw).items or []]
        jobs = self._jobs(kw)
        gpus: dict[str, int] = {}
        for pod in pods:
            gang = _labels(pod).get(GANG_LABEL, "")
            gpus[gang] = gpus.get(gang, 0) + _pod_gpus(pod)
        out = [self._leftover("gang-job", job, gpus=gpus.get(job["metadata"]["name"], 0)) for job in jobs]
        names = {job["metadata"]["name"] for job in jobs}
        for pod in pods:
            gang = _labels(pod).get(GANG_LABEL, "")
            if gang not in names and not _deleting(pod):
                out.append(self._leftover("gang-pod", pod, gpus=_pod_gpus(pod),
                                          reason=f"its gang job {gang} is gone", gang=gang))
        for secret in secrets:
            gang = _labels(secret).get(GANG_LABEL, "")
            if gang not in names and not _deleting(secret):
                out.append(self._leftover("gang-secret", secret, gang=gang))
        return out

    def _jobs(self, kw: dict) -> list[dict]:
        if self.scheduler == "volcano":
            listing = self.hook.custom_object_client.list_namespaced_custom_object(
                group=VOLCANO_GROUP, version=VOLCANO_VERSION, plural=VOLCANO_PLURAL, **kw)
            return [obj for obj in listing.get("items") or [] if not _deleting(obj)]
        return [job for job in (_plain(j) for j in self.hook.batch_v1_client.list_namespaced_job(**kw).items or [])
                if not _deleting(job)]

    def _leftover(self, kind: str, obj: dict, *, gpus: int = 0, reason: str = "", gang: str = "") -> Leftover:
        meta = obj.get("metadata") or {}
        owner = owner_from_annotations(meta.get("annotations"))
        fix = (f"label it {INSTANCE_LABEL}={self._mine} (kubectl label) for this instance's reaper to judge it")
        return Leftover(self.place, kind, meta["name"], owner=owner, gpus=gpus, since=_created(meta),
                        reason="" if owner else reason, detail={"gang": gang or meta["name"]},
                        skip=not_ours(_labels(obj).get(INSTANCE_LABEL), self._mine, fix=fix))

    def release(self, leftover: Leftover) -> None:
        kw = {"name": leftover.name, "namespace": self.namespace, "_request_timeout": self.timeout_s}
        if leftover.kind == "gang-job":
            delete_gang(self.hook, self.scheduler, self.namespace, leftover.name, timeout=self.timeout_s)
        elif leftover.kind == "gang-pod":
            _ignore_missing(self.hook.core_v1_client.delete_namespaced_pod, kw)
        elif leftover.kind == "gang-secret":
            _ignore_missing(self.hook.core_v1_client.delete_namespaced_secret, kw)
        else:
            raise ValueError(f"{leftover.kind} is not a Kubernetes gang's leftover")


def _ignore_missing(call, kw: dict) -> None:
    try:
        call(**kw)
    except Exception as exc:
        if getattr(exc, "status", None) != 404:
            raise


def _plain(obj: Any) -> dict:
    """A client model object (V1Pod, V1Job, ...) as the API's own camelCase dict."""
    if isinstance(obj, dict):
        return obj
    from kubernetes.client import ApiClient

    return ApiClient().sanitize_for_serialization(obj)


def _labels(obj: dict) -> dict:
    return (obj.get("metadata") or {}).get("labels") or {}


def _deleting(obj: dict) -> bool:
    return bool((obj.get("metadata") or {}).get("deletionTimestamp"))


def _created(meta: dict) -> datetime | None:
    stamp = meta.get("creationTimestamp")
    if isinstance(stamp, datetime):
        return stamp
    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")) if stamp else None
    except ValueError:
        return None


def _pod_gpus(pod: dict) -> int:
    """GPUs the pod holds now: its containers' GPU limits while it is pending or running."""
    if ((pod.get("status") or {}).get("phase")) not in _HOLDING:
        return 0
    containers = (pod.get("spec") or {}).get("containers") or []
    return sum(int(((c.get("resources") or {}).get("limits") or {}).get(GPU_RESOURCE, 0)) for c in containers)
