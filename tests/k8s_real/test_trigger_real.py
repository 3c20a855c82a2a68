"""The deferred train task's trigger on a real control plane, driven through Airflow's own
``TriggerRunner``: a user stopping the task deletes the job, and the real garbage collector takes
its pods, PodGroup or Workload with it (the Secret and Service the backend deletes); a triggerer
restart leaves the gang running, and the next trigger re-attaches and reports the gang's success."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
from tests.k8s_real.conftest import CONN_ID, real_cluster, until
from tests.support.trigger_runner import stop_while_deferred

from hybridflow.backends.k8s.backend import KubernetesGangBackend
from hybridflow.backends.k8s.trigger import GangJobTrigger
from hybridflow.backends.local import GangJob


def _queue(real, scheduler: str) -> None:
    if scheduler == "kueue":
        real.kueue_queues({"vision": 8})
    else:
        real.volcano_queue("vision")


def _gang(real, scheduler: str, *, pool: str, command=None) -> str:
    kw = {"command": command} if command else {}
    backend = KubernetesGangBackend(real_cluster(scheduler, real.ns, pool=pool), image="registry.local/train:1",
                                    read_timeout_s=10, **kw)
    job = GangJob(name=f"train-r1-{scheduler}", workers=4, spec={"run_key": "r1"}, env={"TOKEN": "s3cr3t"},
                  labels={"team": "vision"})
    backend.submit_spec(backend.gang_spec(job, pool=pool, queue="vision"), job.env)
    return job.name


def _trigger(real, name: str, scheduler: str) -> GangJobTrigger:
    return GangJobTrigger(conn_id=CONN_ID, scheduler=scheduler, namespace=real.ns, name=name, cluster="k8s-real",
                          submitted_at=time.time(), admission_timeout_s=600, poll_interval=0.2, request_timeout_s=10)




def _left(real, name: str, scheduler: str) -> dict:
    """What is left of gang ``name`` in the namespace, by kind."""
    custom = real.custom()
    owned = custom.list_namespaced_custom_object(
        *(("scheduling.volcano.sh", "v1beta1", real.ns, "podgroups") if scheduler == "volcano"
          else ("kueue.x-k8s.io", "v1beta2", real.ns, "workloads")))["items"]
    jobs = (custom.list_namespaced_custom_object("batch.volcano.sh", "v1alpha1", real.ns, "jobs")["items"]
            if scheduler == "volcano" else real.batch().list_namespaced_job(real.ns).items)
    return {"jobs": len(jobs), "pods": len(real.pods(name)), "owned": len(owned),
            "secrets": len(real.core().list_namespaced_secret(real.ns, field_selector=f"metadata.name={name}-env").items),
            "services": len(real.core().list_namespaced_service(real.ns).items)}


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_a_user_stopping_the_deferred_task_deletes_the_gang_and_the_collector_takes_the_rest(real, scheduler):
    _queue(real, scheduler)
    name = _gang(real, scheduler, pool="h100")
    until(lambda: len([p for p in real.pods(name) if p.status.phase == "Running"]) == 4, what="the gang to run")
    asyncio.run(stop_while_deferred(_trigger(real, name, scheduler), user_action=True, wait_s=1.0))
    gone = {"jobs": 0, "pods": 0, "owned": 0, "secrets": 0, "services": 0}
    until(lambda: _left(real, name, scheduler) == gone, 60, "the job, its pods, PodGroup/Workload, Secret and Service "
          f"to be gone (left: {_left(real, name, scheduler)})")


@pytest.mark.parametrize("scheduler", ["volcano", "kueue"])
def test_a_triggerer_restart_leaves_the_gang_running_and_the_next_trigger_reattaches(real, agent, scheduler, tmp_path):
    _queue(real, scheduler)
    script = tmp_path / "work.py"
    script.write_text("import time\ntime.sleep(4)\n")
    name = _gang(real, scheduler, pool="run", command=(sys.executable, str(script)))
    until(lambda: len([p for p in real.pods(name) if p.status.phase == "Running"]) == 4, 60, "the gang to run")
    asyncio.run(stop_while_deferred(_trigger(real, name, scheduler), user_action=False, wait_s=1.0))
    assert _left(real, name, scheduler)["pods"] == 4  # nothing deleted

    async def first_event():
        async for event in _trigger(real, name, scheduler).run():
            return event.payload

    payload = asyncio.run(asyncio.wait_for(first_event(), 90))
    assert payload["status"] == "success" and payload["admitted"], payload
