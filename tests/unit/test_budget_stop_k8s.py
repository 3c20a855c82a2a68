"""A budget freeze stops the frozen project's interruptible gangs on every Kubernetes cluster of the
estate (Volcano and Kueue, against the cluster simulator): each job is annotated with the reason,
then deleted with its pods; other gangs keep running, an unreachable cluster is logged and skipped,
and enforcing again is a no-op."""

from __future__ import annotations

import dataclasses
import logging
from datetime import UTC, date, datetime

import pytest
from sqlalchemy import create_engine
from tests.support.k8s_sim import SimCluster, install_clusters
from urllib3.exceptions import MaxRetryError

from hybridflow.backends.k8s.backend import MISSING, RUNNING, KubernetesGangBackend
from hybridflow.backends.k8s.manifests import gang_job_name
from hybridflow.backends.local import GangFailed, GangJob
from hybridflow.budgets.config import load_budgets
from hybridflow.budgets.enforce import refuse_if_frozen, stop_interruptible_gangs
from hybridflow.budgets.evaluate import evaluate_period
from hybridflow.budgets.store import BudgetStore
from hybridflow.config import Cluster, Estate, load_estate
from hybridflow.errors import AdmissionError
from hybridflow.settings import REPO_ROOT

NS = "hybridflow"
STOPPED = KubernetesGangBackend.STOPPED_REASON
REASON = "project 'digits-ocr' has spent 25,010.00 USD of its 25,000.00 USD budget for 2026-12"
FROZEN = "hybridflow.io/project=digits-ocr,hybridflow.io/interruptible=true"
# (project, interruptible, priority) of the gangs started on each cluster; only the first is stopped.
GANGS = {
    "frozen": ("digits-ocr", "true", "normal"),
    "steady": ("digits-ocr", "false", "normal"),
    "critical": ("digits-ocr", "true", "critical"),
    "other": ("ranking", "true", "batch"),
}


def _cluster(name: str, scheduler: str) -> Cluster:
    cluster = Cluster.model_validate({
        "location": "public", "region": "us-east-1", "backend": "kubernetes", "conn_id": f"k8s_{name}",
        "scheduler": scheduler,
        "node_pools": [{"name": "h100", "gpu_model": "H100-80GB", "gpu_memory_gib": 80, "gpus": 16,
                        "node_labels": {"hybridflow.io/pool": "h100"}}],
        "prices": {"on_demand": 3.9},
    })
    cluster._name = name
    return cluster


def _sim() -> SimCluster:
    return SimCluster({f"h100-{i}": {"gpus": 4, "labels": {"hybridflow.io/pool": "h100"}} for i in range(4)})


def _backend(cluster: Cluster) -> KubernetesGangBackend:
    return KubernetesGangBackend(cluster, image="ghcr.io/example/trainer:1.0")


def _start(cluster: Cluster, sim: SimCluster) -> dict[str, str]:
    """Start every gang of GANGS on ``cluster``; their job names by key."""
    backend, names = _backend(cluster), {}
    for key, (project, interruptible, priority) in GANGS.items():
        name = gang_job_name("hybrid_training", f"manual__{key}", "train", cluster.name, readable=f"train-{key}")
        job = GangJob(name=name, workers=2, spec={"run_key": key, "train_steps": 100}, env={"TOKEN": "x"},
                      labels={"project": project, "team": "vision", "priority": priority,
                              "interruptible": interruptible})
        backend.submit_spec(backend.gang_spec(job, pool="h100", queue="vision"), job.env)
        names[key] = name
    sim.run(3)
    assert all(backend.status(n).phase == RUNNING and len(sim.pod_names(n)) == 2 for n in names.values())
    return names


@dataclasses.dataclass
class World:
    estate: Estate
    sims: dict[str, SimCluster]  # by cluster name

    def start_all(self) -> dict[str, dict[str, str]]:
        return {name: _start(self.estate.clusters[name], sim) for name, sim in self.sims.items()}


@pytest.fixture
def world(monkeypatch) -> World:
    """The shipped estate (two local clusters) plus a Volcano and a Kueue cluster, each simulated."""
    clusters = {"gpu-volcano": _cluster("gpu-volcano", "volcano"), "gpu-kueue": _cluster("gpu-kueue", "kueue")}
    sims = {name: _sim() for name in clusters}
    install_clusters(monkeypatch, {c.conn_id: sims[name] for name, c in clusters.items()})
    base = load_estate(REPO_ROOT / "config")
    return World(dataclasses.replace(base, clusters={**base.clusters, **clusters}), sims)


def _job_of(sim: SimCluster, scheduler: str, name: str) -> dict | None:
    return (sim.vcjobs if scheduler == "volcano" else sim.jobs).get((NS, name))


# --- the backend's list and stop --------------------------------------------------------------


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_list_gangs_by_label_and_stop_annotates_then_deletes(monkeypatch, scheduler):
    sim = _sim()
    cluster = _cluster("gpu", scheduler)
    install_clusters(monkeypatch, {cluster.conn_id: sim})
    names = _start(cluster, sim)
    backend = _backend(cluster)
    assert backend.list_gangs(FROZEN) == sorted([names["frozen"], names["critical"]])
    assert backend.list_gangs(f"{FROZEN},hybridflow.io/priority!=critical") == [names["frozen"]]
    assert backend.list_gangs("hybridflow.io/project=nobody") == []

    name = names["frozen"]
    assert backend.stop(name, REASON) is True
    kind = "vcjob" if scheduler == "volcano" else "job"
    assert sim.calls[-2:] == [f"patch {kind} {name}", f"delete {kind} {name}"]  # annotated first, then deleted
    assert sim.deleted[(kind, NS, name)]["metadata"]["annotations"][STOPPED] == REASON
    assert _job_of(sim, scheduler, name) is None and sim.pod_names(name) == []
    assert (NS, f"{name}-env") not in sim.secrets and (NS, name) not in sim.services
    # What the waiting train task then reads: the job is gone, an outcome it reports as a failure.
    assert backend.status(name).phase == MISSING
    with pytest.raises(GangFailed, match="ended missing"):
        backend.outcome(name, backend.status(name), admitted=True)

    assert backend.stop(name, REASON) is False  # already gone: no error
    sim.run(2)
    others = [n for k, n in names.items() if k != "frozen"]
    assert all(backend.status(n).phase == RUNNING and len(sim.pod_names(n)) == 2 for n in others)


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_finished_gangs_are_listed_only_when_asked(monkeypatch, scheduler):
    sim = _sim()
    cluster = _cluster("gpu", scheduler)
    install_clusters(monkeypatch, {cluster.conn_id: sim})
    names = _start(cluster, sim)
    sim.succeed(names["frozen"])
    sim.run(2)
    backend = _backend(cluster)
    assert backend.list_gangs(f"{FROZEN},hybridflow.io/priority!=critical") == []  # kept for its status only
    assert backend.list_gangs(f"{FROZEN},hybridflow.io/priority!=critical", finished=True) == [names["frozen"]]


def test_patching_a_job_with_the_clients_default_content_type_is_refused_as_by_the_api(monkeypatch):
    # BatchV1Api sends a dict body as a JSON patch by default; stop() must not rely on that.
    sim = _sim()
    cluster = _cluster("gpu", "kueue")
    install_clusters(monkeypatch, {cluster.conn_id: sim})
    name = _start(cluster, sim)["frozen"]
    with pytest.raises(Exception) as err:
        sim.batch.patch_namespaced_job(name=name, namespace=NS, body={"metadata": {"annotations": {"a": "b"}}})
    assert err.value.status == 400


# --- the freeze across the estate ---------------------------------------------------------------


def test_freeze_stops_the_projects_interruptible_gangs_on_every_kubernetes_cluster(world, tmp_path):
    estate, started = world.estate, world.start_all()

    assert stop_interruptible_gangs("ranking-ish", "nothing", estate, tmp_path) == []  # no gang of that project
    stopped = stop_interruptible_gangs("digits-ocr", REASON, estate, tmp_path)
    assert sorted(stopped) == sorted(f"{c}/{names['frozen']}" for c, names in started.items())

    for cluster, sim in world.sims.items():
        scheduler, names = estate.clusters[cluster].scheduler, started[cluster]
        kind = "vcjob" if scheduler == "volcano" else "job"
        assert sim.deleted[(kind, NS, names["frozen"])]["metadata"]["annotations"][STOPPED] == REASON
        assert _job_of(sim, scheduler, names["frozen"]) is None and sim.pod_names(names["frozen"]) == []
        sim.run(2)
        for key in ("steady", "critical", "other"):  # non-interruptible, critical, another project's
            assert _job_of(sim, scheduler, names[key]) is not None
            assert len(sim.pod_names(names[key])) == 2, (cluster, key)
            assert STOPPED not in (_job_of(sim, scheduler, names[key])["metadata"].get("annotations") or {})

    calls = {c: len(sim.calls) for c, sim in world.sims.items()}
    assert stop_interruptible_gangs("digits-ocr", REASON, estate, tmp_path) == []  # enforcing again: no-op
    assert all(not any(x.startswith(("patch", "delete")) for x in sim.calls[calls[c]:])
               for c, sim in world.sims.items())


def test_an_unreachable_cluster_is_logged_and_the_others_are_still_stopped(world, tmp_path, monkeypatch, caplog):
    estate, started = world.estate, world.start_all()
    volcano = world.sims["gpu-volcano"]
    listing, down = volcano.custom.list_namespaced_custom_object, [True]

    def unreachable(*args, **kwargs):
        if down[0]:
            raise MaxRetryError(None, "/apis/batch.volcano.sh/v1alpha1/namespaces/hybridflow/jobs",
                                reason="connection refused")
        return listing(*args, **kwargs)

    monkeypatch.setattr(volcano.custom, "list_namespaced_custom_object", unreachable)
    with caplog.at_level(logging.WARNING, logger="hybridflow.budgets.enforce"):
        stopped = stop_interruptible_gangs("digits-ocr", REASON, estate, tmp_path)
    assert stopped == [f"gpu-kueue/{started['gpu-kueue']['frozen']}"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "on cluster gpu-volcano" in warnings[0]
    assert "MaxRetryError" in warnings[0] and "digits-ocr" in warnings[0]
    assert len(volcano.pod_names(started["gpu-volcano"]["frozen"])) == 2  # untouched

    # Reachable again: the next enforcement stops what was left, and nothing more.
    down[0] = False
    assert stop_interruptible_gangs("digits-ocr", REASON, estate, tmp_path) == [
        f"gpu-volcano/{started['gpu-volcano']['frozen']}"]


def test_the_freeze_is_recorded_even_when_a_cluster_fails_and_the_train_task_can_tell(world, tmp_path, monkeypatch):
    estate, started = world.estate, world.start_all()

    def broken(*args, **kwargs):
        raise RuntimeError("kubeconfig of k8s_gpu-kueue expired")

    monkeypatch.setattr(world.sims["gpu-kueue"].batch, "list_namespaced_job", broken)
    store = BudgetStore(create_engine(f"sqlite:///{tmp_path / 'ledger.db'}"))
    store.ensure_schema()
    at = datetime(2026, 12, 20, 3, 0, tzinfo=UTC)
    outcomes = {o.project: o for o in evaluate_period(
        "2026-12", load_budgets(estate.config_dir, estate), store,
        spend=lambda project, period: 25_010.0 if project == "digits-ocr" else 0.0, send=lambda note: None,
        stop_gangs=lambda project, reason: stop_interruptible_gangs(project, reason, estate, tmp_path), at=at)}
    assert outcomes["digits-ocr"].frozen and store.get("digits-ocr", "2026-12").frozen
    assert outcomes["digits-ocr"].stopped == [f"gpu-volcano/{started['gpu-volcano']['frozen']}"]
    assert outcomes["ranking"].stopped == [] and not outcomes["ranking"].frozen
    # A train task whose gang vanished asks the budget store, and learns it was stopped on purpose.
    with pytest.raises(AdmissionError, match="has spent 25,010.00 USD"):
        refuse_if_frozen("digits-ocr", "normal", "", estate, store=store, today=date(2026, 12, 20))
