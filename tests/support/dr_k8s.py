"""An estate whose serving fails over between two Kubernetes clusters, for tests.

``dc-k8s`` (Connection ``k8s_private``) is the private primary and hosts the inference pool
(``serving.kubernetes``, kind ``kserve`` unless asked otherwise, namespace ``serving``); ``dr-k8s``
(Connection ``k8s_dr``, ``role: dr``) has ``dr.serving`` in namespace ``dr-serving``. Each cluster is a
:class:`~tests.support.k8s_sim.SimCluster` with KServe attached, its models volume a folder of its own.
The DR store is a local object store holding the replicas :func:`replicate` puts there.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml
from tests.support.deploy_settings import quick_serving
from tests.support.k8s_config import as_kubernetes
from tests.support.k8s_sim import SimCluster, install_clusters
from tests.support.k8s_sim_kserve import attach

from hybridflow.settings import REPO_ROOT

PRIMARY, DR = "dc-k8s", "dr-k8s"
PRIMARY_NS, DR_NS = "serving", "dr-serving"
IMAGE = "registry.local/hybridflow-serve:1"
L4 = {"name": "l4", "gpu_model": "L4", "gpu_memory_gib": 24, "gpus": 8,
      "node_labels": {"hybridflow.io/pool": "inference"}}


def write_config(base: Path, *, kind: str = "kserve", dr_serving: bool = True, dr_backend: str = "kubernetes") -> Path:
    """The shipped config with the two clusters and the pool on ``dc-k8s``; quick gate."""
    config = base / "config"
    shutil.copytree(REPO_ROOT / "config", config)
    doc = yaml.safe_load((config / "clusters.yaml").read_text())
    primary = as_kubernetes(copy.deepcopy(doc["clusters"]["onprem-a"]), conn_id="k8s_private", scheduler="volcano")
    primary["node_pools"].append(dict(L4))
    primary["scratch_dir"] = str(base / "scratch-primary")
    dr: dict[str, Any] = {
        "location": "private", "region": "dc-2", "jurisdiction": "eu", "role": "dr", "backend": "local",
        "dr": {"min_gpus": 1}, "node_pools": [{k: v for k, v in L4.items() if k != "node_labels"}],
        "prices": {"onprem": 0.5},
        "cache": {"conn_id": "hybridflow_dr_k8s", "bucket": "hf-dr-k8s"}, "scratch_dir": str(base / "scratch-dr")}
    if dr_backend == "kubernetes":
        dr["node_pools"] = [dict(L4)]
        as_kubernetes(dr, conn_id="k8s_dr", scheduler="volcano")
        dr["scratch_dir"] = str(base / "scratch-dr")
    if dr_serving:
        dr["dr"]["serving"] = {"node_pool": "l4", "namespace": DR_NS, "models_claim": "dr-models",
                               "models_dir": str(base / "dr-models"), "replicas": 1, "ready_timeout_s": 20}
    doc["clusters"][PRIMARY], doc["clusters"][DR] = primary, dr
    (config / "clusters.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    pipeline = quick_serving(yaml.safe_load((config / "pipeline.yaml").read_text()))
    pipeline["serving"]["kubernetes"] = {
        "cluster": PRIMARY, "node_pool": "l4", "namespace": PRIMARY_NS, "image": IMAGE,
        "models_claim": "private-models", "models_dir": str(base / "models"), "replicas": 1, "gpus_per_replica": 1,
        "ready_timeout_s": 20, "kind": kind}
    (config / "pipeline.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    return config


def clusters(monkeypatch, base: Path, *, processes: bool = False) -> SimpleNamespace:
    """The two simulators with KServe, every hook routed to its Connection's; close() stops them."""
    sims = {"k8s_private": SimCluster({}), "k8s_dr": SimCluster({})}
    ctrls = {"k8s_private": attach(sims["k8s_private"], base / "models", base / "revisions-primary",
                                   processes=processes),
             "k8s_dr": attach(sims["k8s_dr"], base / "dr-models", base / "revisions-dr", processes=processes)}
    for conn in sims:
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn.upper()}", "kubernetes://")
    install_clusters(monkeypatch, sims)

    def close() -> None:
        for ctrl in ctrls.values():
            ctrl.close()

    return SimpleNamespace(primary=sims["k8s_private"], dr=sims["k8s_dr"], primary_kserve=ctrls["k8s_private"],
                           dr_kserve=ctrls["k8s_dr"], close=close)


def replicate(store_root: Path, endpoint: str, version: str, bundle: Path, model: str) -> None:
    """``bundle`` as the replica of ``endpoint`` ``version`` in the DR store at ``store_root``."""
    from hybridflow.dr.replication.replicas import replicate_set
    from hybridflow.dr.replication.sources import model_set
    from hybridflow.storage.objectstore import LocalObjectStore

    record = {"endpoint": endpoint, "version": version, "bundle": str(bundle), "model": model, "status": "active"}
    replicate_set(model_set(endpoint, record), LocalObjectStore(store_root))
