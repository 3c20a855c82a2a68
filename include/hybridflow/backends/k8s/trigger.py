"""Deferrable wait for a gang job: polls its status until it ends or is not admitted in time.

Side-effect free (it never deletes or restarts: the operator decides in ``execute_complete``),
and every outcome, errors included, becomes one event with a ``status``:

- ``success``: the gang finished;
- ``failed``: it failed for good (restarts exhausted, or the job vanished);
- ``not_admitted``: still waiting for gang admission ``admission_timeout_s`` after submission;
- ``error``: the API could not be read (the message says why).

The event's ``gang`` holds the last :class:`~hybridflow.backends.k8s.backend.GangStatus` as a dict
and ``admitted`` whether the gang ever started, for ``KubernetesGangBackend.outcome``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from hybridflow.backends.k8s.backend import FAILED, MISSING, PENDING, SUCCEEDED, make_hook, read_status


class GangJobTrigger(BaseTrigger):
    def __init__(self, *, conn_id: str, scheduler: str, namespace: str, name: str, cluster: str,
                 submitted_at: float, admission_timeout_s: float, poll_interval: float = 15.0,
                 admitted: bool = False) -> None:
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

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {"conn_id": self.conn_id, "scheduler": self.scheduler, "namespace": self.namespace, "name": self.name,
             "cluster": self.cluster, "submitted_at": self.submitted_at,
             "admission_timeout_s": self.admission_timeout_s, "poll_interval": self.poll_interval,
             "admitted": self.admitted},
        )

    def _event(self, status: str, message: str, gang: dict | None = None) -> TriggerEvent:
        return TriggerEvent({"status": status, "name": self.name, "namespace": self.namespace, "cluster": self.cluster,
                             "message": message, "gang": gang, "admitted": self.admitted})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        # The provider's sync hook in a thread: the same client calls as the backend's, off the event loop.
        hook = make_hook(self.conn_id)
        while True:
            try:
                gang = await asyncio.to_thread(read_status, hook, self.scheduler, self.namespace, self.name)
            except Exception as exc:  # noqa: BLE001 - every outcome becomes an event
                yield self._event("error", f"could not read gang {self.namespace}/{self.name}: {exc}")
                return
            if gang.phase != PENDING:
                self.admitted = True
            if gang.phase == SUCCEEDED:
                yield self._event("success", f"gang {self.name} succeeded", gang.to_dict())
                return
            if gang.phase in (FAILED, MISSING):
                yield self._event("failed", f"gang {self.name}: {gang.message or gang.phase}", gang.to_dict())
                return
            if gang.phase == PENDING and not self.admitted and \
                    time.time() - self.submitted_at >= self.admission_timeout_s:
                yield self._event("not_admitted", f"gang {self.name} was not admitted within "
                                  f"{self.admission_timeout_s:.0f} s", gang.to_dict())
                return
            self.log.info("gang %s: %s %s", self.name, gang.phase, gang.message)
            await asyncio.sleep(self.poll_interval)
