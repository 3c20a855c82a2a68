"""A node agent for a local control plane: runs the pods bound to one node as local processes and
reports them through the API, the way a kubelet does, so a gang's real code runs (resume from a
checkpoint, exit 75 on SIGTERM) while everything above the node (admission, scheduling, the Job,
PodGroup and Workload status, podFailurePolicy, preemption, garbage collection) is the real
controllers'.

What it does as a kubelet would: keeps its Node Ready and its Lease renewed; starts a pod's first
container with the container's ``env`` (``fieldRef`` to the pod's name, namespace, annotations and
labels resolved), its ``envFrom`` Secrets and ConfigMaps; reports Running, then Succeeded or Failed
with the container's exit code (what podFailurePolicy reads); on a graceful deletion sends SIGTERM,
waits up to the pod's grace period, SIGKILLs, reports the exit and removes the pod. What it does
differently, because every pod runs on this one machine: ``python`` is this interpreter; pod DNS
names in ``MASTER_ADDR`` resolve to 127.0.0.1, and each gang gets its own free ``MASTER_PORT``;
volumes are not mounted (a pod's paths are this machine's).
"""

from __future__ import annotations

import base64
import datetime as dt
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from hybridflow.devenv.k8s.processes import free_port

LEASE_S = 40


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Running:
    proc: subprocess.Popen
    namespace: str
    name: str
    container: str
    image: str
    started_at: str
    stop_deadline: float | None = None


@dataclass
class NodeAgent:
    kubeconfig: Path
    node: str
    log_dir: Path
    poll_s: float = 0.3
    exits: list[tuple[str, int]] = field(default_factory=list)  # (pod name, exit code), in exit order
    started: list[str] = field(default_factory=list)  # pod names, in start order

    def __post_init__(self) -> None:
        from kubernetes import client, config

        self._api = config.new_client_from_config(config_file=str(self.kubeconfig))
        self.core = client.CoreV1Api(self._api)
        self.coord = client.CoordinationV1Api(self._api)
        # By pod UID, as a kubelet keeps them: a restarted gang's pods reuse their names (Volcano), and a
        # pod that ended must never be reported or deleted in the place of its namesake.
        self.procs: dict[str, _Running] = {}
        self.ports: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_beat = 0.0
        self.errors: list[str] = []

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> NodeAgent:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._loop, name=f"node-agent-{self.node}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=30)
        for run in self.procs.values():
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait(timeout=30)
        self.procs.clear()
        self._api.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - an API hiccup: the next pass tries again
                self.errors.append(repr(exc))
            self._stop.wait(self.poll_s)

    # -- one pass ----------------------------------------------------------------------------
    def step(self) -> None:
        if time.monotonic() - self._last_beat > 10:
            self._heartbeat()
        pods = {p.metadata.uid: p for p in self.core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self.node}", _request_timeout=10).items}
        for key, run in list(self.procs.items()):
            pod = pods.get(key)
            if pod is None:  # removed without a graceful deletion (force delete): kill at once
                run.proc.kill()
                self._finish(key, run, report=False)
            elif pod.metadata.deletion_timestamp is not None:
                self._terminate(key, run, pod)
            elif run.proc.poll() is not None:
                self._finish(key, run)
        for key, pod in pods.items():
            if key in self.procs:
                continue
            if pod.metadata.deletion_timestamp is not None:
                self._delete_now(pod)  # never started here (or already reported): let it go
            elif pod.status.phase == "Pending" and not (pod.status.container_statuses or []):
                self._run(key, pod)

    def _heartbeat(self) -> None:
        from kubernetes.client.exceptions import ApiException

        now = _now()
        micro = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        conditions = [{"type": t, "status": s, "reason": r, "lastHeartbeatTime": now, "lastTransitionTime": now}
                      for t, s, r in (("Ready", "True", "KubeletReady"), ("MemoryPressure", "False", "NodeAgent"),
                                      ("DiskPressure", "False", "NodeAgent"), ("PIDPressure", "False", "NodeAgent"))]
        self.core.patch_node_status(self.node, {"status": {
            "conditions": conditions, "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
            "nodeInfo": {"kubeletVersion": "hybridflow-node-agent", "architecture": "amd64", "operatingSystem": "linux"},
        }})
        lease = {"metadata": {"name": self.node, "namespace": "kube-node-lease"},
                 "spec": {"holderIdentity": self.node, "leaseDurationSeconds": LEASE_S, "renewTime": micro}}
        try:
            self.coord.replace_namespaced_lease(self.node, "kube-node-lease", {
                **lease, "metadata": {**lease["metadata"], "resourceVersion": self.coord.read_namespaced_lease(
                    self.node, "kube-node-lease").metadata.resource_version}})
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.coord.create_namespaced_lease("kube-node-lease", lease)
        self._last_beat = time.monotonic()

    # -- pods --------------------------------------------------------------------------------
    def _env(self, pod) -> dict[str, str]:
        container = pod.spec.containers[0]
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
        env["PYTHONUNBUFFERED"] = "1"
        for source in container.env_from or []:
            if source.secret_ref:
                secret = self.core.read_namespaced_secret(source.secret_ref.name, pod.metadata.namespace)
                env.update({k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()})
            if source.config_map_ref:
                cm = self.core.read_namespaced_config_map(source.config_map_ref.name, pod.metadata.namespace)
                env.update(cm.data or {})
        for item in container.env or []:
            if item.value is not None:
                env[item.name] = item.value
            elif item.value_from and item.value_from.field_ref:
                env[item.name] = _field(pod, item.value_from.field_ref.field_path)
            elif item.value_from and item.value_from.secret_key_ref:
                ref = item.value_from.secret_key_ref
                data = self.core.read_namespaced_secret(ref.name, pod.metadata.namespace).data or {}
                env[item.name] = base64.b64decode(data[ref.key]).decode()
            else:
                env[item.name] = ""
        # This node advertises GPUs the machine may not have: a pod's worker uses what is really here.
        env["HYBRIDFLOW_DEVICE"] = "auto"
        if "MASTER_ADDR" in env:  # a pod DNS name: every rank runs here
            gang = _gang(pod)
            env["MASTER_ADDR"] = "127.0.0.1"
            env["MASTER_PORT"] = str(self.ports.setdefault(gang, free_port()))
        return env

    def _run(self, key: str, pod) -> None:
        container = pod.spec.containers[0]
        command = [*(container.command or []), *(container.args or [])]
        command = [sys.executable if c in ("python", "python3") else c for c in command]
        with open(self.log_dir / f"{pod.metadata.name}.log", "ab") as log:
            proc = subprocess.Popen(command, env=self._env(pod), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        run = _Running(proc, pod.metadata.namespace, pod.metadata.name, container.name, container.image, _now())
        self.procs[key] = run
        self.started.append(pod.metadata.name)
        self._report(key, "Running", run)

    def _terminate(self, key: str, run: _Running, pod) -> None:
        if run.proc.poll() is not None:
            self._finish(key, run)
            self._delete_now(pod)
            return
        if run.stop_deadline is None:
            grace = pod.metadata.deletion_grace_period_seconds
            grace = 30 if grace is None else grace
            run.stop_deadline = time.monotonic() + grace
            _signal(run.proc, signal.SIGTERM if grace else signal.SIGKILL)
        elif time.monotonic() > run.stop_deadline:
            _signal(run.proc, signal.SIGKILL)
            run.proc.wait(timeout=30)
            self._finish(key, run)
            self._delete_now(pod)

    def _finish(self, key: str, run: _Running, *, report: bool = True) -> None:
        code = run.proc.wait(timeout=30)
        code = 128 - code if code < 0 else code  # killed by signal N: the container runtime says 128+N
        self.exits.append((run.name, code))
        del self.procs[key]
        if report:
            self._report(key, "Succeeded" if code == 0 else "Failed", run, exit_code=code)

    def _delete_now(self, pod) -> None:
        from kubernetes.client import V1DeleteOptions, V1Preconditions
        from kubernetes.client.exceptions import ApiException

        body = V1DeleteOptions(grace_period_seconds=0, preconditions=V1Preconditions(uid=pod.metadata.uid))
        try:
            self.core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, body=body)
        except ApiException as exc:
            if exc.status not in (404, 409):  # 409: gone, and a namesake of another UID is there
                raise

    def _report(self, uid: str, phase: str, run: _Running, exit_code: int | None = None) -> None:
        from kubernetes.client.exceptions import ApiException

        now = _now()
        running = phase == "Running"
        if running:
            state = {"running": {"startedAt": run.started_at}}
        else:
            state = {"terminated": {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                                    "startedAt": run.started_at, "finishedAt": now}}
        ready = "True" if running else "False"
        status = {
            "phase": phase, "hostIP": "127.0.0.1", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
            "startTime": run.started_at,
            "conditions": [{"type": t, "status": s, "lastTransitionTime": now} for t, s in
                           (("PodScheduled", "True"), ("Initialized", "True"), ("ContainersReady", ready),
                            ("Ready", ready))],
            "containerStatuses": [{"name": run.container, "image": run.image, "imageID": run.image,
                                   "ready": running, "started": running, "restartCount": 0, "state": state}],
        }
        try:  # the UID in the patch is a precondition: never the status of a namesake
            self.core.patch_namespaced_pod_status(run.name, run.namespace, {"metadata": {"uid": uid}, "status": status})
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise


def _signal(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to the container's process group (the worker and anything it started)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass  # it has just exited: the next pass reports it


def _gang(pod) -> str:
    owners = pod.metadata.owner_references or []
    return owners[0].uid if owners else pod.metadata.name


def _field(pod, path: str) -> str:
    meta = pod.metadata
    simple = {"metadata.name": meta.name, "metadata.namespace": meta.namespace, "metadata.uid": meta.uid,
              "spec.nodeName": pod.spec.node_name, "status.podIP": "127.0.0.1", "status.hostIP": "127.0.0.1"}
    if path in simple:
        return simple[path] or ""
    for prefix, values in (("metadata.annotations", meta.annotations), ("metadata.labels", meta.labels)):
        if path.startswith(prefix + "['") and path.endswith("']"):
            return (values or {}).get(path[len(prefix) + 2:-2], "")
    raise ValueError(f"fieldRef {path!r} is not one a kubelet resolves")
