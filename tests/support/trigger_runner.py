"""Stopping a deferred task's trigger the way Airflow's triggerer does, through its own TriggerRunner:
a user action (mark failed or success, clear) cancels it with the user-action message, so it gets
``on_kill``; a triggerer shutting down (or handing the trigger over) cancels it plainly."""

from __future__ import annotations

import asyncio

import pytest
from airflow.jobs.triggerer_job_runner import TriggerRunner


async def stop_while_deferred(trigger, *, user_action: bool, wait_s: float = 0.3) -> None:
    """Start ``trigger`` in a TriggerRunner, let it poll ``wait_s``, then stop it; it must not have
    fired an event."""
    runner = TriggerRunner()
    task = asyncio.create_task(runner.run_trigger(1, trigger, None, None))
    runner.triggers[1] = {"task": task, "name": "gang", "events": 0, "is_watcher": False}
    await asyncio.sleep(wait_s)
    assert not task.done()  # still waiting for the gang
    if user_action:
        runner.to_cancel.append(1)
        await runner.cancel_triggers()
    else:
        task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert runner.triggers[1]["events"] == 0
