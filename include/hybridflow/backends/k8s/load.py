"""What a Kubernetes cluster's gang scheduler says about its GPUs: the reading behind
``KubernetesGangBackend.load``.

Volcano (``scheduling.volcano.sh/v1beta1``):

- ``Queue`` objects (cluster-scoped): ``status.allocated["nvidia.com/gpu"]`` is what the admitted
  gangs of each queue hold. ``used`` sums the leaf queues, every tenant's, since they all share the
  nodes; a parent queue (``root`` and any queue another names in ``spec.parent``) already adds up
  its children, so counting it as well would count those GPUs twice. ``teams`` is each team's
  queue's own figure.
- ``PodGroup`` objects (all namespaces) in phase Pending or Inqueue are the gangs waiting for
  admission: GPUs from ``spec.minResources``, else one per ``spec.minMember``.

Kueue (``kueue.x-k8s.io/v1beta2``, the storage version of Kueue v0.19):

- ``ClusterQueue`` objects (cluster-scoped): ``status.flavorsUsage[].resources[]`` of
  ``nvidia.com/gpu`` over every flavour and queue is ``used``.
- ``LocalQueue`` objects of the cluster's namespace: ``status.flavorsUsage`` of each team's queue
  is ``teams``.
- ``Workload`` objects of the namespace with neither ``QuotaReserved`` nor ``Admitted`` true, not
  ``Finished`` and not deactivated are waiting: GPUs are ``count`` times the pod template's GPUs
  summed over ``spec.podSets``.

Waiting gangs are named after the job that owns them (its controller ``ownerReference``), since
neither scheduler names its object after the job: Volcano >= 1.5 names a vcjob's PodGroup
``<job>-<job uid>``, Kueue a Job's Workload ``job-<job>-<hash>``.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from hybridflow.backends.base import ClusterLoad
from hybridflow.backends.k8s.manifests import GPU_RESOURCE, PRIORITY_CLASSES, PRIORITY_VALUES

VOLCANO_SCHEDULING_GROUP, VOLCANO_SCHEDULING_VERSION = "scheduling.volcano.sh", "v1beta1"
KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta2"
_WAITING_PHASES = ("Pending", "Inqueue")
_PRIORITY_OF_CLASS = {cls: prio for prio, cls in PRIORITY_CLASSES.items()}
_PRIORITY_OF_VALUE = {value: prio for prio, value in PRIORITY_VALUES.items()}
_RANK = {"critical": 0, "normal": 1, "batch": 2}
_TEAM_LABEL = "hybridflow.io/team"
_UID_SUFFIX = re.compile(r"-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_SUFFIXES = {"m": Decimal("0.001"), "": Decimal(1), "k": Decimal(10) ** 3, "M": Decimal(10) ** 6,
             "G": Decimal(10) ** 9, "T": Decimal(10) ** 12, "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
             "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40,
             "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)$")


class Unreadable(Exception):
    """Reading ``what`` (e.g. "volcano queues") failed with ``cause``."""

    def __init__(self, what: str, cause: BaseException) -> None:
        super().__init__(f"{what}: {describe_error(cause)}")
        self.what = what
        self.cause = cause


@dataclass(frozen=True)
class Reading:
    used: int
    queued: int
    teams: dict[str, int]
    waiting: tuple[tuple[str, int, str, str | None], ...]
    queues: frozenset[str] = frozenset()  # the queues a gang may name (placement rules out a missing one)


def describe_error(exc: BaseException) -> str:
    """One short line for a failed API call (an ApiException's str spans headers and body)."""
    status, reason = getattr(exc, "status", None), getattr(exc, "reason", None)
    if status is not None:
        return f"{type(exc).__name__} {status} {reason or ''}".strip()
    if isinstance(reason, BaseException):  # urllib3's MaxRetryError: what the last try ran into
        return f"{type(exc).__name__} ({describe_error(reason)})"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def quantity(value: Any) -> int:
    """GPUs in a Kubernetes quantity (int-or-string: 4, "4", "4000m", "1e1"), rounded up."""
    if value is None or value == "":
        return 0
    if isinstance(value, bool):
        raise ValueError(f"not a quantity: {value!r}")
    if isinstance(value, int | float):
        return math.ceil(value)
    match = _QUANTITY.match(str(value).strip())
    if not match or match.group(2) not in _SUFFIXES:
        raise ValueError(f"not a quantity: {value!r}")
    try:
        return math.ceil(Decimal(match.group(1)) * _SUFFIXES[match.group(2)])
    except InvalidOperation as exc:
        raise ValueError(f"not a quantity: {value!r}") from exc


def _items(call: Callable[..., Any], what: str, **kw: Any) -> list[dict]:
    try:
        return list((call(**kw) or {}).get("items") or [])
    except Exception as exc:
        raise Unreadable(what, exc) from exc


def _owner(meta: Mapping, kind: str) -> str | None:
    """The name of the object's controller of ``kind`` (the job a PodGroup or Workload stands for)."""
    refs = meta.get("ownerReferences") or []
    for ref in sorted(refs, key=lambda r: not r.get("controller")):
        if ref.get("kind") == kind and ref.get("name"):
            return ref["name"]
    return None


def _order(entries: list[tuple[int, str, str, tuple]]) -> tuple[tuple[str, int, str, str | None], ...]:
    """Admission order: the sort key first (priority, then creation), then the name."""
    return tuple(entry for _key, _created, _name, entry in sorted(entries, key=lambda e: (e[0], e[1], e[2])))


# --- Volcano ------------------------------------------------------------------------------------


def read_volcano(custom: Any, *, timeout: float, queue_teams: Mapping[str, str] | None) -> Reading:
    kw = {"group": VOLCANO_SCHEDULING_GROUP, "version": VOLCANO_SCHEDULING_VERSION, "_request_timeout": timeout}
    queues = _items(custom.list_cluster_custom_object, "volcano queues", plural="queues", **kw)
    groups = _items(custom.list_cluster_custom_object, "volcano podgroups", plural="podgroups", **kw)
    # Queues without a parent hang under "root" (the queue controller sets spec.parent so).
    parents = {(q.get("spec") or {}).get("parent") or "root" for q in queues if q["metadata"]["name"] != "root"}
    used, teams = 0, {}
    for queue in queues:
        name = queue["metadata"]["name"]
        held = quantity(((queue.get("status") or {}).get("allocated") or {}).get(GPU_RESOURCE))
        if name not in parents and name != "root":
            used += held
        team = _team_of(name, queue_teams) if name != "root" else None
        if team is not None:
            teams[team] = teams.get(team, 0) + held
    entries = []
    for group in groups:
        if (group.get("status") or {}).get("phase", "Pending") not in _WAITING_PHASES:
            continue
        meta, spec = group["metadata"], group.get("spec") or {}
        resources = spec.get("minResources") or {}
        gpu = resources.get(GPU_RESOURCE, resources.get(f"requests.{GPU_RESOURCE}"))
        gpus = quantity(gpu) if gpu is not None else int(spec.get("minMember") or 0)
        priority = _PRIORITY_OF_CLASS.get(spec.get("priorityClassName") or "", "normal")
        team = _team_of(spec.get("queue") or "default", queue_teams) or (meta.get("labels") or {}).get(_TEAM_LABEL)
        name = _owner(meta, "Job") or _UID_SUFFIX.sub("", meta["name"])
        entries.append((_RANK[priority], meta.get("creationTimestamp") or "", name, (name, gpus, priority, team)))
    waiting = _order(entries)
    return Reading(used, sum(w[1] for w in waiting), teams, waiting,
                   frozenset(q["metadata"]["name"] for q in queues))


def _team_of(queue: str, queue_teams: Mapping[str, str] | None) -> str | None:
    if queue_teams is None:
        return queue  # the estate's default: a team's queue is named after it
    return queue_teams.get(queue)


# --- Kueue --------------------------------------------------------------------------------------


def _flavors_gpus(usage: list | None) -> int:
    return sum(quantity(r.get("total")) for flavor in usage or [] for r in flavor.get("resources") or []
               if r.get("name") == GPU_RESOURCE)


def pod_gpus(template: Mapping) -> int:
    total = 0
    for container in (template.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        # Requests default to limits for extended resources; either may be what the manifest set.
        value = (resources.get("requests") or {}).get(GPU_RESOURCE, (resources.get("limits") or {}).get(GPU_RESOURCE))
        total += quantity(value)
    return total


def _true(status: Mapping, kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True" for c in status.get("conditions") or [])


def _kueue_priority(spec: Mapping) -> str:
    ref = spec.get("priorityClassRef") or {}
    if ref.get("name") in _PRIORITY_OF_CLASS:
        return _PRIORITY_OF_CLASS[ref["name"]]
    return _PRIORITY_OF_VALUE.get(spec.get("priority"), "normal")


def read_kueue(custom: Any, namespace: str, *, timeout: float, queue_teams: Mapping[str, str] | None) -> Reading:
    kw = {"group": KUEUE_GROUP, "version": KUEUE_VERSION, "_request_timeout": timeout}
    cluster_queues = _items(custom.list_cluster_custom_object, "kueue clusterqueues", plural="clusterqueues", **kw)
    local_queues = _items(custom.list_namespaced_custom_object, "kueue localqueues", namespace=namespace,
                          plural="localqueues", **kw)
    workloads = _items(custom.list_namespaced_custom_object, "kueue workloads", namespace=namespace,
                       plural="workloads", **kw)
    used = sum(_flavors_gpus((cq.get("status") or {}).get("flavorsUsage")) for cq in cluster_queues)
    teams: dict[str, int] = {}
    for lq in local_queues:
        team = _team_of(lq["metadata"]["name"], queue_teams)
        if team is not None:
            teams[team] = teams.get(team, 0) + _flavors_gpus((lq.get("status") or {}).get("flavorsUsage"))
    entries = []
    for wl in workloads:
        meta, spec, status = wl["metadata"], wl.get("spec") or {}, wl.get("status") or {}
        if (not spec.get("queueName") or spec.get("active") is False or _true(status, "QuotaReserved")
                or _true(status, "Admitted") or _true(status, "Finished")):
            continue
        gpus = sum(int(ps.get("count", 1)) * pod_gpus(ps.get("template") or {}) for ps in spec.get("podSets") or [])
        labels = ((spec.get("podSets") or [{}])[0].get("template") or {}).get("metadata", {}).get("labels") or {}
        team = _team_of(spec["queueName"], queue_teams) or labels.get(_TEAM_LABEL)
        name = _owner(meta, "Job") or meta["name"]
        # Kueue admits higher spec.priority first, then the older workload.
        key = -int(spec.get("priority") or 0)
        entries.append((key, meta.get("creationTimestamp") or "", name, (name, gpus, _kueue_priority(spec), team)))
    waiting = _order(entries)
    return Reading(used, sum(w[1] for w in waiting), teams, waiting,
                   frozenset(lq["metadata"]["name"] for lq in local_queues))


# --- the cache ----------------------------------------------------------------------------------

# One reading per cluster for cache_s: placement, the trigger's standing and the team caps each ask
# for the load within moments of each other, and every backend object is built afresh.
_CACHE: dict[tuple, tuple[float, ClusterLoad]] = {}
_LOCK = threading.Lock()
_now = time.monotonic  # tests move time on by replacing it


def cached(key: tuple, cache_s: float, read: Callable[[], ClusterLoad]) -> ClusterLoad:
    """``read()``'s result, reused for ``cache_s`` seconds under ``key`` (an unknown reading too: a
    cluster that just timed out is not asked again at once); ``cache_s`` 0 reads every time."""
    if cache_s <= 0:
        return read()
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None and _now() - hit[0] < cache_s:
            return hit[1]
    # Read outside the lock: clusters are read in parallel, each bounded by its own timeout.
    load = read()
    with _LOCK:
        _CACHE[key] = (_now(), load)
    return load


def clear_cache() -> None:
    with _LOCK:
        _CACHE.clear()
