"""The train task's waits in a cluster's queue: keeping the gang's place while the task is
deferred, what it does when the wait hands back (launch, stop batch gangs first, move, wait again,
fail naming the fence or the limit), and leaving a queue it moved away from or gave up on.

Mixed into :class:`~hybridflow.operators.train.GangTrainOperator`; the trigger
(:class:`~hybridflow.queueing.QueueWaitTrigger`) only reads the queue, everything that changes it
happens here, in the task."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridflow.training.job import TrainJob


def fenced(cluster: str, settings: Any = None) -> str | None:
    """Why ``cluster`` takes no gang now (declared down: who, when, why) and the fix; None when it is up."""
    from hybridflow.fencing import down_clusters, state_path

    record = down_clusters(state_path(None if settings is None else settings.state_dir)).get(cluster)
    if record is None:
        return None
    return (f"cluster {cluster} is declared down (at {record.get('declared_at')} by {record.get('by')}: "
            f"{record.get('reason') or 'no reason kept'}) and takes no new gangs. Clear the choose_cluster task (and "
            f"its downstream tasks) so placement picks again, or `hybridflow cluster up {cluster}` once it is back "
            "and clear the train task")


class QueueWaits:
    """The queue-wait half of the train task (``self.run``, ``self._job_name``, ``self.log``)."""

    def _after_wait(self, context, exc, placement: dict, staged: dict, estate, settings,
                    queued_since: float) -> tuple[dict, dict]:
        """The gang waited a full admission window: move it to an eligible cluster that would admit
        it now, else keep its place in the queue (deferred: no worker slot held), until
        ``training.max_queue_wait_s`` runs out."""
        from hybridflow.training.failover import fail_over

        if self._killed:
            raise exc
        cfg = estate.pipeline.training
        self._fail_if_expired(exc.cluster, queued_since, cfg.max_queue_wait_s, str(exc), estate, settings)
        self.log.warning("%s", exc)
        if not exc.over_team_cap:  # a team's cap spans the estate: another cluster would not help
            why = getattr(exc, "moved", None) or f"gang not admitted within {cfg.gang_admission_timeout_s:g} s"
            moved = fail_over(self.run, placement, exc.cluster, why, settings)
            if moved is not None:
                self._leave_queue(exc.cluster, estate, settings, queued_since)
                self.log.warning("Moved to cluster %s, which would admit the gang now", moved[0]["cluster"])
                return moved
        down = fenced(exc.cluster, settings)
        if down is not None:  # its queue admits nothing until the cluster is up: do not wait there
            from airflow.sdk.exceptions import AirflowFailException

            self._leave_fenced(exc.cluster, estate, settings)
            self._note(exc.cluster, "fenced", queued_since, settings)
            raise AirflowFailException(f"not started: {down}")
        return self._wait_in_queue(context, exc, placement, staged, estate, settings, queued_since)

    def _fail_if_expired(self, cluster: str, queued_since: float, max_wait_s: float, standing: str,
                         estate: Any = None, settings: Any = None) -> None:
        """Fail once the run has waited ``training.max_queue_wait_s`` in all; nothing of it keeps
        queueing on ``cluster`` (with ``estate``: its ticket or job is withdrawn first)."""
        from airflow.sdk.exceptions import AirflowFailException

        waited = time.time() - queued_since
        if waited >= max_wait_s:
            if estate is not None:
                self._leave_queue(cluster, estate, settings, queued_since, "expired")
            raise AirflowFailException(
                f"gang {self._job_name} waited {waited:.0f} s for admission, training.max_queue_wait_s is "
                f"{max_wait_s:g} (config/pipeline.yaml); last seen: {standing}. Raise the limit, ask for fewer "
                "workers, or trigger the run again when the cluster is less busy"
            )

    def _leave_queue(self, cluster: str, estate, settings, queued_since: float, state: str = "moved") -> None:
        """Nothing of this run keeps queueing on a cluster it moved away from or gave up on: its
        Kubernetes job, or its ticket in the local queue."""
        from hybridflow.backends import gang_backend

        backend = gang_backend(estate.clusters[cluster], estate, settings.state_dir)
        if getattr(backend, "pool", None) is not None:
            backend.pool.withdraw(f"train-{self.run['run_key']}")
        elif self._job_name:
            backend.cancel(self._job_name)
        self._note(cluster, state, queued_since, settings)

    def _note(self, cluster: str, state: str, queued_since: float, settings) -> None:
        """How the run's wait on ``cluster`` ended (moved, fenced), for its page."""
        from hybridflow.queueing import note_standing

        note_standing(settings.private_root, self.run["run_key"], cluster=cluster, state=state,
                      queued_since=queued_since)

    def _leave_fenced(self, cluster: str, estate, settings) -> None:
        """Nothing of this run waits or holds slots on a local cluster declared down: its gang's
        ticket, or slots a queue wait took for it just before the fence."""
        from hybridflow.backends import gang_backend

        backend = gang_backend(estate.clusters[cluster], estate, settings.state_dir)
        pool = getattr(backend, "pool", None)
        name = f"train-{self.run['run_key']}"
        if pool is not None and not backend.cancel(name):  # no live gang: only its ticket or leased slots
            pool.withdraw(name)
            pool.release(name)

    def _wait_in_queue(self, context, exc, placement: dict, staged: dict, estate, settings,
                       queued_since: float) -> tuple[dict, dict]:
        """Keep the gang's place: in the triggerer (local slot queue, or a team over its cap before a
        Kubernetes gang is submitted); a blocking Kubernetes wait simply waits another window. The
        task keeps the gang's ticket and writes where it stands; the trigger only reads."""
        from hybridflow.backends import gang_backend, team_held_outside
        from hybridflow.backends.base import GangJob
        from hybridflow.placement.reserve import private_only
        from hybridflow.queueing import TICKET_SLACK_S, QueueWaitTrigger, describe, keep_standing
        from hybridflow.request import AdmittedRun

        cfg = estate.pipeline.training
        backend = gang_backend(estate.clusters[exc.cluster], estate, settings.state_dir)
        local = backend.supervised_by_task
        if not local and not exc.over_team_cap:
            return placement, staged  # blocking Kubernetes: the job keeps its place, wait another window
        req = AdmittedRun.from_xcom(dict(self.run))
        team_cap = None if req.priority == "critical" else estate.teams[req.team].gpu_cap
        if local:  # the place lives as long as the task comes back each window to keep it
            backend.keep_place(GangJob(name=self._job_name, workers=req.workers, spec={}, team_cap=team_cap,
                                       labels={"priority": req.priority, "team": req.team,
                                               "private_only": str(private_only(req, estate)).lower()},
                                       team_held_outside=team_held_outside(estate, settings.state_dir, req.team)
                                       if team_cap else 0),
                               since=queued_since, keep_s=cfg.gang_admission_timeout_s + TICKET_SLACK_S)
        trigger = QueueWaitTrigger(
            kind="slots" if local else "team_cap", cluster=exc.cluster,
            job={"name": self._job_name, "workers": req.workers, "priority": req.priority, "team": req.team,
                 "team_cap": team_cap, "private_only": private_only(req, estate)},
            run=dict(self.run), queued_since=queued_since,
            max_wait_s=cfg.max_queue_wait_s, recheck_s=cfg.gang_admission_timeout_s, poll_s=cfg.queue_poll_s)
        try:  # where it stands, for the run's page: best effort, never a reason not to wait
            _, note = trigger.standing_now()
            if "fenced" not in note:
                keep_standing(settings.private_root, self.run["run_key"], {**note, "state": "waiting"})
                self.log.info("gang %s %s", self._job_name, describe(note))
        except Exception as exc_note:  # noqa: BLE001
            self.log.warning("gang %s: standing unknown (%s)", self._job_name, exc_note)
        self.defer(trigger=trigger, method_name="resume_after_wait",
                   kwargs={"placement": placement, "staged": staged, "queued_since": queued_since})
        raise AssertionError("defer() raises")  # pragma: no cover

    def resume_after_wait(self, context, event: dict, placement: dict, staged: dict, queued_since: float) -> dict:
        """Back from :class:`~hybridflow.queueing.QueueWaitTrigger`: the gang would be admitted now, or
        by stopping batch gangs (take the slots, stopping them first, and launch), a window passed or
        the cluster was declared down (move to a cluster with room now, wait again, or fail naming
        the fence), or the wait ran out (withdraw the ticket and fail)."""
        from hybridflow.backends.errors import GangNotAdmitted
        from hybridflow.config import load_estate
        from hybridflow.errors import GangError
        from hybridflow.settings import get_settings

        settings = get_settings()
        estate = load_estate(settings.config_dir)
        status, cluster = event.get("status"), event.get("cluster") or placement["cluster"]
        self._job_name = f"train-{self.run['run_key']}"
        if status == "error":
            raise GangError(f"{event.get('message')}; clear the train task to wait again")
        if status == "expired":
            self._fail_if_expired(cluster, queued_since, estate.pipeline.training.max_queue_wait_s,
                                  event.get("message", ""), estate, settings)
        if status in ("recheck", "fenced"):  # a window passed, or the cluster was declared down: placement's turn
            moved_or_stay = self._after_wait(
                context, GangNotAdmitted(event.get("message", ""), cluster=cluster, queued_since=queued_since),
                placement, staged, estate, settings, queued_since)
            placement, staged = moved_or_stay
        return self._train_with_failover(context, settings, estate, placement, staged, queued_since)

    def _note_waiting(self, job: TrainJob, backend, estate, queued_since: float, settings) -> None:
        """The gang's position, the GPUs ahead of it and an estimated start, for the run's page and
        the task log. Best effort: the standing is a help, never a reason to stop waiting."""
        from hybridflow.queueing import describe, estimate_for, note_standing

        try:
            load = backend.load()
            note = note_standing(settings.private_root, job.run_key, cluster=job.cluster.name, state="waiting",
                                 queued_since=queued_since, standing=backend.standing(self._job_name),
                                 estimate=estimate_for(estate, job.cluster.name, job.admitted.workers, load))
        except Exception as exc:  # noqa: BLE001
            self.log.warning("gang %s: standing unknown (%s)", self._job_name, exc)
            return
        self.log.info("gang %s %s", self._job_name, describe(note))
