"""Node health on a real control plane: an Xid on a node cordons and taints it (other taints kept),
and the gangs with a pod there are restarted away from it by the real Job controller and scheduler,
as a disruption (spending no application failure), never as a failed Job; restoring the node lifts
the cordon and the taint."""

from __future__ import annotations

import pytest
from tests.k8s_real.conftest import real_cluster, until

from hybridflow.backends.k8s.backend import RUNNING, KubernetesGangBackend
from hybridflow.backends.k8s.nodes import TAINT_KEY
from hybridflow.backends.local import GangJob
from hybridflow.nodehealth import NodeFinding, report_findings, restore_node


class _Estate:
    def __init__(self, cluster) -> None:
        self.clusters = {cluster.name: cluster}


@pytest.mark.parametrize("scheduler", ["kueue", "volcano"])
def test_an_xid_cordons_the_node_and_its_gang_restarts_on_the_other_node(real, scheduler, tmp_path):
    if scheduler == "kueue":
        real.kueue_queues({"vision": 8})
    else:
        real.volcano_queue("vision")
    cluster = real_cluster(scheduler, real.ns)
    backend = KubernetesGangBackend(cluster, image="registry.local/train:1", read_timeout_s=10, cache_s=0)
    job = GangJob(name=f"train-nh-{scheduler}", workers=2, spec={"run_key": "nh"}, labels={"team": "vision"})
    backend.submit_spec(backend.gang_spec(job, pool="h100", queue="vision"), {})

    def placed() -> dict[str, str]:
        return {p.metadata.uid: p.spec.node_name for p in real.pods(job.name)  # Volcano reuses pod names
                if p.status.phase == "Running" and p.metadata.deletion_timestamp is None}

    first = until(lambda: len(placed()) == 2 and placed(), what="the gang to run")
    sick = sorted(first.values())[0]
    estate, state = _Estate(cluster), tmp_path / "nodehealth.json"
    try:
        [decision] = report_findings([NodeFinding(cluster.name, sick, (79,), 0, 0, True)], estate=estate,
                                     state_path=state)
        assert decision.unhealthy and decision.reason == "xid-79"
        node = real.core().read_node(sick)
        assert node.spec.unschedulable and TAINT_KEY in {t.key for t in node.spec.taints}
        assert "nvidia.com/gpu" in {t.key for t in node.spec.taints}  # the node's own taint kept
        moved = until(lambda: len(p := placed()) == 2 and set(p) != set(first) and p, 90,
                      "the gang's pods to be recreated and running")
        assert sick not in moved.values()  # away from the cordoned node
        assert backend.status(job.name).phase == RUNNING
        if scheduler == "kueue":
            assert not real.batch().read_namespaced_job(job.name, real.ns).status.failed  # a disruption, no failure
    finally:
        restore_node(cluster.name, sick, estate=estate, state_path=state)
    node = real.core().read_node(sick)
    assert not node.spec.unschedulable and TAINT_KEY not in {t.key for t in node.spec.taints or []}
