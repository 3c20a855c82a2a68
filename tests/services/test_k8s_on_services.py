"""A training run on a Kubernetes cluster through real Airflow 3 services: the scheduler runs the
pipeline, the train task submits its gang through the real ``KubernetesHook`` (a kubeconfig
Connection) to the cluster simulator served over HTTP (:mod:`tests.support.k8s_http`), and the real
triggerer process waits for it. Driven through the REST API only, as a user would:

- the API server answering 503 for 20 s while the task is deferred does not fail it: the triggerer
  rides the outage out and the gang, still training on its nodes, finishes the task;
- marking the deferred task failed deletes the gang job and its pods within 10 s (``on_kill`` in the
  triggerer).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import yaml
from tests.services.airflow_stack import AirflowStack, config_copy, services_available, wait_for
from tests.support.k8s_config import as_kubernetes
from tests.support.k8s_http import SimApiServer
from tests.support.k8s_kubelet import Kubelet
from tests.support.k8s_sim import SimCluster

_MISSING = services_available()
pytestmark = [pytest.mark.services, pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))]
DAG, CLUSTER, CONN = "hybrid_training", "k8s-dc2", "k8s_dc2"
PARAMS = {"cluster_preference": "private", "workers": 2, "hyperparameters": {"steps": 60},
          "checkpoint_every_steps": 20, "deploy": False}


def _estate(root: Path) -> Path:
    """The shipped config plus k8s-dc2: a private Kueue cluster cheaper than onprem-a, so placement
    picks it for a private run; the wait polls every half second."""
    config = config_copy(root)
    clusters = yaml.safe_load((config / "clusters.yaml").read_text())
    dc2 = json.loads(json.dumps(clusters["clusters"]["onprem-a"]))
    dc2["prices"]["onprem"] = 0.80
    dc2["node_pools"][0]["node_labels"] = {"hybridflow.io/pool": "a100"}
    as_kubernetes(dc2, conn_id=CONN, scheduler="kueue", scratch_dir=str(root / "scratch-volume"))
    clusters["clusters"][CLUSTER] = dc2
    (config / "clusters.yaml").write_text(yaml.safe_dump(clusters, sort_keys=False))
    pipeline = yaml.safe_load((config / "pipeline.yaml").read_text())
    pipeline["training"].update(kubernetes_deferrable=True, kubernetes_poll_s=0.5, preemption_grace_s=10)
    (config / "pipeline.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    return config


class _Nodes:
    """The cluster's control plane and nodes, in the test process: the simulator steps and the
    kubelet runs Running pods as worker processes, whether or not its API server answers."""

    def __init__(self, server: SimApiServer, kubelet: Kubelet) -> None:
        self.server, self.kubelet = server, kubelet
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sim-nodes", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            with self.server.lock:
                self.kubelet.step()

    def __enter__(self) -> _Nodes:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.kubelet.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("k8s-services")
    sim = SimCluster({f"gpu-{i}": {"gpus": 2, "labels": {"hybridflow.io/pool": "a100"}} for i in (1, 2)})
    sim.add_kueue_queues("teams", 4, ["hybridflow/perception", "hybridflow/search"])
    (root / "pods").mkdir()
    config = _estate(root)
    with pytest.MonkeyPatch.context() as mp, SimApiServer(sim) as server:
        # The pods' processes see the estate as the stack's processes do.
        mp.setenv("HYBRIDFLOW_HOME", str(root / "hf-home"))
        mp.setenv("HYBRIDFLOW_CONFIG_DIR", str(config))
        env = {f"AIRFLOW_CONN_{CONN.upper()}": server.connection()}
        with _Nodes(server, Kubelet(sim, root / "pods", wait_for_stops=False)), AirflowStack(root, config_dir=config, env=env) as stack:
            print(f"\nservice logs: {stack.logs}")
            stack.wait_for_dag(DAG)
            stack.unpause(DAG)
            yield stack, sim, server
    shutil.rmtree(root / "scratch-volume", ignore_errors=True)


def _reads(sim: SimCluster, server: SimApiServer) -> int:
    with server.lock:
        return sum(method == "read_namespaced_job" for method, _ in sim.requests)


def _deferred_train(stack: AirflowStack, run_id: str, sim: SimCluster, server: SimApiServer) -> None:
    """Wait until the train task is deferred and the triggerer has started waiting for its gang (it
    reads the job): a trigger the triggerer has not picked up yet has no wait to cancel."""
    wait_for("the train task to defer", lambda: stack.task_states(DAG, run_id).get("train") == "deferred", 300,
             diagnose=lambda: f"tasks: {stack.task_states(DAG, run_id)}\n{stack.tail_logs('scheduler', 'triggerer')}")
    before = _reads(sim, server)
    wait_for("the triggerer to read the gang", lambda: _reads(sim, server) > before + 1, 120, interval=0.2,
             diagnose=lambda: stack.tail_logs("triggerer"))


def _gang_jobs(sim: SimCluster, server: SimApiServer) -> list[str]:
    with server.lock:
        return [name for (_, name) in sim.jobs]


def test_marking_the_deferred_train_task_failed_deletes_its_gang_within_10_s(cluster) -> None:
    stack, sim, server = cluster
    run_id = stack.trigger(DAG, {**PARAMS, "hyperparameters": {"steps": 100000}})
    _deferred_train(stack, run_id, sim, server)
    [job] = _gang_jobs(sim, server)
    with server.lock:  # the gang names the task it works for, as the reaper reads it
        annotations = sim.jobs[("hybridflow", job)]["metadata"]["annotations"]
    assert annotations["hybridflow.io/dag-id"] == DAG and annotations["hybridflow.io/run-id"] == run_id
    assert annotations["hybridflow.io/task-id"] == "train" and annotations["hybridflow.io/try-number"] == "1"
    stack.api("PATCH", f"/dags/{DAG}/dagRuns/{run_id}/taskInstances/train", json={"new_state": "failed"})
    marked = time.monotonic()
    def gone() -> bool:  # the job, its pods and its credentials Secret (deleted one after the other)
        if _gang_jobs(sim, server):
            return False
        with server.lock:
            return not sim.pod_names(job) and not sim.secrets

    wait_for(f"gang {job} with its pods and Secret to be deleted", gone, 10, interval=0.2,
             diagnose=lambda: stack.task_log(DAG, run_id, "train")[-6000:] + stack.tail_logs("triggerer"))
    print(f"gang deleted {time.monotonic() - marked:.1f} s after the task was marked failed")
    assert stack.wait_for_run(DAG, run_id) == "failed"


def test_a_20_s_api_outage_during_the_wait_does_not_fail_the_train_task(cluster) -> None:
    stack, sim, server = cluster
    run_id = stack.trigger(DAG, PARAMS)
    _deferred_train(stack, run_id, sim, server)
    with server.lock:
        sim.outage(20, status=503)
    wait_for("the train task to finish", lambda: stack.task_states(DAG, run_id).get("train") in ("success", "failed"),
             300, interval=1, diagnose=lambda: stack.tail_logs("triggerer", "scheduler"))
    states = stack.task_states(DAG, run_id)
    log = stack.task_log(DAG, run_id, "train") + (stack.logs / "triggerer.log").read_text(errors="replace")
    assert states["train"] == "success", f"{states}\n{log[-4000:]}"
    assert "not answering" in log and "503" in log  # the outage was seen, and ridden out
    ti = stack.api("GET", f"/dags/{DAG}/dagRuns/{run_id}/taskInstances/train")
    assert ti["try_number"] == 1  # no Airflow retry was spent
