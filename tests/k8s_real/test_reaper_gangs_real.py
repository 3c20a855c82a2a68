"""The gang side of the resource reaper on a real control plane: the gang job of an ended task goes,
and the real garbage collector takes its pods and PodGroup or Workload; a live run's gang is kept; a
Secret whose gang job is gone goes when its owner ended; objects without the product's labels are
never touched; a dry run deletes nothing. The pods the real controllers make carry the gang's
Airflow instance label, and another instance's gang is left alone and reported, its run ended or
not."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import pytest
from tests.k8s_real.conftest import real_cluster, until
from tests.support.reaper_states import RunStates, train_owner

from hybridflow.backends.k8s.backend import KubernetesGangBackend
from hybridflow.backends.k8s.manifests import INSTANCE_LABEL, env_secret, gang_job_name
from hybridflow.backends.local import GangJob
from hybridflow.reaper.gangs import GangFinder
from hybridflow.reaper.liveness import ALIVE, ENDED
from hybridflow.reaper.owners import owner_annotations
from hybridflow.reaper.sweep import sweep
from hybridflow.runs import RunIdentity

DONE, LIVE, GONE = "scheduled__2026-03-01T10:00:00+00:00", "manual__2026-03-01T11:00:00+00:00", "manual__gone"
THEIRS = "manual__2026-03-01T09:00:00+00:00"
MINE, OTHER = "airflow-here", "airflow-there"


def _submit(backend, run_id: str, *, instance: str = MINE) -> str:
    run_key = RunIdentity("hybrid_training", run_id).run_key
    name = gang_job_name("hybrid_training", run_id, "train", "k8s-real", readable=f"train-{run_key}")
    job = GangJob(name=name, workers=2, spec={"run_key": run_key}, env={"AWS_SECRET_ACCESS_KEY": "xxxxxx"},
                  labels={"project": "digits", "team": "vision", "priority": "normal"}, owner=train_owner(run_id))
    spec = backend.gang_spec(job, pool="h100", queue="vision")  # labelled with HYBRIDFLOW_INSTANCE
    backend.submit_spec(dataclasses.replace(spec, labels={**spec.labels, "instance": instance}), job.env)
    return name


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_gangs_of_ended_tasks_are_deleted_with_their_pods_and_live_ones_kept(real, scheduler, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_INSTANCE", MINE)
    if scheduler == "kueue":
        real.kueue_queues({"vision": 8})
    else:
        real.volcano_queue("vision")
    cluster = real_cluster(scheduler, real.ns)
    backend = KubernetesGangBackend(cluster, image="registry.local/train:1", read_timeout_s=10)
    done, live, theirs = _submit(backend, DONE), _submit(backend, LIVE), _submit(backend, THEIRS, instance=OTHER)
    until(lambda: len([p for p in real.pods(done) + real.pods(live) + real.pods(theirs)
                       if p.status.phase == "Running"]) == 6, what="the three gangs to run")
    assert {p.metadata.labels[INSTANCE_LABEL] for p in real.pods(done) + real.pods(live)} == {MINE}
    assert {p.metadata.labels[INSTANCE_LABEL] for p in real.pods(theirs)} == {OTHER}
    core = real.core()
    # A Secret of this instance whose job was deleted by hand.
    secret = env_secret("train-gone-env", real.ns, {"K": "v"}, "train-gone", instance=MINE)
    secret["metadata"]["annotations"] = owner_annotations(train_owner(GONE))
    core.create_namespaced_secret(real.ns, secret)
    core.create_namespaced_secret(real.ns, env_secret("unowned-env", real.ns, {"K": "v"}, "unowned"))
    core.create_namespaced_secret(real.ns, {"metadata": {"name": "not-ours"}, "stringData": {"K": "v"}})
    finder = GangFinder(backend)
    states = RunStates({DONE: ENDED, LIVE: ALIVE, GONE: ENDED, THEIRS: ENDED})
    now = datetime.now(UTC)

    dry = sweep([finder], states, dry_run=lambda _: True, now=now, clock=lambda: now)
    assert sorted((r.leftover.kind, r.leftover.name) for r in dry.releases) == [
        ("gang-job", done), ("gang-secret", "train-gone-env")]
    assert {r.leftover.name: r.leftover.gpus for r in dry.releases}[done] == 2
    assert len(real.pods(done)) == 2  # a dry run deletes nothing
    # Another instance's gang, and the Secret made before instances were recorded, are only reported.
    assert sorted((lo.kind, lo.name) for lo in dry.skipped) == [("gang-job", theirs), ("gang-secret", "unowned-env")]

    swept = sweep([finder], states, dry_run=lambda _: False, now=now, clock=lambda: now)
    assert all(r.released for r in swept.releases) and len(swept.releases) == 2
    until(lambda: real.pods(done) == [], 60, "the garbage collector to take the ended gang's pods")
    assert len(real.pods(live)) == 2 and len(real.pods(theirs)) == 2
    assert [lo.name for lo in swept.skipped if lo.kind == "gang-job"] == [theirs]
    secrets = {s.metadata.name for s in core.list_namespaced_secret(real.ns).items}
    assert {f"{live}-env", f"{theirs}-env", "unowned-env", "not-ours"} <= secrets
    assert not {f"{done}-env", "train-gone-env"} & secrets
    assert sweep([finder], states, dry_run=lambda _: False, now=now, clock=lambda: now).releases == []
