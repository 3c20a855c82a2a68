"""A stateful Kubernetes cluster simulator for the gang backend and node-health tests.

Nodes have GPU capacity, labels, cordons and taints; pods move Pending -> Running -> Succeeded /
Failed (or are evicted); Volcano Jobs are admitted all-or-nothing by ``minAvailable`` and follow
their lifecycle policies (first match by event or exit code; RestartJob while ``retryCount``, raised first, stays below ``maxRetry``,
TerminateJob / AbortJob keep the pods that already ended); Kueue-managed batch/v1 Jobs stay
suspended until the whole gang fits, then Kueue unsuspends them and the Job controller keeps
``parallelism`` pods, applying the podFailurePolicy to each failed pod (Ignore: recreated, not
counted; FailJob: the Job fails; no rule: counted towards ``backoffLimit``) and keeping failed pods
with their exit codes (:mod:`tests.support.k8s_sim_policies`). Both schedulers admit the higher
PriorityClass first, and preempt lower-priority gangs for a gang that does not fit as the real ones
do (:mod:`tests.support.k8s_sim_preemption`: Volcano evicts the victims' pods, Kueue evicts their
Workloads and suspends their Jobs, then readmits them).

It is driven through the same client calls as a real API server: fakes of the kubernetes client's
``CoreV1Api``, ``BatchV1Api``, ``CustomObjectsApi`` and ``SchedulingV1Api`` methods (:mod:`tests.support.k8s_sim_api`), returning the client's own model
objects (or dicts for custom objects) and raising ``ApiException`` with real status codes; jobs
can be listed by label selector and patched (merge patch), and ``deleted`` keeps each deleted job
as it was last. :func:`install` hands them out from ``KubernetesHook``'s client properties
(:func:`install_clusters`: one simulator per Connection, for an estate of clusters).

The schedulers' own objects are there too (:mod:`tests.support.k8s_sim_queues`): Volcano Queues and
PodGroups, Kueue ClusterQueues, LocalQueues and Workloads, served by the custom objects API
(namespaced and cluster-wide get and list, each object valid against its CRD schema, checked on
every answer). Every call through the fakes is recorded in ``requests`` as (method,
``_request_timeout``); ``unreachable`` (True, or an exception to raise) makes every call fail as
against an API server that cannot be reached, :meth:`SimCluster.outage` does so for a while only
(e.g. an API server answering 503 while it restarts), ``api_delay_s`` makes every answer that slow
(a call whose ``_request_timeout`` is shorter times out after that long instead, as urllib3
would), and ``forbidden`` holds RBAC rules the caller lacks, as (verb, resource, API group): such a
call gets the API server's 403 Status, message and all.
"""

from __future__ import annotations

import json
import time
import uuid

from kubernetes.client.exceptions import ApiException
from tests.reference import REFERENCE  # noqa: F401 - tests resolve the reference data through here
from tests.support import k8s_sim_moves as moves
from tests.support import k8s_sim_policies as policies
from tests.support import k8s_sim_preemption as preemption
from tests.support import k8s_sim_queues as queues
from tests.support.k8s_sim_api import (  # noqa: F401 - crd_schema, crd_validator, to_model: for the tests
    FakeBatchV1Api,
    FakeCoreV1Api,
    FakeCustomObjectsApi,
    crd_schema,
    crd_validator,
    to_model,
)
from urllib3 import HTTPSConnectionPool
from urllib3.exceptions import MaxRetryError, NewConnectionError, ReadTimeoutError

GPU = "nvidia.com/gpu"


class SimCluster:
    def __init__(self, nodes: dict[str, dict]) -> None:
        self.nodes = {
            name: {"gpus": n["gpus"], "labels": dict(n.get("labels", {})), "unschedulable": False,
                   "taints": list(n.get("taints", []))}
            for name, n in nodes.items()
        }
        self.vcjobs: dict[tuple[str, str], dict] = {}
        self.jobs: dict[tuple[str, str], dict] = {}
        self.pods: dict[tuple[str, str], dict] = {}
        self.secrets: dict[tuple[str, str], dict] = {}
        self.claims: set[tuple[str, str]] | None = None  # PersistentVolumeClaims (None: every one asked for)
        self.services: dict[tuple[str, str], dict] = {}
        self.deleted: dict[tuple[str, str, str], dict] = {}  # (kind, ns, name): a job as it was when deleted
        self.kueue_admits = True  # Kueue admits at all (with declared queues, also within the quota)
        self.on_read = None  # called before each job read: lets time pass between a watcher's polls
        self.calls: list[str] = []  # what changed the cluster
        self.requests: list[tuple[str, object]] = []  # every call: (method, its _request_timeout)
        self.unreachable: bool | BaseException = False
        self.api_delay_s = 0.0
        self.forbidden: set[tuple[str, str, str]] = set()  # (verb, resource, group) the caller may not
        self.user = "system:serviceaccount:airflow:hybridflow"
        self._outage: tuple[float, BaseException] | None = None
        self.volcano_queues = {"root": queues.volcano_queue("root", parent=None),
                               "default": queues.volcano_queue("default")}
        self.podgroups: dict[tuple[str, str], dict] = {}
        self.cluster_queues: dict[str, dict] = {}
        self.local_queues: dict[tuple[str, str], dict] = {}
        self.workloads: dict[tuple[str, str], dict] = {}
        self._gen = 0
        self._uids = 0
        self._serving = False
        self._clock = 0  # seconds since the simulated epoch: creation order is timestamp order
        self.priority_classes = preemption.initial_classes()  # name -> scheduling.k8s.io/v1 PriorityClass
        self.volcano_actions = list(preemption.VOLCANO_ACTIONS)  # add "preempt" for Volcano's preemption
        self.core, self.batch, self.custom = FakeCoreV1Api(self), FakeBatchV1Api(self), FakeCustomObjectsApi(self)
        self.scheduling = preemption.FakeSchedulingV1Api(self)

    # --- the API server's side ----------------------------------------------------------------

    def stamp(self) -> str:
        """A creation time: each one a second after the last, so creation order is timestamp order."""
        self._clock += 1
        return queues.stamp(self._clock)

    def now(self) -> str:
        return queues.stamp(self._clock)

    def new_uid(self) -> str:
        self._uids += 1
        return str(uuid.UUID(int=self._uids))

    def answer(self, method: str, kwargs: dict) -> None:
        """Every call through the fakes: recorded, then failed or slowed as the test set it up."""
        timeout = kwargs.get("_request_timeout")
        self.requests.append((method, timeout))
        pool = HTTPSConnectionPool("sim.invalid", 6443)
        if self.unreachable is True:
            raise MaxRetryError(pool, f"/{method}", NewConnectionError(
                pool, "Failed to establish a new connection: [Errno 111] Connection refused"))
        if isinstance(self.unreachable, BaseException):
            raise self.unreachable
        if self._outage is not None and time.monotonic() < self._outage[0]:
            raise self._outage[1]
        rbac = _rbac(method, kwargs)
        if rbac in self.forbidden:
            raise _forbidden(self.user, rbac, kwargs)
        if self.api_delay_s:
            read = timeout[-1] if isinstance(timeout, tuple) else timeout
            if read is not None and read < self.api_delay_s:
                time.sleep(read)
                raise MaxRetryError(pool, f"/{method}", ReadTimeoutError(
                    pool, f"/{method}", f"Read timed out. (read timeout={read})"))
            time.sleep(self.api_delay_s)

    def outage(self, seconds: float, status: int = 503) -> None:
        """Every call fails for the next ``seconds`` (wall clock) with HTTP ``status``, as from an API
        server that is restarting or overloaded; then it answers again."""
        self._outage = (time.monotonic() + seconds, ApiException(status=status, reason="Service Unavailable"
                                                                 if status == 503 else "Too Many Requests"))

    def add_volcano_queue(self, name: str, capability_gpus: int | None = None, parent: str = "root") -> None:
        self.volcano_queues[name] = queues.volcano_queue(name, capability_gpus, parent)
        self.sync_queues()

    def add_kueue_queues(self, cluster_queue: str, gpus_quota: int, local_queues, *,
                         flavor: str = "default-flavor", preemption: str | None = None) -> None:
        """A ClusterQueue with ``gpus_quota`` nominal GPUs and the LocalQueues (``"namespace/name"``)
        that submit to it; ``preemption``: its ``withinClusterQueue`` policy (Kueue's default: Never)."""
        self.cluster_queues[cluster_queue] = queues.cluster_queue(cluster_queue, gpus_quota, flavor)
        if preemption:
            self.cluster_queues[cluster_queue]["spec"]["preemption"] = {"withinClusterQueue": preemption}
        for ref in local_queues:
            ns, name = ref.split("/", 1)
            self.local_queues[(ns, name)] = queues.local_queue(ns, name, cluster_queue)
        self.sync_queues()

    def sync_queues(self) -> None:
        queues.sync_volcano(self)
        queues.sync_kueue(self)

    # --- scheduling -----------------------------------------------------------------------------

    def free_gpus(self, ignoring=()) -> dict[str, int]:
        """Free GPUs per node, as if the pods of the ``ignoring`` owners were gone."""
        free = {n: v["gpus"] for n, v in self.nodes.items()}
        for pod in self.pods.values():
            if pod["node"] and pod["phase"] in ("Pending", "Running") and pod["owner"] not in ignoring:
                free[pod["node"]] -= pod["gpus"]
        return free

    def _fits(self, node: str, template: dict) -> bool:
        spec, info = template["spec"], self.nodes[node]
        if info["unschedulable"]:
            return False
        if any(info["labels"].get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
            return False
        tolerated = {t["key"] for t in spec.get("tolerations", []) if t.get("operator") == "Exists"}
        return not any(t["effect"] == "NoSchedule" and t["key"] not in tolerated for t in info["taints"])

    def _place(self, templates: list[dict], ignoring=()) -> list[str] | None:
        """Nodes for every template at once, or None: gang admission is all-or-nothing."""
        if any(preemption.value(self, t["spec"].get("priorityClassName")) is None for t in templates):
            return None  # the API server refuses pods naming a PriorityClass that does not exist
        free, chosen = self.free_gpus(ignoring), []
        for template in templates:
            need = _gpus(template)
            node = next((n for n in sorted(free) if self._fits(n, template) and free[n] >= need), None)
            if node is None:
                return None
            free[node] -= need
            chosen.append(node)
        return chosen

    def _new_pod(self, ns: str, name: str, template: dict, node: str | None, owner: tuple, labels: dict,
                 index: int | None = None) -> None:
        self.pods[(ns, name)] = {"name": name, "namespace": ns, "labels": {**template["metadata"]["labels"], **labels},
                                 "node": node, "phase": "Pending", "gpus": _gpus(template), "owner": owner,
                                 "index": index, "template": template, "reason": None, "disrupted": False,
                                 "exit_code": None}

    def pods_of(self, owner: tuple) -> list[dict]:
        return [p for p in self.pods.values() if p["owner"] == owner]

    # --- test controls --------------------------------------------------------------------------

    def pod_names(self, job: str) -> list[str]:
        return sorted(p["name"] for p in self.pods.values() if p["owner"][2] == job)

    def succeed(self, job: str) -> None:
        for pod in self.pods.values():
            if pod["owner"][2] == job and pod["phase"] == "Running":
                pod["phase"] = "Succeeded"

    def fail_pod(self, name: str, ns: str = "hybridflow", exit_code: int = 1) -> None:
        """The pod's worker exited ``exit_code`` (75: it was preempted and checkpointed first)."""
        self.pods[(ns, name)].update(phase="Failed", reason="Error", exit_code=exit_code)

    def evict_pod(self, name: str, ns: str = "hybridflow", exit_code: int | None = 75) -> None:
        """Evicted (condition DisruptionTarget); its worker checkpointed on SIGTERM and exited ``exit_code``."""
        self.pods[(ns, name)].update(phase="Failed", reason="Evicted", disrupted=True, exit_code=exit_code)

    def run(self, ticks: int = 3) -> None:
        for _ in range(ticks):
            self.step()

    def step(self) -> None:
        """One reconcile pass of the scheduler and the job controllers."""
        for pod in self.pods.values():
            if pod["phase"] == "Pending" and pod["node"] is None:
                placed = self._place([pod["template"]])
                if placed:
                    pod["node"] = placed[0]
            elif pod["phase"] == "Pending":
                pod["phase"] = "Running"
        # Both schedulers admit the higher priority class first, then the older job.
        for (ns, name), job in self._admission_order(self.vcjobs, lambda j: j["spec"].get("priorityClassName")):
            self._reconcile_volcano(ns, name, job)
        for (ns, name), job in self._admission_order(self.jobs, lambda j: j["spec"]["template"]["spec"].get(
                "priorityClassName")):
            self._reconcile_job(ns, name, job)
        self.sync_queues()

    def _admission_order(self, jobs: dict, priority_class) -> list:
        return sorted(jobs.items(), key=lambda item: (-(preemption.value(self, priority_class(item[1])) or 0),
                                                      item[1]["metadata"].get("creationTimestamp", "")))

    def _reconcile_volcano(self, ns: str, name: str, job: dict) -> None:
        status, owner = job["status"], ("vcjob", ns, name)
        phase = status["state"]["phase"]
        pods = self.pods_of(owner)
        if phase in ("Completed", "Failed"):
            return
        if phase == "Restarting":
            status["state"]["phase"] = "Pending"
            return
        if phase == "Pending" and not pods:
            templates, names = [], []
            for task in job["spec"]["tasks"]:
                for i in range(task["replicas"]):
                    templates.append(task["template"])
                    names.append(f"{name}-{task['name']}-{i}")
            fits = len(templates) >= job["spec"]["minAvailable"] and \
                queues.volcano_queue_allows(self, job, sum(_gpus(t) for t in templates))
            nodes = self._place(templates) if fits else None
            if nodes is None:
                status["conditions"] = [{"status": "Pending", "reason": "Unschedulable"}]
                preemption.volcano_preempt(self, ns, name, job, templates)  # admitted on a later pass
                return
            for pod_name, template, node in zip(names, templates, nodes, strict=True):
                self._new_pod(ns, pod_name, template, node, owner, {"volcano.sh/job-name": name,
                                                                    "volcano.sh/task-spec": pod_name.rsplit("-", 2)[1]})
            return
        if self._volcano_failure(ns, job, pods):
            return
        running = sum(1 for p in pods if p["phase"] == "Running")
        succeeded = sum(1 for p in pods if p["phase"] == "Succeeded")
        status.update(running=running, succeeded=succeeded, pending=len(pods) - running - succeeded)
        if pods and succeeded == len(pods):
            status["state"] = {"phase": "Completed"}
        elif running >= job["spec"]["minAvailable"]:
            status["state"] = {"phase": "Running"}

    def _volcano_failure(self, ns: str, job: dict, pods: list[dict]) -> bool:
        """Apply the job's policies to its first evicted (deleted) or failed pod; True if one did."""
        status = job["status"]
        failed = [p for p in pods if p["phase"] == "Failed"]
        if job.pop("_deleted_pods", 0):
            event, code = "PodEvicted", None
        elif failed:
            first = sorted(failed, key=lambda p: (not p["disrupted"], p["name"]))[0]
            event, code = ("PodEvicted" if first["disrupted"] else "PodFailed"), first["exit_code"]
        else:
            return False
        action = policies.volcano_action(job["spec"].get("policies", []), event, code)
        if action in ("TerminateJob", "AbortJob"):
            for pod in pods:  # killed, keeping the pods that already ended (their exit codes stay readable)
                if pod["phase"] in ("Pending", "Running"):
                    del self.pods[(ns, pod["name"])]
            status["state"] = {"phase": "Terminated" if action == "TerminateJob" else "Aborted", "reason": event}
            return True
        for pod in pods:
            del self.pods[(ns, pod["name"])]
        if action == "RestartJob":
            status["retryCount"] += 1  # as Volcano does: counted first, then checked against maxRetry
        if action == "RestartJob" and status["retryCount"] < job["spec"].get("maxRetry", 3):
            status["state"] = {"phase": "Restarting", "reason": event}
        else:
            status["state"] = {"phase": "Failed", "reason": event}
        return True

    def _reconcile_job(self, ns: str, name: str, job: dict) -> None:
        spec, status, owner = job["spec"], job["status"], ("job", ns, name)
        if any(c["type"] in ("Complete", "Failed") for c in status.get("conditions", [])):
            return
        template = spec["template"]
        labels = {"batch.kubernetes.io/job-name": name, "job-name": name}
        if preemption.stop_if_evicted(self, ns, name, job):
            return
        if spec.get("suspend"):
            if not self.kueue_admits or not moves.active(queues.workload_of(self, ns, name)):
                return  # an inactive Workload (a gang moved off) is never admitted again
            nodes = self._place([template] * spec["parallelism"]) if queues.kueue_quota_allows(self, ns, name) \
                else None
            if nodes is None:
                preemption.kueue_preempt(self, ns, name)  # admitted on a later pass
                return
            queues.admit_workload(self, ns, name)
            preemption.resumed(job)
            spec["suspend"] = False  # Kueue admitted the workload: unsuspend
            status["startTime"] = "2026-01-01T00:00:00Z"
            for index, node in enumerate(nodes):
                self._gen += 1
                self._new_pod(ns, f"{name}-{index}-{self._gen:05d}", template, node, owner, labels, index)
            return
        for pod in self.pods_of(owner):
            if pod["phase"] != "Failed" or pod.get("counted"):
                continue
            pod["counted"] = True  # the failed pod stays, its exit code readable, until the Job is deleted
            container = template["spec"]["containers"][0]["name"]
            action, message = policies.pod_failure_action(spec.get("podFailurePolicy"), pod, container)
            if action == "Count":
                status["failed"] = status.get("failed", 0) + 1
            if action == "FailJob" or status.get("failed", 0) > spec.get("backoffLimit", 6):
                for other in self.pods_of(owner):  # active pods are deleted, ended ones kept
                    if other["phase"] in ("Pending", "Running"):
                        del self.pods[(ns, other["name"])]
                reason = "PodFailurePolicy" if action == "FailJob" else "BackoffLimitExceeded"
                status["conditions"] = [{"type": "Failed", "status": "True", "reason": reason,
                                         "message": message or "Job has reached the specified backoff limit"}]
                status["active"] = 0
                return
        done = {p["index"] for p in self.pods_of(owner) if p["phase"] == "Succeeded"}
        alive = {p["index"] for p in self.pods_of(owner) if p["phase"] in ("Pending", "Running")}
        for index in range(spec["completions"]):
            if index not in done and index not in alive:  # the Job controller replaces lost pods
                self._gen += 1
                self._new_pod(ns, f"{name}-{index}-{self._gen:05d}", template, None, owner, labels, index)
        status["active"] = sum(1 for p in self.pods_of(owner) if p["phase"] in ("Pending", "Running"))
        status["ready"] = sum(1 for p in self.pods_of(owner) if p["phase"] == "Running")
        status["succeeded"] = len(done)
        if len(done) == spec["completions"]:
            status["conditions"] = [{"type": "Complete", "status": "True"}]

    def delete_owned(self, owner: tuple) -> None:
        for pod in self.pods_of(owner):
            del self.pods[(pod["namespace"], pod["name"])]
        self.delete_scheduling(owner)

    def delete_scheduling(self, owner: tuple) -> None:
        """The job's PodGroup or Workload goes with it (garbage collection; Kueue finalizes the
        Workload of a deleted Job whatever the propagation policy)."""
        kind, ns, name = owner
        store = self.podgroups if kind == "vcjob" else self.workloads
        for key, obj in list(store.items()):
            if key[0] == ns and obj["metadata"]["ownerReferences"][0]["name"] == name:
                del store[key]
        self.sync_queues()

_VERBS = {"read": "get", "get": "get", "list": "list", "create": "create", "delete": "delete",
          "patch": "patch", "replace": "update"}
_CORE = {"job": ("jobs", "batch"), "secret": ("secrets", ""), "service": ("services", ""),
         "pod": ("pods", ""), "node": ("nodes", "")}


def _rbac(method: str, kwargs: dict) -> tuple[str, str, str]:
    """(verb, resource, group) a client method needs, as the API server authorises it."""
    verb = _VERBS.get(method.split("_", 1)[0], method)
    if "plural" in kwargs:
        return verb, kwargs["plural"], kwargs.get("group", "")
    kind = method.rsplit("_", 1)[-1]
    if method.endswith("_status"):
        kind = method.rsplit("_", 2)[-2]
    resource, group = _CORE.get(kind, (kind + "s", ""))
    return verb, resource, group


def _forbidden(user: str, rbac: tuple[str, str, str], kwargs: dict) -> ApiException:
    verb, resource, group = rbac
    qualified = f"{resource}.{group}" if group else resource
    name, ns = kwargs.get("name"), kwargs.get("namespace")
    message = (f"{qualified}{f' {json.dumps(name)}' if name else ''} is forbidden: User {json.dumps(user)} cannot "
               f"{verb} resource {json.dumps(resource)} in API group {json.dumps(group)}"
               + (f" in the namespace {json.dumps(ns)}" if ns else " at the cluster scope"))
    exc = ApiException(status=403, reason="Forbidden")
    exc.body = json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                           "message": message, "reason": "Forbidden",
                           "details": {"name": name, "group": group, "kind": resource}, "code": 403})
    return exc




def _gpus(template: dict) -> int:
    return sum(int(c.get("resources", {}).get("limits", {}).get(GPU, 0)) for c in template["spec"]["containers"])

def install(monkeypatch, sim: SimCluster) -> None:
    """Make every KubernetesHook hand out the simulator's clients (where the hook builds them)."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    monkeypatch.setattr(KubernetesHook, "core_v1_client", property(lambda self: sim.core))
    monkeypatch.setattr(KubernetesHook, "batch_v1_client", property(lambda self: sim.batch))
    monkeypatch.setattr(KubernetesHook, "custom_object_client", property(lambda self: sim.custom))


def install_clusters(monkeypatch, sims: dict[str, SimCluster]) -> None:
    """Like :func:`install` for an estate of several clusters: each hook gets the clients of the
    simulator registered under its ``conn_id``."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    monkeypatch.setattr(KubernetesHook, "core_v1_client", property(lambda self: sims[self.conn_id].core))
    monkeypatch.setattr(KubernetesHook, "batch_v1_client", property(lambda self: sims[self.conn_id].batch))
    monkeypatch.setattr(KubernetesHook, "custom_object_client", property(lambda self: sims[self.conn_id].custom))
