"""The train task: one gang job on the chosen cluster, resumed from its newest checkpoint on retry."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from airflow.sdk import BaseOperator

from hybridflow.operators.queue_waits import QueueWaits, fenced
from hybridflow.runs import RunIdentity

if TYPE_CHECKING:
    from hybridflow.training.job import TrainJob


def _resume_hint(job: TrainJob) -> str:
    """What to do about a gang stopped on purpose, whatever stopped it."""
    return (f"The newest checkpoint is kept in {job.ckpt_spec.uri}: clear the train task to resume from it once "
            "the stop no longer holds (the budget freeze lifted, or the cluster declared up again with "
            "`hybridflow cluster up`); for a cluster declared down, clearing the choose_cluster task places the run "
            "again")


class GangTrainOperator(QueueWaits, BaseOperator):
    """Run distributed training as a gang (all workers or none) and bring the model home.

    The gang job's name derives from the DAG run, so a retry or a cleared task takes the same slots
    and the same checkpoint places, and resumes where the last committed checkpoint left off.

    Preemption (a worker exits 75 after its final checkpoint: spot reclaim, eviction) is not an
    application error: the task relaunches the gang itself, as a new attempt that resumes from that
    checkpoint, up to ``training.preemption_retries`` times per task try. Application errors
    (:class:`~hybridflow.backends.errors.GangFailed`) raise and use the task's Airflow ``retries``.
    ``on_kill`` (the task itself was stopped) stops the gang and is never relaunched.
    """

    template_fields: Sequence[str] = ("run", "placement", "staged")
    ui_color = "#f0e4ff"

    def __init__(self, *, run: Any, placement: Any, staged: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.run = run
        self.placement = placement
        self.staged = staged
        self._job_name: str | None = None
        self._backend = None
        self._killed = False

    def execute(self, context) -> dict:
        from airflow.sdk.exceptions import AirflowFailException

        from hybridflow.budgets.enforce import refuse_if_frozen
        from hybridflow.config import load_estate
        from hybridflow.errors import AdmissionError
        from hybridflow.request import AdmittedRun
        from hybridflow.settings import get_settings
        from hybridflow.training.failover import resume_placement

        settings = get_settings()
        estate = load_estate(settings.config_dir)
        req = AdmittedRun.from_xcom(dict(self.run)).request
        try:  # a train task cleared or retried while its project is frozen must not spend on
            refuse_if_frozen(req.project, req.priority, req.budget_override, estate)
        except AdmissionError as exc:
            raise AirflowFailException(f"not started: {exc}") from exc
        placement, staged = dict(self.placement), dict(self.staged)
        if RunIdentity.from_context(context).try_number > 1:  # a retry or a cleared task: where is the work?
            placement, staged = resume_placement(self.run, placement, staged, estate, settings)
        return self._train_with_failover(context, settings, estate, placement, staged)

    def execute_complete(self, context, event: dict, placement: dict, staged: dict, attempt: dict,
                         started: float) -> dict:
        """Back from the triggerer: the Kubernetes gang finished or failed, it waited a whole
        admission window (moved to a cluster that would admit it now, or deferred again), or it
        waited ``training.max_queue_wait_s``."""
        from hybridflow.backends import gang_backend
        from hybridflow.backends.errors import GangMoved, GangNotAdmitted
        from hybridflow.config import load_estate
        from hybridflow.settings import get_settings

        settings = get_settings()
        estate = load_estate(settings.config_dir)
        job = self._job(context, settings, estate, placement, staged)
        backend = gang_backend(job.cluster, estate, settings.state_dir)
        self._job_name, self._backend = event.get("name"), backend
        queued_since = float(event.get("queued_since") or started)
        if event.get("admitted_at"):
            self._admitted_after(job, attempt["attempt"], float(event["admitted_at"]) - queued_since, settings)
        if event.get("status") == "expired":
            self._end_attempt(job, attempt, "not_admitted")
            backend.cancel(self._job_name)  # nothing of this run keeps queueing after it gave up
            self._fail_if_expired(job.cluster.name, queued_since, estate.pipeline.training.max_queue_wait_s,
                                  event.get("message", ""))
        try:
            status = backend.on_event(event)
        except GangMoved as exc:  # checkpointed to make room there: placed again from that checkpoint
            if self._killed:
                self._end_attempt_on_error(job, attempt, exc, estate)
            moved = self._after_wait(context, self._moved(job, attempt, exc), placement, staged, estate, settings,
                                     time.time())
            return self._train_with_failover(context, settings, estate, *moved)
        except GangNotAdmitted as exc:
            try:  # placement runs here, never in the trigger: move to a cluster with room, or stay
                moved = self._after_wait(context, exc, placement, staged, estate, settings, queued_since)
            except BaseException:
                self._end_attempt(job, attempt, "not_admitted")
                raise
            if moved[0]["cluster"] == job.cluster.name:  # the gang keeps its place: wait another window
                self._defer_to_gang(job, backend, estate, attempt, started, queued_since, created=False, admitted=False)
            self._end_attempt(job, attempt, "not_admitted")
            return self._train_with_failover(context, settings, estate, *moved, queued_since)
        except BaseException as exc:
            self._end_attempt_on_error(job, attempt, exc, estate)
        attempts = self._end_attempt(job, attempt, "succeeded")
        backend.delete_secret(self._job_name)
        return self._bring_home(job, attempts, status.retries, started)

    def _train_with_failover(self, context, settings, estate, placement: dict, staged: dict,
                             queued_since: float | None = None) -> dict:
        from hybridflow.backends.errors import GangNotAdmitted

        while True:
            try:
                return self._train_on(context, settings, estate, placement, staged, queued_since)
            except GangNotAdmitted as exc:
                queued_since = queued_since or exc.queued_since or time.time()
                placement, staged = self._after_wait(context, exc, placement, staged, estate, settings, queued_since)

    def _job(self, context, settings, estate, placement: dict, staged: dict) -> TrainJob:
        """What every gang of this run on ``placement``'s cluster is given, whatever its backend."""
        from hybridflow.training.job import build_job

        return build_job(dict(self.run), placement, staged, RunIdentity.from_context(context), settings, estate,
                         self.log, task_id=self.task_id)

    def _train_on(self, context, settings, estate, placement: dict, staged: dict,
                  queued_since: float | None = None) -> dict:
        """Train on ``placement``'s cluster; GangNotAdmitted if its gang is not admitted in time."""
        from airflow.sdk.exceptions import AirflowFailException

        from hybridflow.backends import gang_backend

        down = fenced(placement["cluster"], settings)
        if down is not None:  # a cleared or retried task, or a gang that waited there: no new gang on it
            self._leave_fenced(placement["cluster"], estate, settings)
            raise AirflowFailException(f"not started: {down}")
        job = self._job(context, settings, estate, placement, staged)
        if gang_backend(job.cluster, estate, settings.state_dir).supervised_by_task:
            return self._train_on_local(job, settings, estate, queued_since)
        return self._train_on_kubernetes(job, estate, settings, queued_since)

    def _train_on_local(self, job: TrainJob, settings, estate, queued_since: float | None = None) -> dict:
        from airflow.sdk.exceptions import AirflowFailException

        from hybridflow.backends import gang_backend, team_held_outside
        from hybridflow.backends.base import GangJob
        from hybridflow.backends.errors import GangMoved, GangNotAdmitted, GangPreempted, GangStopped

        req = job.admitted.request
        training_cfg = estate.pipeline.training
        # The launcher's SIGTERM -> SIGKILL grace is the workers' time to commit a final checkpoint.
        self._backend = gang_backend(job.cluster, estate, settings.state_dir)
        self._job_name = self._backend.gang_name(job.identity.dag_id, job.identity.run_id, self.task_id,
                                                 readable=f"train-{job.run_key}")
        # Critical runs are never held by the team's cap (they may preempt batch work instead).
        team_cap = None if req.priority == "critical" else estate.teams[job.admitted.team].gpu_cap
        outside = team_held_outside(estate, settings.state_dir, job.admitted.team) if team_cap else 0
        budget = training_cfg.preemption_retries
        preemptions = 0
        started = time.time()
        while True:
            label = f"try-{job.identity.try_number}" + (f"-relaunch-{preemptions}" if preemptions else "")
            attempt = self._begin_attempt(job, label)
            outcome, reason = "failed", None
            try:
                self._backend.run(
                    GangJob(name=self._job_name, workers=req.workers, spec={**job.spec, "attempt": label},
                            env=job.env, attempt=label, labels=dict(job.labels), team_cap=team_cap,
                            team_held_outside=outside, owner=dict(job.owner)),
                    admission_timeout_s=training_cfg.gang_admission_timeout_s,
                    log=self.log, queued_since=queued_since,
                    on_admitted=lambda waited, label=label: self._admitted_after(job, label, waited, settings),
                )
                queued_since = None  # a relaunch after a preemption queues afresh
                outcome = "succeeded"
            except GangNotAdmitted:
                outcome = "not_admitted"  # nothing ran; the task moves the run or keeps it waiting
                raise
            except GangStopped as exc:
                # Stopped on purpose (budget freeze, cluster declared down): checkpointed, and neither
                # relaunched nor retried.
                outcome = "stopped"
                raise AirflowFailException(f"{exc.reason}. {_resume_hint(job)}") from exc
            except GangMoved as exc:  # checkpointed to make room here: placed again, as after a wait
                outcome, reason = ("interrupted" if self._killed else "moved"), exc.reason
                if self._killed:
                    raise
                raise GangNotAdmitted(str(exc), cluster=job.cluster.name, queued_since=time.time(),
                                      moved=exc.reason) from exc
            except GangPreempted:
                # on_kill stops the gang with SIGTERM too; that exit is the task's, not a preemption.
                outcome = "interrupted" if self._killed else "preempted"
                if self._killed:
                    raise
            except BaseException:
                if self._killed:
                    outcome = "interrupted"
                raise
            finally:
                attempts = self._end_attempt(job, attempt, outcome, reason)
            if outcome == "succeeded":
                break
            preemptions += 1
            resume_at = attempts[-1].get("last_committed_step")
            if preemptions > budget:
                raise AirflowFailException(
                    f"gang {self._job_name!r} was preempted {preemptions} times in this try, more than "
                    f"training.preemption_retries = {budget} (config/pipeline.yaml). Its newest checkpoint "
                    f"(step {resume_at}) is kept in {job.ckpt_spec.uri} and {job.replica_spec.uri}: clear the "
                    "train task to resume from it, raise training.preemption_retries, or run on capacity that "
                    "is not reclaimed (spot_allowed=false)"
                )
            self.log.warning(
                "Gang %s was preempted (relaunch %d of at most %d); relaunching, it resumes from step %s",
                self._job_name,
                preemptions,
                budget,
                resume_at,
            )
        return self._bring_home(job, attempts, preemptions, started)

    def _train_on_kubernetes(self, job: TrainJob, estate, settings, queued_since: float | None = None) -> dict:
        """Submit the gang (or re-attach to the one this run already has there) and wait for it, in
        the triggerer when ``training.kubernetes_deferrable`` (no worker slot held for hours)."""
        from hybridflow.backends import gang_backend
        from hybridflow.backends.base import GangJob
        from hybridflow.backends.errors import GangMoved, GangNotAdmitted
        from hybridflow.queueing import hold_for_team_cap

        req = job.admitted.request
        cfg = estate.pipeline.training
        backend = gang_backend(job.cluster, estate, settings.state_dir)
        identity = job.identity
        # Deterministic per run, task and cluster: a retry or a cleared task finds its job again.
        self._job_name = backend.gang_name(identity.dag_id, identity.run_id, self.task_id, readable=f"train-{job.run_key}")
        self._backend = backend
        label = f"try-{identity.try_number}"
        gang = GangJob(name=self._job_name, workers=req.workers, spec={**job.spec, "attempt": label}, env=job.env,
                       attempt=label, labels=dict(job.labels), owner=dict(job.owner))
        queue = estate.queue_of(job.admitted.team)
        pool = job.placement["node_pool"]
        hold_for_team_cap(job.admitted, job.cluster.name, self._job_name, backend, estate, settings.state_dir,
                          queued_since)
        started = time.time()
        attempt = self._begin_attempt(job, label)
        if cfg.kubernetes_deferrable:
            try:
                handle = backend.submit(gang, pool=pool, queue=queue)
            except BaseException as exc:
                self._end_attempt_on_error(job, attempt, exc, estate)
            self._defer_to_gang(job, backend, estate, attempt, started, queued_since or started,
                                created=handle.created, admitted=handle.admitted)
        try:
            status = backend.run(gang, pool=pool, queue=queue, admission_timeout_s=cfg.gang_admission_timeout_s,
                                 poll_s=cfg.kubernetes_poll_s, log=self.log)
        except GangNotAdmitted as exc:
            self._end_attempt(job, attempt, "not_admitted")
            exc.queued_since = queued_since or started
            raise
        except GangMoved as exc:
            if self._killed:
                self._end_attempt_on_error(job, attempt, exc, estate)
            raise self._moved(job, attempt, exc) from exc
        except BaseException as exc:
            self._end_attempt_on_error(job, attempt, exc, estate)
        attempts = self._end_attempt(job, attempt, "succeeded")
        backend.delete_secret(self._job_name)  # the store credentials do not outlive the gang
        return self._bring_home(job, attempts, status.retries, started)

    def _moved(self, job: TrainJob, attempt: dict, exc) -> BaseException:
        """A Kubernetes gang moved off its cluster to make room: the attempt ends ``moved`` with the
        reason, the job (kept so that this task could read why) is deleted, and the run is placed
        again as after a wait, that cluster excluded."""
        from hybridflow.backends.errors import GangNotAdmitted

        self._end_attempt(job, attempt, "moved", exc.reason)
        self._backend.cancel(self._job_name)
        return GangNotAdmitted(str(exc), cluster=job.cluster.name, queued_since=time.time(), moved=exc.reason)

    def _defer_to_gang(self, job: TrainJob, backend, estate, attempt: dict, started: float, queued_since: float,
                       *, created: bool, admitted: bool) -> NoReturn:
        """Wait for the submitted gang in the triggerer for one admission window (no worker slot held
        for hours). Where a pending gang stands goes to the run's queue.json first: the trigger only
        waits, it writes nothing."""
        from hybridflow.settings import get_settings

        cfg = estate.pipeline.training
        cluster = job.cluster
        self.log.info("gang %s %s on %s (%s); waiting in the triggerer", self._job_name,
                      "submitted" if created else "re-attached", cluster.name, cluster.scheduler)
        if not admitted:
            if job.labels.get("private_only") == "true":  # it may run only here: movable gangs make room
                backend.make_room(self._job_name, log=self.log.info)
            self._note_waiting(job, backend, estate, queued_since, get_settings())
        self.defer(
            trigger=backend.wait_trigger(
                self._job_name, submitted_at=time.time(), admitted=admitted, queued_since=queued_since,
                admission_timeout_s=cfg.gang_admission_timeout_s, poll_s=cfg.kubernetes_poll_s,
                max_wait_s=cfg.max_queue_wait_s),
            method_name="execute_complete",
            kwargs={"placement": job.placement, "staged": {"source": job.spec["source"]}, "attempt": attempt,
                    "started": started},
        )
        raise AssertionError("defer() raises")  # pragma: no cover

    def _admitted_after(self, job: TrainJob, label: str, waited_s: float, settings) -> None:
        from hybridflow.queueing import record_admission

        record_admission(settings.private_root, job.run_key, label, job.cluster.name, job.admitted, waited_s,
                         self.log, private_only=job.labels.get("private_only") == "true")
        self.log.info("gang %s admitted on %s after %.1f s in the queue", self._job_name, job.cluster.name, waited_s)

    def _end_attempt_on_error(self, job: TrainJob, attempt: dict, exc: BaseException, estate) -> NoReturn:
        """Record how a Kubernetes gang ended badly and raise: a gang stopped by a budget freeze or by
        its cluster declared down (deleted, so it ends failed or missing) fails the task without a
        retry, like a local one."""
        from airflow.sdk.exceptions import AirflowFailException

        from hybridflow.backends.errors import GangFailed
        from hybridflow.budgets.enforce import refuse_if_frozen
        from hybridflow.errors import AdmissionError

        if isinstance(exc, GangFailed):
            req = job.admitted.request
            try:
                refuse_if_frozen(req.project, req.priority, req.budget_override, estate)
                stopped = fenced(job.cluster.name)
            except AdmissionError as frozen:
                stopped = str(frozen)
            if stopped is not None:
                self._end_attempt(job, attempt, "stopped")
                raise AirflowFailException(f"gang {self._job_name} stopped: {stopped}. {_resume_hint(job)}") from exc
        from hybridflow.backends.errors import PreemptionBudgetSpent

        if isinstance(exc, PreemptionBudgetSpent) and not self._killed:  # as on the local backend: no retry
            self._end_attempt(job, attempt, "preempted")
            raise AirflowFailException(str(exc)) from exc
        self._end_attempt(job, attempt, "interrupted" if self._killed else "failed")
        raise exc

    def _begin_attempt(self, job: TrainJob, label: str) -> dict:
        from hybridflow.training.attempts import begin_attempt

        return begin_attempt(job, label, self._job_name, self.log)

    def _end_attempt(self, job: TrainJob, attempt: dict, outcome: str, reason: str | None = None) -> list[dict]:
        from hybridflow.training.attempts import end_attempt

        return end_attempt(job, attempt, outcome, self.log, reason)

    def _bring_home(self, job: TrainJob, attempts: list[dict], preemptions: int, started: float) -> dict:
        from hybridflow.training.job import bring_home

        return bring_home(job, self._job_name, attempts, preemptions, started)

    def on_kill(self) -> None:
        self._killed = True
        if self._backend is not None and self._job_name:
            self._backend.cancel(self._job_name)

