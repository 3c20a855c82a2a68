"""Deferrable wait for a gang job: polls its status until it ends, or moves or gives up waiting.

While waiting it changes nothing on the cluster (it never deletes or restarts: the operator
decides in ``execute_complete``), and every outcome, errors included, becomes one event with a
``status``:

- ``success``: the gang finished;
- ``failed``: it failed for good (restarts exhausted, or the job vanished);
- ``moved``: it was checkpointed and moved off to make room for work that may run only on its
  cluster (:mod:`~hybridflow.backends.k8s.moves`): the operator places the run again;
- ``not_admitted``: still waiting for gang admission ``admission_timeout_s`` after ``submitted_at``:
  the operator looks for another eligible cluster that would admit it now and moves it there, or
  defers again for another window (the gang keeps its place in the queue);
- ``expired``: still waiting ``max_wait_s`` after it first queued (``queued_since``);
- ``error``: the API could not be read: it refused the Connection (401, or 403 naming the RBAC verb
  and resource missing), or stayed unreachable for ``api_outage_s`` (connection errors, timeouts, 429
  and 5xx answers are retried with backoff until then, without ending the wait).

The trigger only waits: while it waits it reads the gang's status and changes nothing, neither on the cluster
nor in the run's files, and never places. Where the gang stands in the queue (the run's queue.json)
is written by the operator each time it defers (:mod:`hybridflow.queueing`).
The event's ``gang`` holds the last :class:`~hybridflow.backends.base.GangStatus` as a dict,
``admitted`` whether the gang ever started and ``admitted_at`` (epoch) when it was first seen so.

A user marking the deferred task failed or success, or clearing it, cancels the wait: Airflow then
calls :meth:`GangJobTrigger.on_kill`, which deletes the job with its pods, Secret and Service. A
triggerer that restarts only calls ``cleanup`` (not overridden): the gang keeps running and the next
triggerer carries on waiting for it. Airflow 3.3's triggerer also cancels "by user action" a
trigger that was merely handed to another triggerer (it is no longer among those assigned to this
one), so ``on_kill`` first asks Airflow for the task's state: a task still deferred has not been
stopped, and its gang is left alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from hybridflow.backends.base import PREEMPTED
from hybridflow.backends.k8s.api import describe, is_transient, job_call, misconfiguration
from hybridflow.backends.k8s.backend import (
    FAILED,
    MISSING,
    PENDING,
    SUCCEEDED,
    GangStatus,
    delete_gang,
    read_status,
)
from hybridflow.errors import GangError
from hybridflow.hooks.kubernetes import kubernetes_hook

# on_kill retries transient API errors this long: within the triggerer's default on_kill_timeout.
KILL_RETRY_S = 15.0


class GangJobTrigger(BaseTrigger):
    def __init__(self, *, conn_id: str, scheduler: str, namespace: str, name: str, cluster: str,
                 submitted_at: float, admission_timeout_s: float, poll_interval: float = 15.0,
                 admitted: bool = False, queued_since: float | None = None, max_wait_s: float | None = None,
                 run: dict | None = None, placement: dict | None = None, admitted_at: float | None = None,
                 request_timeout_s: float = 10.0, api_outage_s: float = 300.0,
                 max_retry: int | None = None) -> None:
        super().__init__()
        self.conn_id = conn_id
        self.scheduler = scheduler
        self.namespace = namespace
        self.name = name
        self.cluster = cluster
        self.submitted_at = submitted_at  # epoch seconds: the admission deadline survives a triggerer restart
        self.admission_timeout_s = admission_timeout_s
        self.poll_interval = poll_interval
        self.admitted = admitted
        self.queued_since = queued_since or submitted_at
        self.max_wait_s = max_wait_s
        self.admitted_at = admitted_at
        self.request_timeout_s = request_timeout_s  # bounds each Kubernetes API call
        self.api_outage_s = api_outage_s  # how long an unreachable API is waited out
        self.max_retry = max_retry  # the preemption budget: gang restarts allowed

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {"conn_id": self.conn_id, "scheduler": self.scheduler, "namespace": self.namespace, "name": self.name,
             "cluster": self.cluster, "submitted_at": self.submitted_at,
             "admission_timeout_s": self.admission_timeout_s, "poll_interval": self.poll_interval,
             "admitted": self.admitted, "queued_since": self.queued_since, "max_wait_s": self.max_wait_s,
             "admitted_at": self.admitted_at,
             "request_timeout_s": self.request_timeout_s, "api_outage_s": self.api_outage_s,
             "max_retry": self.max_retry},
        )

    def _event(self, status: str, message: str, gang: dict | None = None) -> TriggerEvent:
        return TriggerEvent({"status": status, "name": self.name, "namespace": self.namespace, "cluster": self.cluster,
                             "message": message, "gang": gang, "admitted": self.admitted,
                             "admitted_at": self.admitted_at, "queued_since": self.queued_since})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        # The provider's sync hook in a thread: the same client calls as the backend's, off the event loop.
        # Kept for on_kill: building the client again (Connection, kubeconfig) takes seconds on a busy triggerer.
        hook = self._hook = kubernetes_hook(self.conn_id)
        # The triggerer answers the first task-state question by building Airflow's in-process
        # execution API (about 5 s, more on a busy host). Asked now, off the wait's path, so that a
        # user's stop later reaches on_kill's state check warm.
        self._warm_up = asyncio.ensure_future(self._task_state())
        window_end = self.submitted_at + self.admission_timeout_s
        last_seen = None
        while True:
            gang = await self._read(hook)
            if isinstance(gang, TriggerEvent):
                yield gang
                return
            if gang.phase != PENDING and not self.admitted:
                self.admitted, self.admitted_at = True, time.time()
            if gang.phase == SUCCEEDED:
                yield self._event("success", f"gang {self.name} succeeded", gang.to_dict())
                return
            if gang.phase == PREEMPTED:  # checkpointed and moved off to make room: the operator places it again
                yield self._event("moved", f"gang {self.name} was moved: {gang.message}", gang.to_dict())
                return
            if gang.phase in (FAILED, MISSING):
                yield self._event("failed", f"gang {self.name}: {gang.message or gang.phase}", gang.to_dict())
                return
            if gang.phase == PENDING and not self.admitted:
                now = time.time()
                if self.max_wait_s is not None and now - self.queued_since >= self.max_wait_s:
                    yield self._event("expired", f"gang {self.name} waited {now - self.queued_since:.0f} s for "
                                      "admission", gang.to_dict())
                    return
                if now >= window_end:
                    yield self._event("not_admitted", f"gang {self.name} was not admitted within "
                                      f"{self.admission_timeout_s:.0f} s", gang.to_dict())
                    return
            seen = (gang.phase, gang.message)
            if seen != last_seen:  # a line per change, not per poll
                self.log.info("gang %s: %s %s", self.name, gang.phase, gang.message)
                last_seen = seen
            await asyncio.sleep(self.poll_interval)

    async def _read(self, hook: Any) -> GangStatus | TriggerEvent:
        """One reading of the gang, waiting out transient API errors with backoff for up to
        ``api_outage_s``; an ``error`` event when the API refuses the Connection or stays away."""
        call = job_call("get", self.scheduler, self.namespace)
        outage_since, failures = None, 0
        while True:
            try:
                return await asyncio.to_thread(read_status, hook, self.scheduler, self.namespace, self.name,
                                               timeout=self.request_timeout_s, max_retry=self.max_retry)
            except Exception as exc:  # noqa: BLE001 - every outcome becomes an event
                problem = misconfiguration(exc, self.conn_id, call)
                if problem or not is_transient(exc):
                    return self._event("error", f"could not read gang {self.namespace}/{self.name} on cluster "
                                       f"{self.cluster}: {problem or describe(exc)}")
                now = time.monotonic()
                outage_since = outage_since if outage_since is not None else now
                if now - outage_since >= self.api_outage_s:
                    return self._event("error", f"the Kubernetes API of cluster {self.cluster} (Connection "
                                       f"{self.conn_id!r}) was unreachable for {now - outage_since:.0f} s while "
                                       f"waiting for gang {self.name} (training.kubernetes_api_outage_s): {describe(exc)}")
                failures += 1
                delay = min(max(self.poll_interval, 1.0), 0.5 * 2 ** (failures - 1),
                            self.api_outage_s - (now - outage_since))
                self.log.warning("gang %s: Kubernetes API of %s not answering (%s); retrying in %.1f s",
                                 self.name, self.cluster, describe(exc), delay)
                await asyncio.sleep(delay)

    async def on_kill(self) -> None:
        """The user stopped the deferred task: delete the gang job with its pods, Secret and Service
        (whatever is already gone is skipped). Each call is bounded by ``request_timeout_s``, well
        within the triggerer's ``[triggerer] on_kill_timeout`` (30 s by default); transient errors are
        retried for up to ``KILL_RETRY_S``."""
        state = await self._task_state()
        if state == "deferred":
            self.log.info("gang %s/%s on %s left running: the task is still deferred (its wait moved to another "
                          "triggerer)", self.namespace, self.name, self.cluster)
            return
        hook = getattr(self, "_hook", None) or kubernetes_hook(self.conn_id)
        give_up, delay = time.monotonic() + KILL_RETRY_S, 0.5
        while True:
            try:
                found = await asyncio.to_thread(delete_gang, hook, self.scheduler, self.namespace, self.name,
                                                timeout=self.request_timeout_s)
                break
            except Exception as exc:
                if not is_transient(exc) or time.monotonic() + delay >= give_up:
                    problem = misconfiguration(exc, self.conn_id, job_call("delete", self.scheduler, self.namespace))
                    raise GangError(f"could not delete gang {self.namespace}/{self.name} on cluster {self.cluster}: "
                                    f"{problem or describe(exc)}; delete it by hand") from exc
                await asyncio.sleep(delay)
                delay *= 2
        self.log.info("gang %s/%s on %s %s: the task was stopped by a user", self.namespace, self.name,
                      self.cluster, "deleted with its pods, Secret and Service" if found else "was already gone")

    async def _task_state(self) -> str | None:
        """The deferred task's state as Airflow has it now (None when it cannot be told)."""
        from hybridflow.backends.task_state import deferred_task_state

        return await deferred_task_state(self.task_instance, self.log, f"gang {self.name}")
