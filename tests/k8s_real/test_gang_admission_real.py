"""Gang admission on a real control plane: Kueue admits a gang's Workload whole within its team's
ClusterQueue quota (the next gang waits suspended, with no pod), Volcano binds a gang's pods only
when all of them fit, and a team queue's cap holds a gang that would exceed it. The backend reads
each state from the real objects (Job, Workload, PodGroup, Queue, ClusterQueue status)."""

from __future__ import annotations

import pytest
from tests.k8s_real.conftest import real_cluster, until

from hybridflow.backends.k8s.backend import PENDING, RUNNING, KubernetesGangBackend
from hybridflow.backends.k8s.manifests import gang_job_name
from hybridflow.backends.local import GangJob

SECRET_ENV = {"AWS_SECRET_ACCESS_KEY": "s3cr3t-value"}


def _job(run: str, workers: int, priority: str = "normal") -> GangJob:
    name = gang_job_name("train_model", f"manual__{run}", "train", "k8s-real", readable=f"train-{run}")
    return GangJob(name=name, workers=workers, spec={"run_key": run, "train_steps": 100}, env=SECRET_ENV,
                   labels={"project": "digits", "team": "vision", "priority": priority})


def _backend(scheduler: str, ns: str) -> KubernetesGangBackend:
    return KubernetesGangBackend(real_cluster(scheduler, ns), image="registry.local/hybridflow-train:1",
                                 read_timeout_s=10, cache_s=0)


def _submit(backend, job, pool: str = "h100") -> None:
    backend.submit_spec(backend.gang_spec(job, pool=pool, queue="vision"), job.env)


def _bound(real, gang: str) -> list[str]:
    return sorted(p.spec.node_name for p in real.pods(gang) if p.spec.node_name)


def test_kueue_admits_a_gang_whole_within_the_team_quota_and_the_next_one_waits_without_pods(real):
    real.kueue_queues({"vision": 4})
    backend = _backend("kueue", real.ns)
    first, second = _job("a", 4), _job("b", 2)
    _submit(backend, first)
    until(lambda: backend.status(first.name).phase == RUNNING and len(_bound(real, first.name)) == 4,
          what="the first gang to be admitted and its 4 pods bound")
    assert set(_bound(real, first.name)) <= {"h100-0", "h100-1"}  # the pool's nodes only
    _submit(backend, second)
    waiting = until(lambda: backend.standing(second.name).position, what="Kueue to hold the second gang")
    assert waiting == 1
    assert backend.status(second.name).phase == PENDING and real.pods(second.name) == []
    # Kueue writes ClusterQueue and LocalQueue usage about a second after it admits (the simulator at once)
    # (used counts every ClusterQueue of the plane: other tests' may not be gone yet)
    load = until(lambda: (got := backend.load()).teams.get("vision") == 4 and got.used >= 4 and got, 30,
                 "Kueue to report the quota in use")
    assert [w[0] for w in load.waiting] == [second.name]
    backend.delete(first.name)
    until(lambda: backend.status(second.name).phase == RUNNING and len(_bound(real, second.name)) == 2,
          what="the second gang to be admitted once the first was deleted")


def test_volcano_binds_no_pod_of_a_gang_that_does_not_fit_whole(real):
    real.volcano_queue("vision")
    backend = _backend("volcano", real.ns)
    holder, big = _job("a", 4), _job("b", 6)  # 4 + 6 > the pool's 8 GPUs
    _submit(backend, holder)
    until(lambda: len(_bound(real, holder.name)) == 4 and backend.status(holder.name).phase == RUNNING,
          what="the first gang to run")
    _submit(backend, big)
    until(lambda: backend.standing(big.name).position, what="Volcano to hold the second gang")
    assert _bound(real, big.name) == []  # not one of its pods placed on a node
    assert backend.status(big.name).phase == PENDING
    backend.delete(holder.name)
    until(lambda: len(_bound(real, big.name)) == 6, what="the whole second gang to be bound once room freed")


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_a_team_cap_holds_a_gang_that_would_exceed_it_though_the_nodes_have_room(real, scheduler):
    if scheduler == "kueue":
        real.kueue_queues({"vision": 2})
    else:
        real.volcano_queue("vision", gpus=2)
    backend = _backend(scheduler, real.ns)
    job = _job("a", 4)
    _submit(backend, job)
    until(lambda: backend.standing(job.name).position, what="the team's cap to hold the gang")
    assert _bound(real, job.name) == [] and backend.status(job.name).phase == PENDING
