"""What placement reads from a Kubernetes cluster (``KubernetesGangBackend.load``, ``standing``,
``queue_exists``, ``find_gangs``) against the cluster simulator's Volcano and Kueue queue objects,
with gangs submitted through the backend's real manifests: usage including other tenants', queued
gangs in admission order, GPUs per team, the shared cache, the timeout on every call, and an
unreachable API server."""

from __future__ import annotations

import time

import jsonschema
import pytest
from kubernetes.client.exceptions import ApiException
from tests.support.k8s_sim import SimCluster, crd_schema, crd_validator, install

from hybridflow.backends.base import ClusterLoad, GangJob
from hybridflow.backends.k8s import load as load_module
from hybridflow.backends.k8s.backend import KubernetesGangBackend
from hybridflow.backends.k8s.manifests import GANG_LABEL, KUEUE_QUEUE_LABEL, gang_job_name, gang_manifest
from hybridflow.config import Cluster

GPU = "nvidia.com/gpu"
NS = "hybridflow"
QUEUE_TEAMS = {"vision-q": "vision", "nlp-q": "nlp"}  # queue -> team, as the estate's teams.<team>.queue say
CRDS = {"queues": "volcano/scheduling.volcano.sh_queues.yaml", "podgroups": "volcano/scheduling.volcano.sh_podgroups.yaml",
        "clusterqueues": "kueue/kueue.x-k8s.io_clusterqueues.yaml", "localqueues": "kueue/kueue.x-k8s.io_localqueues.yaml",
        "workloads": "kueue/kueue.x-k8s.io_workloads.yaml"}


def _cluster(scheduler: str, namespace: str | None = None) -> Cluster:
    cluster = Cluster.model_validate({
        "location": "private", "region": "eu-west", "backend": "kubernetes", "conn_id": "k8s_dc2",
        "scheduler": scheduler, "namespace": namespace,
        "node_pools": [{"name": "h100", "gpu_model": "H100-80GB", "gpu_memory_gib": 80, "gpus": 16,
                        "node_labels": {"hybridflow.io/pool": "h100"}}],
        "prices": {"onprem": 2.0},
    })
    cluster._name = "k8s-dc2"
    return cluster


def _backend(scheduler: str, namespace: str | None = None, **kw) -> KubernetesGangBackend:
    kw.setdefault("queue_teams", QUEUE_TEAMS)
    return KubernetesGangBackend(_cluster(scheduler, namespace), image="ghcr.io/example/trainer:1.0", **kw)


@pytest.fixture(autouse=True)
def _fresh_cache():
    load_module.clear_cache()
    yield
    load_module.clear_cache()


@pytest.fixture
def sim(monkeypatch):
    sim = SimCluster({f"h100-{i}": {"gpus": 4, "labels": {"hybridflow.io/pool": "h100"}} for i in range(4)})
    install(monkeypatch, sim)
    return sim


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(load_module, "_now", clock)
    return clock


def _submit(backend: KubernetesGangBackend, run: str, workers: int, queue: str, team: str,
            priority: str = "normal", **labels: str) -> str:
    name = gang_job_name("train_model", run, "train", backend.cluster_name, readable=f"train-{run}")
    job = GangJob(name=name, workers=workers, spec={"run_key": run}, env={"AWS_SECRET_ACCESS_KEY": "x"},
                  labels={"project": "digits", "team": team, "priority": priority, **labels})
    backend.submit_spec(backend.gang_spec(job, pool="h100", queue=queue), job.env)
    return name


def _scenario(sim: SimCluster, scheduler: str) -> dict[str, str]:
    """16 GPUs: another tenant's gang of 4 and vision's gang of 8 run; nlp's 6 (normal), vision's 8
    (batch) and nlp's 6 (critical), submitted in that order, wait."""
    if scheduler == "volcano":
        for queue in ("vision-q", "nlp-q", "research"):
            sim.add_volcano_queue(queue)
    else:
        sim.add_kueue_queues("teams", 12, [f"{NS}/vision-q", f"{NS}/nlp-q"])
        sim.add_kueue_queues("tenants", 8, ["research/research"])
    names = {"other": _submit(_backend(scheduler, "research"), "other", 4, "research", "research")}
    sim.run(2)
    backend = _backend(scheduler)
    names["running"] = _submit(backend, "a", 8, "vision-q", "vision")
    sim.run(2)
    names["normal"] = _submit(backend, "b", 6, "nlp-q", "nlp")
    names["batch"] = _submit(backend, "c", 8, "vision-q", "vision", priority="batch")
    names["critical"] = _submit(backend, "d", 6, "nlp-q", "nlp", priority="critical")
    sim.run(3)
    return names


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_load_reads_usage_queue_and_teams_from_the_cluster(sim, scheduler):
    names = _scenario(sim, scheduler)
    assert len(sim.pod_names(names["running"])) == 8 and sim.pod_names(names["normal"]) == []
    load = _backend(scheduler).load()
    assert load.reachable and load.cluster == "k8s-dc2" and load.capacity == 16
    assert load.used == 12  # the other tenant's 4 GPUs count: they are on the same nodes
    assert load.free == 4 and not load.has_room(2)  # gangs are queued ahead of any newcomer
    assert dict(load.teams) == {"vision": 8, "nlp": 0}  # the other tenant's queue is nobody's team
    assert load.queued == 20
    # Admission order: priority first, then submission; named after the jobs, not the scheduler's objects.
    assert load.waiting == ((names["critical"], 6, "critical", "nlp"), (names["normal"], 6, "normal", "nlp"),
                            (names["batch"], 8, "batch", "vision"))


def test_volcano_parent_queues_are_not_counted_twice(sim):
    names = _scenario(sim, "volcano")
    # root adds up its children, as Volcano's scheduler reports it: summing every queue would say 24.
    assert sim.volcano_queues["root"]["status"]["allocated"][GPU] == "12"
    pg = next(g for g in sim.podgroups.values() if g["metadata"]["ownerReferences"][0]["name"] == names["running"])
    assert pg["metadata"]["name"] != names["running"] and pg["metadata"]["name"].startswith(names["running"] + "-")
    assert _backend("volcano").load().used == 12


def test_kueue_waiting_workloads_are_named_after_their_jobs(sim):
    names = _scenario(sim, "kueue")
    assert not any(name == names["normal"] for _, name in sim.workloads)  # Kueue names them job-<job>-<hash>
    standing = _backend("kueue").standing(names["normal"])
    assert (standing.position, standing.gpus_ahead, standing.free, standing.capacity) == (2, 6, 4, 16)


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_standing_of_waiting_and_running_gangs(sim, scheduler):
    names = _scenario(sim, scheduler)
    backend = _backend(scheduler)
    first, second = backend.standing(names["critical"]), backend.standing(names["normal"])
    assert (first.position, first.gpus_ahead) == (1, 0)
    assert (second.position, second.gpus_ahead) == (2, 6)
    assert "position 2 in the queue of k8s-dc2, 6 GPUs ahead" in second.describe()
    assert backend.standing(names["running"]).position == 0


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_a_waiting_gang_leaves_the_queue_when_admitted(sim, scheduler, clock):
    names = _scenario(sim, scheduler)
    backend = _backend(scheduler)
    assert backend.load().queued == 20
    backend.delete(names["running"])  # frees vision's 8 GPUs (and its quota)
    sim.run(3)
    assert backend.load().queued == 20  # the same reading until cache_s has passed
    clock.now += 10
    load = backend.load()
    # Both gangs of 6 got in (the critical one first), the batch gang of 8 no longer fits.
    assert load.waiting == ((names["batch"], 8, "batch", "vision"),) and load.queued == 8
    assert load.used == 16 and dict(load.teams) == {"vision": 0, "nlp": 12}


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_the_scheduler_admits_by_priority(sim, scheduler):
    sim.add_volcano_queue("vision-q")
    sim.add_kueue_queues("teams", 16, [f"{NS}/vision-q"])
    backend = _backend(scheduler)
    running = _submit(backend, "a", 12, "vision-q", "vision")
    sim.run(2)
    batch = _submit(backend, "b", 4, "vision-q", "vision", priority="batch")
    critical = _submit(backend, "c", 4, "vision-q", "vision", priority="critical")
    assert [w[0] for w in backend.load().waiting] == [critical, batch]
    backend.delete(running)
    sim.run(1)  # one pass, room for both: the critical gang is placed first, on the first nodes
    nodes = {p["node"] for p in sim.pods.values() if p["owner"][2] == critical}
    assert nodes == {"h100-0"}


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_every_served_queue_object_is_valid_against_its_crd(sim, scheduler):
    _scenario(sim, scheduler)
    group, version = ("scheduling.volcano.sh", "v1beta1") if scheduler == "volcano" else ("kueue.x-k8s.io", "v1beta2")
    served = {}
    for plural, path in CRDS.items():
        if plural.startswith(("queues", "podgroups")) != (scheduler == "volcano"):
            continue
        schema = crd_schema(path, version if scheduler == "kueue" else None)
        checker = jsonschema.validators.validator_for(schema)
        checker.check_schema(schema)  # a schema the validator reads as meant (once: seconds for Workloads)
        items = sim.custom.list_cluster_custom_object(group=group, version=version, plural=plural)["items"]
        for obj in items:
            checker(schema).validate(obj)  # independently of the simulator's own check
        served[plural] = len(items)
    if scheduler == "volcano":
        assert served == {"queues": 5, "podgroups": 5}  # root, default and three declared; one per gang
        phases = {g["status"]["phase"] for g in sim.podgroups.values()}
    else:
        assert served == {"clusterqueues": 2, "localqueues": 3, "workloads": 5}
        phases = {tuple(sorted(c["type"] for c in w["status"].get("conditions", []) if c["status"] == "True"))
                  for w in sim.workloads.values()}
    assert len(phases) == 2  # admitted and waiting objects were both checked
    # The schemas are strict enough to catch a wrong value: a PodGroup has no "Failed" phase, a
    # Workload's condition needs a reason.
    if scheduler == "volcano":
        bad, path = {**next(iter(sim.podgroups.values())), "status": {"phase": "Failed"}}, CRDS["podgroups"]
    else:
        bad, path = {**next(iter(sim.workloads.values())), "status": {"conditions": [
            {"type": "Finished", "status": "True", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}, \
            CRDS["workloads"]
    with pytest.raises(jsonschema.ValidationError):
        crd_validator(path, version if scheduler == "kueue" else None).validate(bad)


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_a_reading_is_shared_for_cache_s_then_read_again(sim, scheduler, clock):
    _scenario(sim, scheduler)
    # the queues, the waiting gangs' objects and, since some wait, the gangs labelled private-only
    reads_per_load = (2 if scheduler == "volcano" else 3) + 1
    sim.requests.clear()
    first = _backend(scheduler, cache_s=5).load()
    again = _backend(scheduler, cache_s=5).load()  # a fresh backend of the same cluster, 0 s later
    clock.now += 4.9
    assert _backend(scheduler, cache_s=5).load() is first is again
    assert len(sim.requests) == reads_per_load
    clock.now += 0.2
    _backend(scheduler, cache_s=5).load()
    assert len(sim.requests) == 2 * reads_per_load
    _backend(scheduler, cache_s=0).load()
    _backend(scheduler, cache_s=0).load()
    assert len(sim.requests) == 4 * reads_per_load


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_every_read_carries_the_timeout(sim, scheduler):
    names = _scenario(sim, scheduler)
    backend = _backend(scheduler, read_timeout_s=2.5, cache_s=0)
    sim.requests.clear()
    backend.load()
    backend.standing(names["normal"])
    backend.queue_exists("vision-q")
    backend.queue_exists("nobody")
    # a load: the queues, the waiting gangs' objects and the gangs labelled private-only; twice
    assert len(sim.requests) == ((2 if scheduler == "volcano" else 3) + 1) * 2 + 2
    assert {timeout for _, timeout in sim.requests} == {2.5}


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_a_slow_api_server_is_cut_off_by_the_timeout(sim, scheduler):
    _scenario(sim, scheduler)
    sim.api_delay_s = 30  # a read without the timeout would hang this long
    started = time.monotonic()
    load = _backend(scheduler, read_timeout_s=0.05).load()
    assert time.monotonic() - started < 5
    assert not load.reachable and "Read timed out" in load.reason and "(Connection k8s_dc2)" in load.reason
    assert _backend(scheduler, read_timeout_s=0.05).queue_exists("vision-q") is None


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
@pytest.mark.parametrize("failure", [True, ApiException(status=503, reason="Service Unavailable"),
                                     ApiException(status=403, reason="Forbidden")], ids=["refused", "503", "403"])
def test_an_unreachable_cluster_is_unknown_and_named(sim, scheduler, failure, clock):
    _scenario(sim, scheduler)
    sim.unreachable = failure
    backend = _backend(scheduler)
    load = backend.load()  # never raises
    assert isinstance(load, ClusterLoad) and not load.reachable
    assert (load.used, load.queued, load.waiting, load.capacity) == (0, 0, (), 16) and not load.has_room(1)
    what = "volcano queues" if scheduler == "volcano" else "kueue clusterqueues"
    assert load.reason.startswith(f"could not read the {what} of cluster k8s-dc2 (Connection k8s_dc2): ")
    expected = "Connection refused" if failure is True else f"ApiException {failure.status} {failure.reason}"
    assert expected in load.reason and "\n" not in load.reason
    assert backend.queue_exists("vision-q") is None
    assert backend.standing("anything").position == 0
    # The unknown reading is not kept past cache_s: the cluster is read again once it answers.
    sim.unreachable = False
    assert not backend.load().reachable
    clock.now += 5
    assert backend.load().reachable


def test_a_missing_connection_is_an_unknown_cluster(sim, monkeypatch):
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    def no_connection(self):
        raise RuntimeError("The conn_id `k8s_dc2` isn't defined")

    monkeypatch.setattr(KubernetesHook, "custom_object_client", property(no_connection))
    load = _backend("volcano").load()
    assert not load.reachable and "Connection k8s_dc2" in load.reason and "isn't defined" in load.reason


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_queue_exists(sim, scheduler):
    if scheduler == "volcano":
        sim.add_volcano_queue("vision-q")
    else:
        sim.add_kueue_queues("teams", 8, [f"{NS}/vision-q", "elsewhere/nlp-q"])
    backend = _backend(scheduler)
    assert backend.queue_exists("vision-q") is True
    assert backend.queue_exists("nlp-q") is False  # Kueue: a LocalQueue of another namespace is not ours
    assert backend.queue_exists("nobody") is False


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_find_gangs_by_labels(sim, scheduler):
    backend = _backend(scheduler)
    frozen = _submit(backend, "f", 2, "vision-q", "vision", interruptible="true")
    critical = _submit(backend, "g", 2, "vision-q", "vision", priority="critical", interruptible="true")
    other = _submit(backend, "h", 2, "nlp-q", "nlp")
    # A job of the namespace that is no gang of ours: never found, even with no labels asked for.
    spec = backend.gang_spec(GangJob(name="foreign", workers=1, spec={}), pool="h100", queue="nlp-q")
    manifest = gang_manifest(spec, scheduler)
    manifest["metadata"]["labels"] = {KUEUE_QUEUE_LABEL: "nlp-q"} if scheduler == "kueue" else {"app": "x"}
    if scheduler == "volcano":
        sim.custom.create_namespaced_custom_object(group="batch.volcano.sh", version="v1alpha1", namespace=NS,
                                                   plural="jobs", body=manifest)
    else:
        sim.batch.create_namespaced_job(namespace=NS, body=manifest)
    sim.run(2)
    assert backend.find_gangs({}) == sorted([frozen, critical, other])
    assert backend.find_gangs({"project": "digits", "interruptible": "true"},
                              not_labels={"priority": "critical"}) == [frozen]
    assert backend.find_gangs({"team": "nlp"}) == [other]
    assert backend.find_gangs({"team": "nobody"}) == []
    assert all(GANG_LABEL in (sim.vcjobs.get((NS, n)) or sim.jobs[(NS, n)])["metadata"]["labels"]
               for n in backend.find_gangs({}))
    sim.succeed(other)
    sim.run(2)
    assert backend.find_gangs({"team": "nlp"}) == []  # finished gangs are not running ones
    assert backend.list_gangs("hybridflow.io/team=nlp", finished=True) == [other]


# --- the simulator behaves like the schedulers ---------------------------------------------------


def test_volcano_podgroup_follows_its_job_and_the_queue_capability_holds_gangs(sim):
    sim.add_volcano_queue("vision-q", capability_gpus=8)
    backend = _backend("volcano")
    first = _submit(backend, "a", 6, "vision-q", "vision")
    second = _submit(backend, "b", 4, "vision-q", "vision")  # 6 + 4 > the queue's 8, though 10 GPUs are free
    sim.run(3)

    def group(job):
        return next(g for g in sim.podgroups.values() if g["metadata"]["ownerReferences"][0]["name"] == job)

    assert group(first)["status"]["phase"] == "Running" and group(second)["status"]["phase"] == "Pending"
    assert group(first)["spec"]["minResources"][GPU] == "6" and group(first)["spec"]["queue"] == "vision-q"
    queue = sim.volcano_queues["vision-q"]["status"]
    assert queue["allocated"][GPU] == "6" and (queue["running"], queue["pending"]) == (1, 1)
    sim.succeed(first)
    sim.run(3)
    assert group(first)["status"]["phase"] == "Completed" and group(second)["status"]["phase"] == "Running"
    backend.delete(first)
    assert [g["metadata"]["ownerReferences"][0]["name"] for g in sim.podgroups.values()] == [second]


def test_kueue_quota_holds_workloads_and_usage_follows_admission(sim):
    sim.add_kueue_queues("teams", 8, [f"{NS}/vision-q"])
    backend = _backend("kueue")
    first = _submit(backend, "a", 6, "vision-q", "vision")
    second = _submit(backend, "b", 4, "vision-q", "vision")  # nodes are free, the quota is not
    sim.run(3)
    assert not sim.jobs[(NS, first)]["spec"]["suspend"] and sim.jobs[(NS, second)]["spec"]["suspend"]
    wl = next(w for w in sim.workloads.values() if w["metadata"]["ownerReferences"][0]["name"] == second)
    assert {c["type"]: c["status"] for c in wl["status"]["conditions"]} == {"QuotaReserved": "False"}
    assert sim.cluster_queues["teams"]["status"]["pendingWorkloads"] == 1
    sim.succeed(first)
    sim.run(3)
    assert not sim.jobs[(NS, second)]["spec"]["suspend"]
    assert sim.local_queues[(NS, "vision-q")]["status"]["flavorsUsage"][0]["resources"][0]["total"] == "4"
    backend.delete(second)
    assert sim.cluster_queues["teams"]["status"]["flavorsUsage"][0]["resources"][0]["total"] == "0"
