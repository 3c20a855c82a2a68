"""Every Kubernetes API call of the gang backend is bounded, and the deferrable wait rides out an API
server that is briefly away (503, connection refused) but ends, naming the Connection, when the API
refuses it (403 names the RBAC verb and resource) or stays away past ``api_outage_s``."""

from __future__ import annotations

import asyncio
import time

import pytest
from tests.support.k8s_config import private_h100_cluster
from tests.support.k8s_sim import SimCluster, install

from hybridflow.backends.k8s.backend import SUCCEEDED, KubernetesGangBackend
from hybridflow.backends.k8s.trigger import GangJobTrigger
from hybridflow.backends.local import GangJob
from hybridflow.errors import GangError

NS = "hybridflow"


def _backend(scheduler: str) -> KubernetesGangBackend:
    return KubernetesGangBackend(private_h100_cluster(scheduler), image="registry.local/train:1", read_timeout_s=4.0)


@pytest.fixture
def sim(monkeypatch):
    sim = SimCluster({"h100-1": {"gpus": 8, "labels": {"hybridflow.io/pool": "h100"}}})
    install(monkeypatch, sim)
    return sim


def _submit(sim: SimCluster, scheduler: str) -> str:
    backend = _backend(scheduler)
    job = GangJob(name="train-r1-0123456789", workers=2, spec={"run_key": "r1"}, env={"TOKEN": "x"},
                  labels={"team": "vision"})
    backend.submit(backend.gang_spec(job, pool="h100", queue="vision"), job.env)
    sim.run(3)
    return job.name


def _trigger(name: str, scheduler: str = "volcano", **kw) -> GangJobTrigger:
    args = dict(conn_id="k8s_dc2", scheduler=scheduler, namespace=NS, name=name, cluster="dc2-k8s",
                submitted_at=time.time(), admission_timeout_s=600, poll_interval=0.1, request_timeout_s=4.0,
                api_outage_s=30)
    return GangJobTrigger(**{**args, **kw})


async def _first_event(trigger: GangJobTrigger, timeout: float = 20) -> dict:
    gen = trigger.run()
    try:
        return (await asyncio.wait_for(gen.__anext__(), timeout=timeout)).payload
    finally:
        await gen.aclose()


def _succeed_after(sim: SimCluster, name: str, reads: int) -> list:
    seen = []

    def read():
        seen.append(1)
        sim.step()
        if len(seen) == reads:
            sim.succeed(name)

    sim.on_read = read
    return seen


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_every_backend_call_carries_a_timeout(sim, scheduler):
    backend = _backend(scheduler)
    name = _submit(sim, scheduler)
    backend.status(name)
    backend.delete_secret(name)
    backend.delete(name)
    backend.delete(name)
    assert sim.requests and {t for _, t in sim.requests} == {4.0}


@pytest.mark.parametrize("status", [503, 429])
def test_an_api_answering_503_for_a_while_does_not_end_the_wait(sim, status):
    name = _submit(sim, "volcano")
    reads = _succeed_after(sim, name, 3)
    sim.outage(2.5, status=status)
    started = time.monotonic()
    event = asyncio.run(_first_event(_trigger(name)))
    assert event["status"] == "success", event
    assert time.monotonic() - started >= 2.5 and len(reads) >= 3
    failed = [m for m, _ in sim.requests if m == "get_namespaced_custom_object"]
    assert len(failed) > len(reads)  # the reads during the outage were retried, not fatal
    assert _backend("volcano").on_event(event).phase == SUCCEEDED


def test_an_api_away_longer_than_the_outage_budget_ends_the_wait_saying_so(sim):
    name = _submit(sim, "kueue")
    sim.unreachable = True  # connection refused, every time
    started = time.monotonic()
    event = asyncio.run(_first_event(_trigger(name, scheduler="kueue", api_outage_s=2)))
    assert 2 <= time.monotonic() - started < 10
    assert event["status"] == "error"
    assert "Connection 'k8s_dc2') was unreachable for 2 s" in event["message"]
    assert "Connection refused" in event["message"] or "NewConnectionError" in event["message"]
    with pytest.raises(GangError, match="unreachable for 2 s.*a retry re-attaches"):
        _backend("kueue").on_event(event)
    sim.unreachable = False
    assert (NS, name) in sim.jobs  # the gang itself was left alone


@pytest.mark.parametrize(("scheduler", "group"), [("volcano", "batch.volcano.sh"), ("kueue", "batch")])
def test_a_403_ends_the_wait_naming_connection_verb_and_resource(sim, scheduler, group):
    name = _submit(sim, scheduler)
    sim.forbidden.add(("get", "jobs", group))
    before = len(sim.requests)
    event = asyncio.run(_first_event(_trigger(name, scheduler=scheduler), timeout=5))
    assert event["status"] == "error"
    message = event["message"]
    assert f"Connection 'k8s_dc2' may not get jobs.{group} in namespace {NS} (403 Forbidden" in message
    assert "verbs ['get']" in message and "system:serviceaccount:airflow:hybridflow" in message
    reads = [m for m, _ in sim.requests[before:] if m in ("get_namespaced_custom_object", "read_namespaced_job")]
    assert len(reads) == 1  # refused for good: not retried
    with pytest.raises(GangError, match="may not get jobs"):
        _backend(scheduler).on_event(event)


def test_on_kill_rides_out_a_short_outage_and_reports_a_forbidden_delete(sim):
    name = _submit(sim, "kueue")
    sim.outage(1.2)
    asyncio.run(_trigger(name, scheduler="kueue").on_kill())
    assert not sim.jobs and not sim.secrets and not sim.services
    other = _submit(sim, "kueue")
    sim.forbidden.add(("delete", "jobs", "batch"))
    with pytest.raises(GangError, match="may not delete jobs.batch .*delete it by hand"):
        asyncio.run(_trigger(other, scheduler="kueue").on_kill())
    assert (NS, other) in sim.jobs
