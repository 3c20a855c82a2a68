"""The API side of the cluster simulator (:mod:`tests.support.k8s_sim`): fakes of the kubernetes
client's ``CoreV1Api``, ``BatchV1Api`` and ``CustomObjectsApi`` that answer from a
:class:`~tests.support.k8s_sim.SimCluster`, with the client's model objects (dicts for custom
objects), ``ApiException`` with real status codes, label selectors, merge patches, and custom
objects checked against their CRD schemas."""

from __future__ import annotations

import copy
import inspect
import json
from functools import cache
from typing import TYPE_CHECKING

import jsonschema
import yaml
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException
from tests.reference import REFERENCE
from tests.support import k8s_sim_queues as queues

if TYPE_CHECKING:
    from tests.support.k8s_sim import SimCluster

GPU = "nvidia.com/gpu"


@cache
def crd_schema(relpath: str, version: str | None = None) -> dict:
    # libyaml where the build has it: the Workload CRD is 1.4 MB of YAML.
    doc = yaml.load((REFERENCE / relpath).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    versions = doc["spec"]["versions"]
    chosen = next(v for v in versions if version is None or v["name"] == version)
    return chosen["schema"]["openAPIV3Schema"]


@cache
def crd_validator(relpath: str, version: str | None = None):
    """A validator of the CRD's schema, made once. Unlike ``jsonschema.validate`` it does not check
    the schema itself against the metaschema on every call (seconds for the Workload CRD): the API
    server accepted these CRDs, and the tests check each schema once."""
    schema = crd_schema(relpath, version)
    return jsonschema.validators.validator_for(schema)(schema)


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

def _not_found(what: str) -> ApiException:
    """The API server's 404 for a named object that does not exist: a Status naming it."""
    exc = ApiException(status=404, reason="Not Found")
    exc.body = json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                           "message": f'"{what}" not found', "reason": "NotFound", "details": {"name": what},
                           "code": 404})
    return exc


class _Fake:
    """A fake client: every public method call goes through :meth:`SimCluster.answer` first."""

    def __init__(self, sim: SimCluster) -> None:
        self.sim = sim

    def __getattribute__(self, name: str):
        attr = object.__getattribute__(self, name)
        if name.startswith("_") or not inspect.ismethod(attr):
            return attr
        sim = object.__getattribute__(self, "sim")

        def call(*args, **kwargs):
            if sim._serving:  # a fake calling another (patch_node answers with read_node): one request
                return attr(*args, **kwargs)
            sim.answer(name, kwargs)
            sim._serving = True
            try:
                return attr(*args, **kwargs)
            finally:
                sim._serving = False

        return call


VCJOBS = ("batch.volcano.sh", "v1alpha1", "jobs")
COMMANDS = ("bus.volcano.sh", "v1alpha1", "commands")  # run at once, as Volcano's job controller does
WORKLOADS = ("kueue.x-k8s.io", "v1beta2", "workloads")  # patched only to (de)activate
KSERVE_GROUP = "serving.kserve.io"  # InferenceServices, served once a KServe controller is attached
KNATIVE_GROUP = "serving.knative.dev"  # served with a KServe controller in Serverless mode
# (group, version, plural) -> the simulator's store, whether namespaced, the kind, its CRD (file, version).
_RESOURCES = {
    VCJOBS: ("vcjobs", True, "Job", ("volcano/batch.volcano.sh_jobs.yaml", None)),
    ("scheduling.volcano.sh", "v1beta1", "queues"):
        ("volcano_queues", False, "Queue", ("volcano/scheduling.volcano.sh_queues.yaml", None)),
    ("scheduling.volcano.sh", "v1beta1", "podgroups"):
        ("podgroups", True, "PodGroup", ("volcano/scheduling.volcano.sh_podgroups.yaml", None)),
    # Only the storage version is simulated (a real server also converts to and from v1beta1).
    ("kueue.x-k8s.io", "v1beta2", "clusterqueues"):
        ("cluster_queues", False, "ClusterQueue", ("kueue/kueue.x-k8s.io_clusterqueues.yaml", "v1beta2")),
    ("kueue.x-k8s.io", "v1beta2", "localqueues"):
        ("local_queues", True, "LocalQueue", ("kueue/kueue.x-k8s.io_localqueues.yaml", "v1beta2")),
    ("kueue.x-k8s.io", "v1beta2", "workloads"):
        ("workloads", True, "Workload", ("kueue/kueue.x-k8s.io_workloads.yaml", "v1beta2")),
}


class FakeCustomObjectsApi(_Fake):
    """The CustomObjectsApi methods the backend calls: Volcano Jobs (create, read, list, patch,
    delete) and the schedulers' queue objects (read and list)."""

    def _resource(self, group: str, version: str, plural: str, namespaced: bool | None = None):
        found = _RESOURCES.get((group, version, plural))
        if found is None or (namespaced is not None and found[1] != namespaced):
            # A namespaced path to a cluster-scoped resource (or the reverse) is no resource either.
            # An API group or resource the server does not serve: not even a Status, as the API server answers.
            exc = ApiException(status=404, reason="Not Found")
            exc.body = "404 page not found\n"
            raise exc
        return found

    def _kserve(self, group: str):
        """The simulated KServe controller (:func:`tests.support.k8s_sim_kserve.attach`) for its API group."""
        return getattr(self.sim, "kserve", None) if group == KSERVE_GROUP else None

    def _check(self, group: str, version: str, plural: str) -> None:
        if (group, version, plural) != VCJOBS:
            raise NotImplementedError(f"only Volcano Jobs are written through the simulator, not {plural}")

    def _out(self, resource: tuple, obj: dict) -> dict:
        out = copy.deepcopy(obj)
        if resource[0] != "vcjobs":  # what a controller wrote must be what the CRD allows
            crd_validator(*resource[3]).validate(out)
        return out

    def _list(self, group, version, plural, resource, items) -> dict:
        return {"apiVersion": f"{group}/{version}", "kind": f"{resource[2]}List", "metadata": {},
                "items": [self._out(resource, obj) for obj in items]}

    def create_namespaced_custom_object(self, group, version, namespace, plural, body, **kwargs):
        if (kserve := self._kserve(group)) is not None:
            return kserve.create(namespace, body)
        if (group, version, plural) == COMMANDS:
            from tests.support import k8s_sim_moves as moves  # it imports this module's fakes' neighbours

            return moves.run_command(self.sim, namespace, copy.deepcopy(body))
        self._check(group, version, plural)
        self.sim.calls.append(f"create vcjob {body['metadata']['name']}")
        crd_validator("volcano/batch.volcano.sh_jobs.yaml").validate(body)  # the API server's check
        key = (namespace, body["metadata"]["name"])
        if key in self.sim.vcjobs:
            raise ApiException(status=409, reason="AlreadyExists")
        stored = copy.deepcopy(body)
        stored["metadata"].update(namespace=namespace, uid=self.sim.new_uid(), creationTimestamp=self.sim.stamp())
        stored["status"] = {"state": {"phase": "Pending"}, "retryCount": 0}
        self.sim.vcjobs[key] = stored
        group_obj = queues.new_podgroup(stored, stored["metadata"]["creationTimestamp"])  # Volcano's job controller
        self.sim.podgroups[(namespace, group_obj["metadata"]["name"])] = group_obj
        self.sim.sync_queues()
        return copy.deepcopy(stored)

    def get_namespaced_custom_object(self, group, version, namespace, plural, name, **kwargs):
        if (kserve := self._kserve(group)) is not None:
            return kserve.get(namespace, name)
        resource = self._resource(group, version, plural, namespaced=True)
        if resource[0] == "vcjobs" and self.sim.on_read:
            self.sim.on_read()
        store = getattr(self.sim, resource[0])
        if (namespace, name) not in store:
            raise _not_found(name)
        return self._out(resource, store[(namespace, name)])

    def get_cluster_custom_object(self, group, version, plural, name, **kwargs):
        resource = self._resource(group, version, plural, namespaced=False)
        store = getattr(self.sim, resource[0])
        if name not in store:
            raise _not_found(name)
        return self._out(resource, store[name])

    def list_namespaced_custom_object(self, group, version, namespace, plural, label_selector=None, **kwargs):
        if (kserve := self._kserve(group)) is not None:
            return kserve.list(namespace, label_selector)
        if group == KNATIVE_GROUP and getattr(self.sim, "kserve", None) is not None and self.sim.kserve.knative:
            # KServe in Serverless mode runs over Knative Serving, whose API the server then serves; its
            # Services (one per revision's configuration) are not simulated, so none is listed.
            return {"apiVersion": f"{group}/{version}", "kind": "ServiceList", "metadata": {}, "items": []}
        resource = self._resource(group, version, plural, namespaced=True)
        items = [obj for (ns, _), obj in sorted(getattr(self.sim, resource[0]).items())
                 if ns == namespace and _label_match(obj["metadata"].get("labels") or {}, label_selector)]
        return self._list(group, version, plural, resource, items)

    def list_cluster_custom_object(self, group, version, plural, label_selector=None, **kwargs):
        """Every object of a cluster-scoped resource, or of a namespaced one in every namespace."""
        resource = self._resource(group, version, plural)
        items = [obj for _, obj in sorted(getattr(self.sim, resource[0]).items())
                 if _label_match(obj["metadata"].get("labels") or {}, label_selector)]
        return self._list(group, version, plural, resource, items)

    def patch_namespaced_custom_object(self, group, version, namespace, plural, name, body, **kwargs):
        if (kserve := self._kserve(group)) is not None:
            _check_patch(body, kwargs.get("_content_type") or "application/merge-patch+json")
            return kserve.patch(namespace, name, body)
        if (group, version, plural) == WORKLOADS:
            _check_patch(body, kwargs.get("_content_type") or "application/merge-patch+json")
            from tests.support import k8s_sim_moves as moves

            return self._out(self._resource(group, version, plural), moves.patch_workload(self.sim, namespace, name, body))
        self._check(group, version, plural)
        # CustomObjectsApi sends a merge patch unless told otherwise.
        _check_patch(body, kwargs.get("_content_type") or "application/merge-patch+json")
        if (namespace, name) not in self.sim.vcjobs:
            raise _not_found(name)
        self.sim.calls.append(f"patch vcjob {name}")
        patched = _merge_patch(copy.deepcopy(self.sim.vcjobs[(namespace, name)]), body)
        crd_validator("volcano/batch.volcano.sh_jobs.yaml").validate(
            {k: v for k, v in patched.items() if k != "status" and not k.startswith("_")})
        self.sim.vcjobs[(namespace, name)] = patched
        return copy.deepcopy(patched)

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, **kwargs):
        if (kserve := self._kserve(group)) is not None:
            return kserve.delete(namespace, name)
        self._check(group, version, plural)
        self.sim.calls.append(f"delete vcjob {name}")
        gone = self.sim.vcjobs.pop((namespace, name), None)
        if gone is None:
            raise _not_found(name)
        self.sim.deleted[("vcjob", namespace, name)] = gone
        self.sim.delete_owned(("vcjob", namespace, name))  # garbage collection of owned pods and PodGroup
        return {"status": "Success"}


class FakeBatchV1Api(_Fake):
    def __init__(self, sim: SimCluster) -> None:
        super().__init__(sim)
        self.api_client = _api_client()

    def create_namespaced_job(self, namespace, body, **kwargs):
        self.sim.calls.append(f"create job {body['metadata']['name']}")
        key = (namespace, body["metadata"]["name"])
        if key in self.sim.jobs:
            raise ApiException(status=409, reason="AlreadyExists")
        stored = copy.deepcopy(body)
        stored["metadata"].update(namespace=namespace, uid=self.sim.new_uid(), creationTimestamp=self.sim.stamp())
        stored["status"] = {}
        self.sim.jobs[key] = stored
        if queues.KUEUE_QUEUE_LABEL in (stored["metadata"].get("labels") or {}):  # Kueue's job reconciler
            wl = queues.new_workload(stored, stored["metadata"]["creationTimestamp"],
                                     {n: int(pc["value"]) for n, pc in self.sim.priority_classes.items()})
            self.sim.workloads[(namespace, wl["metadata"]["name"])] = wl
            self.sim.sync_queues()
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
        else:
            self.sim.delete_scheduling(("job", namespace, name))
        return to_model({"status": "Success"}, "V1Status")


def _pod_object(pod: dict) -> dict:
    """A pod as the API server shows it: the job controllers' index annotations, the DisruptionTarget
    condition of an evicted pod, and the exit code of a container that ended."""
    if pod["owner"][0] == "vcjob":
        annotations = {"volcano.sh/task-index": pod["name"].rsplit("-", 1)[1]}
    else:
        annotations = {"batch.kubernetes.io/job-completion-index": str(pod["index"])}
    container = pod["template"]["spec"]["containers"][0]["name"]
    status: dict = {"phase": pod["phase"], "reason": pod["reason"]}
    if pod["disrupted"]:
        status["conditions"] = [{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]
    code = 0 if pod["phase"] == "Succeeded" else pod.get("exit_code")
    if pod["phase"] in ("Succeeded", "Failed") and code is not None:
        state = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}}
        status["containerStatuses"] = [{"name": container, "image": "x", "imageID": "", "ready": False,
                                        "restartCount": 0, "state": state}]
    return {"metadata": {"name": pod["name"], "namespace": pod["namespace"], "labels": pod["labels"],
                         "annotations": annotations},
            "spec": {"nodeName": pod["node"], "containers": pod["template"]["spec"]["containers"]},
            "status": status}


class FakeCoreV1Api(_Fake):
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
            items.append(_pod_object(pod))
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

    def read_namespaced_persistent_volume_claim(self, name, namespace, **kwargs):
        """A claim the cluster's admins made: every one asked for, bound, unless the test lists the
        claims that exist (``sim.claims``)."""
        if self.sim.claims is not None and (namespace, name) not in self.sim.claims:
            raise _not_found(name)
        return to_model({"metadata": {"name": name, "namespace": namespace}, "status": {"phase": "Bound"}},
                        "V1PersistentVolumeClaim")

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
