"""Making room on a real control plane, with the gangs' code really running (node ``run-0``): an
interruptible gang that may run public holds the pool; work that may run only there waits first;
the backend moves the newest movable gang off by the scheduler's own stop (Kueue: the Workload
deactivated; Volcano: an AbortJob Command), its workers checkpoint on SIGTERM and exit 75, its job
stays and reads as moved with the reason, and the real scheduler admits the waiting gang."""

from __future__ import annotations

import sys

import pytest
from tests.k8s_real.conftest import real_cluster, until
from tests.support.gang_worker import WORKER

from hybridflow.backends.base import PREEMPTED, RUNNING
from hybridflow.backends.errors import GangMoved
from hybridflow.backends.k8s.backend import KubernetesGangBackend
from hybridflow.backends.k8s.manifests import gang_job_name
from hybridflow.backends.local import GangJob


def _gang(run: str, workers: int, work, *, movable: bool = False, private_only: bool = False) -> GangJob:
    name = gang_job_name("train_model", f"manual__{run}", "train", "k8s-real", readable=f"train-{run}")
    labels = {"team": "vision", "priority": "normal", "interruptible": str(movable).lower(),
              "movable": str(movable).lower(), "private_only": str(private_only).lower()}
    return GangJob(name=name, workers=workers, spec={"run_key": run}, labels=labels,
                   env={"WORK_DIR": str(work), "RUN_S": "120", "RESUME_S": "1"})


@pytest.mark.parametrize("scheduler", ["kueue", "volcano"])
def test_a_private_only_gang_moves_the_newest_movable_gang_off_and_is_admitted(real, agent, tmp_path, scheduler):
    script, work = tmp_path / "worker.py", tmp_path / "work"
    script.write_text(WORKER)
    work.mkdir()
    if scheduler == "kueue":
        real.kueue_queues({"vision": 8})
    else:
        real.volcano_queue("vision")
    # grace_s 5: the pods' terminationGracePeriodSeconds is 15, time enough for the SIGTERM checkpoint
    backend = KubernetesGangBackend(real_cluster(scheduler, real.ns, pool="run"), image="registry.local/hybridflow-train:1",
                                    command=(sys.executable, str(script)), grace_s=5, read_timeout_s=10, cache_s=0)
    older, newer = _gang("older", 4, work, movable=True), _gang("newer", 4, work, movable=True)
    restricted = _gang("restricted", 4, work, private_only=True)
    seen = len(agent.exits)
    for gang in (older, newer):
        backend.submit_spec(backend.gang_spec(gang, pool="run", queue="vision"), gang.env)
        until(lambda g=gang: len(list(work.glob(f"{g.name}-*.ready"))) == 4, 90, f"every rank of {gang.name} at work")
    backend.submit_spec(backend.gang_spec(restricted, pool="run", queue="vision"), restricted.env)
    until(lambda: backend.standing(restricted.name).position == 1, 60, "the restricted gang to wait first")
    assert backend.load().private_only_queued == 4

    # The schedulers report their usage a moment after admitting: until then the gang seems to fit.
    moved = until(lambda: backend.make_room(restricted.name, log=print), 60, "making room to move a gang")
    assert moved == [newer.name]

    status = until(lambda: (s := backend.status(newer.name)).phase == PREEMPTED and s, 60, "the move to end")
    with pytest.raises(GangMoved) as err:
        backend.outcome(newer.name, status, admitted=True)
    assert f"for {restricted.name}, work that may run only on private clusters" in err.value.reason
    assert [code for pod, code in agent.exits[seen:] if pod.startswith(newer.name)] == [75] * 4
    assert len(list(work.glob(f"{newer.name}-*.ckpt"))) == 4  # each rank committed its checkpoint
    until(lambda: backend.status(restricted.name).phase == RUNNING and len(list(work.glob(f"{restricted.name}-*.ready"))) == 4,
          90, "the restricted gang to be admitted and at work")
    assert backend.status(older.name).phase == RUNNING and backend.status(older.name).retries == 0
    assert backend.status(newer.name).phase == PREEMPTED  # nothing restarts it: its task places it again
    if scheduler == "kueue":
        [wl] = [w for w in real.custom().list_namespaced_custom_object(
            "kueue.x-k8s.io", "v1beta2", real.ns, "workloads")["items"] if w["metadata"]["ownerReferences"][0]["name"] == newer.name]
        assert wl["spec"]["active"] is False
    else:
        job = real.custom().get_namespaced_custom_object("batch.volcano.sh", "v1alpha1", real.ns, "jobs", newer.name)
        assert job["status"]["state"]["phase"] == "Aborted"
    assert backend.delete(newer.name)
