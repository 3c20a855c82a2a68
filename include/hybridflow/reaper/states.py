"""Airflow's own states of the runs and tasks that things were made for, read through the Task SDK
from inside the reaper's task (``context["ti"]``), each run read once per sweep.

A reading that fails is ``UNREAD``, never an exception: the sweep then keeps the thing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from hybridflow.reaper.base import Owner
from hybridflow.reaper.liveness import NO_TASK_INSTANCE, RUN_GONE, UNREAD, verdict

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Judgement:
    verdict: str  # liveness.ALIVE, ENDED or UNKNOWN
    ended: datetime | None = None  # when the owner's DAG run ended, if it did and that could be read
    why: str = ""  # the states it was judged on, for the log


class AirflowStates:
    """Owner liveness from the metadata database, through the task instance's Task SDK calls
    (``get_dr_count``, ``get_dagrun_state``, ``get_task_states``)."""

    def __init__(self, ti: Any) -> None:
        self.ti = ti
        self._runs: dict[tuple[str, str], tuple[str, datetime | None]] = {}
        self._tasks: dict[tuple[str, str], dict[str, Any] | None] = {}

    def judge(self, owner: Owner) -> Judgement:
        run_state, ended = self._run(owner.dag_id, owner.run_id)
        task_state = None
        if owner.task_id is not None and run_state not in (RUN_GONE, UNREAD):
            task_state = self._task(owner.dag_id, owner.run_id, owner.task_id)
        found = verdict(run_state, task_state, whole_run=owner.task_id is None)
        why = f"run {owner.dag_id}/{owner.run_id}: {run_state}"
        if owner.task_id is not None:
            why += f", task {owner.task_id}: {task_state}"
        return Judgement(found, ended, why)

    def _run(self, dag_id: str, run_id: str) -> tuple[str, datetime | None]:
        key = (dag_id, run_id)
        if key not in self._runs:
            self._runs[key] = self._read_run(dag_id, run_id)
        return self._runs[key]

    def _read_run(self, dag_id: str, run_id: str) -> tuple[str, datetime | None]:
        try:
            if self.ti.get_dr_count(dag_id=dag_id, run_ids=[run_id]) == 0:
                return RUN_GONE, None
            state = self.ti.get_dagrun_state(dag_id=dag_id, run_id=run_id)
        except Exception as exc:  # noqa: BLE001 - an unreadable state keeps the thing
            log.warning("could not read the state of DAG run %s/%s: %s", dag_id, run_id, exc)
            return UNREAD, None
        state = getattr(state, "value", state)
        return state, (_run_end(dag_id, run_id) if state in ("success", "failed") else None)

    def _task(self, dag_id: str, run_id: str, task_id: str) -> str | None:
        key = (dag_id, run_id)
        if key not in self._tasks:
            try:
                states = self.ti.get_task_states(dag_id=dag_id, run_ids=[run_id])
                self._tasks[key] = dict((states or {}).get(run_id) or {})
            except Exception as exc:  # noqa: BLE001 - an unreadable state keeps the thing
                log.warning("could not read the task states of DAG run %s/%s: %s", dag_id, run_id, exc)
                self._tasks[key] = None
        states = self._tasks[key]
        if states is None:
            return UNREAD
        if task_id not in states:
            return NO_TASK_INSTANCE
        state = states[task_id]
        return getattr(state, "value", state)


def _run_end(dag_id: str, run_id: str) -> datetime | None:
    """The finished DAG run's end date (the Task SDK's GetDagRun), or None if it cannot be read."""
    try:
        from airflow.sdk.execution_time.comms import GetDagRun
        from airflow.sdk.execution_time.task_runner import SUPERVISOR_COMMS

        return SUPERVISOR_COMMS.send(GetDagRun(dag_id=dag_id, run_id=run_id)).end_date
    except Exception:  # noqa: BLE001 - without it, GPU-hours count from when the thing started
        return None
