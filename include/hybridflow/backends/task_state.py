"""What Airflow has as a deferred task's state, asked from a trigger's ``on_kill``: Airflow cancels
"by user action" a trigger that was only handed to another triggerer too, and the task's state
tells the two apart (still ``deferred``: the wait moved; anything else: a user stopped the task)."""

from __future__ import annotations

from typing import Any


async def deferred_task_state(ti: Any, log: Any, what: str) -> str | None:
    """The deferred task's state as Airflow has it now (``ti``: the trigger's task instance); None
    when it cannot be told (no task instance, or no answer): a cancel is then taken as the user's,
    as Airflow says it is."""
    if ti is None:
        return None
    try:
        from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance
        from asgiref.sync import sync_to_async

        states = await sync_to_async(RuntimeTaskInstance.get_task_states)(
            dag_id=ti.dag_id, map_index=ti.map_index, task_ids=[ti.task_id], run_ids=[ti.run_id])
    except Exception as exc:  # noqa: BLE001 - without an answer the user's stop is honoured
        log.warning("%s: the task's state could not be read (%s); taking the cancel as a user's stop", what, exc)
        return None
    run = states.get(ti.run_id) or {}
    key = ti.task_id if (ti.map_index is None or ti.map_index < 0) else f"{ti.task_id}_{ti.map_index}"
    return run.get(key)
