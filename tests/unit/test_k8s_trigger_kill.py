"""A deferred Kubernetes train task stopped by a user deletes its gang; a triggerer restart does not.

Driven through Airflow's own ``TriggerRunner.run_trigger`` and ``cancel_triggers``: a trigger removed
by a user action (mark failed / success, clear) is cancelled with the user-action message and gets
``on_kill``; a triggerer shutting down cancels it plainly and only ``cleanup`` runs. The gang lives in
the simulator served over HTTP (:mod:`tests.support.k8s_http`): the trigger's real KubernetesHook
reaches it through Connection k8s_dc2."""

from __future__ import annotations

import asyncio
import time

import pytest
from tests.support.k8s_config import private_h100_cluster
from tests.support.k8s_http import SimApiServer, serve
from tests.support.k8s_sim import SimCluster
from tests.support.trigger_runner import stop_while_deferred

from hybridflow.backends.k8s.backend import KubernetesGangBackend
from hybridflow.backends.k8s.trigger import GangJobTrigger
from hybridflow.backends.local import GangJob

NS = "hybridflow"


@pytest.fixture
def sim():
    return SimCluster({"h100-1": {"gpus": 8, "labels": {"hybridflow.io/pool": "h100"}}})


@pytest.fixture
def api(monkeypatch, sim):
    with serve(monkeypatch, sim) as server:
        yield server


def _deletes(api: SimApiServer) -> list[str]:
    """The DELETE requests the API server got, as path?query."""
    return [r.url.path_qs for r in api.handler if r.method.value == "DELETE"]


def _running_gang(sim: SimCluster, scheduler: str) -> str:
    backend = KubernetesGangBackend(private_h100_cluster(scheduler), image="registry.local/train:1")
    job = GangJob(name="train-r1-0123456789", workers=4, spec={"run_key": "r1"}, env={"TOKEN": "s3cr3t"},
                  labels={"team": "vision"})
    backend.submit_spec(backend.gang_spec(job, pool="h100", queue="vision"), job.env)
    sim.run(3)
    assert len(sim.pod_names(job.name)) == 4
    return job.name


def _trigger(name: str, scheduler: str) -> GangJobTrigger:
    return GangJobTrigger(conn_id="k8s_dc2", scheduler=scheduler, namespace=NS, name=name, cluster="dc2-k8s",
                          submitted_at=time.time(), admission_timeout_s=600, poll_interval=0.05,
                          request_timeout_s=2.0)




@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_user_stopping_the_deferred_task_deletes_job_pods_secret_and_service(api, sim, scheduler):
    name = _running_gang(sim, scheduler)
    asyncio.run(stop_while_deferred(_trigger(name, scheduler), user_action=True))
    assert not sim.vcjobs and not sim.jobs and sim.pod_names(name) == []
    assert not sim.secrets and not sim.services and not sim.podgroups and not sim.workloads
    jobs = "/apis/batch.volcano.sh/v1alpha1" if scheduler == "volcano" else "/apis/batch/v1"
    # The job goes with its pods (a batch/v1 Job's would be orphaned without the propagation policy).
    assert _deletes(api) == [f"{jobs}/namespaces/{NS}/jobs/{name}?propagationPolicy=Background",
                             f"/api/v1/namespaces/{NS}/secrets/{name}-env", f"/api/v1/namespaces/{NS}/services/{name}"]


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_triggerer_restart_leaves_the_gang_running(api, sim, scheduler):
    name = _running_gang(sim, scheduler)
    asyncio.run(stop_while_deferred(_trigger(name, scheduler), user_action=False))
    assert len(sim.pod_names(name)) == 4 and (sim.vcjobs or sim.jobs) and sim.secrets
    assert not _deletes(api) and not any(m.startswith("delete_") for m, _ in sim.requests)
    assert any(m in ("get_namespaced_custom_object", "read_namespaced_job") for m, _ in sim.requests)  # it polled


def test_on_kill_of_a_gang_already_gone_is_a_no_op(api, sim):
    name = _running_gang(sim, "kueue")
    trigger = _trigger(name, "kueue")
    asyncio.run(trigger.on_kill())
    assert not sim.jobs and not sim.secrets and not sim.services
    asyncio.run(trigger.on_kill())  # the job, Secret and Service are gone: 404 each, no error
    assert sim.calls.count(f"delete job {name}") == 2 and not sim.jobs
    assert len(_deletes(api)) == 6
