"""What a Kubernetes cluster holds of the product's gangs: gang jobs (Volcano Jobs or batch/v1 Jobs),
gang pods whose job is gone, and credentials Secrets whose gang job is gone, in the cluster's
namespace (:meth:`KubernetesGangBackend.remnants`), and their release.

Only objects carrying the product's gang label (``hybridflow.io/gang``) are listed, each call bounded
by the cluster read timeout. Each names its owner in annotations and the Airflow instance that made
it in the label ``hybridflow.io/instance``; the resource reaper judges them. Pods and Secrets are
listed before the jobs, so a gang created meanwhile is seen with its job. A gang job is released
with its pods, Secret and Service (background propagation: pods are not orphaned); a pod or Secret
on its own. Whatever is already gone is skipped.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from hybridflow.backends.base import GangRemnant, owner_from_annotations
from hybridflow.backends.k8s.manifests import (
    GANG_LABEL,
    GPU_RESOURCE,
    INSTANCE_LABEL,
    VOLCANO_GROUP,
    VOLCANO_PLURAL,
    VOLCANO_VERSION,
)

if TYPE_CHECKING:
    from hybridflow.backends.k8s.backend import KubernetesGangBackend

_HOLDING = ("Pending", "Running")  # pod phases that hold their GPUs
HANDOVER = f"label it {INSTANCE_LABEL}={{instance}} (kubectl label) for this instance's reaper to judge it"


def remnants(backend: KubernetesGangBackend) -> list[GangRemnant]:
    kw = {"namespace": backend.namespace, "label_selector": GANG_LABEL, "_request_timeout": backend.read_timeout_s}
    core = backend.hook.core_v1_client
    secrets = [_plain(s) for s in core.list_namespaced_secret(**kw).items or []]
    pods = [_plain(p) for p in core.list_namespaced_pod(**kw).items or []]
    jobs = _jobs(backend, kw)
    gpus: dict[str, int] = {}
    for pod in pods:
        gang = _labels(pod).get(GANG_LABEL, "")
        gpus[gang] = gpus.get(gang, 0) + _pod_gpus(pod)
    out = [_remnant("gang-job", job, gpus=gpus.get(job["metadata"]["name"], 0)) for job in jobs]
    names = {job["metadata"]["name"] for job in jobs}
    for pod in pods:
        gang = _labels(pod).get(GANG_LABEL, "")
        if gang not in names and not _deleting(pod):
            out.append(_remnant("gang-pod", pod, gpus=_pod_gpus(pod), reason=f"its gang job {gang} is gone",
                                gang=gang))
    for secret in secrets:
        gang = _labels(secret).get(GANG_LABEL, "")
        if gang not in names and not _deleting(secret):
            out.append(_remnant("gang-secret", secret, gang=gang))
    return out


def clear(backend: KubernetesGangBackend, remnant: GangRemnant) -> None:
    from hybridflow.backends.k8s.backend import delete_gang

    timeout = backend.read_timeout_s
    kw = {"name": remnant.name, "namespace": backend.namespace, "_request_timeout": timeout}
    core = backend.hook.core_v1_client
    if remnant.kind == "gang-job":
        delete_gang(backend.hook, backend.scheduler, backend.namespace, remnant.name, timeout=timeout)
    elif remnant.kind == "gang-pod":
        _ignore_missing(core.delete_namespaced_pod, kw)
    elif remnant.kind == "gang-secret":
        _ignore_missing(core.delete_namespaced_secret, kw)
    else:
        raise ValueError(f"{remnant.kind} is not a Kubernetes gang's remnant")


def _jobs(backend: KubernetesGangBackend, kw: dict) -> list[dict]:
    if backend.scheduler == "volcano":
        listing = backend.hook.custom_object_client.list_namespaced_custom_object(
            group=VOLCANO_GROUP, version=VOLCANO_VERSION, plural=VOLCANO_PLURAL, **kw)
        return [obj for obj in listing.get("items") or [] if not _deleting(obj)]
    return [job for job in (_plain(j) for j in backend.hook.batch_v1_client.list_namespaced_job(**kw).items or [])
            if not _deleting(job)]


def _remnant(kind: str, obj: dict, *, gpus: int = 0, reason: str = "", gang: str = "") -> GangRemnant:
    meta = obj.get("metadata") or {}
    return GangRemnant(kind, meta["name"], owner=owner_from_annotations(meta.get("annotations")),
                       instance=_labels(obj).get(INSTANCE_LABEL), gpus=gpus, since=_created(meta), reason=reason,
                       detail={"gang": gang or meta["name"]}, handover=HANDOVER)


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
