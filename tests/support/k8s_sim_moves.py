"""The simulator's side of moving a gang off to make room (hybridflow.backends.k8s.moves): a Kueue
Workload deactivated with ``spec.active: false`` (Kueue evicts it with reason ``Deactivated``, its
Job is suspended and its pods deleted, and it is not admitted again while inactive), and a Volcano
``bus.volcano.sh`` Command ``AbortJob`` (the job controller kills the job's pods and the job ends
``Aborted``; the Command is consumed)."""

from __future__ import annotations

import copy

from kubernetes.client.exceptions import ApiException
from tests.support import k8s_sim_preemption as preemption
from tests.support import k8s_sim_queues as queues


def _not_found(what: str) -> ApiException:
    exc = ApiException(status=404, reason="Not Found")
    exc.body = f'{{"kind":"Status","status":"Failure","reason":"NotFound","message":"{what} not found","code":404}}'
    return exc


def active(wl: dict | None) -> bool:
    return wl is None or wl["spec"].get("active", True) is not False


def patch_workload(sim, ns: str, name: str, body: dict) -> dict:
    wl = sim.workloads.get((ns, name))
    if wl is None:
        raise _not_found(f'workloads.kueue.x-k8s.io "{name}"')
    extra = set(body) - {"spec"} or set(body.get("spec") or {}) - {"active"}
    if extra:
        raise NotImplementedError(f"the simulator patches a Workload's spec.active only, not {sorted(extra)}")
    sim.calls.append(f"patch workload {name}")
    wanted = body["spec"]["active"]
    if wanted is False and active(wl) and queues._has(wl, "QuotaReserved"):
        preemption.evict_workload(sim, wl, "Deactivated", "", "The workload is deactivated")
    wl["spec"]["active"] = wanted
    return wl


def run_command(sim, ns: str, body: dict) -> dict:
    """Volcano's job controller runs a Command on its target job, then deletes the Command."""
    target = (body.get("target") or {}).get("name")
    if body.get("action") != "AbortJob" or (body.get("target") or {}).get("kind") != "Job":
        raise NotImplementedError(f"the simulator runs AbortJob on a Job only, not {body.get('action')}")
    sim.calls.append(f"create command {body.get('action')} {target}")
    job = sim.vcjobs.get((ns, target))
    if job is not None and job["status"]["state"]["phase"] not in ("Completed", "Failed", "Aborted", "Terminated"):
        for pod in sim.pods_of(("vcjob", ns, target)):
            if pod["phase"] in ("Pending", "Running"):
                del sim.pods[(ns, pod["name"])]  # SIGTERM: the worker commits its checkpoint first
        job["status"]["state"] = {"phase": "Aborted", "reason": body.get("reason") or "",
                                  "message": body.get("message") or ""}
        sim.sync_queues()
    out = copy.deepcopy(body)
    out["metadata"].update(namespace=ns, uid=sim.new_uid(), creationTimestamp=sim.stamp())
    return out
