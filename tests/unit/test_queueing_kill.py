"""A local gang waiting in the triggerer whose task a user stops withdraws its ticket; a triggerer
restart keeps it.

Driven through Airflow's own ``TriggerRunner`` (:func:`tests.support.trigger_runner.stop_while_deferred`):
a user action (mark failed / success, clear) cancels the trigger with the user-action message and
Airflow calls ``on_kill``; a triggerer shutting down cancels it plainly. The queue is the shipped
estate's onprem-a slot pool (4 GPUs) under a test HYBRIDFLOW_HOME."""

from __future__ import annotations

import asyncio
import os
import time
from types import SimpleNamespace

import pytest
from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance
from tests.support.trigger_runner import stop_while_deferred

from hybridflow.backends import gang_backend
from hybridflow.config import load_estate
from hybridflow.queueing import QueueWaitTrigger, read_standing
from hybridflow.settings import get_settings

GANG = "train-r1"
TI = SimpleNamespace(dag_id="hybrid_training", run_id="manual__2026-12-05T09:00:00+00:00", task_id="train",
                     map_index=-1, try_number=1)


@pytest.fixture
def pool(tmp_path, monkeypatch):
    """onprem-a's slot pool, its 4 slots held by another gang."""
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    settings = get_settings()
    estate = load_estate(settings.config_dir)
    pool = gang_backend(estate.clusters["onprem-a"], estate, settings.state_dir).pool
    assert pool.capacity == 4 and pool.try_acquire("busy", 4, os.getpid())
    return pool


def _trigger(workers: int = 2) -> QueueWaitTrigger:
    return QueueWaitTrigger(kind="slots", cluster="onprem-a",
                            job={"name": GANG, "workers": workers, "priority": "normal", "team": "perception",
                                 "team_cap": None},
                            run={"run_key": "r1"}, queued_since=time.time(),
                            max_wait_s=3600, recheck_s=3600, poll_s=0.02)


def _state() -> str:
    return read_standing(get_settings().private_root, "r1")["state"]


def test_a_user_stopping_the_deferred_task_withdraws_its_ticket(pool):
    asyncio.run(stop_while_deferred(_trigger(), user_action=True, wait_s=1.0))
    assert GANG not in pool.waiting() and _state() == "stopped"
    pool.release("busy")
    # The pool is empty: a 1-GPU gang that came later is no longer held behind a gang nobody waits for.
    assert pool.try_acquire("train-small", 1, os.getpid(), queue=True)
    asyncio.run(_trigger().on_kill())  # stopped again: nothing left to withdraw, no error
    assert pool.waiting() == {}


def test_a_triggerer_restart_keeps_the_gang_s_place(pool):
    asyncio.run(stop_while_deferred(_trigger(), user_action=False, wait_s=1.0))
    assert pool.waiting()[GANG]["slots"] == 2 and _state() == "waiting"
    pool.release("busy")
    assert not pool.try_acquire("train-small", 1, os.getpid(), queue=True)  # still behind train-r1


@pytest.mark.parametrize(("task_state", "kept"), [("deferred", True), ("failed", False)])
def test_only_a_task_airflow_no_longer_has_deferred_loses_its_place(pool, monkeypatch, task_state, kept):
    """Airflow 3.3's triggerer also cancels "by user action" a trigger merely handed to another
    triggerer: Airflow's state of the task tells the two apart."""
    asked = []

    def get_task_states(**kw):
        asked.append(kw)
        return {TI.run_id: {TI.task_id: task_state}}

    monkeypatch.setattr(RuntimeTaskInstance, "get_task_states", staticmethod(get_task_states))
    trigger = _trigger()
    trigger.task_instance = TI
    admitted, _ = trigger._poll()
    assert not admitted and GANG in pool.waiting()  # queued behind the busy gang
    asyncio.run(trigger.on_kill())
    assert (GANG in pool.waiting()) is kept
    assert asked == [{"dag_id": TI.dag_id, "map_index": -1, "task_ids": ["train"], "run_ids": [TI.run_id]}]


def test_slots_a_stopped_trigger_took_are_given_back(pool):
    trigger = _trigger(workers=1)
    pool.release("busy")
    admitted, _ = trigger._poll()  # admitted, and then stopped before its event reached the task
    assert admitted and GANG in pool.holdings()
    asyncio.run(trigger.on_kill())
    assert pool.holdings() == {} and pool.waiting() == {}


def test_slots_a_new_try_took_over_stay_with_it(pool):
    trigger = _trigger(workers=1)
    pool.release("busy")
    admitted, _ = trigger._poll()
    assert admitted and "lease_until" in pool.holdings()[GANG]
    assert pool.try_acquire(GANG, 1, os.getppid())  # a new try of the cleared task launches on them
    asyncio.run(trigger.on_kill())
    assert pool.holdings()[GANG]["pid"] == os.getppid()
