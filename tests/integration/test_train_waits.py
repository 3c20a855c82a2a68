"""Runs that wait: a gang that no eligible cluster can take now keeps its place in the queue, in the
triggerer, and starts when capacity frees up, without spending an Airflow retry."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import yaml
from tests.support.train_task import seed_examples, train_task

from hybridflow.backends.local import LocalSlotPool
from hybridflow.settings import REPO_ROOT


@pytest.fixture
def busy_private(tmp_path, monkeypatch):
    """Shipped config with a 1 s admission window, fast queue polls and a short maximum wait."""
    home, config = tmp_path / "home", tmp_path / "config"
    shutil.copytree(REPO_ROOT / "config", config)
    pipeline = yaml.safe_load((config / "pipeline.yaml").read_text())
    pipeline["training"].update(gang_admission_timeout_s=1, preemption_grace_s=5, queue_poll_s=0.2)
    (config / "pipeline.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(home))
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(config))
    seed_examples(home)
    return home


def _restricted(name: str):
    return train_task(name, {"classification": "restricted", "hyperparameters": {"steps": 40},
                             "checkpoint_every_steps": 20})


async def _events(trigger, seen: list) -> None:
    async for event in trigger.run():
        seen.append(event.payload)
        return


def test_restricted_run_waits_for_the_busy_private_pool_and_starts_when_a_gang_finishes(busy_private: Path) -> None:
    from airflow.sdk.exceptions import TaskDeferred

    from hybridflow.ledger.queue_waits import queue_wait_history
    from hybridflow.queueing import QueueWaitTrigger, read_standing

    home = busy_private
    run, placement, staged, op, context = _restricted("waits")
    assert placement["cluster"] == "onprem-a"
    blocker = LocalSlotPool(home / "state", "onprem-a", 4)
    assert blocker.try_acquire("someone-else", 4)
    try:
        with pytest.raises(TaskDeferred) as deferred:
            op.execute(context)  # 1 s in the worker, then no other eligible cluster: it waits, it does not fail
        trigger = deferred.value.trigger
        assert isinstance(trigger, QueueWaitTrigger) and trigger.kind == "slots"
        assert deferred.value.method_name == "resume_after_wait"
        seen: list = []
        waiting = threading.Thread(target=lambda: asyncio.run(_events(trigger, seen)))
        waiting.start()
        deadline = time.monotonic() + 20
        while (note := read_standing(home / "private", run["run_key"])) is None or note["state"] != "waiting":
            assert time.monotonic() < deadline, "the wait never showed on the run's page"
            time.sleep(0.1)
        assert note["cluster"] == "onprem-a" and note["position"] == 1 and note["free"] == 0
        assert "estimate_basis" in note  # no history yet: the basis says so
    finally:
        blocker.release("someone-else")  # the other gang finishes
    waiting.join(timeout=30)
    assert seen and seen[0]["status"] == "admitted", seen
    # The trigger took nothing: the slots stay free, and the ticket the task kept before deferring holds
    # the gang's place, so a later gang cannot take them meanwhile.
    pool = LocalSlotPool(home / "state", "onprem-a", 4)
    assert pool.holdings() == {} and f"train-{run['run_key']}" in pool.waiting()
    assert not pool.try_acquire("later", 1, queue=True)
    pool.withdraw("later")

    resumed = type(op)(task_id=op.task_id, run=op.run, placement=op.placement, staged=op.staged)
    result = resumed.resume_after_wait(context, event=seen[0], **deferred.value.kwargs)
    assert result["cluster"] == "onprem-a" and result["final_step"] == 40
    run_folder = home / "private" / "runs" / run["run_key"]
    attempts = json.loads((run_folder / "train-attempts.json").read_text())
    assert [(a["try_number"], a["outcome"]) for a in attempts] == [(1, "not_admitted"), (1, "succeeded")]
    assert read_standing(home / "private", run["run_key"])["state"] == "admitted"
    assert LocalSlotPool(home / "state", "onprem-a", 4).holdings() == {}
    [wait] = queue_wait_history(days=1, clusters=["onprem-a"])
    assert wait.gpus == 2 and wait.wait_s >= 1.0  # the history deadline placement estimates from


def test_a_wait_past_max_queue_wait_fails_naming_the_setting(busy_private: Path) -> None:
    from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

    home = busy_private
    config = Path(busy_private.parent / "config")
    pipeline = yaml.safe_load((config / "pipeline.yaml").read_text())
    pipeline["training"]["max_queue_wait_s"] = 2
    (config / "pipeline.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    run, _, _, op, context = _restricted("gives-up")
    blocker = LocalSlotPool(home / "state", "onprem-a", 4)
    assert blocker.try_acquire("someone-else", 4)
    try:
        with pytest.raises(TaskDeferred) as deferred:
            op.execute(context)
        seen: list = []
        asyncio.run(_events(deferred.value.trigger, seen))
        assert seen[0]["status"] == "expired"
        resumed = type(op)(task_id=op.task_id, run=op.run, placement=op.placement, staged=op.staged)
        with pytest.raises(AirflowFailException, match="training.max_queue_wait_s is 2"):
            resumed.resume_after_wait(context, event=seen[0], **deferred.value.kwargs)
    finally:
        blocker.release("someone-else")
    # It left the queue: nothing of the run waits or holds slots there.
    pool = LocalSlotPool(home / "state", "onprem-a", 4)
    assert pool.waiting() == {} and pool.holdings() == {}
