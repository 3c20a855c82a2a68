"""A local gang waiting in the triggerer whose task a user stops withdraws its ticket; a triggerer
restart keeps it. The trigger itself only reads the queue: it takes no slots and stops no gang.

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
    assert pool.capacity == 4 and pool.try_acquire("busy", 4, os.getpid(), priority="batch")
    return pool


def _trigger(workers: int = 2, priority: str = "normal", *, pool=None) -> QueueWaitTrigger:
    """The wait of a deferred task; with ``pool``, the ticket that task kept before deferring."""
    queued_since = time.time()
    if pool is not None:
        pool.keep_ticket(GANG, workers, since=queued_since, keep_s=3600, priority=priority, team="perception")
    return QueueWaitTrigger(kind="slots", cluster="onprem-a",
                            job={"name": GANG, "workers": workers, "priority": priority, "team": "perception",
                                 "team_cap": None},
                            run={"run_key": "r1"}, queued_since=queued_since,
                            max_wait_s=3600, recheck_s=3600, poll_s=0.02)


def _state() -> str:
    return read_standing(get_settings().private_root, "r1")["state"]


def test_a_user_stopping_the_deferred_task_withdraws_its_ticket(pool):
    asyncio.run(stop_while_deferred(_trigger(pool=pool), user_action=True, wait_s=1.0))
    assert GANG not in pool.waiting() and _state() == "stopped"
    pool.release("busy")
    # The pool is empty: a 1-GPU gang that came later is no longer held behind a gang nobody waits for.
    assert pool.try_acquire("train-small", 1, os.getpid(), queue=True)
    asyncio.run(_trigger().on_kill())  # stopped again: nothing left to withdraw, no error
    assert pool.waiting() == {}


def test_a_triggerer_restart_keeps_the_gang_s_place(pool):
    asyncio.run(stop_while_deferred(_trigger(pool=pool), user_action=False, wait_s=1.0))
    assert pool.waiting()[GANG]["slots"] == 2 and read_standing(get_settings().private_root, "r1") is None
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
    trigger = _trigger(pool=pool)
    trigger.task_instance = TI
    verdict, _ = trigger.standing_now()
    assert verdict is None and GANG in pool.waiting()  # queued behind the busy gang
    asyncio.run(trigger.on_kill())
    assert (GANG in pool.waiting()) is kept
    assert asked == [{"dag_id": TI.dag_id, "map_index": -1, "task_ids": ["train"], "run_ids": [TI.run_id]}]


def test_the_trigger_takes_no_slots_and_stops_no_gang(pool):
    before = pool.path.read_text()
    trigger = _trigger(workers=2, pool=pool)
    kept = pool.path.read_text()
    assert trigger.standing_now()[0] is None  # the busy gang holds all 4 slots
    critical = _trigger(workers=2, priority="critical")
    verdict, note = critical.standing_now()
    # A critical gang fits once the batch gang stops: the trigger says so, the task stops it.
    assert verdict == "preempt" and note["free"] == 0
    assert pool.path.read_text() == kept != before  # only the task's own ticket was ever written
    pool.release("busy")
    assert trigger.standing_now()[0] == "now"
    assert pool.holdings() == {} and GANG in pool.waiting()  # the slots wait for the resumed task


def test_stopping_a_wait_never_gives_back_slots_a_new_try_took(pool):
    trigger = _trigger(workers=1, pool=pool)
    pool.release("busy")
    assert pool.try_acquire(GANG, 1, os.getppid())  # a new try of the cleared task launched on them
    asyncio.run(trigger.on_kill())
    assert pool.holdings()[GANG]["pid"] == os.getppid() and pool.waiting() == {}


def test_a_preempt_event_resumes_the_task_which_stops_the_batch_gangs_and_launches(pool, monkeypatch):
    from hybridflow.operators.train import GangTrainOperator

    op = GangTrainOperator(task_id="train", run={"run_key": "r1"}, placement={}, staged={})
    trained: list = []
    monkeypatch.setattr(op, "_train_with_failover", lambda *args: trained.append(args[3]) or {})
    op.resume_after_wait({}, event={"status": "preempt", "cluster": "onprem-a"}, placement={"cluster": "onprem-a"},
                         staged={}, queued_since=time.time())
    assert trained == [{"cluster": "onprem-a"}]  # the launch path, whose admission stops batch gangs first
