"""The gang schedulers' queue objects of the cluster simulator (:mod:`tests.support.k8s_sim`), kept as
the real controllers keep them, so the backend's ``load`` reads what a real cluster would show.

Volcano: ``root`` and ``default`` Queues exist from the start (Volcano installs them; queues
without a parent hang under ``root``, whose ``status.allocated`` adds up its children). Each vcjob
gets a PodGroup named ``<job>-<job uid>`` with the job's labels and a controller ownerReference to
it (as Volcano >= 1.5 makes it): Pending until admitted, Running once its pods hold nodes,
Completed when the job ends (the CRD has no Failed phase); deleted with the job. A queue's
``spec.capability`` GPUs bound what its gangs may hold at once.

Kueue: ``add_kueue_queues`` makes a ClusterQueue with a nominal GPU quota and LocalQueues pointing
to it. Each Job with the ``kueue.x-k8s.io/queue-name`` label gets a Workload ``job-<job>-<hash>``
(one PodSet ``main`` of ``parallelism`` pods, the pod template's priority class and value);
admitting it (conditions QuotaReserved and Admitted True, ``status.admission``) needs room in the
ClusterQueue's quota (evicted and admitted again: Evicted and Preempted turn False); it is Finished when the Job ends and deleted with the Job. Usage counts
admitted, unfinished workloads, as Kueue's does.

A job naming a queue that was never declared is scheduled as before queues were simulated (no
quota or capability applies) and no Queue object counts it: the older tests declare none.
"""

from __future__ import annotations

import copy
import hashlib
from datetime import UTC, datetime, timedelta

from hybridflow.backends.k8s.manifests import KUEUE_QUEUE_LABEL, priority_classes

GPU = "nvidia.com/gpu"
_EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
PRIORITY_VALUES = {pc["metadata"]["name"]: pc["value"] for pc in priority_classes()}


def stamp(second: int) -> str:
    return (_EPOCH + timedelta(seconds=second)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(kind: str, status: str, reason: str, message: str, when: str) -> dict:
    return {"type": kind, "status": status, "reason": reason, "message": message, "lastTransitionTime": when}


def _pod_gpus(template: dict) -> int:
    return sum(int(c.get("resources", {}).get("limits", {}).get(GPU, 0)) for c in template["spec"]["containers"])


def _owner_ref(api_version: str, name: str, uid: str) -> dict:
    return {"apiVersion": api_version, "kind": "Job", "name": name, "uid": uid, "controller": True,
            "blockOwnerDeletion": True}


# --- Volcano ------------------------------------------------------------------------------------


def volcano_queue(name: str, capability_gpus: int | None = None, parent: str | None = "root") -> dict:
    spec: dict = {"weight": 1, "reclaimable": True}
    if parent:
        spec["parent"] = parent
    if capability_gpus is not None:
        spec["capability"] = {GPU: str(capability_gpus)}
    return {"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "Queue", "metadata": {"name": name},
            "spec": spec, "status": {"state": "Open", "allocated": {GPU: "0"}}}


def new_podgroup(job: dict, when: str) -> dict:
    """The PodGroup Volcano's job controller makes for a vcjob."""
    meta, spec = job["metadata"], job["spec"]
    gpus = sum(task["replicas"] * _pod_gpus(task["template"]) for task in spec["tasks"])
    return {
        "apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "PodGroup",
        "metadata": {"name": f"{meta['name']}-{meta['uid']}", "namespace": meta["namespace"],
                     "labels": dict(meta.get("labels") or {}), "creationTimestamp": when,
                     "ownerReferences": [_owner_ref("batch.volcano.sh/v1alpha1", meta["name"], meta["uid"])]},
        "spec": {"minMember": spec["minAvailable"], "queue": spec.get("queue") or "default",
                 "minTaskMember": {task["name"]: task.get("minAvailable", task["replicas"]) for task in spec["tasks"]},
                 # As the controller's quota usage has it: the GPU both as requests.<name> and <name>.
                 "minResources": {GPU: str(gpus), f"requests.{GPU}": str(gpus), "pods": str(spec["minAvailable"])},
                 **({"priorityClassName": spec["priorityClassName"]} if spec.get("priorityClassName") else {})},
        "status": {"phase": "Pending"},
    }


def volcano_held(sim, queue: str) -> int:
    """GPUs held by the pods (bound to a node) of the vcjobs in ``queue``."""
    return sum(p["gpus"] for p in sim.pods.values() if p["owner"][0] == "vcjob" and p["node"]
               and p["phase"] in ("Pending", "Running")
               and (sim.vcjobs.get(p["owner"][1:]) or {}).get("spec", {}).get("queue") == queue)


def volcano_queue_allows(sim, job: dict, gpus: int) -> bool:
    queue = sim.volcano_queues.get(job["spec"].get("queue") or "default")
    cap = ((queue or {}).get("spec", {}).get("capability") or {}).get(GPU)
    return cap is None or volcano_held(sim, queue["metadata"]["name"]) + gpus <= int(cap)


def sync_volcano(sim) -> None:
    """PodGroup phases and Queue statuses from the jobs and pods, as the scheduler keeps them."""
    for (ns, _), group in sim.podgroups.items():
        owner = group["metadata"]["ownerReferences"][0]["name"]
        job = sim.vcjobs.get((ns, owner))
        pods = sim.pods_of(("vcjob", ns, owner))
        phase = (job or {}).get("status", {}).get("state", {}).get("phase", "Pending")
        status = group["status"]
        status.update(running=sum(p["phase"] == "Running" for p in pods),
                      succeeded=sum(p["phase"] == "Succeeded" for p in pods),
                      failed=sum(p["phase"] == "Failed" for p in pods))
        if phase in ("Completed", "Failed", "Aborted", "Terminated"):
            status["phase"] = "Completed"
        elif sum(1 for p in pods if p["node"]) >= group["spec"]["minMember"]:
            status["phase"] = "Running"
        else:
            status["phase"] = "Pending"
    own = {name: volcano_held(sim, name) for name in sim.volcano_queues}
    for name, queue in sim.volcano_queues.items():
        groups = [g for g in sim.podgroups.values() if g["spec"]["queue"] == name]
        held = own[name] + sum(own[c] for c in _descendants(sim.volcano_queues, name))
        queue["status"].update(allocated={GPU: str(held)}, **{
            key: sum(g["status"]["phase"] == phase for g in groups)
            for key, phase in (("pending", "Pending"), ("inqueue", "Inqueue"), ("running", "Running"),
                               ("completed", "Completed"))})


def _descendants(queues: dict, name: str) -> list[str]:
    children = [q for q, obj in queues.items() if obj["spec"].get("parent") == name and q != name]
    return children + [d for c in children for d in _descendants(queues, c)]


# --- Kueue --------------------------------------------------------------------------------------


def cluster_queue(name: str, gpus_quota: int, flavor: str) -> dict:
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": name},
            "spec": {"namespaceSelector": {}, "queueingStrategy": "BestEffortFIFO",
                     "resourceGroups": [{"coveredResources": [GPU], "flavors": [
                         {"name": flavor, "resources": [{"name": GPU, "nominalQuota": gpus_quota}]}]}]},
            "status": {}}


def local_queue(namespace: str, name: str, cluster_queue_name: str) -> dict:
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"clusterQueue": cluster_queue_name}, "status": {}}


def new_workload(job: dict, when: str, priority_values: dict[str, int] | None = None) -> dict:
    """The Workload Kueue's job reconciler makes for a batch/v1 Job with a queue-name label
    (``priority_values``: the cluster's PriorityClasses, name -> value)."""
    meta, spec = job["metadata"], job["spec"]
    template = copy.deepcopy(spec["template"])
    digest = hashlib.sha256(f"{meta['name']}/{meta['uid']}/batch/v1/Job".encode()).hexdigest()[:5]
    body = {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": {"name": f"job-{meta['name']}-{digest}", "namespace": meta["namespace"],
                     "labels": {"kueue.x-k8s.io/job-uid": meta["uid"]}, "creationTimestamp": when,
                     "ownerReferences": [_owner_ref("batch/v1", meta["name"], meta["uid"])]},
        "spec": {"active": True, "queueName": meta["labels"][KUEUE_QUEUE_LABEL],
                 "podSets": [{"name": "main", "count": spec.get("parallelism", 1), "template": template}]},
        "status": {},
    }
    pc = template["spec"].get("priorityClassName")
    values = PRIORITY_VALUES if priority_values is None else priority_values
    if pc in values:
        body["spec"]["priorityClassRef"] = {"group": "scheduling.k8s.io", "kind": "PriorityClass", "name": pc}
        body["spec"]["priority"] = values[pc]
    return body


def workload_gpus(wl: dict) -> int:
    return sum(ps["count"] * _pod_gpus(ps["template"]) for ps in wl["spec"]["podSets"])


def _has(wl: dict, kind: str) -> bool:
    return any(c["type"] == kind and c["status"] == "True" for c in wl["status"].get("conditions", []))


def _set(wl: dict, condition: dict) -> None:
    conditions = wl["status"].get("conditions", [])
    old = next((c for c in conditions if c["type"] == condition["type"]), None)
    if old is not None and old["status"] == condition["status"]:
        condition = {**condition, "lastTransitionTime": old["lastTransitionTime"]}  # no transition
    wl["status"]["conditions"] = [*(c for c in conditions if c["type"] != condition["type"]), condition]


def workload_of(sim, ns: str, job: str) -> dict | None:
    return next((wl for (wns, _), wl in sim.workloads.items()
                 if wns == ns and wl["metadata"]["ownerReferences"][0]["name"] == job), None)


def _cluster_queue_of(sim, ns: str, wl: dict) -> str | None:
    lq = sim.local_queues.get((ns, wl["spec"]["queueName"]))
    return lq["spec"]["clusterQueue"] if lq else None


def _admitted(sim, cq: str) -> list[dict]:
    return [wl for (ns, _), wl in sim.workloads.items()
            if _cluster_queue_of(sim, ns, wl) == cq and _has(wl, "Admitted") and not _has(wl, "Finished")]


def kueue_quota_allows(sim, ns: str, job: str) -> bool:
    """Room in the ClusterQueue behind the job's LocalQueue (no Workload or undeclared queue: room)."""
    wl = workload_of(sim, ns, job)
    if wl is None or (ns, wl["spec"]["queueName"]) not in sim.local_queues:
        return True
    cq = sim.cluster_queues.get(_cluster_queue_of(sim, ns, wl))
    if cq is None:
        return False  # a LocalQueue pointing nowhere admits nothing
    resources = cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"]
    quota = int(next(r["nominalQuota"] for r in resources if r["name"] == GPU))
    need = workload_gpus(wl) + sum(workload_gpus(w) for w in _admitted(sim, cq["metadata"]["name"]))
    if need <= quota:
        return True
    _set(wl, _condition("QuotaReserved", "False", "Pending", f"couldn't assign flavors to pod set main: "
                        f"insufficient unused quota for {GPU}, {need - quota} more needed", sim.now()))
    return False


def admit_workload(sim, ns: str, job: str) -> None:
    wl = workload_of(sim, ns, job)
    if wl is None:
        return
    when, cq = sim.now(), _cluster_queue_of(sim, ns, wl)
    _set(wl, _condition("QuotaReserved", "True", "QuotaReserved", f"Quota reserved in ClusterQueue {cq}", when))
    _set(wl, _condition("Admitted", "True", "Admitted", "The workload is admitted", when))
    for kind in ("Evicted", "Preempted"):  # admitted again after an eviction: Kueue keeps what they said
        old = next((c for c in wl["status"].get("conditions", []) if c["type"] == kind), None)
        if old is not None and old["status"] == "True":
            _set(wl, _condition(kind, "False", "QuotaReserved", f"Previously: {old['message']}", when))
    flavor = _flavor(sim.cluster_queues[cq]) if cq in sim.cluster_queues else "default-flavor"
    wl["status"]["admission"] = {
        **({"clusterQueue": cq} if cq else {}),
        "podSetAssignments": [{"name": ps["name"], "count": ps["count"], "flavors": {GPU: flavor},
                               "resourceUsage": {GPU: str(ps["count"] * _pod_gpus(ps["template"]))}}
                              for ps in wl["spec"]["podSets"]]}


def _flavor(cq: dict) -> str:
    return cq["spec"]["resourceGroups"][0]["flavors"][0]["name"]


def _usage(flavor: str, gpus: int, borrowed: bool) -> list[dict]:
    resource = {"name": GPU, "total": str(gpus), **({"borrowed": "0"} if borrowed else {})}
    return [{"name": flavor, "resources": [resource]}]


def sync_kueue(sim) -> None:
    """Finished workloads, and the usage and counts of every ClusterQueue and LocalQueue."""
    for (ns, _), wl in sim.workloads.items():
        job = sim.jobs.get((ns, wl["metadata"]["ownerReferences"][0]["name"]))
        ended = [c for c in (job or {}).get("status", {}).get("conditions", []) if c["type"] in ("Complete", "Failed")]
        if ended and not _has(wl, "Finished"):
            reason = "Succeeded" if ended[0]["type"] == "Complete" else "Failed"
            _set(wl, _condition("Finished", "True", reason, f"Job {reason.lower()}", sim.now()))
    for name, cq in sim.cluster_queues.items():
        admitted = _admitted(sim, name)
        lq_names = {key for key, lq in sim.local_queues.items() if lq["spec"]["clusterQueue"] == name}
        pending = [wl for key, wl in sim.workloads.items()
                   if (key[0], wl["spec"]["queueName"]) in lq_names and not _has(wl, "QuotaReserved")
                   and not _has(wl, "Finished")]
        gpus = sum(workload_gpus(w) for w in admitted)
        cq["status"] = {"flavorsUsage": _usage(_flavor(cq), gpus, True),
                        "flavorsReservation": _usage(_flavor(cq), gpus, True), "pendingWorkloads": len(pending),
                        "reservingWorkloads": len(admitted), "admittedWorkloads": len(admitted),
                        "conditions": [_condition("Active", "True", "Ready", "Can admit new workloads", stamp(0))]}
        for (ns, lq_name) in lq_names:
            mine = [w for w in admitted if w["metadata"]["namespace"] == ns and w["spec"]["queueName"] == lq_name]
            waiting = [w for w in pending if w["metadata"]["namespace"] == ns and w["spec"]["queueName"] == lq_name]
            used = sum(workload_gpus(w) for w in mine)
            sim.local_queues[(ns, lq_name)]["status"] = {
                "flavorsUsage": _usage(_flavor(cq), used, False), "flavorsReservation": _usage(_flavor(cq), used, False),
                "pendingWorkloads": len(waiting), "reservingWorkloads": len(mine), "admittedWorkloads": len(mine),
                "conditions": [_condition("Active", "True", "Ready", "Can submit new workloads", stamp(0))]}
