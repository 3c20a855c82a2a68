"""The HTTP front of the cluster simulator (:mod:`tests.support.k8s_http`) as its users rely on it: one
server per Connection, each hook reaching its own cluster; another process reaching the same
simulator through the kubeconfig; requests the simulator has no answer for reported, not hidden."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
from kubernetes.client.exceptions import ApiException
from tests.support.k8s_http import SimApiServer, serve, serve_clusters
from tests.support.k8s_sim import SimCluster

from hybridflow.backends.k8s.backend import KubernetesGangBackend
from hybridflow.backends.local import GangJob

# Another process, by the kubeconfig file alone (the standard library keeps it quick to start).
CHILD = """
import json, sys, urllib.request
kubeconfig = json.load(open(sys.argv[1]))
server, token = kubeconfig["clusters"][0]["cluster"]["server"], kubeconfig["users"][0]["user"]["token"]
def get(path):
    request = urllib.request.Request(server + path, headers={"Authorization": "Bearer " + token})
    return json.load(urllib.request.urlopen(request, timeout=10))
node = get("/api/v1/nodes/h100-1")
jobs = get("/apis/batch.volcano.sh/v1alpha1/namespaces/hybridflow/jobs?labelSelector=hybridflow.io%2Fgang%3Dtrain-r1-0123456789")
print(json.dumps({"gpus": node["status"]["capacity"]["nvidia.com/gpu"], "jobs": [j["metadata"]["name"] for j in jobs["items"]]}))
"""


def _sim(gpus: int) -> SimCluster:
    return SimCluster({"h100-1": {"gpus": gpus, "labels": {"hybridflow.io/pool": "h100"}}})


def test_each_connection_reaches_its_own_cluster(monkeypatch):
    with serve_clusters(monkeypatch, {"k8s_dc2": _sim(8), "k8s_dc3": _sim(4)}) as servers:
        assert servers["k8s_dc2"].port != servers["k8s_dc3"].port
        for conn_id, gpus in (("k8s_dc2", "8"), ("k8s_dc3", "4")):
            node = KubernetesHook(conn_id=conn_id).core_v1_client.read_node("h100-1", _request_timeout=5)
            assert node.status.capacity == {"nvidia.com/gpu": gpus}


def test_another_process_reaches_the_same_simulator_through_the_kubeconfig(monkeypatch, tmp_path):
    from tests.support.k8s_config import private_h100_cluster

    sim = _sim(8)
    with serve(monkeypatch, sim) as server:
        backend = KubernetesGangBackend(private_h100_cluster("volcano"), image="registry.local/train:1")
        job = GangJob(name="train-r1-0123456789", workers=2, spec={"run_key": "r1"}, labels={"team": "vision"})
        backend.submit_spec(backend.gang_spec(job, pool="h100", queue="vision"))
        path = server.write_kubeconfig(tmp_path / "kubeconfig")
        child = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=60,
                               check=False)
    assert child.returncode == 0, child.stderr[-2000:]
    assert json.loads(child.stdout.splitlines()[-1]) == {"gpus": "8", "jobs": ["train-r1-0123456789"]}
    assert ("read_node", None) in sim.requests  # the child's request, answered by this process's simulator


def test_a_request_the_simulator_cannot_answer_is_a_404_and_fails_the_block(monkeypatch):
    with pytest.raises(AssertionError, match=r"GET /api/v1/namespaces/hybridflow \(FakeCoreV1Api\.read_namespace\)"):
        with serve(monkeypatch, _sim(8)) as server:
            with pytest.raises(ApiException) as err:
                KubernetesHook(conn_id="k8s_dc2").core_v1_client.read_namespace("hybridflow", _request_timeout=5)
            assert err.value.status == 404 and "not simulated" in err.value.body
            assert isinstance(server, SimApiServer) and server.unserved
