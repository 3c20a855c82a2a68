"""The gang side of the resource reaper on a real control plane: the gang job of an ended task goes,
and the real garbage collector takes its pods and PodGroup or Workload; a live run's gang is kept; a
Secret whose gang job is gone goes when its owner ended; objects without the product's labels are
never touched; a dry run deletes nothing."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from tests.k8s_real.conftest import real_cluster, until
from tests.support.reaper_states import RunStates, train_owner

from hybridflow.backends.k8s.backend import KubernetesGangBackend
from hybridflow.backends.k8s.manifests import env_secret, gang_job_name
from hybridflow.backends.local import GangJob
from hybridflow.reaper.k8s import KubernetesGangFinder
from hybridflow.reaper.liveness import ALIVE, ENDED
from hybridflow.reaper.owners import owner_annotations
from hybridflow.reaper.sweep import sweep
from hybridflow.runs import RunIdentity

DONE, LIVE, GONE = "scheduled__2026-03-01T10:00:00+00:00", "manual__2026-03-01T11:00:00+00:00", "manual__gone"


def _submit(backend, run_id: str) -> str:
    run_key = RunIdentity("hybrid_training", run_id).run_key
    name = gang_job_name("hybrid_training", run_id, "train", "k8s-real", readable=f"train-{run_key}")
    job = GangJob(name=name, workers=2, spec={"run_key": run_key}, env={"AWS_SECRET_ACCESS_KEY": "xxxxxx"},
                  labels={"project": "digits", "team": "vision", "priority": "normal"}, owner=train_owner(run_id))
    backend.submit(backend.gang_spec(job, pool="h100", queue="vision"), job.env)
    return name


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_gangs_of_ended_tasks_are_deleted_with_their_pods_and_live_ones_kept(real, scheduler):
    if scheduler == "kueue":
        real.kueue_queues({"vision": 8})
    else:
        real.volcano_queue("vision")
    cluster = real_cluster(scheduler, real.ns)
    backend = KubernetesGangBackend(cluster, image="registry.local/train:1", read_timeout_s=10)
    done, live = _submit(backend, DONE), _submit(backend, LIVE)
    until(lambda: len([p for p in real.pods(done) + real.pods(live) if p.status.phase == "Running"]) == 4,
          what="both gangs to run")
    core = real.core()
    secret = env_secret("train-gone-env", real.ns, {"K": "v"}, "train-gone")  # its job was deleted by hand
    secret["metadata"]["annotations"] = owner_annotations(train_owner(GONE))
    core.create_namespaced_secret(real.ns, secret)
    core.create_namespaced_secret(real.ns, env_secret("unowned-env", real.ns, {"K": "v"}, "unowned"))
    core.create_namespaced_secret(real.ns, {"metadata": {"name": "not-ours"}, "stringData": {"K": "v"}})
    finder = KubernetesGangFinder(cluster, timeout_s=10)
    states = RunStates({DONE: ENDED, LIVE: ALIVE, GONE: ENDED})
    now = datetime.now(UTC)

    dry = sweep([finder], states, dry_run=lambda _: True, now=now, clock=lambda: now)
    assert sorted((r.leftover.kind, r.leftover.name) for r in dry.releases) == [
        ("gang-job", done), ("gang-secret", "train-gone-env")]
    assert {r.leftover.name: r.leftover.gpus for r in dry.releases}[done] == 2
    assert len(real.pods(done)) == 2  # a dry run deletes nothing

    swept = sweep([finder], states, dry_run=lambda _: False, now=now, clock=lambda: now)
    assert all(r.released for r in swept.releases) and len(swept.releases) == 2
    until(lambda: real.pods(done) == [], 60, "the garbage collector to take the ended gang's pods")
    assert len(real.pods(live)) == 2
    secrets = {s.metadata.name for s in core.list_namespaced_secret(real.ns).items}
    assert {f"{live}-env", "unowned-env", "not-ours"} <= secrets and not {f"{done}-env", "train-gone-env"} & secrets
    assert sweep([finder], states, dry_run=lambda _: False, now=now, clock=lambda: now).releases == []
