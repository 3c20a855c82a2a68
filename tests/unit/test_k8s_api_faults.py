"""Every Kubernetes API call of the gang backend is bounded, and the deferrable wait rides out an API
server that is briefly away (503, 429, connection refused) but ends, naming the Connection, when the API
refuses it (403 names the RBAC verb and resource) or stays away past ``api_outage_s``.

All over HTTP: the simulator behind a kmock server on loopback (:mod:`tests.support.k8s_http`), reached
through Airflow Connection k8s_dc2 by the real KubernetesHook and kubernetes client."""

from __future__ import annotations

import asyncio
import time

import pytest
from tests.support.k8s_config import private_h100_cluster
from tests.support.k8s_http import serve
from tests.support.k8s_sim import SimCluster

from hybridflow.backends.k8s import trigger as trigger_module
from hybridflow.backends.k8s.backend import SUCCEEDED, KubernetesGangBackend
from hybridflow.backends.k8s.trigger import GangJobTrigger
from hybridflow.backends.local import GangJob
from hybridflow.errors import GangError

NS = "hybridflow"
SPEED = 20  # the trigger's clock runs this much faster than the wall clock (see fast_clock)


def _backend(scheduler: str, read_timeout_s: float = 4.0) -> KubernetesGangBackend:
    return KubernetesGangBackend(private_h100_cluster(scheduler), image="registry.local/train:1",
                                 read_timeout_s=read_timeout_s)


@pytest.fixture
def sim():
    return SimCluster({"h100-1": {"gpus": 8, "labels": {"hybridflow.io/pool": "h100"}}})


@pytest.fixture
def api(monkeypatch, sim):
    with serve(monkeypatch, sim) as server:
        yield server


class _FastTime:
    """``time`` as the trigger reads it, running ``SPEED`` times faster than the wall clock."""

    def __init__(self) -> None:
        self.wall, self.mono = time.time(), time.monotonic()

    def time(self) -> float:
        return self.wall + (time.time() - self.wall) * SPEED

    def monotonic(self) -> float:
        return self.mono + (time.monotonic() - self.mono) * SPEED


class _FastAsyncio:
    """``asyncio`` as the trigger uses it, its sleeps ``SPEED`` times shorter."""

    def __getattr__(self, name: str):
        return getattr(asyncio, name)

    @staticmethod
    async def sleep(delay: float, result=None):
        return await asyncio.sleep(delay / SPEED, result)


@pytest.fixture
def fast_clock(monkeypatch) -> _FastTime:
    """The trigger's seconds pass ``SPEED`` times faster: an API outage of 20 s as the trigger measures
    it (its backoff, its ``api_outage_s``) is 20 / SPEED s of the server's (wall clock) outage."""
    clock = _FastTime()
    monkeypatch.setattr(trigger_module, "time", clock)
    monkeypatch.setattr(trigger_module, "asyncio", _FastAsyncio())
    return clock


def _submit(sim: SimCluster, scheduler: str) -> str:
    backend = _backend(scheduler)
    job = GangJob(name="train-r1-0123456789", workers=2, spec={"run_key": "r1"}, env={"TOKEN": "x"},
                  labels={"team": "vision"})
    backend.submit_spec(backend.gang_spec(job, pool="h100", queue="vision"), job.env)
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


def _reads(sim: SimCluster) -> list[str]:
    return [m for m, _ in sim.requests if m in ("get_namespaced_custom_object", "read_namespaced_job")]


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_every_backend_call_gives_up_on_a_slow_api_server(api, sim, scheduler):
    # The client's _request_timeout is not sent to the server: the bound shows as calls that give up
    # on an API server answering in 3 s, each within its read timeout (urllib3 tries a GET or DELETE
    # four times, a POST once), where a call without one would wait and succeed.
    name = _submit(sim, scheduler)
    backend = _backend(scheduler, read_timeout_s=0.1)
    sim.api_delay_s = 3.0
    for call in (backend.status, backend.delete_secret, backend.delete):
        started = time.monotonic()
        with pytest.raises(Exception, match="Read timed out") as err:
            call(name)
        assert time.monotonic() - started < 2.5, call  # four tries of 0.1 s, well before the answer
        assert "ReadTimeoutError" in repr(err.value)
    sim.api_delay_s = 0
    assert (sim.vcjobs or sim.jobs) and sim.secrets  # nothing was deleted: every delete gave up in time
    assert backend.status(name).phase != "missing"


@pytest.mark.parametrize(("scheduler", "status"), [("volcano", 503), ("kueue", 503), ("volcano", 429)])
def test_the_api_server_answering_503_for_20_s_during_a_wait_does_not_fail_the_task(api, sim, fast_clock,
                                                                                     scheduler, status):
    name = _submit(sim, scheduler)
    reads = _succeed_after(sim, name, 3)
    sim.outage(20 / SPEED, status=status)  # 20 s of the trigger's clock
    started = fast_clock.monotonic()
    event = asyncio.run(_first_event(_trigger(name, scheduler=scheduler)))
    assert event["status"] == "success", event
    assert fast_clock.monotonic() - started >= 20 and len(reads) >= 3
    assert len(_reads(sim)) > len(reads) + 5  # the reads during the outage were retried, not fatal
    assert _backend(scheduler).on_event(event).phase == SUCCEEDED


def test_an_outage_longer_than_the_budget_ends_the_wait_naming_the_answer(api, sim, fast_clock):
    name = _submit(sim, "volcano")
    sim.outage(20 / SPEED)
    event = asyncio.run(_first_event(_trigger(name, api_outage_s=15)))
    assert event["status"] == "error"
    assert "Connection 'k8s_dc2') was unreachable for 15 s" in event["message"]
    assert "503 Service Unavailable" in event["message"]  # the client's ServiceException, as it came
    with pytest.raises(GangError, match="unreachable for 15 s.*a retry re-attaches"):
        _backend("volcano").on_event(event)


def test_an_api_away_longer_than_the_outage_budget_ends_the_wait_saying_so(api, sim, fast_clock):
    name = _submit(sim, "kueue")
    sim.unreachable = True  # the port refuses connections, every time
    started = fast_clock.monotonic()
    event = asyncio.run(_first_event(_trigger(name, scheduler="kueue", api_outage_s=20)))
    assert 20 <= fast_clock.monotonic() - started < 60
    assert event["status"] == "error"
    assert "Connection 'k8s_dc2') was unreachable for 20 s" in event["message"]
    assert "Connection refused" in event["message"] or "NewConnectionError" in event["message"]
    with pytest.raises(GangError, match="unreachable for 20 s.*a retry re-attaches"):
        _backend("kueue").on_event(event)
    sim.unreachable = False
    assert (NS, name) in sim.jobs  # the gang itself was left alone


@pytest.mark.parametrize(("scheduler", "group"), [("volcano", "batch.volcano.sh"), ("kueue", "batch")])
def test_a_403_ends_the_wait_naming_connection_verb_and_resource(api, sim, scheduler, group):
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


def test_on_kill_rides_out_a_short_outage_and_reports_a_forbidden_delete(api, sim):
    name = _submit(sim, "kueue")
    sim.outage(1.2)
    asyncio.run(_trigger(name, scheduler="kueue").on_kill())
    assert not sim.jobs and not sim.secrets and not sim.services
    other = _submit(sim, "kueue")
    sim.forbidden.add(("delete", "jobs", "batch"))
    with pytest.raises(GangError, match="may not delete jobs.batch .*delete it by hand"):
        asyncio.run(_trigger(other, scheduler="kueue").on_kill())
    assert (NS, other) in sim.jobs


def test_a_cluster_that_no_longer_serves_volcano_jobs_ends_the_wait_naming_the_fix(api, sim, monkeypatch):
    from tests.support import k8s_sim_api

    name = _submit(sim, "volcano")
    # The scheduler's CRDs are gone (uninstalled, or the wrong scheduler in clusters.yaml): the API
    # server answers its plain "404 page not found", which is not the job being gone.
    monkeypatch.setattr(k8s_sim_api, "_RESOURCES", {k: v for k, v in k8s_sim_api._RESOURCES.items()
                                                    if k[0] != "batch.volcano.sh"})
    event = asyncio.run(_first_event(_trigger(name), timeout=5))
    assert event["status"] == "error", event
    assert "Connection 'k8s_dc2' serves no jobs.batch.volcano.sh (404 Not Found" in event["message"]
    assert "install the scheduler" in event["message"]


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_a_deleted_job_still_reads_as_gone(api, sim, scheduler):
    name = _submit(sim, scheduler)
    _backend(scheduler).delete(name)
    event = asyncio.run(_first_event(_trigger(name, scheduler=scheduler), timeout=5))
    assert event["status"] == "failed" and "does not exist" in event["message"]


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_the_blocking_wait_rides_out_an_outage_and_the_gang_finishes(api, sim, scheduler):
    backend = KubernetesGangBackend(private_h100_cluster(scheduler), image="registry.local/train:1",
                                    read_timeout_s=2.0, api_outage_s=30)
    job = GangJob(name="train-r1-0123456789", workers=2, spec={"run_key": "r1"}, labels={"team": "vision"})
    polls = []

    def sleep(seconds: float) -> None:
        polls.append(seconds)
        with api.lock:
            if len(polls) == 2:
                sim.outage(1.5, status=503)  # the API server restarts while the task waits in a worker
            if len(polls) == 8:
                sim.succeed(job.name)
        time.sleep(min(seconds, 0.3))
        with api.lock:
            sim.step()

    status = backend.run(job, pool="h100", queue="vision", admission_timeout_s=60, poll_s=0.05, sleep=sleep)
    assert status.phase == SUCCEEDED
    assert any(s >= 0.5 for s in polls)  # it backed off while the API answered 503


def test_the_blocking_wait_gives_up_after_the_outage_budget_naming_the_connection(api, sim):
    backend = KubernetesGangBackend(private_h100_cluster("kueue"), image="registry.local/train:1",
                                    read_timeout_s=2.0, api_outage_s=1.0)
    job = GangJob(name="train-r1-0123456789", workers=2, spec={"run_key": "r1"}, labels={"team": "vision"})

    def sleep(seconds: float) -> None:
        with api.lock:
            sim.outage(30, status=503)
        time.sleep(min(seconds, 0.3))

    with pytest.raises(GangError, match=r"Connection 'k8s_dc2'\) was unreachable for \d+ s .*kubernetes_api_outage_s"):
        backend.run(job, pool="h100", queue="vision", admission_timeout_s=60, poll_s=0.05, sleep=sleep)
    assert (NS, job.name) in sim.jobs  # the gang is left running: a retry re-attaches
