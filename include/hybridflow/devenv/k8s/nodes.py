"""Fake GPU nodes for a local control plane, from a cluster of clusters.yaml: one node per
``gpus_per_node`` GPUs of each node pool, labelled with the pool's ``node_labels`` (what the gang
manifests select on), tainted like GPU nodes commonly are, and with ``nvidia.com/gpu`` capacity.
kwok keeps the nodes annotated ``kwok.x-k8s.io/node: fake`` Ready and their pods Running; a node
without that annotation is left to the project's node agent (:mod:`hybridflow.devenv.k8s.agent`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GPU = "nvidia.com/gpu"
POOL_LABEL = "hybridflow.io/node-pool"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"


@dataclass(frozen=True)
class FakeNode:
    name: str
    gpus: int
    labels: dict[str, str] = field(default_factory=dict)
    kwok: bool = True  # False: a node whose pods the node agent runs as local processes
    cpu: str = "64"
    memory: str = "512Gi"

    def manifest(self) -> dict:
        annotations = {"node.alpha.kubernetes.io/ttl": "0"}
        if self.kwok:
            annotations[KWOK_ANNOTATION] = "fake"
        return {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": self.name, "annotations": annotations,
                         "labels": {**self.labels, "kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux",
                                    "kubernetes.io/arch": "amd64", "type": "kwok" if self.kwok else "agent"}},
            "spec": {"taints": [{"key": GPU, "value": "present", "effect": "NoSchedule"}] if self.gpus else []},
        }

    def capacity(self) -> dict:
        cap = {"cpu": self.cpu, "memory": self.memory, "pods": "110"}
        if self.gpus:
            cap[GPU] = str(self.gpus)
        return cap


def pool_nodes(cluster_name: str, pools: list[dict], *, gpus_per_node: int = 8) -> list[FakeNode]:
    """The nodes of ``pools`` (clusters.yaml ``node_pools`` entries as dicts), named ``<pool>-<i>``."""
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be at least 1, got {gpus_per_node}")
    nodes = []
    for pool in pools:
        total = int(pool["gpus"])
        per = min(gpus_per_node, total) or 1
        for i in range(math.ceil(total / per)):
            gpus = min(per, total - i * per)
            labels = {**pool.get("node_labels", {}), POOL_LABEL: pool["name"], "hybridflow.io/cluster": cluster_name}
            nodes.append(FakeNode(f"{pool['name']}-{i}", gpus, labels))
    return nodes
