"""The train task: one gang job on the chosen cluster, resumed from its newest checkpoint on retry."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

from airflow.sdk import BaseOperator

from hybridflow.runs import RunIdentity, run_dir, write_json_atomic


class GangTrainOperator(BaseOperator):
    """Run distributed training as a gang (all workers or none) and bring the model home.

    The gang job's name derives from the DAG run, so a retry or a cleared task takes the same slots
    and the same checkpoint places, and resumes where the last committed checkpoint left off.

    Preemption (a worker exits 75 after its final checkpoint: spot reclaim, eviction) is not an
    application error: the task relaunches the gang itself, as a new attempt that resumes from that
    checkpoint, up to ``training.preemption_retries`` times per task try. Application errors
    (:class:`~hybridflow.backends.local.GangFailed`) raise and use the task's Airflow ``retries``.
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

        from hybridflow.admission import AdmittedRun
        from hybridflow.budgets.enforce import refuse_if_frozen
        from hybridflow.config import load_estate
        from hybridflow.errors import AdmissionError
        from hybridflow.pipeline import current_placement
        from hybridflow.settings import get_settings

        settings = get_settings()
        estate = load_estate(settings.config_dir)
        req = AdmittedRun.from_xcom(dict(self.run)).request
        try:  # a train task cleared or retried while its project is frozen must not spend on
            refuse_if_frozen(req.project, req.priority, req.budget_override, estate)
        except AdmissionError as exc:
            raise AirflowFailException(f"not started: {exc}") from exc
        placement, staged = current_placement(self.run, self.placement, self.staged, settings)
        return self._train_with_failover(context, settings, estate, placement, staged)

    def execute_complete(self, context, event: dict, placement: dict, staged: dict, attempt: dict,
                         started: float) -> dict:
        """Back from the triggerer: the Kubernetes gang finished or failed, another cluster would
        admit it now, or it waited ``training.max_queue_wait_s``."""
        from hybridflow.backends import gang_backend
        from hybridflow.backends.errors import GangNotAdmitted
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
        except GangNotAdmitted as exc:
            self._end_attempt(job, attempt, "not_admitted")
            placement, staged = self._after_wait(context, exc, placement, staged, estate, settings, queued_since)
            return self._train_with_failover(context, settings, estate, placement, staged, queued_since)
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

    def _after_wait(self, context, exc, placement: dict, staged: dict, estate, settings,
                    queued_since: float) -> tuple[dict, dict]:
        """The gang waited a full admission window: move it to an eligible cluster that would admit
        it now, else keep its place in the queue (deferred: no worker slot held), until
        ``training.max_queue_wait_s`` runs out."""
        from hybridflow.pipeline import fail_over

        if self._killed:
            raise exc
        cfg = estate.pipeline.training
        self._fail_if_expired(exc.cluster, queued_since, cfg.max_queue_wait_s, str(exc))
        self.log.warning("%s", exc)
        if not exc.over_team_cap:  # a team's cap spans the estate: another cluster would not help
            moved = fail_over(self.run, placement, exc.cluster,
                              f"gang not admitted within {cfg.gang_admission_timeout_s:g} s", settings)
            if moved is not None:
                self._leave_queue(exc.cluster, estate, settings)
                self.log.warning("Moved to cluster %s, which would admit the gang now", moved[0]["cluster"])
                return moved
        return self._wait_in_queue(context, exc, placement, staged, estate, settings, queued_since)

    def _fail_if_expired(self, cluster: str, queued_since: float, max_wait_s: float, standing: str) -> None:
        from airflow.sdk.exceptions import AirflowFailException

        waited = time.time() - queued_since
        if waited >= max_wait_s:
            raise AirflowFailException(
                f"gang {self._job_name} waited {waited:.0f} s for admission, training.max_queue_wait_s is "
                f"{max_wait_s:g} (config/pipeline.yaml); last seen: {standing}. Raise the limit, ask for fewer "
                "workers, or trigger the run again when the cluster is less busy"
            )

    def _leave_queue(self, cluster: str, estate, settings) -> None:
        """Nothing of this run keeps queueing on a cluster it moved away from."""
        from hybridflow.backends import gang_backend

        if self._job_name:
            gang_backend(estate.clusters[cluster], estate, settings.state_dir).cancel(self._job_name)

    def _wait_in_queue(self, context, exc, placement: dict, staged: dict, estate, settings,
                       queued_since: float) -> tuple[dict, dict]:
        """Keep the gang's place: in the triggerer (local slot queue, or a team over its cap before a
        Kubernetes gang is submitted); a blocking Kubernetes wait simply waits another window."""
        from hybridflow.admission import AdmittedRun
        from hybridflow.backends import gang_backend
        from hybridflow.queueing import QueueWaitTrigger

        cfg = estate.pipeline.training
        local = gang_backend(estate.clusters[exc.cluster], estate, settings.state_dir).supervised_by_task
        if not local and not exc.over_team_cap:
            return placement, staged  # blocking Kubernetes: the job keeps its place, wait another window
        req = AdmittedRun.from_xcom(dict(self.run))
        team_cap = None if req.priority == "critical" else estate.teams[req.team].gpu_cap
        self.defer(
            trigger=QueueWaitTrigger(
                kind="slots" if local else "team_cap", cluster=exc.cluster,
                job={"name": self._job_name, "workers": req.workers, "priority": req.priority, "team": req.team,
                     "team_cap": team_cap},
                run=dict(self.run), placement=dict(placement), queued_since=queued_since,
                max_wait_s=cfg.max_queue_wait_s, recheck_s=cfg.gang_admission_timeout_s, poll_s=cfg.queue_poll_s),
            method_name="resume_after_wait",
            kwargs={"placement": placement, "staged": staged, "queued_since": queued_since},
        )
        raise AssertionError("defer() raises")  # pragma: no cover

    def resume_after_wait(self, context, event: dict, placement: dict, staged: dict, queued_since: float) -> dict:
        """Back from :class:`~hybridflow.queueing.QueueWaitTrigger`: admitted (launch on the slots it
        took), another cluster has room (move there), or the wait ran out."""
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
                                  event.get("message", ""))
        if status == "room_elsewhere":
            moved_or_stay = self._after_wait(
                context, GangNotAdmitted(event.get("message", ""), cluster=cluster, queued_since=queued_since),
                placement, staged, estate, settings, queued_since)
            placement, staged = moved_or_stay
        return self._train_with_failover(context, settings, estate, placement, staged, queued_since)

    def _job(self, context, settings, estate, placement: dict, staged: dict) -> _TrainJob:
        """What every gang of this run on ``placement``'s cluster is given, whatever its backend."""
        from hybridflow import rundata
        from hybridflow.admission import AdmittedRun
        from hybridflow.backends import gang_backend
        from hybridflow.pipeline import cache_store_spec, checkpoint_replica_spec, checkpoint_store_spec

        admitted = AdmittedRun.from_xcom(dict(self.run))
        req = admitted.request
        cluster = estate.clusters[placement["cluster"]]
        run_key = self.run["run_key"]
        entry, model = estate.datasets.get(admitted.dataset), estate.models.get(admitted.model)
        version = rundata.read_version(settings.private_root, run_key)
        ckpt_spec = checkpoint_store_spec(run_key, cluster, settings)
        replica_spec = checkpoint_replica_spec(run_key, cluster, settings)
        training_cfg = estate.pipeline.training
        timer_s = training_cfg.interruptible_checkpoint_every_s if req.interruptible else None
        spec = {
            "run_key": run_key,
            "model": {"name": model.name, "entrypoint": model.entrypoint, "hyperparameters": admitted.hyperparameters},
            "dataset": rundata.dataset_info(entry, version, admitted.classification),
            "source": staged["source"],
            "checkpoint_store": ckpt_spec.to_dict(),
            "checkpoint_replica": replica_spec.to_dict(),
            "checkpoint_every_steps": req.checkpoint_every_steps,
            # Interruptible runs may be reclaimed at any time: also checkpoint on a timer.
            "checkpoint_every_seconds": timer_s,
            "preemption_grace_s": training_cfg.preemption_grace_s,
            "keep": training_cfg.checkpoint_keep,
        }
        # Staged data and cache checkpoints share the cluster's cache connection; data read in place
        # from a private bucket needs that bucket's.
        env = cache_store_spec(cluster).credential_env() if cluster.cache else {}
        if staged["source"].get("kind") == "store":
            _, data_env = rundata.source_where_it_lives(entry, settings.private_root, run_key,
                                                        estate.file_roots(settings.home))
            if env and data_env and env != data_env:
                raise ValueError(f"cluster {cluster.name} reads its cache and dataset {entry.name}'s private bucket "
                                 "with different credentials; stage the data into the cache instead")
            env = {**env, **data_env}
        return _TrainJob(
            identity=RunIdentity.from_context(context), admitted=admitted, placement=placement, cluster=cluster,
            run_key=run_key, ckpt_spec=ckpt_spec, replica_spec=replica_spec, spec=spec, model=model,
            env=env,
            attempts_path=run_dir(settings.private_root, run_key) / "train-attempts.json",
            labels={"project": req.project, "team": admitted.team, "priority": req.priority,
                    "interruptible": str(req.interruptible).lower()},
            log=self.log,
            task_reads_local=gang_backend(cluster, estate, settings.state_dir).reads_private_storage,
        )

    def _train_on(self, context, settings, estate, placement: dict, staged: dict,
                  queued_since: float | None = None) -> dict:
        """Train on ``placement``'s cluster; GangNotAdmitted if its gang is not admitted in time."""
        from hybridflow.backends import gang_backend

        job = self._job(context, settings, estate, placement, staged)
        if gang_backend(job.cluster, estate, settings.state_dir).supervised_by_task:
            return self._train_on_local(job, settings, estate, queued_since)
        return self._train_on_kubernetes(job, estate, settings, queued_since)

    def _train_on_local(self, job: _TrainJob, settings, estate, queued_since: float | None = None) -> dict:
        from airflow.sdk.exceptions import AirflowFailException

        from hybridflow.backends import gang_backend, team_held_outside
        from hybridflow.backends.base import GangJob
        from hybridflow.backends.errors import GangNotAdmitted, GangPreempted, GangStopped

        req = job.admitted.request
        training_cfg = estate.pipeline.training
        self._job_name = f"train-{job.run_key}"
        # The launcher's SIGTERM -> SIGKILL grace is the workers' time to commit a final checkpoint.
        self._backend = gang_backend(job.cluster, estate, settings.state_dir)
        # Critical runs are never held by the team's cap (they may preempt batch work instead).
        team_cap = None if req.priority == "critical" else estate.teams[job.admitted.team].gpu_cap
        outside = team_held_outside(estate, settings.state_dir, job.admitted.team) if team_cap else 0
        budget = training_cfg.preemption_retries
        preemptions = 0
        started = time.time()
        while True:
            label = f"try-{job.identity.try_number}" + (f"-relaunch-{preemptions}" if preemptions else "")
            attempt = self._begin_attempt(job, label)
            outcome = "failed"
            try:
                self._backend.run(
                    GangJob(name=self._job_name, workers=req.workers, spec={**job.spec, "attempt": label},
                            env=job.env, attempt=label, labels=dict(job.labels), team_cap=team_cap,
                            team_held_outside=outside),
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
                # Stopped on purpose (budget freeze): checkpointed, and neither relaunched nor retried.
                outcome = "stopped"
                raise AirflowFailException(
                    f"{exc.reason}. The newest checkpoint is kept in {job.ckpt_spec.uri}: clear the train task "
                    "once the freeze is lifted to resume from it"
                ) from exc
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
                attempts = self._end_attempt(job, attempt, outcome)
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

    def _train_on_kubernetes(self, job: _TrainJob, estate, settings, queued_since: float | None = None) -> dict:
        """Submit the gang (or re-attach to the one this run already has there) and wait for it, in
        the triggerer when ``training.kubernetes_deferrable`` (no worker slot held for hours)."""
        from hybridflow.backends import gang_backend
        from hybridflow.backends.base import GangJob
        from hybridflow.backends.errors import GangNotAdmitted
        from hybridflow.backends.k8s.backend import MISSING, PENDING
        from hybridflow.backends.k8s.manifests import gang_job_name
        from hybridflow.backends.k8s.trigger import GangJobTrigger

        req = job.admitted.request
        cfg = estate.pipeline.training
        backend = gang_backend(job.cluster, estate, settings.state_dir)
        identity = job.identity
        # Deterministic per run, task and cluster: a retry or a cleared task finds its job again.
        self._job_name = gang_job_name(identity.dag_id, identity.run_id, self.task_id, job.cluster.name,
                                       readable=f"train-{job.run_key}")
        self._backend = backend
        label = f"try-{identity.try_number}"
        gang = GangJob(name=self._job_name, workers=req.workers, spec={**job.spec, "attempt": label}, env=job.env,
                       attempt=label, labels=dict(job.labels))
        queue = estate.queue_of(job.admitted.team)
        pool = job.placement["node_pool"]
        self._hold_for_team_cap(job, backend, estate, settings, queued_since)
        started = time.time()
        attempt = self._begin_attempt(job, label)
        if cfg.kubernetes_deferrable:
            try:
                sub = backend.submit(backend.gang_spec(gang, pool=pool, queue=queue), gang.env)
            except BaseException as exc:
                self._end_attempt_on_error(job, attempt, exc, estate)
            self.log.info("gang %s %s on %s (%s); waiting in the triggerer", sub.name,
                          "submitted" if sub.created else "re-attached", job.cluster.name, job.cluster.scheduler)
            self.defer(
                trigger=GangJobTrigger(
                    conn_id=job.cluster.conn_id, scheduler=job.cluster.scheduler, namespace=backend.namespace,
                    name=sub.name, cluster=job.cluster.name, submitted_at=started,
                    admission_timeout_s=cfg.gang_admission_timeout_s, poll_interval=cfg.kubernetes_poll_s,
                    admitted=sub.status.phase not in (PENDING, MISSING), queued_since=queued_since or started,
                    max_wait_s=cfg.max_queue_wait_s, run=dict(self.run), placement=dict(job.placement),
                ),
                method_name="execute_complete",
                kwargs={"placement": job.placement, "staged": {"source": job.spec["source"]}, "attempt": attempt,
                        "started": started},
            )
        try:
            status = backend.run(gang, pool=pool, queue=queue, admission_timeout_s=cfg.gang_admission_timeout_s,
                                 poll_s=cfg.kubernetes_poll_s, log=self.log)
        except GangNotAdmitted as exc:
            self._end_attempt(job, attempt, "not_admitted")
            exc.queued_since = queued_since or started
            raise
        except BaseException as exc:
            self._end_attempt_on_error(job, attempt, exc, estate)
        attempts = self._end_attempt(job, attempt, "succeeded")
        backend.delete_secret(self._job_name)  # the store credentials do not outlive the gang
        return self._bring_home(job, attempts, status.retries, started)

    def _hold_for_team_cap(self, job: _TrainJob, backend, estate, settings, queued_since: float | None) -> None:
        """A team's gpu_cap spans the estate, and a Kubernetes scheduler knows only its own cluster:
        a gang that would take its team past the cap is not submitted yet (GangNotAdmitted with
        over_team_cap: the task waits for the team's GPUs in the triggerer). A job this run already
        has there is re-attached, never held."""
        from hybridflow.backends import estate_load, team_usage
        from hybridflow.backends.errors import GangNotAdmitted
        from hybridflow.backends.k8s.backend import MISSING

        req = job.admitted.request
        cap = estate.teams[job.admitted.team].gpu_cap
        if cap is None or req.priority == "critical" or backend.status(self._job_name).phase != MISSING:
            return
        held = team_usage(estate_load(estate, settings.state_dir)).get(job.admitted.team, 0)
        if held + req.workers > cap:
            raise GangNotAdmitted(
                f"gang {self._job_name} not submitted to {job.cluster.name}: team {job.admitted.team} holds {held} of "
                f"its gpu_cap of {cap} GPUs and the gang needs {req.workers}; it waits for the team's runs to finish "
                f"(or raise teams.{job.admitted.team}.gpu_cap in projects.yaml)",
                cluster=job.cluster.name, over_team_cap=True, queued_since=queued_since or time.time())

    def _admitted_after(self, job: _TrainJob, label: str, waited_s: float, settings) -> None:
        """The gang was admitted after ``waited_s`` in the queue: for the run's page and the ledger's
        history of queue waits (which deadline placement estimates from). Best effort."""
        from hybridflow.queueing import note_standing

        now = time.time()
        try:
            note_standing(settings.private_root, job.run_key, cluster=job.cluster.name, state="admitted",
                          queued_since=now - waited_s)
            from hybridflow.ledger.queue_waits import record_queue_wait

            record_queue_wait(job.run_key, label, job.cluster.name, job.admitted.workers, job.admitted.priority,
                              datetime.fromtimestamp(now - waited_s, UTC), datetime.fromtimestamp(now, UTC),
                              "admitted")
        except Exception as exc:  # noqa: BLE001 - the history is a help, never a reason to stop training
            self.log.warning("could not record the queue wait of %s (%s)", job.run_key, exc)
        self.log.info("gang %s admitted on %s after %.1f s in the queue", self._job_name, job.cluster.name, waited_s)

    def _end_attempt_on_error(self, job: _TrainJob, attempt: dict, exc: BaseException, estate) -> NoReturn:
        """Record how a Kubernetes gang ended badly and raise: a gang stopped by a budget freeze
        (deleted, so it ends failed or missing) fails the task without a retry, like a local one."""
        from airflow.sdk.exceptions import AirflowFailException

        from hybridflow.backends.local import GangFailed
        from hybridflow.budgets.enforce import refuse_if_frozen
        from hybridflow.errors import AdmissionError

        if isinstance(exc, GangFailed):
            req = job.admitted.request
            try:
                refuse_if_frozen(req.project, req.priority, req.budget_override, estate)
            except AdmissionError as frozen:
                self._end_attempt(job, attempt, "stopped")
                raise AirflowFailException(
                    f"gang {self._job_name} stopped: {frozen}. The newest checkpoint is kept in "
                    f"{job.ckpt_spec.uri}: clear the train task once the freeze is lifted to resume from it"
                ) from exc
        self._end_attempt(job, attempt, "interrupted" if self._killed else "failed")
        raise exc

    def _begin_attempt(self, job: _TrainJob, label: str) -> dict:
        attempt = _start_attempt(job.attempts_path, job.identity.try_number, label, job.admitted.request.workers,
                                 job.cluster.name, progress_of=lambda earlier: _progress(job.places(), earlier,
                                                                                         self.log),
                                 gang=self._job_name)
        _note_in_ledger(_read_attempts(job.attempts_path), **job.bill())
        return attempt

    def _end_attempt(self, job: _TrainJob, attempt: dict, outcome: str) -> list[dict]:
        attempts = _finish_attempt(job.attempts_path, attempt, outcome,
                                   _progress(job.places(), attempt["attempt"], self.log))
        _note_in_ledger(attempts, **job.bill())
        return attempts

    def _bring_home(self, job: _TrainJob, attempts: list[dict], preemptions: int, started: float) -> dict:
        """The finished gang's model into the run's folder as a bundle, and the task's summary for XCom."""
        from hybridflow.bundle import WEIGHTS_FILE, ModelCard, write_bundle
        from hybridflow.storage.objectstore import open_store
        from hybridflow.training.context import FINAL_MODEL_KEY, RESULT_KEY

        store = open_store(job.ckpt_spec)
        summary = json.loads(store.get_bytes(RESULT_KEY))
        bundle = job.attempts_path.parent / "model"  # the run's folder in private storage
        card = ModelCard(**job.model.card(), hyperparameters=dict(job.admitted.hyperparameters), variant="fp32",
                         version=job.run_key)
        write_bundle(bundle, store.get_bytes(FINAL_MODEL_KEY), card)
        model_path = bundle / WEIGHTS_FILE
        gpu_seconds = sum(a["seconds"] * a["workers"] for a in attempts if a.get("seconds") is not None)
        self.log.info(
            "Gang %s finished: steps %s..%s, %s checkpoints, %d preemptions in this try, model at %s",
            self._job_name,
            summary["start_step"],
            summary["final_step"],
            summary["checkpoints_written"],
            preemptions,
            model_path,
        )
        return {
            "job_name": self._job_name,
            "cluster": job.cluster.name,
            "model_path": str(model_path),
            "bundle": str(bundle),
            "checkpoint_store": job.ckpt_spec.uri,
            "checkpoint_replica": job.replica_spec.uri,
            "checkpoints_written": summary["checkpoints_written"],
            "checkpoint_blocked_s_mean": (summary.get("checkpoints") or {}).get("blocked_s_mean"),
            "start_step": summary["start_step"],
            "final_step": summary["final_step"],
            "final_loss": summary.get("final_loss"),
            "metrics": {k: v.get("last") for k, v in (summary.get("metrics") or {}).items()},
            "checkpoint_kind": summary.get("checkpoint_kind"),
            "preemptions": preemptions,
            "seconds": round(time.time() - started, 3),
            "gpu_seconds": round(gpu_seconds, 3),
            "attempts": attempts,
        }

    def on_kill(self) -> None:
        self._killed = True
        if self._backend is not None and self._job_name:
            self._backend.cancel(self._job_name)


@dataclass(frozen=True)
class _TrainJob:
    """One run's training on one cluster: what its gangs are given and where their attempts are noted."""

    identity: RunIdentity
    admitted: Any
    placement: dict
    cluster: Any
    run_key: str
    ckpt_spec: Any
    replica_spec: Any
    spec: dict
    model: Any
    env: dict
    attempts_path: Path
    labels: dict
    log: Any
    task_reads_local: bool = True  # the backend's gangs write local places the task can read too

    def places(self) -> list:
        """The checkpoint places this task can read: a Kubernetes cluster's scratch volume is only
        mounted in its pods."""
        from hybridflow.storage.objectstore import open_store

        specs = [self.ckpt_spec, self.replica_spec]
        if not self.task_reads_local:
            specs = [s for s in specs if s.kind != "local"]
        return [open_store(s) for s in specs]

    def bill(self) -> dict:
        return {"run_key": self.run_key, "admitted": self.admitted, "identity": self.identity,
                "placement": self.placement, "log": self.log}


def _progress(places: list, label: str, log) -> dict:
    """What an attempt achieved: its start and last step (from the gang's report in the primary
    place, ``places[0]``) and the newest checkpoint committed in either place. Missing facts stay None (a killed gang reports no
    last step); reading them never hides the attempt's own outcome."""
    from hybridflow.training.checkpoint import CheckpointStore
    from hybridflow.training.context import attempt_status_key

    out: dict = {"start_step": None, "last_step": None, "last_committed_step": None}
    try:
        status = json.loads(places[0].get_bytes(attempt_status_key(label)))
        out.update({k: status.get(k) for k in ("start_step", "last_step", "sigterm_to_commit_s") if k in status})
    except FileNotFoundError:
        pass
    except Exception as exc:
        log.warning("could not read the gang's report of attempt %s: %s", label, exc)
    committed: list[int] = []
    for place in places:
        try:
            committed += CheckpointStore(place).committed_steps()
        except Exception as exc:
            log.warning("could not list checkpoints in %s: %s", place.uri, exc)
    out["last_committed_step"] = max(committed, default=None)
    return out


def _read_attempts(path: Path) -> list[dict]:
    return json.loads(path.read_text()) if path.is_file() else []


def _write_attempts(path: Path, attempts: list[dict]) -> None:
    write_json_atomic(path, attempts)


def _note_in_ledger(attempts: list[dict], *, run_key: str, admitted, identity, placement: dict, log) -> None:
    """Put the run's attempts in the ledger as they start and end, so the nightly allocation bills
    GPU time of runs that fail, or are still going, before their record step; the run record
    replaces these rows when it is written. Best effort: the ledger never stops training."""
    req = admitted.request
    provisional = {
        "run_key": run_key, "project": req.project, "team": admitted.team,
        "cluster": placement.get("cluster"), "gpu_type": req.gpu_type,
        "pricing_class": placement.get("pricing_class"), "price_per_gpu_hour": placement.get("price_per_gpu_hour"),
        "workers": req.workers, "priority": req.priority, "dag_id": identity.dag_id, "run_id": identity.run_id,
        "budget_override": req.budget_override,
        "train_attempts": [{k: v for k, v in a.items() if not k.startswith("_")} for a in attempts],
        "recorded_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    try:
        from hybridflow.ledger import ingest_run_record

        ingest_run_record(provisional)
    except Exception as exc:  # noqa: BLE001 - billing catches up from the run record
        log.warning("could not note the training attempts in the ledger (%s); the run record brings them", exc)


def _start_attempt(
    path: Path,
    try_number: int,
    label: str,
    workers: int,
    cluster: str,
    progress_of: Callable[[str], dict] | None = None,
    gang: str | None = None,
) -> dict:
    """Note the attempt before the gang starts, so a killed try still counts its GPU time."""
    attempts = _read_attempts(path)
    for earlier in attempts:
        if earlier["outcome"] == "running":
            # That try's process died without finishing: it ran at least until this one started
            # (an upper bound; the gang backend stops orphaned workers on launcher death).
            earlier["outcome"] = "interrupted"
            if progress_of is not None and earlier.get("attempt"):
                earlier.update(progress_of(earlier["attempt"]))
    attempt = {
        "try_number": try_number,
        "attempt": label,
        "cluster": cluster,
        "workers": workers,
        # The gang's job name: metering ties GPU samples of its pods to the run by it.
        "gang": gang,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": None,
        "outcome": "running",
    }
    attempts.append(attempt)
    _write_attempts(path, attempts)
    attempt["_t0"] = time.time()
    return attempt


def _finish_attempt(path: Path, attempt: dict, outcome: str, progress: dict | None = None) -> list[dict]:
    attempts = _read_attempts(path)
    for a in attempts:
        if a.get("attempt") == attempt["attempt"] and a["started_at"] == attempt["started_at"]:
            a["seconds"] = round(time.time() - attempt["_t0"], 3)
            a["outcome"] = outcome
            a.update(progress or {})
    _write_attempts(path, attempts)
    return attempts
