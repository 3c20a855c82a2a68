"""A run waiting for its gang to be admitted: where it stands, what it may do, and the deferrable wait.

When no eligible cluster can take a run now, the run keeps its place in the queue of the cluster
placement chose, in the triggerer (:class:`QueueWaitTrigger`: no worker slot held), until

- the gang would be admitted now (``admitted``), or a critical gang would be once batch gangs stop
  (``preempt``): the resumed task takes the slots (stopping those gangs first) and launches it;
  the gang's ticket, which the task left before deferring, keeps its place meanwhile;
- a whole ``training.gang_admission_timeout_s`` has passed (``recheck``): the task resumes and asks
  placement for an eligible cluster that would admit the gang now; it moves there
  (:func:`hybridflow.training.failover.fail_over`) or defers again, keeping the gang's ticket;
- it has waited ``training.max_queue_wait_s`` in all (``expired``): the task withdraws the ticket and
  fails, naming the setting;
- the cluster is declared down (:mod:`hybridflow.fencing`; ``fenced``): the gang is never admitted
  there; the task withdraws its ticket and moves it, or fails naming the fence.

The trigger only reads: it never takes slots, stops gangs, places or writes the run's files (the
one exception is on_kill, which withdraws the ticket of a task a user stopped). Its position, the
GPUs ahead of it and an estimated start go to the task log; the task writes them to
``runs/<key>/queue.json``, which the run's page shows, each time it defers.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from hybridflow.runs import run_dir, write_json_atomic

QUEUE_FILE = "queue.json"
# A deferred task's ticket lives an admission window plus this long: time for the task to get a
# worker and write it again; a task that is gone stops doing so, and its ticket lapses.
TICKET_SLACK_S = 600.0


def _iso(epoch: float | None) -> str | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds")


def note_standing(private_root: Path, run_key: str, *, cluster: str, state: str, queued_since: float,
                  standing: Any = None, estimate: Any = None) -> dict:
    """Write where the run's gang stands (``state``: waiting, admitted, moved, expired, fenced) for its page."""
    body = standing_body(cluster=cluster, state=state, queued_since=queued_since, standing=standing, estimate=estimate)
    keep_standing(private_root, run_key, body)
    return body


def keep_standing(private_root: Path, run_key: str, body: dict) -> None:
    """Write a :func:`standing_body` to the run's queue.json."""
    write_json_atomic(run_dir(private_root, run_key) / QUEUE_FILE, body)


def standing_body(*, cluster: str, state: str, queued_since: float, standing: Any = None,
                  estimate: Any = None) -> dict:
    """Where the run's gang stands, as :func:`note_standing` writes it."""
    now = time.time()
    body: dict[str, Any] = {"cluster": cluster, "state": state, "queued_since": _iso(queued_since),
                            "waited_s": round(now - queued_since, 1), "updated_at": _iso(now)}
    if standing is not None:
        body.update(standing.to_dict())
    if estimate is not None:
        body["estimated_start"] = None if estimate.seconds is None else _iso(now + estimate.seconds)
        body["estimate_basis"] = estimate.basis
    return body


def read_standing(private_root: Path, run_key: str) -> dict | None:
    try:
        return json.loads((run_dir(private_root, run_key) / QUEUE_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None


def describe(note: Mapping[str, Any]) -> str:
    """One log line from a :func:`note_standing` body."""
    where = (f"held by its team's gpu_cap on {note['cluster']}" if note.get("over_team_cap") else
             f"position {note.get('position') or '?'} on {note['cluster']}, {note.get('gpus_ahead', 0)} GPUs ahead, "
             f"{note.get('free', '?')} of {note.get('capacity', '?')} free")
    eta = note.get("estimated_start")
    return (f"waiting {note['waited_s']:.0f} s: {where}; estimated start "
            f"{eta or 'unknown'} ({note.get('estimate_basis') or 'no estimate'})")


def estimate_for(estate: Any, cluster: str, gpus: int, load: Any) -> Any:
    """The cluster's expected wait for a gang of ``gpus`` (ledger history; unknown without a ledger)."""
    from hybridflow.waits import estimate_waits

    cfg = estate.pipeline.placement
    try:
        from hybridflow.ledger.queue_waits import queue_wait_history

        history = queue_wait_history(days=cfg.wait_history_days, clusters=[cluster])
    except Exception:  # noqa: BLE001 - the estimate is a help, never a reason to stop waiting
        history = []
    return estimate_waits(history, {cluster: load}, gpus, quantile=cfg.wait_quantile, min_samples=cfg.wait_min_samples,
                          days=cfg.wait_history_days)[cluster]


class QueueWaitTrigger(BaseTrigger):
    """Wait in a cluster's queue for the run's gang (``kind`` ``slots``: the local backend's slot
    pool; ``team_cap``: the team's GPUs across the estate to come under its gpu_cap before a
    Kubernetes gang is submitted). It reads the queue and yields one event; it changes nothing.

    A user who marks the deferred task failed or success, or clears it, cancels the wait: Airflow
    then calls :meth:`on_kill`, which withdraws the ticket (gangs queued behind it are no longer
    held back by a gang nobody waits for). A triggerer that restarts only cancels the trigger: the
    ticket keeps the gang's place for the next triggerer."""

    def __init__(self, *, kind: str, cluster: str, job: dict, run: dict, queued_since: float,
                 max_wait_s: float, recheck_s: float, poll_s: float) -> None:
        super().__init__()
        self.kind = kind
        self.cluster = cluster
        self.job = job  # name, workers, priority, team, team_cap
        self.run_info = run  # its run_key: where the run's queue.json is
        self.queued_since = queued_since
        self.max_wait_s = max_wait_s
        self.recheck_s = recheck_s
        self.poll_s = poll_s
        self._estimate: tuple[float, Any] | None = None  # (when, estimate): the ledger is read once a recheck

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"kind": self.kind, "cluster": self.cluster, "job": self.job, "run": self.run_info,
                 "queued_since": self.queued_since, "max_wait_s": self.max_wait_s,
                 "recheck_s": self.recheck_s, "poll_s": self.poll_s})

    def _event(self, status: str, message: str, note: dict | None = None) -> TriggerEvent:
        return TriggerEvent({"status": status, "cluster": self.cluster, "message": message, "queue": note,
                             "queued_since": self.queued_since})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        checked = time.time()
        last = None
        while True:
            try:
                verdict, note = await asyncio.to_thread(self.standing_now)
            except Exception as exc:  # noqa: BLE001 - every outcome becomes an event
                yield self._event("error", f"could not read the queue of {self.cluster}: {exc}")
                return
            if verdict == "now":
                yield self._event("admitted", f"gang {self.job['name']} would be admitted on {self.cluster} now",
                                  note)
                return
            if verdict == "preempt":  # the task stops the batch gangs, then takes the slots
                yield self._event("preempt", f"gang {self.job['name']} fits on {self.cluster} once batch gangs stop "
                                             "(it is critical) or movable gangs move (it may run only there)", note)
                return
            if note.get("fenced"):  # never admitted there: the task withdraws the ticket and moves or fails
                yield self._event("fenced", f"gang {self.job['name']} waits on {self.cluster}, which {note['fenced']}")
                return
            line = describe(note)
            if note.get("position") != last:
                self.log.info("gang %s %s", self.job["name"], line)
                last = note.get("position")
            if time.time() - self.queued_since >= self.max_wait_s:  # the task withdraws the ticket and fails
                yield self._event("expired", f"gang {self.job['name']} waited {self.max_wait_s:.0f} s: {line}", note)
                return
            if self.kind == "slots" and time.time() - checked >= self.recheck_s:
                # The task looks for room elsewhere (placement is not the trigger's); the ticket stays.
                yield self._event("recheck", f"gang {self.job['name']} still waits on {self.cluster}: {line}", note)
                return
            await asyncio.sleep(self.poll_s)

    def _context(self):
        from hybridflow.backends import gang_backend
        from hybridflow.config import load_estate
        from hybridflow.settings import get_settings

        settings = get_settings()
        estate = load_estate(settings.config_dir)
        return settings, estate, gang_backend(estate.clusters[self.cluster], estate, settings.state_dir)

    def standing_now(self) -> tuple[str | None, dict]:
        """(``now``, ``preempt`` or None, where the gang stands): read only. The task writes the same
        reading to the run's queue.json before it defers."""
        from hybridflow.backends import team_held_outside
        from hybridflow.backends.base import GangJob, QueueStanding

        settings, estate, backend = self._context()
        why = fenced_cluster(self.cluster, settings.state_dir)
        if why is not None:  # checked before every admission step: a fenced queue admits nothing
            return None, {"fenced": why}
        team, cap = self.job.get("team") or "", self.job.get("team_cap")
        job = GangJob(name=self.job["name"], workers=int(self.job["workers"]), spec={},
                      labels={"priority": self.job["priority"], "team": team,
                              "private_only": str(bool(self.job.get("private_only"))).lower()}, team_cap=cap,
                      team_held_outside=team_held_outside(estate, settings.state_dir, team) if cap else 0)
        if self.kind == "slots":
            verdict = backend.admission(job)
            standing = backend.standing(job.name)
            load = backend.load()
        else:
            from hybridflow.backends import estate_load, team_usage

            loads = estate_load(estate, settings.state_dir)
            held = team_usage(loads).get(job.team or "", 0)
            verdict = "now" if job.team_cap is None or held + job.workers <= job.team_cap else None
            load = loads[self.cluster]
            standing = QueueStanding(self.cluster, 0, 0, load.free, load.capacity, over_team_cap=verdict is None)
        if self._estimate is None or time.time() - self._estimate[0] >= self.recheck_s:
            self._estimate = (time.time(), estimate_for(estate, self.cluster, job.workers, load))
        note = standing_body(cluster=self.cluster, state="waiting" if verdict is None else "admitted",
                             queued_since=self.queued_since, standing=standing, estimate=self._estimate[1])
        return verdict, note

    async def on_kill(self) -> None:
        """The user stopped the deferred task: withdraw the gang's ticket from the cluster's queue and
        give back slots this trigger took for it that no task will come for; the run's queue.json
        says ``stopped``. A task Airflow still has as deferred was not stopped (its wait moved to
        another triggerer): its place is kept. Withdrawing a ticket already gone is harmless."""
        from hybridflow.backends.task_state import deferred_task_state

        state = await deferred_task_state(self.task_instance, self.log, f"gang {self.job['name']}")
        if state == "deferred":
            self.log.info("gang %s keeps its place on %s: the task is still deferred (its wait moved to another "
                          "triggerer)", self.job["name"], self.cluster)
            return
        await asyncio.to_thread(self._stop)

    def _stop(self) -> None:
        settings, _, backend = self._context()
        if self.kind == "slots":
            backend.pool.withdraw(self.job["name"])
        note_standing(settings.private_root, self.run_info["run_key"], cluster=self.cluster, state="stopped",
                      queued_since=self.queued_since)
        self.log.info("gang %s withdrawn from the queue of %s: the task was stopped by a user", self.job["name"],
                      self.cluster)


def fenced_cluster(cluster: str, state_dir: Path) -> str | None:
    """``is declared down (...)`` when ``cluster`` is fenced (:mod:`hybridflow.fencing`), else None."""
    from hybridflow.fencing import down_clusters, state_path

    record = down_clusters(state_path(state_dir)).get(cluster)
    if record is None:
        return None
    return f"is declared down ({record.get('reason') or 'no reason kept'})"


def hold_for_team_cap(admitted: Any, cluster: str, gang: str, backend: Any, estate: Any, state_dir: Path,
                      queued_since: float | None) -> None:
    """A team's gpu_cap spans the estate, and a Kubernetes scheduler knows only its own cluster:
    a gang that would take its team past the cap is not submitted yet (GangNotAdmitted with
    over_team_cap: the task waits for the team's GPUs in the triggerer). A job this run already
    has there is re-attached, never held."""
    from hybridflow.backends import estate_load, team_usage
    from hybridflow.backends.base import MISSING
    from hybridflow.backends.errors import GangNotAdmitted

    req = admitted.request
    cap = estate.teams[admitted.team].gpu_cap
    if cap is None or req.priority == "critical" or backend.status(gang).phase != MISSING:
        return
    held = team_usage(estate_load(estate, state_dir)).get(admitted.team, 0)
    if held + req.workers > cap:
        raise GangNotAdmitted(
            f"gang {gang} not submitted to {cluster}: team {admitted.team} holds {held} of "
            f"its gpu_cap of {cap} GPUs and the gang needs {req.workers}; it waits for the team's runs to finish "
            f"(or raise teams.{admitted.team}.gpu_cap in projects.yaml)",
            cluster=cluster, over_team_cap=True, queued_since=queued_since or time.time())


def record_admission(private_root: Path, run_key: str, attempt: str, cluster: str, admitted: Any, waited_s: float,
                     log: Any, *, private_only: bool = False) -> None:
    """The gang of ``attempt`` was admitted after ``waited_s`` in the queue: for the run's page and
    the ledger's history of queue waits (which deadline placement estimates from, and which says
    where work that may run only on private clusters is expected: ``private_only``). Best effort."""
    now = time.time()
    try:
        note_standing(private_root, run_key, cluster=cluster, state="admitted", queued_since=now - waited_s)
        from hybridflow.ledger.queue_waits import record_queue_wait

        record_queue_wait(run_key, attempt, cluster, admitted.workers, admitted.priority,
                          datetime.fromtimestamp(now - waited_s, UTC), datetime.fromtimestamp(now, UTC), "admitted",
                          private_only=private_only)
    except Exception as exc:  # noqa: BLE001 - the history is a help, never a reason to stop training
        log.warning("could not record the queue wait of %s (%s)", run_key, exc)
