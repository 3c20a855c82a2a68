"""Making room on a Kubernetes private cluster, through the gang backend against the cluster
simulator: an interruptible gang that may run public holds the GPUs; work that may run only there
waits first in the queue; making room checkpoints the movable gang (its workers are real processes:
SIGTERM, checkpoint, exit 75), its job stays and reads as moved with the reason (the train task's
GangMoved), and the waiting gang is admitted. A gang not labelled movable is never moved."""

from __future__ import annotations

import sys
import time

import pytest
from tests.support.k8s_config import private_h100_cluster
from tests.support.k8s_kubelet import h100_pool
from tests.support.k8s_sim_queues import workload_of

from hybridflow.backends.base import PREEMPTED, RUNNING
from hybridflow.backends.errors import GangMoved
from hybridflow.backends.k8s.backend import PENDING, KubernetesGangBackend
from hybridflow.backends.k8s.manifests import gang_job_name
from hybridflow.backends.local import GangJob

NS = "hybridflow"


@pytest.fixture(params=["volcano", "kueue"])
def cluster(request, monkeypatch, tmp_path):
    """2 nodes x 4 H100 behind one team queue of 8 GPUs; no priority preemption."""
    with h100_pool(request.param, monkeypatch, tmp_path, preemption=False) as (sim, kubelet, script):
        yield request.param, sim, kubelet, script


def _gang(run_id: str, workers: int, work_dir, *, movable: bool = False, private_only: bool = False) -> GangJob:
    name = gang_job_name("train_model", run_id, "train", "dc2-k8s", readable=f"train-{run_id}")
    labels = {"team": "vision", "priority": "normal", "interruptible": str(movable).lower(),
              "movable": str(movable).lower(), "private_only": str(private_only).lower()}
    return GangJob(name=name, workers=workers, spec={"run_key": run_id}, labels=labels,
                   env={"WORK_DIR": str(work_dir), "RUN_S": "60", "RESUME_S": "0.2"})


def _until(condition, kubelet, seconds: float = 30):
    deadline = time.monotonic() + seconds
    while not (got := condition()):
        assert time.monotonic() < deadline, "the cluster did not get there in time"
        kubelet.step()
        time.sleep(0.02)
    return got


def _submit(backend, gang) -> None:
    backend.submit_spec(backend.gang_spec(gang, pool="h100", queue="vision"), gang.env)


def test_a_private_only_gang_first_in_the_queue_moves_the_newest_movable_gang_off(cluster, tmp_path):
    scheduler, sim, kubelet, script = cluster
    backend = KubernetesGangBackend(private_h100_cluster(scheduler), image="ghcr.io/example/trainer:1.0",
                                    command=(sys.executable, str(script)), cache_s=0)
    older, newer = _gang("older", 4, tmp_path, movable=True), _gang("newer", 4, tmp_path, movable=True)
    restricted = _gang("restricted", 4, tmp_path, private_only=True)
    for gang in (older, newer):
        _submit(backend, gang)
        _until(lambda g=gang: len(list(tmp_path.glob(f"{g.name}-*.ready"))) == 4, kubelet)
    _submit(backend, restricted)
    kubelet.step()
    load = backend.load()
    assert [w[0] for w in load.waiting] == [restricted.name] and load.private_only_queued == 4

    moved = backend.make_room(restricted.name, log=lambda line: None)

    assert moved == [newer.name]  # the newest movable gang, and only as many GPUs as it needs
    status = _until(lambda: (s := backend.status(newer.name)).phase == PREEMPTED and s, kubelet)
    assert f"for {restricted.name}, work that may run only on private clusters" in status.message
    with pytest.raises(GangMoved, match="checkpointed and moved") as err:
        backend.outcome(newer.name, status, admitted=True)
    assert restricted.name in err.value.reason
    # Its workers got SIGTERM, committed their checkpoint and exited 75 (the simulator drops a deleted
    # pod at once; a real API lists it, so the gang reads as being moved, until its process ended); the
    # job is kept (its task deletes it once it has read why), and the restricted gang runs.
    exits = _until(lambda: [code for pod, code in kubelet.exits if pod.startswith(newer.name)], kubelet)
    assert exits == [75] * 4
    assert len(list(tmp_path.glob(f"{newer.name}-*.ckpt"))) == 4
    _until(lambda: backend.status(restricted.name).phase == RUNNING, kubelet)
    assert backend.status(older.name).phase == RUNNING and backend.status(older.name).retries == 0
    if scheduler == "kueue":
        wl = workload_of(sim, NS, newer.name)
        assert wl["spec"]["active"] is False  # never admitted again
        assert sim.jobs[(NS, newer.name)]["spec"]["suspend"] is True
    else:
        assert sim.vcjobs[(NS, newer.name)]["status"]["state"]["phase"] == "Aborted"
    for _ in range(5):
        kubelet.step()
    assert backend.status(newer.name).phase == PREEMPTED  # it stays moved: nothing restarts it
    assert backend.delete(newer.name)


def test_gangs_not_labelled_movable_are_never_moved_and_a_gang_that_fits_moves_nobody(cluster, tmp_path):
    scheduler, sim, kubelet, script = cluster
    backend = KubernetesGangBackend(private_h100_cluster(scheduler), image="ghcr.io/example/trainer:1.0",
                                    command=(sys.executable, str(script)), cache_s=0)
    fixed = _gang("fixed", 8, tmp_path)  # not interruptible: may not be moved
    restricted = _gang("restricted", 4, tmp_path, private_only=True)
    _submit(backend, fixed)
    _until(lambda: len(list(tmp_path.glob(f"{fixed.name}-*.ready"))) == 8, kubelet)
    _submit(backend, restricted)
    kubelet.step()
    assert backend.make_room(restricted.name, log=lambda line: None) == []
    assert backend.status(fixed.name).phase == RUNNING and backend.status(restricted.name).phase == PENDING
    backend.delete(fixed.name)
    _until(lambda: backend.status(restricted.name).phase == RUNNING, kubelet)
    other = _gang("other", 2, tmp_path, private_only=True)
    _submit(backend, other)
    assert backend.make_room(other.name, log=lambda line: None) == []  # 4 GPUs free: it fits
    assert not any("create command" in c or "patch workload" in c for c in sim.calls)


def test_moving_a_gang_that_is_gone_changes_nothing(cluster, tmp_path):
    scheduler, sim, kubelet, script = cluster
    backend = KubernetesGangBackend(private_h100_cluster(scheduler), image="ghcr.io/example/trainer:1.0",
                                    command=(sys.executable, str(script)), cache_s=0)
    assert backend.move("train-nobody", "making room") is False
    assert not any(c.startswith(("create", "patch")) for c in sim.calls)


def test_a_connection_that_may_not_stop_jobs_moves_nothing_and_says_what_it_needs(cluster, tmp_path):
    scheduler, sim, kubelet, script = cluster
    backend = KubernetesGangBackend(private_h100_cluster(scheduler), image="ghcr.io/example/trainer:1.0",
                                    command=(sys.executable, str(script)), cache_s=0)
    movable, restricted = _gang("movable", 8, tmp_path, movable=True), _gang("restricted", 4, tmp_path, private_only=True)
    _submit(backend, movable)
    _until(lambda: len(list(tmp_path.glob(f"{movable.name}-*.ready"))) == 8, kubelet)
    _submit(backend, restricted)
    kubelet.step()
    sim.forbidden.add(("patch", "workloads", "kueue.x-k8s.io") if scheduler == "kueue"
                      else ("create", "commands", "bus.volcano.sh"))
    said = []
    assert backend.make_room(restricted.name, log=said.append) == []
    needs = "patch on workloads.kueue.x-k8s.io" if scheduler == "kueue" else "create on commands.bus.volcano.sh"
    assert f"could not make room on cluster {backend.cluster_name}" in said[0] and needs in said[0]
    assert "it waits in the queue" in said[0]
    # The movable gang runs on, and does not read as being moved (its annotation was taken back).
    assert backend.status(movable.name).phase == RUNNING and "moved" not in backend.status(movable.name).message
    assert not kubelet.exits
