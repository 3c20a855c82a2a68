"""A Kubernetes DR cluster for drill tests: ``dr-west`` as a Volcano cluster behind Connection
``k8s_dr_west``, simulated (:mod:`tests.support.k8s_sim`) with a kubelet that runs its gang pods as
local processes (:mod:`tests.support.k8s_kubelet`).

A drill polls its gang job from a thread of the task while the test (and the drill's main thread)
call the same API, so every call to the simulator is made under one lock; each read of a job lets
the kubelet move the pods on first (``sim.on_read``), as in the train task's tests.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from tests.support.k8s_config import kubeconfig, kubernetes_connection
from tests.support.k8s_kubelet import Kubelet
from tests.support.k8s_sim import SimCluster, install_clusters
from tests.support.k8s_sim_kserve import attach

CONN_ID = "k8s_dr_west"
POOL = {"name": "a100", "gpu_model": "A100-80GB", "gpu_memory_gib": 80, "gpus": 2,
        "node_labels": {"hybridflow.io/pool": "a100"}}
# clusters.yaml keys that turn the drill tests' dr-west into a kubernetes cluster its pods can train on.
KUBERNETES_DR = {"backend": "kubernetes", "conn_id": CONN_ID, "scheduler": "volcano",
                 "image": "registry.local/hybridflow-train:1", "checkpoint_store": "cache",
                 "checkpoint_replica": "scratch", "scratch_claim": "dr-scratch", "scratch_dir": "/scratch",
                 "node_pools": [POOL]}


class _Serialised:
    """A fake API client whose every call holds the simulator's lock (re-entrant: the kubelet
    stepped inside a read calls the simulator too)."""

    def __init__(self, api, lock: threading.RLock) -> None:
        self._api, self._lock = api, lock

    def __getattr__(self, name: str):
        attr = getattr(self._api, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            with self._lock:
                return attr(*args, **kwargs)

        return call


@contextmanager
def dr_simulator(monkeypatch, log_dir: Path, *, queues: tuple[str, ...] = ("perception",),
                 kserve_models: Path | None = None) -> Iterator[SimpleNamespace]:
    """The DR cluster's simulator (2 nodes of 2 A100 in pool a100, Volcano ``queues``; KServe with
    in-process predictors serving from ``kserve_models`` when given) installed for Connection
    ``k8s_dr_west``; yields (sim, kubelet, lock, step); every pod process and predictor is stopped
    on leaving."""
    sim = SimCluster({f"dr-gpu-{i}": {"gpus": 2, "labels": {"hybridflow.io/pool": "a100"}} for i in (1, 2)})
    for queue in queues:
        sim.add_volcano_queue(queue)
    kserve = attach(sim, kserve_models, log_dir / "revisions", processes=False) if kserve_models else None
    lock = threading.RLock()
    kubelet = Kubelet(sim, log_dir, wait_for_stops=False)
    sim.on_read = kubelet.step
    install_clusters(monkeypatch, {CONN_ID: SimpleNamespace(
        core=_Serialised(sim.core, lock), batch=_Serialised(sim.batch, lock), custom=_Serialised(sim.custom, lock))})
    # The readiness check looks the Connection up; the hook's clients are the simulator's.
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}",
                       kubernetes_connection(kubeconfig("https://dr-west.invalid:6443", "unused")))

    def step() -> None:
        with lock:
            kubelet.step()

    try:
        yield SimpleNamespace(sim=sim, kubelet=kubelet, lock=lock, step=step, kserve=kserve)
    finally:
        with lock:
            kubelet.stop()
        if kserve is not None:
            kserve.close()


SERVING_NS = "dr-serving"
INFERENCE_POOL = {"name": "l4", "gpu_model": "L4", "gpu_memory_gib": 24, "gpus": 2,
                  "node_labels": {"hybridflow.io/pool": "inference"}}


def serve_on_kubernetes(config: Path, base: Path) -> Path:
    """A copy of ``config`` whose models serve on KServe: the inference pool on ``dc-k8s`` (a second
    private kubernetes cluster) and dr-west's own inference pool (``dr.serving`` on its l4 pool,
    models volume ``<base>/dr-models``)."""
    import copy
    import shutil

    import yaml
    from tests.support.deploy_settings import quick_serving
    from tests.support.k8s_config import as_kubernetes

    target = base / "config-kserve"
    shutil.copytree(config, target)
    doc = yaml.safe_load((target / "clusters.yaml").read_text())
    pool_host = as_kubernetes(copy.deepcopy(doc["clusters"]["onprem-a"]), conn_id="k8s_dc", scheduler="volcano")
    pool_host["node_pools"].append(dict(INFERENCE_POOL))
    dr = doc["clusters"]["dr-west"]
    dr["node_pools"] = [*dr["node_pools"], dict(INFERENCE_POOL)]
    dr["dr"]["serving"] = {"node_pool": "l4", "namespace": SERVING_NS, "models_claim": "dr-models",
                           "models_dir": str(base / "dr-models"), "replicas": 1, "ready_timeout_s": 20}
    doc["clusters"]["dc-k8s"] = pool_host
    (target / "clusters.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    pipeline = quick_serving(yaml.safe_load((target / "pipeline.yaml").read_text()))
    pipeline["serving"]["kubernetes"] = {
        "cluster": "dc-k8s", "node_pool": "l4", "namespace": "serving", "image": "registry.local/hybridflow-serve:1",
        "models_claim": "models", "models_dir": str(base / "models"), "replicas": 1, "gpus_per_replica": 1,
        "ready_timeout_s": 20, "kind": "kserve"}
    (target / "pipeline.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    return target
