"""The reaper on a Kubernetes cluster (the stateful simulator, through the provider's KubernetesHook):
the gang job of an ended task goes with its pods, Secret and Service, a live run's gang is kept,
a Secret left by a gang whose job is gone goes when its owner ended, a pod whose job is gone goes,
objects without the product's gang label are never listed, and dry-run changes nothing. Only gangs
labelled with this Airflow instance's identity are judged: another instance's, and those naming
none, are left alone and reported."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import pytest
from tests.support import k8s_sim_api
from tests.support.k8s_sim import SimCluster, install
from tests.support.reaper_states import RunStates, train_owner
from tests.unit.test_k8s_backend import _cluster

from hybridflow.backends.k8s.backend import KubernetesGangBackend
from hybridflow.backends.k8s.manifests import GANG_LABEL, INSTANCE_LABEL, env_secret, gang_job_name
from hybridflow.backends.local import GangJob
from hybridflow.reaper.gangs import GangFinder
from hybridflow.reaper.liveness import ALIVE, ENDED
from hybridflow.reaper.owners import owner_annotations
from hybridflow.reaper.sweep import sweep
from hybridflow.runs import RunIdentity

NS = "hybridflow"
MINE, OTHER = "airflow-here", "airflow-there"


def _list_by_selector(store: str):
    """Listing by label selector (existence too, as the API server does) for objects the simulator
    keeps but does not list: Secrets, and pods by an existence selector."""
    def call(self, namespace, label_selector=None, **kwargs):
        if store == "secrets":
            items = [s for (ns, _), s in sorted(self.sim.secrets.items()) if ns == namespace]
            kind = "V1SecretList"
        else:
            items = [k8s_sim_api._pod_object(p) for p in self.sim.pods.values() if p["namespace"] == namespace]
            kind = "V1PodList"
        items = [i for i in items if k8s_sim_api._label_match(i["metadata"].get("labels") or {}, label_selector)]
        return k8s_sim_api.to_model({"items": items}, kind)
    return call


@pytest.fixture
def sim(monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_INSTANCE", MINE)
    sim = SimCluster({"h100-1": {"gpus": 8, "labels": {"hybridflow.io/pool": "h100"}}})
    install(monkeypatch, sim)
    monkeypatch.setattr(k8s_sim_api.FakeCoreV1Api, "list_namespaced_secret", _list_by_selector("secrets"),
                        raising=False)
    monkeypatch.setattr(k8s_sim_api.FakeCoreV1Api, "list_namespaced_pod", _list_by_selector("pods"))
    return sim


def _submit(sim, backend, run_id: str, *, instance: str | None = MINE) -> str:
    """A train task's gang, made by Airflow instance ``instance`` (None: before instances were recorded)."""
    run_key = RunIdentity("hybrid_training", run_id).run_key
    name = gang_job_name("hybrid_training", run_id, "train", "cloud-east", readable=f"train-{run_key}")
    job = GangJob(name=name, workers=2, spec={"run_key": run_key}, env={"AWS_SECRET_ACCESS_KEY": "x"},
                  labels={"project": "digits", "team": "vision", "priority": "normal"}, owner=train_owner(run_id))
    spec = backend.gang_spec(job, pool="h100", queue="vision")
    assert spec.labels["instance"] == MINE  # this instance's, from HYBRIDFLOW_INSTANCE
    labels = {k: v for k, v in spec.labels.items() if k != "instance"}
    backend.submit_spec(dataclasses.replace(spec, labels={**labels, **({"instance": instance} if instance else {})}),
                   job.env)
    store = sim.vcjobs if backend.scheduler == "volcano" else sim.jobs
    for obj in (store[(NS, name)], sim.secrets[(NS, f"{name}-env")]):  # as the backend annotates them
        assert obj["metadata"]["annotations"] == owner_annotations(job.owner)
    return name


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_gangs_of_ended_tasks_are_deleted_and_live_ones_kept(sim, scheduler):
    cluster = _cluster(scheduler)
    backend = KubernetesGangBackend(cluster, image="registry.local/train:1")
    done = _submit(sim, backend, "scheduled__2026-03-01T10:00:00+00:00")
    live = _submit(sim, backend, "manual__2026-03-01T11:00:00+00:00")
    sim.run(3)
    core = backend.hook.core_v1_client
    secret = env_secret("train-gone-env", NS, {"K": "v"}, "train-gone", instance=MINE)  # its job was deleted by hand
    secret["metadata"]["annotations"] = owner_annotations(train_owner("manual__gone"))
    core.create_namespaced_secret(namespace=NS, body=secret)
    core.create_namespaced_secret(namespace=NS, body=env_secret("unowned-env", NS, {"K": "v"}, "unowned",
                                                                instance=MINE))
    core.create_namespaced_secret(namespace=NS, body={"metadata": {"name": "not-ours"}, "stringData": {}})
    finder = GangFinder(KubernetesGangBackend(cluster, image=""))
    states = RunStates({"scheduled__2026-03-01T10:00:00+00:00": ENDED, "manual__2026-03-01T11:00:00+00:00": ALIVE,
                        "manual__gone": ENDED})
    now = datetime.now(UTC)

    dry = sweep([finder], states, dry_run=lambda _: True, now=now, clock=lambda: now)
    assert sorted((r.leftover.kind, r.leftover.name) for r in dry.releases) == [
        ("gang-job", done), ("gang-secret", "train-gone-env")]
    assert dry.kept == 2  # the live gang, and the Secret that names no owner
    assert {r.leftover.name: r.leftover.gpus for r in dry.releases}[done] == 2
    assert not any(c.startswith("delete") for c in sim.calls)

    swept = sweep([finder], states, dry_run=lambda _: False, now=now, clock=lambda: now)
    assert all(r.released for r in swept.releases) and len(swept.releases) == 2
    store = sim.vcjobs if scheduler == "volcano" else sim.jobs
    assert set(k[1] for k in store) == {live}
    assert {p["labels"][GANG_LABEL] for p in sim.pods.values()} == {live}
    assert set(k[1] for k in sim.secrets) == {f"{live}-env", "unowned-env", "not-ours"}
    assert all(t for m, t in sim.requests if m.startswith(("list", "delete")))  # every call has a timeout
    assert sweep([finder], states, dry_run=lambda _: False, now=now, clock=lambda: now).releases == []


def test_a_pod_whose_job_is_gone_is_deleted(sim):
    cluster = _cluster("kueue")
    backend = KubernetesGangBackend(cluster, image="registry.local/train:1")
    name = _submit(sim, backend, "manual__2026-03-01T09:00:00+00:00")
    sim.run(3)
    backend.hook.batch_v1_client.delete_namespaced_job(name=name, namespace=NS)  # orphans its pods
    assert len(sim.pods) == 2
    now = datetime.now(UTC)
    # The pods go on that fact alone, whatever their owner's state; the Secret by its owner's.
    swept = sweep([GangFinder(KubernetesGangBackend(cluster, image=""))], RunStates({"manual__2026-03-01T09:00:00+00:00": ALIVE}),
                  dry_run=lambda _: False, now=now, clock=lambda: now)
    assert sorted(r.leftover.kind for r in swept.releases) == ["gang-pod", "gang-pod"]
    assert all(r.released and r.leftover.gpus == 1 for r in swept.releases)
    assert sim.pods == {} and swept.kept == 1  # its Secret's run is alive: kept


def test_an_unreachable_cluster_is_an_error_of_the_sweep(sim):
    sim.unreachable = True
    now = datetime.now(UTC)
    swept = sweep([GangFinder(KubernetesGangBackend(_cluster("kueue"), image=""))], RunStates({}), dry_run=lambda _: False,
                  now=now, clock=lambda: now)
    assert swept.releases == [] and "Connection refused" in swept.errors["cloud-east"]


def _instances(sim, name: str) -> set:
    """The hybridflow.io/instance labels of gang ``name``'s job, pods, Secret and Service."""
    jobs = [o for (_, n), o in {**sim.vcjobs, **sim.jobs}.items() if n == name]
    found = [o["metadata"].get("labels") or {} for o in jobs]
    found += [p["labels"] for p in sim.pods.values() if p["labels"].get(GANG_LABEL) == name]
    found += [o["metadata"].get("labels") or {} for (_, n), o in {**sim.secrets, **sim.services}.items()
              if n in (name, f"{name}-env")]
    return {labels.get(INSTANCE_LABEL) for labels in found}


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_only_this_instance_s_gangs_are_judged_and_the_others_reported(sim, scheduler):
    cluster = _cluster(scheduler)
    backend = KubernetesGangBackend(cluster, image="registry.local/train:1")
    mine = _submit(sim, backend, "manual__mine")
    theirs = _submit(sim, backend, "manual__theirs", instance=OTHER)
    legacy = _submit(sim, backend, "manual__legacy", instance=None)
    sim.run(3)
    assert _instances(sim, mine) == {MINE} and _instances(sim, theirs) == {OTHER}
    assert _instances(sim, legacy) == {None}
    # Every run has ended as far as this instance can tell (the other's run ids are not in its database).
    states = RunStates(dict.fromkeys(("manual__mine", "manual__theirs", "manual__legacy"), ENDED))
    now = datetime.now(UTC)

    swept = sweep([GangFinder(KubernetesGangBackend(cluster, image=""))], states, dry_run=lambda _: False, now=now,
                  clock=lambda: now)
    assert [(r.leftover.kind, r.leftover.name, r.released) for r in swept.releases] == [("gang-job", mine, True)]
    assert {lo.name: lo.skip for lo in swept.skipped} == {
        theirs: f"was made by Airflow instance {OTHER}, not by this one ({MINE}): that instance's reaper judges it",
        legacy: "names no Airflow instance (made before instances were recorded, or by hand); label it "
                f"{INSTANCE_LABEL}={MINE} (kubectl label) for this instance's reaper to judge it"}
    assert swept.kept == 0
    store = sim.vcjobs if scheduler == "volcano" else sim.jobs
    assert {k[1] for k in store} == {theirs, legacy}
    assert {p["labels"][GANG_LABEL] for p in sim.pods.values()} == {theirs, legacy}
    assert {k[1] for k in sim.secrets} == {f"{theirs}-env", f"{legacy}-env"}


def test_another_instance_s_pods_and_secret_stay_when_its_job_is_gone(sim):
    cluster = _cluster("kueue")
    backend = KubernetesGangBackend(cluster, image="registry.local/train:1")
    theirs = _submit(sim, backend, "manual__theirs", instance=OTHER)
    sim.run(3)
    backend.hook.batch_v1_client.delete_namespaced_job(name=theirs, namespace=NS)  # orphans its pods
    now = datetime.now(UTC)
    swept = sweep([GangFinder(KubernetesGangBackend(cluster, image=""))], RunStates({"manual__theirs": ENDED}),
                  dry_run=lambda _: False, now=now, clock=lambda: now)
    assert swept.releases == [] and swept.kept == 0
    assert sorted(lo.kind for lo in swept.skipped) == ["gang-pod", "gang-pod", "gang-secret"]
    assert len(sim.pods) == 2 and (NS, f"{theirs}-env") in sim.secrets
