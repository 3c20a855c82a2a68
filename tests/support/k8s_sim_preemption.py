"""PriorityClasses and preemption in the cluster simulator (:mod:`tests.support.k8s_sim`).

PriorityClasses (``scheduling.k8s.io/v1``): the cluster starts with the ones the gang manifests name
(:func:`~hybridflow.backends.k8s.manifests.priority_classes`, as its admins apply them), served by
:class:`FakeSchedulingV1Api`. A pod naming no class has priority 0; a gang naming a class that does
not exist gets no pods (the API server refuses such pods) and is never admitted.

Preemption, when a gang cannot be admitted for lack of GPUs: the scheduler picks victims among the
admitted gangs of lower priority, lowest priority first, then the newest, as few as free enough room
(nodes, and the queue's capability or quota); if even all of them would not make room, nothing is
preempted. The preemptor is admitted on a later pass, once the victims' pods are gone.

- Volcano (only with ``preempt`` in ``sim.volcano_actions``, as in volcano-scheduler.conf; victims
  within the preemptor's queue): every pod of a victim is evicted (condition DisruptionTarget; the
  kubelet sends its worker SIGTERM, it commits a checkpoint and exits 75), and Volcano's job
  controller applies the job's PodEvicted policy (RestartJob spends ``maxRetry``).
- Kueue (only when the ClusterQueue's ``spec.preemption.withinClusterQueue`` is ``LowerPriority``;
  victims within the ClusterQueue): the victim's Workload gets Evicted (reason Preempted) and
  Preempted (reason InClusterQueue) and ``status.schedulingStats.evictions`` counts it; Kueue's job
  reconciler suspends the Job, whose controller deletes its active pods (SIGTERM to each worker;
  these pods are not failures and do not count towards ``backoffLimit``); Kueue then releases the
  quota and requeues the Workload (QuotaReserved and Admitted False, Requeued True). Admitted again
  when room exists (Evicted and Preempted turn False), the Job is unsuspended and its pods recreated.
"""

from __future__ import annotations

import copy

from kubernetes.client.exceptions import ApiException
from tests.support import k8s_sim_queues as queues
from tests.support.k8s_sim_api import _Fake, _not_found, to_model

from hybridflow.backends.k8s.manifests import priority_classes

# What volcano-scheduler.conf enables by default; a test adds "preempt".
VOLCANO_ACTIONS = ("enqueue", "allocate", "backfill")


def initial_classes() -> dict[str, dict]:
    return {pc["metadata"]["name"]: pc for pc in priority_classes()}


def value(sim, name: str | None) -> int | None:
    """A priority class's value: 0 for none named, None for one that does not exist."""
    if not name:
        return 0
    pc = sim.priority_classes.get(name)
    return None if pc is None else int(pc["value"])


def _rank(sim, name: str | None) -> int:
    return value(sim, name) or 0


def _victim_order(sim, candidates: list[tuple[str | None, dict, object]]) -> list:
    """(priority class, the job or Workload as stored, key): lowest priority first, then newest."""
    newest_first = sorted(candidates, key=lambda c: c[1]["metadata"].get("creationTimestamp", ""), reverse=True)
    return sorted(newest_first, key=lambda c: _rank(sim, c[0]))


def _choose(sim, candidates: list, fits) -> list:
    """The fewest victims, in victim order, after whose eviction ``fits(victims)``; [] if none would do."""
    victims = []
    for candidate in _victim_order(sim, candidates):
        victims.append(candidate)
        if fits(victims):
            return victims
    return []


def _holds_nodes(sim, owner: tuple) -> bool:
    return any(p["node"] and p["phase"] in ("Pending", "Running") for p in sim.pods_of(owner))


# --- Volcano ------------------------------------------------------------------------------------


def volcano_preempt(sim, ns: str, name: str, job: dict, templates: list[dict]) -> bool:
    """Evict the pods of lower-priority gangs of ``job``'s queue so that it fits; True if any were."""
    if "preempt" not in sim.volcano_actions:
        return False
    mine = _rank(sim, job["spec"].get("priorityClassName"))
    queue = job["spec"].get("queue") or "default"
    candidates = [(other["spec"].get("priorityClassName"), other, key) for key, other in sim.vcjobs.items()
                  if key != (ns, name) and (other["spec"].get("queue") or "default") == queue
                  and _rank(sim, other["spec"].get("priorityClassName")) < mine
                  and _holds_nodes(sim, ("vcjob", *key))]
    need = sum(queues._pod_gpus(t) for t in templates)

    def fits(victims: list) -> bool:
        owners = {("vcjob", *v[2]) for v in victims}
        freed = sum(p["gpus"] for o in owners for p in sim.pods_of(o) if p["node"] and p["phase"] in ("Pending", "Running"))
        queue_obj = sim.volcano_queues.get(queue) or {}
        cap = (queue_obj.get("spec", {}).get("capability") or {}).get(queues.GPU)
        room = cap is None or queues.volcano_held(sim, queue) - freed + need <= int(cap)
        return room and sim._place(templates, ignoring=owners) is not None

    victims = _choose(sim, candidates, fits)
    for _, _, key in victims:
        for pod in sim.pods_of(("vcjob", *key)):
            if pod["phase"] in ("Pending", "Running"):
                sim.evict_pod(pod["name"], pod["namespace"])
    return bool(victims)


# --- Kueue --------------------------------------------------------------------------------------


def kueue_preempt(sim, ns: str, name: str) -> bool:
    """Evict lower-priority Workloads of the ClusterQueue so that job ``name``'s fits; True if any were."""
    wl = queues.workload_of(sim, ns, name)
    cq_name = queues._cluster_queue_of(sim, ns, wl) if wl else None
    cq = sim.cluster_queues.get(cq_name)
    if cq is None or (cq["spec"].get("preemption") or {}).get("withinClusterQueue") != "LowerPriority":
        return False
    mine = wl["spec"].get("priority", 0)
    candidates = [(w["spec"].get("priorityClassRef", {}).get("name"), w, w["metadata"]["ownerReferences"][0]["name"])
                  for w in queues._admitted(sim, cq_name)
                  if w["spec"].get("priority", 0) < mine and not queues._has(w, "Evicted")]
    resources = cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"]
    quota = int(next(r["nominalQuota"] for r in resources if r["name"] == queues.GPU))
    held = sum(queues.workload_gpus(w) for w in queues._admitted(sim, cq_name))
    job = sim.jobs[(ns, name)]

    def fits(victims: list) -> bool:
        freed = sum(queues.workload_gpus(v[1]) for v in victims)
        owners = {("job", ns, v[2]) for v in victims}
        return held - freed + queues.workload_gpus(wl) <= quota and \
            sim._place([job["spec"]["template"]] * job["spec"]["parallelism"], ignoring=owners) is not None

    victims = _choose(sim, candidates, fits)
    for _, victim, _ in victims:
        uid = job["metadata"]["uid"]
        evict_workload(sim, victim, "Preempted", "InClusterQueue",
                       f"Preempted to accommodate a workload (UID: {wl['metadata'].get('uid', uid)}, JobUID: {uid}) "
                       "due to prioritization in the ClusterQueue")
    return bool(victims)


def evict_workload(sim, wl: dict, reason: str, cause: str, message: str) -> None:
    """Kueue evicts an admitted Workload: Evicted (and, for a preemption, Preempted) conditions and
    the eviction counted in ``status.schedulingStats.evictions``."""
    when = sim.now()
    queues._set(wl, queues._condition("Evicted", "True", reason, message, when))
    if reason == "Preempted":
        queues._set(wl, queues._condition("Preempted", "True", cause, message, when))
    evictions = wl["status"].setdefault("schedulingStats", {}).setdefault("evictions", [])
    entry = next((e for e in evictions if e["reason"] == reason and e["underlyingCause"] == cause), None)
    if entry is None:
        entry = {"reason": reason, "underlyingCause": cause, "count": 0}
        evictions.append(entry)
    entry["count"] += 1


def stop_if_evicted(sim, ns: str, name: str, job: dict) -> bool:
    """Kueue's job reconciler stops the Job of an evicted Workload (suspend), the Job controller
    deletes its active pods without counting them as failed, and Kueue releases the Workload's quota
    and requeues it. True if the Job was stopped now."""
    wl = queues.workload_of(sim, ns, name)
    if wl is None or job["spec"].get("suspend") or not queues._has(wl, "Evicted"):
        return False
    job["spec"]["suspend"] = True
    for pod in sim.pods_of(("job", ns, name)):
        if pod["phase"] in ("Pending", "Running"):
            del sim.pods[(ns, pod["name"])]  # terminated for the suspension: not a failure
    status, when = job["status"], sim.now()
    status.update(active=0, ready=0)
    status.pop("startTime", None)
    status["conditions"] = [*(c for c in status.get("conditions", []) if c["type"] != "Suspended"),
                            {"type": "Suspended", "status": "True", "reason": "JobSuspended",
                             "message": "Job suspended"}]
    evicted = next(c for c in wl["status"]["conditions"] if c["type"] == "Evicted")
    queues._set(wl, queues._condition("QuotaReserved", "False", "Pending", evicted["message"], when))
    queues._set(wl, queues._condition("Admitted", "False", "NoReservation", "The workload has no reservation", when))
    queues._set(wl, queues._condition("Requeued", "True", evicted["reason"], evicted["message"], when))
    wl["status"].pop("admission", None)
    return True


def resumed(job: dict) -> None:
    job["status"]["conditions"] = [c for c in job["status"].get("conditions", []) if c["type"] != "Suspended"]


# --- the API ------------------------------------------------------------------------------------


class FakeSchedulingV1Api(_Fake):
    """The kubernetes client's SchedulingV1Api: PriorityClasses (cluster-scoped)."""

    def read_priority_class(self, name, **kwargs):
        if name not in self.sim.priority_classes:
            raise _not_found(name)
        return to_model(self.sim.priority_classes[name], "V1PriorityClass")

    def list_priority_class(self, **kwargs):
        items = [pc for _, pc in sorted(self.sim.priority_classes.items())]
        return to_model({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClassList", "metadata": {},
                         "items": items}, "V1PriorityClassList")

    def create_priority_class(self, body, **kwargs):
        name = body["metadata"]["name"]
        self.sim.calls.append(f"create priorityclass {name}")
        if name in self.sim.priority_classes:
            raise ApiException(status=409, reason="AlreadyExists")
        self.sim.priority_classes[name] = copy.deepcopy(body)
        return to_model(body, "V1PriorityClass")

    def delete_priority_class(self, name, **kwargs):
        self.sim.calls.append(f"delete priorityclass {name}")
        if self.sim.priority_classes.pop(name, None) is None:
            raise _not_found(name)
        return to_model({"status": "Success"}, "V1Status")
