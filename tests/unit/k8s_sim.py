"""A stateful Kubernetes cluster simulator for the gang backend and node-health tests.

Nodes have GPU capacity, labels, cordons and taints; pods move Pending -> Running -> Succeeded /
Failed (or are evicted); Volcano Jobs are admitted all-or-nothing by ``minAvailable`` and follow
their lifecycle policies (PodEvicted / PodFailed -> RestartJob up to ``maxRetry``); Kueue-managed
batch/v1 Jobs stay suspended until the whole gang fits, then Kueue unsuspends them and the Job
controller keeps ``parallelism`` pods, recreating evicted ones without counting them against
``backoffLimit`` (the podFailurePolicy Ignore rule on DisruptionTarget).

It is driven through the same client calls as a real API server: fakes of the kubernetes client's
``CoreV1Api``, ``BatchV1Api`` and ``CustomObjectsApi`` methods, returning the client's own model
objects (or dicts for custom objects) and raising ``ApiException`` with real status codes; jobs
can be listed by label selector and patched (merge patch), and ``deleted`` keeps each deleted job
as it was last. :func:`install` hands them out from ``KubernetesHook``'s client properties
(:func:`install_clusters`: one simulator per Connection, for an estate of clusters).
"""

from __future__ import annotations

import copy
import json
from functools import cache

import jsonschema
import yaml
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException
from tests.reference import REFERENCE

GPU = "nvidia.com/gpu"


@cache
def crd_schema(relpath: str, version: str | None = None) -> dict:
    doc = yaml.safe_load((REFERENCE / relpath).read_text())
    versions = doc["spec"]["versions"]
    chosen = next(v for v in versions if version is None or v["name"] == version)
    return chosen["schema"]["openAPIV3Schema"]


@cache
def _api_client() -> ApiClient:
    return ApiClient()


class _Response:
    def __init__(self, body: dict) -> None:
        self.data = json.dumps(body, default=str)


def to_model(body: dict, kind: str):
    """A dict as the kubernetes client's model object (V1Job, V1Node, ...), as a real call returns."""
    return _api_client().deserialize(_Response(body), kind)


def _selector(selector: str | None) -> dict[str, str]:
    if not selector:
        return {}
    return dict(part.split("=", 1) for part in selector.split(","))


def _label_match(labels: dict, selector: str | None) -> bool:
    """An equality-based label selector as the API server reads it: ``k=v``, ``k==v``, ``k!=v`` (true
    when the label is absent), ``k`` (exists), ``!k`` (absent), joined by commas."""
    for part in filter(None, (p.strip() for p in (selector or "").split(","))):
        if "(" in part:
            raise NotImplementedError(f"set-based selector {part!r} is not simulated")
        if "!=" in part:
            key, value = part.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in part:
            key, value = part.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif part.startswith("!"):
            if part[1:].strip() in labels:
                return False
        elif part not in labels:
            return False
    return True


def _merge_patch(target: dict, patch: dict) -> dict:
    """RFC 7386 JSON merge patch (what a strategic merge patch also does to maps like annotations)."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge_patch(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
    return target


def _check_patch(body, content_type: str) -> None:
    # The API server refuses a map sent as a JSON patch (which must be a list of operations).
    if content_type == "application/json-patch+json" and not isinstance(body, list):
        raise ApiException(status=400, reason="BadRequest: json: cannot unmarshal object into Go value of type "
                                              "[]handlers.jsonPatchOp")
    if content_type not in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
        raise NotImplementedError(f"patch content type {content_type!r} is not simulated")


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
        self.services: dict[tuple[str, str], dict] = {}
        self.deleted: dict[tuple[str, str, str], dict] = {}  # (kind, ns, name): a job as it was when deleted
        self.kueue_admits = True  # the LocalQueue's ClusterQueue has quota
        self.on_read = None  # called before each job read: lets time pass between a watcher's polls
        self.calls: list[str] = []
        self._gen = 0
        self.core, self.batch, self.custom = FakeCoreV1Api(self), FakeBatchV1Api(self), FakeCustomObjectsApi(self)

    # --- scheduling -----------------------------------------------------------------------------

    def free_gpus(self) -> dict[str, int]:
        free = {n: v["gpus"] for n, v in self.nodes.items()}
        for pod in self.pods.values():
            if pod["node"] and pod["phase"] in ("Pending", "Running"):
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

    def _place(self, templates: list[dict]) -> list[str] | None:
        """Nodes for every template at once, or None: gang admission is all-or-nothing."""
        free, chosen = self.free_gpus(), []
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
                                 "index": index, "template": template, "reason": None, "disrupted": False}

    def pods_of(self, owner: tuple) -> list[dict]:
        return [p for p in self.pods.values() if p["owner"] == owner]

    # --- test controls --------------------------------------------------------------------------

    def pod_names(self, job: str) -> list[str]:
        return sorted(p["name"] for p in self.pods.values() if p["owner"][2] == job)

    def succeed(self, job: str) -> None:
        for pod in self.pods.values():
            if pod["owner"][2] == job and pod["phase"] == "Running":
                pod["phase"] = "Succeeded"

    def fail_pod(self, name: str, ns: str = "hybridflow") -> None:
        self.pods[(ns, name)].update(phase="Failed", reason="Error")

    def evict_pod(self, name: str, ns: str = "hybridflow") -> None:
        self.pods[(ns, name)].update(phase="Failed", reason="Evicted", disrupted=True)

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
        for (ns, name), job in list(self.vcjobs.items()):
            self._reconcile_volcano(ns, name, job)
        for (ns, name), job in list(self.jobs.items()):
            self._reconcile_job(ns, name, job)

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
            nodes = self._place(templates) if len(templates) >= job["spec"]["minAvailable"] else None
            if nodes is None:
                status["conditions"] = [{"status": "Pending", "reason": "Unschedulable"}]
                return
            for pod_name, template, node in zip(names, templates, nodes, strict=True):
                self._new_pod(ns, pod_name, template, node, owner, {"volcano.sh/job-name": name})
            return
        evicted = job.pop("_deleted_pods", 0) or sum(1 for p in pods if p["disrupted"])
        failed = sum(1 for p in pods if p["phase"] == "Failed" and not p["disrupted"])
        if evicted or failed:
            event = "PodEvicted" if evicted else "PodFailed"
            action = next((p["action"] for p in job["spec"].get("policies", []) if p.get("event") == event), None)
            for pod in pods:
                del self.pods[(ns, pod["name"])]
            if action == "RestartJob" and status["retryCount"] < job["spec"].get("maxRetry", 3):
                status["retryCount"] += 1
                status["state"] = {"phase": "Restarting", "reason": event}
            else:
                status["state"] = {"phase": "Failed", "reason": event}
            return
        running = sum(1 for p in pods if p["phase"] == "Running")
        succeeded = sum(1 for p in pods if p["phase"] == "Succeeded")
        status.update(running=running, succeeded=succeeded, pending=len(pods) - running - succeeded)
        if pods and succeeded == len(pods):
            status["state"] = {"phase": "Completed"}
        elif running >= job["spec"]["minAvailable"]:
            status["state"] = {"phase": "Running"}

    def _reconcile_job(self, ns: str, name: str, job: dict) -> None:
        spec, status, owner = job["spec"], job["status"], ("job", ns, name)
        if any(c["type"] in ("Complete", "Failed") for c in status.get("conditions", [])):
            return
        template = spec["template"]
        labels = {"batch.kubernetes.io/job-name": name, "job-name": name}
        if spec.get("suspend"):
            if not self.kueue_admits:
                return
            nodes = self._place([template] * spec["parallelism"])
            if nodes is None:
                return
            spec["suspend"] = False  # Kueue admitted the workload: unsuspend
            status["startTime"] = "2026-01-01T00:00:00Z"
            for index, node in enumerate(nodes):
                self._gen += 1
                self._new_pod(ns, f"{name}-{index}-{self._gen:05d}", template, node, owner, labels, index)
            return
        for pod in self.pods_of(owner):
            if pod["phase"] == "Failed":
                del self.pods[(ns, pod["name"])]
                if not pod["disrupted"]:
                    status["failed"] = status.get("failed", 0) + 1
                if status.get("failed", 0) > spec.get("backoffLimit", 6):
                    for other in self.pods_of(owner):
                        del self.pods[(ns, other["name"])]
                    status["conditions"] = [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]
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


def _gpus(template: dict) -> int:
    return sum(int(c.get("resources", {}).get("limits", {}).get(GPU, 0)) for c in template["spec"]["containers"])


def _not_found(what: str) -> ApiException:
    return ApiException(status=404, reason=f"NotFound: {what}")


class FakeCustomObjectsApi:
    """The CustomObjectsApi methods the backend calls, for Volcano Jobs."""

    def __init__(self, sim: SimCluster) -> None:
        self.sim = sim

    def _check(self, group: str, version: str, plural: str) -> None:
        if (group, version, plural) != ("batch.volcano.sh", "v1alpha1", "jobs"):
            raise ApiException(status=404, reason=f"NotFound: no resource {group}/{version}/{plural}")

    def create_namespaced_custom_object(self, group, version, namespace, plural, body, **kwargs):
        self._check(group, version, plural)
        self.sim.calls.append(f"create vcjob {body['metadata']['name']}")
        jsonschema.validate(body, crd_schema("volcano/batch.volcano.sh_jobs.yaml"))  # the API server's check
        key = (namespace, body["metadata"]["name"])
        if key in self.sim.vcjobs:
            raise ApiException(status=409, reason="AlreadyExists")
        stored = copy.deepcopy(body)
        stored["status"] = {"state": {"phase": "Pending"}, "retryCount": 0}
        self.sim.vcjobs[key] = stored
        return copy.deepcopy(stored)

    def get_namespaced_custom_object(self, group, version, namespace, plural, name, **kwargs):
        self._check(group, version, plural)
        if self.sim.on_read:
            self.sim.on_read()
        if (namespace, name) not in self.sim.vcjobs:
            raise _not_found(name)
        return copy.deepcopy(self.sim.vcjobs[(namespace, name)])

    def list_namespaced_custom_object(self, group, version, namespace, plural, label_selector=None, **kwargs):
        self._check(group, version, plural)
        items = [copy.deepcopy(job) for (ns, _), job in sorted(self.sim.vcjobs.items())
                 if ns == namespace and _label_match(job["metadata"].get("labels") or {}, label_selector)]
        return {"apiVersion": f"{group}/{version}", "kind": "JobList", "metadata": {}, "items": items}

    def patch_namespaced_custom_object(self, group, version, namespace, plural, name, body, **kwargs):
        self._check(group, version, plural)
        # CustomObjectsApi sends a merge patch unless told otherwise.
        _check_patch(body, kwargs.get("_content_type") or "application/merge-patch+json")
        if (namespace, name) not in self.sim.vcjobs:
            raise _not_found(name)
        self.sim.calls.append(f"patch vcjob {name}")
        patched = _merge_patch(copy.deepcopy(self.sim.vcjobs[(namespace, name)]), body)
        jsonschema.validate({k: v for k, v in patched.items() if k != "status" and not k.startswith("_")},
                            crd_schema("volcano/batch.volcano.sh_jobs.yaml"))
        self.sim.vcjobs[(namespace, name)] = patched
        return copy.deepcopy(patched)

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, **kwargs):
        self._check(group, version, plural)
        self.sim.calls.append(f"delete vcjob {name}")
        gone = self.sim.vcjobs.pop((namespace, name), None)
        if gone is None:
            raise _not_found(name)
        self.sim.deleted[("vcjob", namespace, name)] = gone
        self.sim.delete_owned(("vcjob", namespace, name))  # garbage collection of owned pods
        return {"status": "Success"}


class FakeBatchV1Api:
    def __init__(self, sim: SimCluster) -> None:
        self.sim = sim
        self.api_client = _api_client()

    def create_namespaced_job(self, namespace, body, **kwargs):
        self.sim.calls.append(f"create job {body['metadata']['name']}")
        key = (namespace, body["metadata"]["name"])
        if key in self.sim.jobs:
            raise ApiException(status=409, reason="AlreadyExists")
        stored = copy.deepcopy(body)
        stored["status"] = {}
        self.sim.jobs[key] = stored
        return to_model(stored, "V1Job")

    def read_namespaced_job(self, name, namespace, **kwargs):
        if self.sim.on_read:
            self.sim.on_read()
        if (namespace, name) not in self.sim.jobs:
            raise _not_found(name)
        return to_model(self.sim.jobs[(namespace, name)], "V1Job")

    read_namespaced_job_status = read_namespaced_job

    def list_namespaced_job(self, namespace, label_selector=None, **kwargs):
        items = [job for (ns, _), job in sorted(self.sim.jobs.items())
                 if ns == namespace and _label_match(job["metadata"].get("labels") or {}, label_selector)]
        return to_model({"apiVersion": "batch/v1", "kind": "JobList", "metadata": {}, "items": items}, "V1JobList")

    def patch_namespaced_job(self, name, namespace, body, **kwargs):
        # For a dict body BatchV1Api picks the first type it offers, json-patch+json.
        _check_patch(body, kwargs.get("_content_type") or "application/json-patch+json")
        if (namespace, name) not in self.sim.jobs:
            raise _not_found(name)
        self.sim.calls.append(f"patch job {name}")
        _merge_patch(self.sim.jobs[(namespace, name)], body)
        return to_model(self.sim.jobs[(namespace, name)], "V1Job")

    def delete_namespaced_job(self, name, namespace, **kwargs):
        self.sim.calls.append(f"delete job {name}")
        gone = self.sim.jobs.pop((namespace, name), None)
        if gone is None:
            raise _not_found(name)
        self.sim.deleted[("job", namespace, name)] = gone
        # The API's default for Jobs orphans their pods; only a propagation policy removes them.
        if kwargs.get("propagation_policy") in ("Background", "Foreground"):
            self.sim.delete_owned(("job", namespace, name))
        return to_model({"status": "Success"}, "V1Status")


class FakeCoreV1Api:
    def __init__(self, sim: SimCluster) -> None:
        self.sim = sim

    def _node(self, name: str) -> dict:
        if name not in self.sim.nodes:
            raise _not_found(name)
        return self.sim.nodes[name]

    def read_node(self, name, **kwargs):
        node = self._node(name)
        return to_model({"metadata": {"name": name, "labels": node["labels"]},
                         "spec": {"unschedulable": node["unschedulable"], "taints": node["taints"] or None},
                         "status": {"capacity": {GPU: str(node["gpus"])}}}, "V1Node")

    def patch_node(self, name, body, **kwargs):
        node = self._node(name)
        self.sim.calls.append(f"patch node {name}")
        spec = body.get("spec", {})
        if "unschedulable" in spec:
            node["unschedulable"] = bool(spec["unschedulable"])
        if "taints" in spec:  # a list without a merge key is replaced as a whole
            node["taints"] = list(spec["taints"] or [])
        return self.read_node(name)

    def list_namespaced_pod(self, namespace, field_selector=None, label_selector=None, **kwargs):
        fields, labels = _selector(field_selector), _selector(label_selector)
        items = []
        for pod in self.sim.pods.values():
            if pod["namespace"] != namespace:
                continue
            if "spec.nodeName" in fields and pod["node"] != fields["spec.nodeName"]:
                continue
            if any(pod["labels"].get(k) != v for k, v in labels.items()):
                continue
            items.append({"metadata": {"name": pod["name"], "namespace": namespace, "labels": pod["labels"]},
                          "spec": {"nodeName": pod["node"], "containers": pod["template"]["spec"]["containers"]},
                          "status": {"phase": pod["phase"], "reason": pod["reason"]}})
        return to_model({"items": items}, "V1PodList")

    def delete_namespaced_pod(self, name, namespace, **kwargs):
        pod = self.sim.pods.pop((namespace, name), None)
        if pod is None:
            raise _not_found(name)
        self.sim.calls.append(f"delete pod {name}")
        kind, ns, job = pod["owner"]
        if kind == "vcjob" and (ns, job) in self.sim.vcjobs:  # Volcano sees a deleted pod as evicted
            self.sim.vcjobs[(ns, job)]["_deleted_pods"] = self.sim.vcjobs[(ns, job)].get("_deleted_pods", 0) + 1
        return to_model({"metadata": {"name": name}}, "V1Pod")

    def _create(self, store: dict, kind: str, namespace, body):
        key = (namespace, body["metadata"]["name"])
        self.sim.calls.append(f"create {kind.lower()} {key[1]}")
        if key in store:
            raise ApiException(status=409, reason="AlreadyExists")
        store[key] = copy.deepcopy(body)
        return to_model(body, f"V1{kind}")

    def create_namespaced_secret(self, namespace, body, **kwargs):
        return self._create(self.sim.secrets, "Secret", namespace, body)

    def replace_namespaced_secret(self, name, namespace, body, **kwargs):
        if (namespace, name) not in self.sim.secrets:
            raise _not_found(name)
        self.sim.secrets[(namespace, name)] = copy.deepcopy(body)
        return to_model(body, "V1Secret")

    def delete_namespaced_secret(self, name, namespace, **kwargs):
        if self.sim.secrets.pop((namespace, name), None) is None:
            raise _not_found(name)

    def create_namespaced_service(self, namespace, body, **kwargs):
        return self._create(self.sim.services, "Service", namespace, body)

    def delete_namespaced_service(self, name, namespace, **kwargs):
        if self.sim.services.pop((namespace, name), None) is None:
            raise _not_found(name)


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
