"""Manifests of a training gang on Kubernetes: a Volcano Job, or a Kueue-managed batch/v1 Job.

Both start all ``workers`` pods together or none: Volcano through ``minAvailable`` (its gang
plugin binds no pod until the whole PodGroup fits), Kueue by keeping the Job suspended until its
queue admits the whole workload. Pure functions from a :class:`GangSpec` to dicts, so tests can
validate them against the real CRD schemas and the backend can submit them unchanged.

Credentials never appear in a manifest: the gang's secret environment is a Secret the backend
creates (``env_secret``), referenced with ``envFrom``.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from hybridflow.config import NodePool
from hybridflow.errors import HybridFlowError

VOLCANO_GROUP, VOLCANO_VERSION, VOLCANO_PLURAL = "batch.volcano.sh", "v1alpha1", "jobs"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GANG_LABEL = "hybridflow.io/gang"  # on the job and every pod: node health restarts gangs by it
# The Airflow instance that made the gang (backends.base.instance_identity), on the job, every pod, its
# Secret and Service: a reaper releases only its own instance's gangs.
INSTANCE_LABEL = "hybridflow.io/instance"
GPU_RESOURCE = "nvidia.com/gpu"
RENDEZVOUS_PORT = 23456
# Every pod requests GPUs, so its worker must use one: it fails at start when none is usable
# (hybridflow.training.device) instead of training on CPU beside idle GPUs.
DEVICE_ENV = {"HYBRIDFLOW_DEVICE": "cuda"}
# One worker process per pod: torchrun's per-machine variables are those of a one-rank machine.
LOCAL_ENV = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
# A worker exits with this code after committing its final checkpoint on SIGTERM (preemption,
# eviction, node drain): the gang restarts from that checkpoint under the preemption budget.
PREEMPTED_EXIT = 75
CONTAINER = "trainer"
# PriorityClass per run priority; the cluster's admins create them (see priority_classes()).
PRIORITY_CLASSES = {"critical": "hybridflow-critical", "normal": "hybridflow-normal", "batch": "hybridflow-batch"}
PRIORITY_VALUES = {"critical": 100000, "normal": 10000, "batch": 1000}
# Longest job name: pods add "-worker-<rank>" (Volcano) or "-<index>-xxxxx" (Job) within 63 characters.
MAX_NAME = 45
MAX_WORKERS = 1024

_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE_RE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_ENV_NAME_RE = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


class ManifestError(HybridFlowError):
    """A gang spec cannot become a valid manifest. ``field`` names the input at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def gang_job_name(dag_id: str, run_id: str, task_id: str, cluster: str, *, readable: str | None = None) -> str:
    """Deterministic DNS-1123 job name: a readable slug plus a hash of the run's identity.

    A retry or a cleared task computes the same name and so finds the job it created before; two
    runs whose slugs collide after truncation still differ in the hash.
    """
    digest = hashlib.sha256("\x1f".join((dag_id, run_id, task_id, cluster)).encode()).hexdigest()[:10]
    slug = re.sub(r"[^a-z0-9]+", "-", (readable or f"{dag_id}-{task_id}").lower()).strip("-")
    slug = slug[: MAX_NAME - len(digest) - 1].rstrip("-") or "gang"
    if not slug[0].isalpha():
        slug = ("g" + slug)[: MAX_NAME - len(digest) - 1].rstrip("-")
    return f"{slug}-{digest}"


@dataclass(frozen=True)
class GangSpec:
    """One training gang on one node pool: everything a manifest needs, nothing secret."""

    name: str
    namespace: str
    workers: int
    image: str
    command: tuple[str, ...]
    pool: NodePool
    queue: str
    priority: str = "normal"
    gpus_per_worker: int = 1
    max_retry: int = 3
    labels: Mapping[str, str] = field(default_factory=dict)  # project, team, ... (hybridflow.io/<key>)
    # Whose gang it is (backends.base.owner_annotations: DAG, run, task, try), for the reaper.
    annotations: Mapping[str, str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)  # non-secret environment of every worker
    env_secret: str | None = None  # Secret holding the secret environment (envFrom)
    # PersistentVolumeClaims mounted in every worker: (claim name, absolute mount path).
    volumes: tuple[tuple[str, str], ...] = ()
    # SIGTERM -> SIGKILL of a deleted or evicted pod: its worker's time to commit a final checkpoint.
    grace_s: float = 30
    # The network interface(s) NCCL uses between pods (clusters.<name>.nccl_socket_ifname); None: NCCL's choice.
    nccl_socket_ifname: str | None = None

    def check(self) -> None:
        """Refuse specs Kubernetes would reject (or that could never be admitted), naming the field."""
        if not isinstance(self.name, str) or len(self.name) > MAX_NAME or not _DNS_LABEL_RE.match(self.name):
            raise ManifestError("name", f"{self.name!r} is not a DNS-1123 label of at most {MAX_NAME} "
                                "characters; build it with gang_job_name()")
        if not _DNS_LABEL_RE.match(self.namespace or "") or len(self.namespace) > 63:
            raise ManifestError("namespace", f"{self.namespace!r} is not a valid namespace (DNS-1123 label)")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or not 1 <= self.workers <= MAX_WORKERS:
            raise ManifestError("workers", f"{self.workers!r} must be an integer in 1..{MAX_WORKERS}")
        if isinstance(self.gpus_per_worker, bool) or not isinstance(self.gpus_per_worker, int) \
                or self.gpus_per_worker < 1:
            raise ManifestError("gpus_per_worker", f"{self.gpus_per_worker!r} must be an integer >= 1")
        total = self.workers * self.gpus_per_worker
        if total > self.pool.gpus:
            raise ManifestError("workers", f"the gang needs {total} GPUs but node pool {self.pool.name!r} has "
                                f"{self.pool.gpus}; it could never be admitted: ask for at most "
                                f"{self.pool.gpus // self.gpus_per_worker} workers or use a larger pool")
        if self.priority not in PRIORITY_CLASSES:
            raise ManifestError("priority", f"{self.priority!r} is not one of {sorted(PRIORITY_CLASSES)}")
        if not self.image or any(c.isspace() for c in self.image):
            raise ManifestError("image", f"{self.image!r} is not a container image reference")
        if not self.command:
            raise ManifestError("command", "the worker command is empty")
        if not _DNS_LABEL_RE.match(self.queue or "") or len(self.queue) > 63:
            raise ManifestError("queue", f"{self.queue!r} is not a valid queue name (DNS-1123 label); "
                                "set teams.<team>.queue in projects.yaml")
        if isinstance(self.max_retry, bool) or not isinstance(self.max_retry, int) or not 0 <= self.max_retry <= 100:
            raise ManifestError("max_retry", f"{self.max_retry!r} must be an integer in 0..100")
        for key, value in self.labels.items():
            if not _DNS_LABEL_RE.match(key) or not _LABEL_VALUE_RE.match(value):
                raise ManifestError(f"labels.{key}", f"{value!r} is not a valid Kubernetes label value")
        for key in self.env:
            if not _ENV_NAME_RE.match(key):
                raise ManifestError(f"env.{key}", "is not a valid environment variable name")
        for i, (claim, mount) in enumerate(self.volumes):
            if not _DNS_LABEL_RE.match(claim or ""):
                raise ManifestError(f"volumes.{i}.claim", f"{claim!r} is not a valid PersistentVolumeClaim name")
            if not str(mount).startswith("/"):
                raise ManifestError(f"volumes.{i}.mount", f"{mount!r} must be an absolute path")
        if isinstance(self.grace_s, bool) or not isinstance(self.grace_s, int | float) or not 0 < self.grace_s <= 3600:
            raise ManifestError("grace_s", f"{self.grace_s!r} must be a number of seconds in (0, 3600]")
        if self.env_secret is not None and not _DNS_LABEL_RE.match(self.env_secret):
            raise ManifestError("env_secret", f"{self.env_secret!r} is not a valid Secret name")


def _labels(spec: GangSpec) -> dict[str, str]:
    out = {f"hybridflow.io/{k}": v for k, v in sorted(spec.labels.items())}
    out[GANG_LABEL] = spec.name
    out["hybridflow.io/priority"] = spec.priority
    return out


def _annotations(spec: GangSpec) -> dict:
    """``{"annotations": ...}`` for a metadata block, or nothing when the gang has no owner."""
    return {"annotations": dict(sorted(spec.annotations.items()))} if spec.annotations else {}


def _container(spec: GangSpec, env: list[dict]) -> dict:
    container = {
        "name": CONTAINER,
        "image": spec.image,
        "command": list(spec.command),
        "env": [{"name": "HYBRIDFLOW_GANG", "value": spec.name},
                *({"name": k, "value": v} for k, v in sorted(_platform_env(spec).items()) if k not in spec.env),
                *({"name": k, "value": v} for k, v in sorted(spec.env.items())), *env],
        "resources": {"limits": {GPU_RESOURCE: spec.gpus_per_worker}},
        "ports": [{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT}],
    }
    if spec.env_secret:
        container["envFrom"] = [{"secretRef": {"name": spec.env_secret}}]
    if spec.volumes:
        container["volumeMounts"] = [{"name": f"vol-{i}", "mountPath": mount} for i, (_, mount) in enumerate(spec.volumes)]
    return container


def _platform_env(spec: GangSpec) -> dict[str, str]:
    """What every worker of a gang is told about its node: GPUs to use, one rank per pod, NCCL's interface."""
    env = {**DEVICE_ENV, **LOCAL_ENV}
    if spec.nccl_socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = spec.nccl_socket_ifname
    return env


def _pod_spec(spec: GangSpec, env: list[dict]) -> dict:
    pod = {
        "restartPolicy": "Never",  # a failed worker is the gang's failure: the job policy decides
        # The kubelet's default 30 s would cut a longer checkpoint grace short; 10 s for the upload to close.
        "terminationGracePeriodSeconds": math.ceil(spec.grace_s) + 10,
        "priorityClassName": PRIORITY_CLASSES[spec.priority],
        "containers": [_container(spec, env)],
        # GPU nodes are commonly tainted so only GPU work lands there.
        "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
    }
    if spec.volumes:
        pod["volumes"] = [{"name": f"vol-{i}", "persistentVolumeClaim": {"claimName": claim}}
                          for i, (claim, _) in enumerate(spec.volumes)]
    if spec.pool.node_labels:
        pod["nodeSelector"] = dict(sorted(spec.pool.node_labels.items()))
    return pod


def volcano_job(spec: GangSpec) -> dict:
    """A Volcano ``batch.volcano.sh/v1alpha1`` Job: a master and ``workers - 1`` workers, gang-admitted.

    The pytorch plugin sets MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK, svc gives pods stable
    hostnames, env adds VK_TASK_INDEX; the worker derives GROUP_RANK/NODE_RANK from RANK (one rank
    per pod). A preempted rank (exit ``PREEMPTED_EXIT``) or an evicted pod
    restarts the whole job (a gang with a missing rank cannot make progress), at most ``max_retry``
    times (the preemption budget); any other failed pod terminates the job at once, so the task's
    own retries apply. Volcano takes the first policy that matches a pod's event or exit code.
    """
    spec.check()
    labels = _labels(spec)

    def task(name: str, replicas: int) -> dict:
        return {"name": name, "replicas": replicas, "minAvailable": replicas,
                "template": {"metadata": {"labels": {**labels, "hybridflow.io/role": name}, **_annotations(spec)},
                             "spec": _pod_spec(spec, [])}}

    tasks = [task("master", 1)] + ([task("worker", spec.workers - 1)] if spec.workers > 1 else [])
    return {
        "apiVersion": f"{VOLCANO_GROUP}/{VOLCANO_VERSION}",
        "kind": "Job",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": labels, **_annotations(spec)},
        "spec": {
            "schedulerName": "volcano",
            "minAvailable": spec.workers,
            "queue": spec.queue,
            "priorityClassName": PRIORITY_CLASSES[spec.priority],
            # Volcano raises retryCount before it checks it against maxRetry, so maxRetry N allows N - 1
            # restarts: max_retry restarts need max_retry + 1 (seen on Volcano 1.10's job controller).
            "maxRetry": spec.max_retry + 1,
            "policies": [{"exitCode": PREEMPTED_EXIT, "action": "RestartJob"},
                         {"event": "PodEvicted", "action": "RestartJob"},
                         {"event": "PodFailed", "action": "TerminateJob"}],
            "plugins": {"pytorch": ["--master=master", "--worker=worker", f"--port={RENDEZVOUS_PORT}"],
                        "svc": [], "env": []},
            "tasks": tasks,
        },
    }


def kueue_job(spec: GangSpec) -> dict:
    """A Kueue-managed ``batch/v1`` Job: suspended until the team's LocalQueue admits all workers.

    Indexed completions give each pod its rank; the headless Service of :func:`rendezvous_service`
    (same name) gives rank 0 a stable address. Its podFailurePolicy tells preemption from failure:
    a pod with condition DisruptionTarget (evicted, preempted, drained) or whose worker exited
    ``PREEMPTED_EXIT`` is ignored (recreated, not counted towards ``backoffLimit``), and the gang
    carries on from its checkpoint; any other non-zero exit fails the Job at once (FailJob), so the
    task's own retries apply. The preemption budget (``max_retry`` restarts) is enforced by the
    backend, which counts the preempted pods of each rank (:func:`~hybridflow.backends.k8s.backend.read_status`).
    """
    spec.check()
    labels = _labels(spec)
    index = {"valueFrom": {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}
    env = [
        {"name": "MASTER_ADDR", "value": f"{spec.name}-0.{spec.name}"},
        {"name": "MASTER_PORT", "value": str(RENDEZVOUS_PORT)},
        {"name": "WORLD_SIZE", "value": str(spec.workers)},
        # One rank per pod: the completion index is the rank and the node's rank alike.
        *({"name": name, **index} for name in ("RANK", "GROUP_RANK", "NODE_RANK")),
    ]
    pod = _pod_spec(spec, env)
    pod["subdomain"] = spec.name
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": spec.name, "namespace": spec.namespace,
                     "labels": {**labels, KUEUE_QUEUE_LABEL: spec.queue}, **_annotations(spec)},
        "spec": {
            "suspend": True,
            "parallelism": spec.workers,
            "completions": spec.workers,
            "completionMode": "Indexed",
            "backoffLimit": spec.max_retry,
            "podFailurePolicy": {"rules": [
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                {"action": "Ignore", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                                     "values": [PREEMPTED_EXIT]}},
                {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "NotIn",
                                                      "values": [PREEMPTED_EXIT]}},
            ]},
            "template": {"metadata": {"labels": labels, **_annotations(spec)}, "spec": pod},
        },
    }


def rendezvous_service(spec: GangSpec) -> dict:
    """Headless Service giving a Kueue Job's pods DNS names (``<job>-<index>.<job>``)."""
    spec.check()
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": _labels(spec)},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {GANG_LABEL: spec.name},
                 "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT}]},
    }


def env_secret(name: str, namespace: str, env: Mapping[str, str], gang: str,
               annotations: Mapping[str, str] | None = None, *, instance: str | None = None) -> dict:
    """The Secret holding a gang's secret environment (store credentials), annotated with the gang's
    owner and labelled with the Airflow instance that made it."""
    metadata = {"name": name, "namespace": namespace,
                "labels": {GANG_LABEL: gang, **({INSTANCE_LABEL: instance} if instance else {})}}
    if annotations:
        metadata["annotations"] = dict(annotations)
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": metadata, "stringData": dict(env)}


def priority_classes() -> list[dict]:
    """The PriorityClasses the gang manifests name, for a cluster's admins to apply once."""
    return [{"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name},
             "value": PRIORITY_VALUES[prio], "globalDefault": False, "preemptionPolicy": "PreemptLowerPriority",
             "description": f"hybridflow {prio} training runs"} for prio, name in PRIORITY_CLASSES.items()]


def gang_manifest(spec: GangSpec, scheduler: str) -> dict:
    if scheduler == "volcano":
        return volcano_job(spec)
    if scheduler == "kueue":
        return kueue_job(spec)
    raise ManifestError("scheduler", f"{scheduler!r} is not a gang scheduler; set clusters.<name>.scheduler "
                        "to volcano or kueue")
