"""Airflow 3.3's triggerer cancels "by user action" every trigger no longer assigned to it, also one
merely handed to another triggerer. The gang is deleted only when Airflow says the task was stopped:
a task still deferred keeps its gang (the other triggerer carries on waiting for it)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance
from tests.support.k8s_config import private_h100_cluster
from tests.support.k8s_sim import SimCluster, install

from hybridflow.backends.k8s.backend import KubernetesGangBackend
from hybridflow.backends.k8s.trigger import GangJobTrigger
from hybridflow.backends.local import GangJob

NAME = "train-r1-0123456789"
TI = SimpleNamespace(dag_id="hybrid_training", run_id="manual__2026-12-05T09:00:00+00:00", task_id="train",
                     map_index=-1, try_number=1)


@pytest.fixture
def sim(monkeypatch):
    sim = SimCluster({"h100-1": {"gpus": 8, "labels": {"hybridflow.io/pool": "h100"}}})
    install(monkeypatch, sim)
    backend = KubernetesGangBackend(private_h100_cluster("kueue"), image="registry.local/train:1")
    job = GangJob(name=NAME, workers=2, spec={"run_key": "r1"}, labels={"team": "vision"})
    backend.submit_spec(backend.gang_spec(job, pool="h100", queue="vision"), job.env)
    sim.run(3)
    return sim


def _kill(monkeypatch, answer) -> None:
    asked = []

    def get_task_states(**kw):
        asked.append(kw)
        if isinstance(answer, BaseException):
            raise answer
        return {TI.run_id: {TI.task_id: answer}}

    monkeypatch.setattr(RuntimeTaskInstance, "get_task_states", staticmethod(get_task_states))
    trigger = GangJobTrigger(conn_id="k8s_dc2", scheduler="kueue", namespace="hybridflow", name=NAME,
                             cluster="dc2-k8s", submitted_at=time.time(), admission_timeout_s=600,
                             request_timeout_s=2.0)
    trigger.task_instance = TI
    asyncio.run(trigger.on_kill())
    assert asked == [{"dag_id": TI.dag_id, "map_index": -1, "task_ids": ["train"], "run_ids": [TI.run_id]}]


def test_a_trigger_moved_to_another_triggerer_leaves_the_gang_running(sim, monkeypatch):
    _kill(monkeypatch, "deferred")
    assert sim.jobs and len(sim.pod_names(NAME)) == 2
    assert not any(m.startswith("delete_") for m, _ in sim.requests)


@pytest.mark.parametrize("state", ["failed", "success", None, "restarting"])
def test_a_task_a_user_stopped_or_cleared_loses_its_gang(sim, monkeypatch, state):
    _kill(monkeypatch, state)
    assert not sim.jobs and sim.pod_names(NAME) == []


def test_without_an_answer_from_airflow_the_user_s_stop_is_honoured(sim, monkeypatch):
    _kill(monkeypatch, RuntimeError("no supervisor"))
    assert not sim.jobs and sim.pod_names(NAME) == []
