"""The Kubernetes gang backend: submit, re-attach, watch and delete one gang job on one cluster.

Talks to the cluster only through the provider's ``KubernetesHook(conn_id=cluster.conn_id)`` and
the clients it hands out (``custom_object_client`` for Volcano Jobs, ``batch_v1_client`` for
Kueue-managed Jobs, ``core_v1_client`` for the companion Secret and Service), so the kubeconfig
stays in the Airflow Connection.

Re-runnable by construction: the job's name derives from the run (``gang_job_name``), and
:meth:`KubernetesGangBackend.submit_spec` first looks for a job of that name. An active or finished one
is re-attached (a retried or cleared task never starts a second gang); a failed one is deleted
and submitted afresh, since that is what a retry asks for.

The deferrable path is :meth:`submit`, then :class:`~hybridflow.backends.k8s.trigger.GangJobTrigger`
(which polls the job's status), then :meth:`outcome` on its event; :meth:`run` is the blocking form.

:meth:`KubernetesGangBackend.load` reads what placement needs from the cluster's gang scheduler
itself (details in :mod:`hybridflow.backends.k8s.load`): Volcano's cluster-scoped Queues
(``status.allocated`` GPUs: ``used``, and per team queue: ``teams``) and its PodGroups in every
namespace still Pending or Inqueue (``queued`` and ``waiting``, in priority then creation order);
or Kueue's ClusterQueues (``status.flavorsUsage``: ``used``), the namespace's LocalQueues (per team
queue: ``teams``) and its Workloads without quota reserved (``queued`` and ``waiting``). Every
call is bounded by ``read_timeout_s``; a reading is shared for ``cache_s`` seconds by every backend
of the same Connection, namespace and scheduler; an unreadable cluster is
:meth:`ClusterLoad.unknown`, never an exception.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hybridflow.backends.base import (
    INSTANCE_KEY,
    ClusterLoad,
    GangBackend,
    GangHandle,
    GangJob,
    GangRemnant,
    instance_identity,
    owner_annotations,
)
from hybridflow.backends.errors import GangFailed, GangMoved, GangNotAdmitted, PreemptionBudgetSpent
from hybridflow.backends.k8s import load as _load
from hybridflow.backends.k8s import moves as _moves
from hybridflow.backends.k8s import pods as _pods
from hybridflow.backends.k8s.api import job_call, ride_out
from hybridflow.backends.k8s.manifests import (
    GANG_LABEL,
    PREEMPTED_EXIT,
    VOLCANO_GROUP,
    VOLCANO_PLURAL,
    VOLCANO_VERSION,
    GangSpec,
    env_secret,
    gang_job_name,
    gang_manifest,
    rendezvous_service,
)
from hybridflow.backends.k8s.status import (  # noqa: F401 - the gang's states, as the trigger and tests use them
    APPLICATION,
    BUDGET_SPENT,
    FAILED,
    MISSING,
    PENDING,
    RESTARTING,
    RUNNING,
    SUCCEEDED,
    GangStatus,
    kueue_status,
    read_status,
    volcano_status,
)
from hybridflow.config import Cluster
from hybridflow.errors import GangError
from hybridflow.hooks.kubernetes import kubernetes_hook

# The worker reads its job spec from the pod's (non-secret) environment.
SPEC_ENV = "HYBRIDFLOW_JOB_SPEC"
DEFAULT_COMMAND = ("python", "-m", "hybridflow.training.worker", "--spec-env", SPEC_ENV)

@dataclass(frozen=True)
class Submission:
    name: str
    namespace: str
    created: bool  # False: a job of this name already existed and was re-attached
    status: GangStatus


def _rank_failure(failure: _pods.PodEnd) -> str:
    return (f"rank {failure.rank} (pod {failure.pod}) exited {failure.exit_code}"
            f"{': ' + failure.message if failure.message else ''}")


def _label_key(key: str) -> str:
    return key.replace("_", "-")  # a label name is a DNS label: private_only is hybridflow.io/private-only


def _status_code(exc: BaseException) -> int | None:
    return getattr(exc, "status", None)


def delete_gang(hook: Any, scheduler: str, namespace: str, name: str, *, timeout: float) -> bool:
    """Delete gang job ``name`` with its pods, Secret and Service, each call bounded by ``timeout``;
    True if the job existed. Whatever is already gone is skipped, so a second call is a no-op."""
    found = True
    kw = {"name": name, "namespace": namespace, "propagation_policy": "Background", "_request_timeout": timeout}
    try:
        if scheduler == "volcano":
            hook.custom_object_client.delete_namespaced_custom_object(
                group=VOLCANO_GROUP, version=VOLCANO_VERSION, plural=VOLCANO_PLURAL, **kw)
        else:
            # Without a propagation policy the API orphans a Job's pods: they would keep their GPUs.
            hook.batch_v1_client.delete_namespaced_job(**kw)
    except Exception as exc:
        if _status_code(exc) != 404:
            raise
        found = False
    core = hook.core_v1_client
    for remove, obj in ((core.delete_namespaced_secret, f"{name}-env"), (core.delete_namespaced_service, name)):
        try:
            remove(name=obj, namespace=namespace, _request_timeout=timeout)
        except Exception as exc:
            if _status_code(exc) != 404:
                raise
    return found


# --- the backend --------------------------------------------------------------------------------


class KubernetesGangBackend(GangBackend):
    """Gang jobs on one ``kubernetes`` cluster of the estate.

    ``queue_teams`` maps a queue's name (Volcano Queue, Kueue LocalQueue) to the team it belongs to,
    for ``load().teams`` and the team of a waiting gang; None: every queue is named after its team
    (the estate's default), so a queue counts under its own name."""

    def __init__(self, cluster: Cluster, *, image: str, command: tuple[str, ...] = DEFAULT_COMMAND,
                 max_retry: int = 3, grace_s: float = 30, hook: Any = None, read_timeout_s: float = 5.0,
                 cache_s: float = 5.0, queue_teams: Mapping[str, str] | None = None,
                 api_outage_s: float = 300.0) -> None:
        if cluster.backend != "kubernetes":
            raise GangError(f"cluster {cluster.name!r} uses backend {cluster.backend!r}; the Kubernetes backend "
                            "needs clusters.<name>.backend: kubernetes")
        if not cluster.conn_id or cluster.scheduler not in ("volcano", "kueue"):
            raise GangError(f"cluster {cluster.name!r} needs conn_id and scheduler (volcano or kueue) in "
                            "clusters.yaml for the Kubernetes backend")
        self.cluster = cluster
        self.cluster_name = cluster.name
        self.namespace = cluster.k8s_namespace
        self.read_timeout_s = read_timeout_s
        self.api_outage_s = api_outage_s  # how long the blocking wait rides out an unreachable API
        self.cache_s = cache_s
        self.queue_teams = dict(queue_teams) if queue_teams is not None else None
        self.scheduler = cluster.scheduler
        self.image = image
        self.command = tuple(command)
        self.max_retry = max_retry
        self.grace_s = grace_s
        self._hook = hook

    @property
    def hook(self) -> Any:
        if self._hook is None:
            self._hook = kubernetes_hook(self.cluster.conn_id)
        return self._hook

    def gang_name(self, dag_id: str, run_id: str, task_id: str, *, readable: str) -> str:
        """A DNS-1123 name: ``readable`` as a slug plus a hash of the run's identity and this cluster."""
        return gang_job_name(dag_id, run_id, task_id, self.cluster.name, readable=readable)

    def wait_trigger(self, name: str, *, submitted_at: float, admitted: bool, queued_since: float,
                     admission_timeout_s: float, poll_s: float, max_wait_s: float) -> Any:
        from hybridflow.backends.k8s.trigger import GangJobTrigger

        return GangJobTrigger(
            conn_id=self.cluster.conn_id, scheduler=self.scheduler, namespace=self.namespace, name=name,
            cluster=self.cluster.name, submitted_at=submitted_at, admission_timeout_s=admission_timeout_s,
            poll_interval=poll_s, admitted=admitted, queued_since=queued_since, max_wait_s=max_wait_s,
            request_timeout_s=self.read_timeout_s, api_outage_s=self.api_outage_s, max_retry=self.max_retry)

    def gang_spec(self, job: GangJob, *, pool: str, queue: str, gpus_per_worker: int = 1) -> GangSpec:
        """The manifest input for ``job`` (a GangJob as the train task builds it) on node pool ``pool``."""
        labels = {_label_key(k): v for k, v in job.labels.items()
                  if k in ("project", "team", "interruptible", "private_only", "movable")}
        if job.spec.get("run_key"):
            # The job name may truncate the run key; metering can tie pods to the run by this label.
            labels["run-key"] = str(job.spec["run_key"])
        labels[INSTANCE_KEY] = instance_identity()  # hybridflow.io/instance: whose reaper may release it
        secret = f"{job.name}-env" if job.env else None
        return GangSpec(
            name=job.name, namespace=self.namespace, workers=job.workers, image=self.image, command=self.command,
            pool=self.cluster.pool(pool), queue=queue, priority=job.priority, gpus_per_worker=gpus_per_worker,
            max_retry=self.max_retry, labels=labels, env={SPEC_ENV: json.dumps(job.spec, sort_keys=True)},
            env_secret=secret, annotations=owner_annotations(job.owner),
            volumes=((self.cluster.scratch_claim, self.cluster.scratch_dir),) if self.cluster.scratch_claim else (),
            grace_s=self.grace_s, nccl_socket_ifname=self.cluster.nccl_socket_ifname,
        )

    def check_job(self, job: GangJob, *, pool: str | None = None, queue: str | None = None) -> None:
        """The gang's manifest is built (and so checked by field) as :meth:`submit` would build it."""
        gang_manifest(self.gang_spec(job, pool=pool or "", queue=queue or ""), self.scheduler)

    def status(self, name: str) -> GangStatus:
        return read_status(self.hook, self.scheduler, self.namespace, name, timeout=self.read_timeout_s,
                           max_retry=self.max_retry)

    def submit(self, job: GangJob, *, pool: str | None = None, queue: str | None = None) -> GangHandle:
        """Create ``job``'s gang job on node pool ``pool`` in queue ``queue`` (its store credentials in
        the gang's Secret), or re-attach to the one this run created before."""
        sub = self.submit_spec(self.gang_spec(job, pool=pool or "", queue=queue or ""), job.env)
        return GangHandle(self.cluster_name, sub.name, job.attempt, created=sub.created,
                          admitted=sub.status.phase not in (PENDING, MISSING), submitted_at=time.time())

    def poll(self, handle: GangHandle) -> GangStatus:
        """The job's status as its scheduler reports it; a pending one with its place in the queue."""
        status = self.status(handle.name)
        if status.phase == PENDING:
            standing = self.standing(handle.name)
            return dataclasses.replace(status, standing=standing, message=status.message or standing.describe())
        failure = self._failed_rank(handle.name) if status.phase == FAILED and status.cause != BUDGET_SPENT else None
        if failure is not None:
            return dataclasses.replace(status, message=_rank_failure(failure))
        return status

    def submit_spec(self, spec: GangSpec, secret_env: Mapping[str, str] | None = None) -> Submission:
        """Create the gang job from its manifest input, or re-attach to the one this run created before."""
        manifest = gang_manifest(spec, self.scheduler)  # validates spec before anything is sent
        existing = self.status(spec.name)
        replacing = existing.phase == FAILED
        if replacing:
            # A retry of a failed gang: start it again under the same name.
            self.delete(spec.name)
        elif existing.phase != MISSING:
            return Submission(spec.name, self.namespace, False, existing)
        self._check_claims(spec)
        if spec.env_secret:
            self._put_secret(env_secret(spec.env_secret, self.namespace, secret_env or {}, spec.name,
                                         spec.annotations, instance=spec.labels.get(INSTANCE_KEY)))
        try:
            if self.scheduler == "volcano":
                self.hook.custom_object_client.create_namespaced_custom_object(
                    group=VOLCANO_GROUP, version=VOLCANO_VERSION, plural=VOLCANO_PLURAL, body=manifest,
                    namespace=self.namespace, _request_timeout=self.read_timeout_s)
            else:
                self._create_ignoring_conflict(self.hook.core_v1_client.create_namespaced_service,
                                               rendezvous_service(spec))
                self.hook.batch_v1_client.create_namespaced_job(namespace=self.namespace, body=manifest,
                                                                _request_timeout=self.read_timeout_s)
        except Exception as exc:
            if _status_code(exc) != 409:
                raise
            if replacing:
                raise GangError(f"gang {spec.name}: the failed job of that name is still being deleted on "
                                f"{self.cluster.name}; retry the task in a few seconds") from exc
            # Created concurrently by another try of the same task: attach to it.
            return Submission(spec.name, self.namespace, False, self.status(spec.name))
        return Submission(spec.name, self.namespace, True, GangStatus(PENDING))

    def _check_claims(self, spec: GangSpec) -> None:
        """Every volume's PersistentVolumeClaim exists in the namespace. A real scheduler keeps a pod
        whose claim is missing Pending for good, saying so only in its own log and the pod's events,
        so the gang would wait out its whole admission timeout; refuse it here instead, before the
        job or its Secret is created. An identity that may not read claims goes on unchecked."""
        for claim, mount in spec.volumes:
            try:
                self.hook.core_v1_client.read_namespaced_persistent_volume_claim(
                    name=claim, namespace=self.namespace, _request_timeout=self.read_timeout_s)
            except Exception as exc:
                if _status_code(exc) in (401, 403):
                    continue
                if _status_code(exc) != 404:
                    raise
                raise GangError(
                    f"clusters.{self.cluster.name}.scratch_claim: no PersistentVolumeClaim {claim!r} in namespace "
                    f"{self.namespace!r} (the gang's pods mount it at {mount}, and a pod whose claim is missing is "
                    f"never scheduled): create the claim there, or keep checkpoints in 'cache' and remove "
                    f"scratch_claim; nothing was submitted") from exc

    def _create_ignoring_conflict(self, create: Callable[..., Any], body: dict) -> None:
        try:
            create(namespace=self.namespace, body=body, _request_timeout=self.read_timeout_s)
        except Exception as exc:
            if _status_code(exc) != 409:
                raise

    def _put_secret(self, body: dict) -> None:
        core = self.hook.core_v1_client
        try:
            core.create_namespaced_secret(namespace=self.namespace, body=body, _request_timeout=self.read_timeout_s)
        except Exception as exc:
            if _status_code(exc) != 409:
                raise
            core.replace_namespaced_secret(name=body["metadata"]["name"], namespace=self.namespace, body=body,
                                           _request_timeout=self.read_timeout_s)

    def delete_secret(self, name: str) -> None:
        """Remove the gang's Secret (store credentials) once it no longer needs it; the job stays
        for its status and logs."""
        try:
            self.hook.core_v1_client.delete_namespaced_secret(name=f"{name}-env", namespace=self.namespace,
                                                              _request_timeout=self.read_timeout_s)
        except Exception as exc:
            if _status_code(exc) != 404:
                raise

    def delete(self, name: str) -> bool:
        """Delete the gang job with its pods, Secret and Service; True if the job existed."""
        return delete_gang(self.hook, self.scheduler, self.namespace, name, timeout=self.read_timeout_s)

    cancel = delete  # on_kill

    def outcome(self, name: str, status: GangStatus, *, admitted: bool) -> GangStatus:
        """Turn a final reading into the train task's outcome: return on success, raise otherwise."""
        if status.phase == SUCCEEDED:
            return status
        if status.phase == PENDING and not admitted:
            # The job keeps its place in the queue: the train task deletes it only if the run moves.
            raise GangNotAdmitted(
                f"gang {name} not admitted yet on cluster {self.cluster.name} ({self.scheduler} queue; "
                f"{self.standing(name).describe()})", cluster=self.cluster.name)
        where = f"gang {name} on cluster {self.cluster.name}"
        if status.cause == _moves.MOVED:  # its task deletes the job and places the run again
            raise GangMoved(f"{where} was checkpointed and moved: {status.message}", reason=status.message,
                            rank=-1, exit_code=PREEMPTED_EXIT, log_tail=status.message)
        if status.cause == BUDGET_SPENT:
            self.delete(name)  # a Kueue Job would go on restarting it: stop it holding GPUs
            raise PreemptionBudgetSpent(
                f"{where} was stopped: {status.message}. Its newest checkpoint is kept: clear the train task to "
                "resume from it, raise training.preemption_retries, or run on capacity that is not reclaimed",
                rank=-1, exit_code=PREEMPTED_EXIT, log_tail=status.message)
        failure = self._failed_rank(name) if status.phase == FAILED else None
        if failure is not None:
            raise GangFailed(f"{where} failed: {_rank_failure(failure)}", rank=failure.rank,
                             exit_code=failure.exit_code or -1, log_tail=failure.message)
        raise GangFailed(f"{where} ended {status.phase} after "
                         f"{status.retries} restarts: {status.message or 'no reason given'}",
                         rank=-1, exit_code=-1, log_tail=status.message)

    def _failed_rank(self, name: str) -> _pods.PodEnd | None:
        try:
            return _pods.application_failure(_pods.failed_pods(self.hook, self.namespace, name,
                                                                timeout=self.read_timeout_s))
        except Exception:  # noqa: BLE001 - the job's own reason is reported instead
            return None

    def on_event(self, event: Mapping[str, Any]) -> GangStatus:
        """``execute_complete``'s decision on a :class:`GangJobTrigger` event."""
        if event.get("status") == "error" or not event.get("gang"):
            raise GangError(f"{event.get('message')}; the gang job {event.get('name')} is left as it is, a retry "
                            "re-attaches to it")
        return self.outcome(event["name"], GangStatus(**event["gang"]), admitted=bool(event.get("admitted")))

    def run(self, job: GangJob, *, pool: str | None = None, queue: str | None = None,
            secret_env: Mapping[str, str] | None = None,
            admission_timeout_s: float, poll_s: float = 10.0, log: Any = None,
            sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> GangStatus:
        """Submit (or re-attach) and wait until the gang finished: the blocking form of the trigger."""
        spec = self.gang_spec(job, pool=pool or "", queue=queue or "")
        sub = self.submit_spec(spec, secret_env if secret_env is not None else job.env)
        if log is not None:
            log.info("gang %s %s on %s (%s)", sub.name, "submitted" if sub.created else "re-attached",
                     self.cluster.name, self.scheduler)
        deadline = clock() + admission_timeout_s
        status, admitted, seen_retries = sub.status, sub.status.phase not in (PENDING, MISSING), 0
        while True:
            if status.phase in (RUNNING, RESTARTING, SUCCEEDED, FAILED):
                admitted = True
            if status.retries > seen_retries and log is not None:
                log.warning("gang %s restarted (%d of at most %d): %s", sub.name, status.retries, self.max_retry,
                            status.message)
            seen_retries = status.retries
            if status.terminal or (status.phase == PENDING and not admitted and clock() >= deadline):
                return self.outcome(sub.name, status, admitted=admitted)
            sleep(poll_s)
            status = ride_out(lambda: self.status(sub.name), conn_id=str(self.cluster.conn_id), sleep=sleep,
                              call=job_call("get", self.scheduler, self.namespace), what=f"gang {sub.name}",
                              outage_s=self.api_outage_s, clock=clock, log=log)

    # --- budget freeze: find gangs by label and stop them -----------------------------------------

    # Set on a gang job just before stop() deletes it: the reason shows in the API server's audit log
    # and to anything watching the job.
    STOPPED_REASON = "hybridflow.io/stopped-reason"
    # Bounds each listing/patch call, so an unreachable API server fails the call instead of hanging it.
    API_TIMEOUT_S = 30.0

    def list_gangs(self, label_selector: str, *, finished: bool = False) -> list[str]:
        """Names (sorted) of the gang jobs in the namespace whose labels match ``label_selector``, e.g.
        ``hybridflow.io/project=ranking,hybridflow.io/interruptible=true``. Succeeded and failed jobs
        (kept for their status and logs) and jobs already being deleted count only with ``finished``."""
        if self.scheduler == "volcano":
            listing = self.hook.custom_object_client.list_namespaced_custom_object(
                group=VOLCANO_GROUP, version=VOLCANO_VERSION, namespace=self.namespace, plural=VOLCANO_PLURAL,
                label_selector=label_selector, _request_timeout=self.API_TIMEOUT_S)
            found = [(obj["metadata"]["name"], bool(obj["metadata"].get("deletionTimestamp")), volcano_status(obj))
                     for obj in listing.get("items") or []]
        else:
            listing = self.hook.batch_v1_client.list_namespaced_job(
                namespace=self.namespace, label_selector=label_selector, _request_timeout=self.API_TIMEOUT_S)
            found = [(job.metadata.name, job.metadata.deletion_timestamp is not None, kueue_status(job))
                     for job in listing.items or []]
        return sorted(name for name, deleting, status in found if finished or not (deleting or status.terminal))

    def remnants(self) -> list[GangRemnant]:
        from hybridflow.backends.k8s.remnants import remnants

        return remnants(self)

    def clear(self, remnant: GangRemnant, reason: str) -> None:
        from hybridflow.backends.k8s.remnants import clear

        clear(self, remnant)

    def stop(self, name: str, reason: str) -> bool:
        """Stop a gang for good: annotate the job with ``STOPPED_REASON`` = ``reason``, then delete it
        with its pods, Secret and Service (the pods get SIGTERM: workers commit a final checkpoint
        within their grace period). True if the job existed; a vanished job is a no-op."""
        patch = {"metadata": {"annotations": {self.STOPPED_REASON: reason}}}
        # Said explicitly: for a dict body BatchV1Api would pick json-patch+json, which the API refuses.
        kw = {"body": patch, "_content_type": "application/merge-patch+json", "_request_timeout": self.API_TIMEOUT_S}
        try:
            if self.scheduler == "volcano":
                self.hook.custom_object_client.patch_namespaced_custom_object(
                    group=VOLCANO_GROUP, version=VOLCANO_VERSION, namespace=self.namespace, plural=VOLCANO_PLURAL,
                    name=name, **kw)
            else:
                self.hook.batch_v1_client.patch_namespaced_job(name=name, namespace=self.namespace, **kw)
        except Exception as exc:
            if _status_code(exc) != 404:
                raise
        # Also after a 404: removes a Secret or Service the vanished job left behind.
        return self.delete(name)

    def move(self, name: str, reason: str) -> bool:
        """Checkpoint and stop gang ``name``, keeping its job so that its task reads that it was
        moved and why (:mod:`~hybridflow.backends.k8s.moves`); False if there is no such gang."""
        return _moves.move(self, name, reason)

    def make_room(self, name: str, log: Callable[[str], None] = print) -> list[str]:
        """Move the newest movable gangs off if gang ``name`` waits first and does not fit."""
        return _moves.make_room(self, name, self._read_load(), log)

    def find_gangs(self, labels: Mapping[str, str], *, not_labels: Mapping[str, str] | None = None) -> list[str]:
        """Names (sorted) of the unfinished gang jobs whose ``hybridflow.io/<key>`` labels have every
        ``labels`` value and none of the ``not_labels`` values."""
        # The gang label's presence keeps other jobs of the namespace out, even with no labels asked for.
        parts = [GANG_LABEL]
        parts += [f"hybridflow.io/{_label_key(key)}={value}" for key, value in sorted(labels.items())]
        parts += [f"hybridflow.io/{_label_key(key)}!={value}" for key, value in sorted((not_labels or {}).items())]
        return self.list_gangs(",".join(parts))

    # --- what placement reads: usage and queues ---------------------------------------------------

    def load(self) -> ClusterLoad:
        """GPUs in use, queued and held per team, as the cluster's gang scheduler reports them now
        (shared for ``cache_s``; see the module docstring). Never raises."""
        teams = tuple(sorted(self.queue_teams.items())) if self.queue_teams is not None else None
        key = (self.cluster.conn_id, self.namespace, self.scheduler, self.cluster_name, self.cluster.total_gpus, teams)
        return _load.cached(key, self.cache_s, self._read_load)

    def _read_load(self) -> ClusterLoad:
        where = f"cluster {self.cluster_name} (Connection {self.cluster.conn_id})"
        try:
            custom = self.hook.custom_object_client
            if self.scheduler == "volcano":
                reading = _load.read_volcano(custom, timeout=self.read_timeout_s, queue_teams=self.queue_teams)
            else:
                reading = _load.read_kueue(custom, self.namespace, timeout=self.read_timeout_s,
                                           queue_teams=self.queue_teams)
        except _load.Unreadable as exc:
            return self._unknown(f"could not read the {exc.what} of {where}: {_load.describe_error(exc.cause)}")
        except Exception as exc:  # noqa: BLE001 - a cluster we cannot read is unknown, not an error
            return self._unknown(f"could not read the {self.scheduler} queues of {where}: {_load.describe_error(exc)}")
        return ClusterLoad(cluster=self.cluster_name, capacity=self.cluster.total_gpus, used=reading.used,
                           queued=reading.queued, teams=reading.teams, waiting=reading.waiting,
                           queues=reading.queues, private_only_queued=_moves.private_only_queued(self, reading.waiting))

    def _unknown(self, reason: str) -> ClusterLoad:
        return ClusterLoad.unknown(self.cluster_name, self.cluster.total_gpus, reason)

    def queue_exists(self, queue: str) -> bool | None:
        """Whether the scheduler has ``queue`` (a Volcano Queue; a Kueue LocalQueue in the namespace);
        None when the cluster cannot be read."""
        kw = {"name": queue, "_request_timeout": self.read_timeout_s}
        try:
            custom = self.hook.custom_object_client
            if self.scheduler == "volcano":
                custom.get_cluster_custom_object(group=_load.VOLCANO_SCHEDULING_GROUP,
                                                 version=_load.VOLCANO_SCHEDULING_VERSION, plural="queues", **kw)
            else:
                custom.get_namespaced_custom_object(group=_load.KUEUE_GROUP, version=_load.KUEUE_VERSION,
                                                    namespace=self.namespace, plural="localqueues", **kw)
        except Exception as exc:  # noqa: BLE001 - unreadable is None, not an error
            return False if _status_code(exc) == 404 else None
        return True
