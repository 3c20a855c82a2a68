"""The ``k8s_real`` tier: the product against a real control plane (kube-apiserver, the Job and
garbage-collection controllers, kube-scheduler, Kueue, Volcano; kwok nodes), built from Go modules
by :mod:`hybridflow.devenv.k8s.build` and started once per session on 127.0.0.1.

KServe's controller runs too (Standard, i.e. raw Deployment, mode: the plane has no Knative).

The product reaches it as a user's would: an Airflow Connection (``AIRFLOW_CONN_K8S_REAL``) holding
the kubeconfig, through the provider's KubernetesHook. Each test gets a namespace of its own and
cluster-scoped objects (queues, flavours) named after it, so tests never see each other's gangs.

Nodes: ``h100-0`` and ``h100-1`` (4 GPUs each, pool ``h100``) are kwok's: their pods run as far as
Running and no further, which is what admission, quota and scheduling tests need. ``run-0`` (8 GPUs,
pool ``run``) is the node agent's: its pods' containers run as processes of this machine, for the
tests that need a gang's code to really run (exit codes, SIGTERM, resume).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time

import pytest
import yaml

from hybridflow.devenv.k8s.nodes import FakeNode, pool_nodes

CONN_ID = "k8s_real"
AGENT_NODE = "run-0"


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if "/k8s_real/" in str(item.fspath):
            item.add_marker(pytest.mark.k8s_real)


@pytest.fixture(scope="session")
def plane(tmp_path_factory):
    """The session's control plane: started here (binaries built if missing), stopped at the end.
    ``HYBRIDFLOW_K8S_DIR`` names a running one (``hybridflow dev k8s up``) to reuse instead."""
    from hybridflow.devenv.k8s.build import BuildError, binaries, check_go
    from hybridflow.devenv.k8s.controlplane import ControlPlane
    from hybridflow.devenv.k8s.processes import free_port

    if not all(path.is_file() for path in binaries().values()):
        try:
            check_go()  # the binaries are built from Go modules: without Go the tier cannot run (a failure in CI)
        except BuildError as exc:
            pytest.skip(f"the k8s_real tier needs its control-plane binaries: {exc}")

    nodes = [*pool_nodes("k8s-real", [{"name": "h100", "gpus": 8, "node_labels": {"hybridflow.io/pool": "h100"}}],
                         gpus_per_node=4),
             FakeNode(AGENT_NODE, 8, {"hybridflow.io/pool": "run"}, kwok=False)]
    reuse = os.environ.get("HYBRIDFLOW_K8S_DIR")
    plane = ControlPlane(reuse or tmp_path_factory.mktemp("k8s"), port=free_port(),
                         addons=("kueue", "volcano", "kserve"), log=lambda m: print(f"[k8s] {m}", flush=True))
    plane.up(nodes)
    try:
        yield plane
    finally:
        if not reuse:
            plane.down()


@pytest.fixture(scope="session")
def agent(plane, tmp_path_factory):
    from hybridflow.devenv.k8s.agent import NodeAgent

    node_agent = NodeAgent(plane.kubeconfig, AGENT_NODE, tmp_path_factory.mktemp("agent")).start()
    deadline = time.monotonic() + 30
    while not _node_ready(plane, AGENT_NODE):
        assert time.monotonic() < deadline, f"the node agent did not make {AGENT_NODE} Ready: {node_agent.errors}"
        time.sleep(0.2)
    yield node_agent
    node_agent.stop()


def _node_ready(plane, name: str) -> bool:
    from kubernetes import client

    with plane.api() as api:
        node = client.CoreV1Api(api).read_node(name)
    return any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))


class Real:
    """One test's corner of the plane: its namespace, the Connection, and cluster-scoped objects."""

    def __init__(self, plane, name: str) -> None:
        self.plane, self.ns, self.prefix = plane, name, name
        self.cluster_scoped: list[tuple[str, str, str, str]] = []  # (group, version, plural, name)
        self.api = plane.api()

    def core(self):
        from kubernetes import client

        return client.CoreV1Api(self.api)

    def batch(self):
        from kubernetes import client

        return client.BatchV1Api(self.api)

    def custom(self):
        from kubernetes import client

        return client.CustomObjectsApi(self.api)

    def create_cluster_object(self, group: str, version: str, plural: str, body: dict) -> None:
        self.custom().create_cluster_custom_object(group, version, plural, body)
        self.cluster_scoped.append((group, version, plural, body["metadata"]["name"]))

    def kueue_queues(self, teams: dict[str, int], *, flavor: str = "gpu", preemption: str = "Never",
                     cohort: str | None = None) -> None:
        """A ResourceFlavor, one ClusterQueue per team with ``teams[team]`` GPUs nominal quota and a
        LocalQueue named after the team in this namespace (what a cluster's admins create)."""
        flavor = f"{self.prefix}-{flavor}"
        self.create_cluster_object("kueue.x-k8s.io", "v1beta2", "resourceflavors",
                                   {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
                                    "metadata": {"name": flavor}})
        for team, gpus in teams.items():
            cq = f"{self.prefix}-{team}"
            spec = {"namespaceSelector": {}, "queueingStrategy": "BestEffortFIFO",
                    "preemption": {"withinClusterQueue": preemption},
                    "resourceGroups": [{"coveredResources": ["cpu", "memory", "nvidia.com/gpu"], "flavors": [
                        {"name": flavor, "resources": [{"name": "cpu", "nominalQuota": 1000},
                                                       {"name": "memory", "nominalQuota": "10Ti"},
                                                       {"name": "nvidia.com/gpu", "nominalQuota": gpus}]}]}]}
            if cohort:
                spec["cohortName"] = cohort
            self.create_cluster_object("kueue.x-k8s.io", "v1beta2", "clusterqueues",
                                       {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
                                        "metadata": {"name": cq}, "spec": spec})
            self.custom().create_namespaced_custom_object(
                "kueue.x-k8s.io", "v1beta2", self.ns, "localqueues",
                {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
                 "metadata": {"name": team, "namespace": self.ns}, "spec": {"clusterQueue": cq}})

    def volcano_queue(self, name: str, *, gpus: int | None = None) -> None:
        spec = {"weight": 1, "reclaimable": True}
        if gpus is not None:
            spec["capability"] = {"nvidia.com/gpu": gpus}
        self.create_cluster_object("scheduling.volcano.sh", "v1beta1", "queues",
                                   {"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "Queue",
                                    "metadata": {"name": name}, "spec": spec})

    def pods(self, gang: str) -> list:
        return self.core().list_namespaced_pod(self.ns, label_selector=f"hybridflow.io/gang={gang}").items

    def cleanup(self) -> None:
        from kubernetes.client.exceptions import ApiException

        core = self.core()
        try:
            core.delete_namespace(self.ns, propagation_policy="Background")
        except ApiException as exc:
            if exc.status != 404:
                raise
        for group, version, plural, name in reversed(self.cluster_scoped):
            try:
                self.custom().delete_cluster_custom_object(group, version, plural, name)
            except ApiException as exc:
                if exc.status != 404:
                    raise
        self.api.close()


@pytest.fixture
def real(plane, request, monkeypatch):
    """This test's namespace (created), the Connection ``k8s_real`` to the plane, the priority classes."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    from hybridflow.backends.k8s.manifests import priority_classes

    # Unique per run too: Kueue keeps counting a ClusterQueue recreated under the name of one still
    # being deleted as empty, so a plane reused across runs must never see a name twice.
    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:6]
    name = f"t-{digest}-{secrets.token_hex(2)}"
    kube_config = yaml.safe_load(plane.kubeconfig.read_text())
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}",
                       json.dumps({"conn_type": "kubernetes", "extra": {"kube_config": kube_config}}))
    with plane.api() as api:
        core = client.CoreV1Api(api)
        core.create_namespace({"metadata": {"name": name}})
        sched = client.SchedulingV1Api(api)
        for body in priority_classes():
            try:
                sched.create_priority_class(body)
            except ApiException as exc:
                if exc.status != 409:
                    raise
        deadline = time.monotonic() + 30  # pods need the namespace's default ServiceAccount
        while not core.list_namespaced_service_account(name, field_selector="metadata.name=default").items:
            assert time.monotonic() < deadline, "the controller manager made no default ServiceAccount"
            time.sleep(0.1)
    corner = Real(plane, name)
    yield corner
    corner.cleanup()


def real_cluster(scheduler: str, namespace: str, *, pool: str = "h100", gpus: int = 8):
    """A kubernetes cluster of clusters.yaml pointing at the plane through Connection ``k8s_real``."""
    from hybridflow.config import Cluster

    cluster = Cluster.model_validate({
        "location": "private", "region": "dc-2", "backend": "kubernetes", "conn_id": CONN_ID,
        "scheduler": scheduler, "namespace": namespace,
        "node_pools": [{"name": pool, "gpu_model": "H100-80GB", "gpu_memory_gib": 80, "gpus": gpus,
                        "node_labels": {"hybridflow.io/pool": pool}}],
        "prices": {"onprem": 1.1},
    })
    cluster._name = "k8s-real"
    return cluster


def until(condition, seconds: float = 60, what: str = "the cluster to get there", poll_s: float = 0.2):
    """Poll ``condition`` until it returns something truthy (returned), failing after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        got = condition()
        if got:
            return got
        assert time.monotonic() < deadline, f"waited {seconds:.0f} s for {what}"
        time.sleep(poll_s)
