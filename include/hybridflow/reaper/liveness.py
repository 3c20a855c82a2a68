"""Whether the Airflow task a thing was made for may still use it: states in, verdict out.

A thing is ``ALIVE`` (never touched) while its DAG run is queued or running and its task has not
finished: no state yet, scheduled, queued, running, deferred, up for retry or reschedule, restarting,
awaiting input (a retry re-attaches to the same gang by its deterministic name, so any try counts). It has
``ENDED`` when its DAG run is gone or finished (success, failed), or its task finished (success,
failed, skipped, upstream_failed, removed). Anything else, a state that could not be read included,
is ``UNKNOWN``, and the sweep keeps the thing: it never releases on doubt.
"""

from __future__ import annotations

ALIVE, ENDED, UNKNOWN = "alive", "ended", "unknown"

# Stand-ins for what a state reading can also be.
RUN_GONE = "<no such dag run>"
NO_TASK_INSTANCE = "<no such task instance>"
UNREAD = "<could not be read>"

RUN_ALIVE = frozenset({"queued", "running"})
RUN_ENDED = frozenset({"success", "failed"})
TASK_ALIVE = frozenset({None, "scheduled", "queued", "running", "deferred", "up_for_retry", "up_for_reschedule",
                        "restarting", "awaiting_input"})
TASK_ENDED = frozenset({"success", "failed", "skipped", "upstream_failed", "removed"})


def verdict(run_state: str | None, task_state: str | None = None, *, whole_run: bool = False) -> str:
    """ALIVE, ENDED or UNKNOWN for a thing whose owner's DAG run is in ``run_state`` (a DagRunState
    value, ``RUN_GONE`` or ``UNREAD``) and whose task is in ``task_state`` (a TaskInstanceState value,
    None for no state yet, ``NO_TASK_INSTANCE`` or ``UNREAD``). ``whole_run``: the thing belongs to
    the DAG run, not one task (only the run's state counts)."""
    run_state = _value(run_state)
    if run_state == RUN_GONE or run_state in RUN_ENDED:
        return ENDED
    if run_state not in RUN_ALIVE:
        return UNKNOWN  # UNREAD, or a state this code does not know
    if whole_run:
        return ALIVE
    task_state = _value(task_state)
    if task_state in TASK_ENDED:
        return ENDED
    if task_state in TASK_ALIVE:
        return ALIVE
    return UNKNOWN  # UNREAD, NO_TASK_INSTANCE while the run goes on, or an unknown state


def _value(state):
    """A state enum as its string value (Airflow's states are str enums; readings may be either)."""
    return getattr(state, "value", state)
