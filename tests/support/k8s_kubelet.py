"""A kubelet for the cluster simulator: runs the Running pods' containers as local processes.

Each pod's container command runs with the environment a real node would give it: the container's
``env`` (``fieldRef`` to the Job completion index resolved), its ``envFrom`` Secret, and what
Volcano's pytorch plugin injects (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``).
Pod DNS names resolve to 127.0.0.1, on a free port per gang start. A process that exits sets its
pod Succeeded or Failed; a pod the API deleted (job deleted, node drained) has its process stopped
with SIGTERM, as the kubelet does: every such container of a pass at once (a gang's ranks stop
together), then the kubelet waits for each to exit. ``exits`` keeps every container's (pod name,
exit code) as it ended (-15: killed by SIGTERM before it could handle it).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Kubelet:
    def __init__(self, sim, log_dir: Path, *, wait_for_stops: bool = True) -> None:
        self.sim = sim
        self.log_dir = log_dir
        # False: a step does not wait for stopped containers to exit (they are reaped by later steps),
        # so a test that steps under the API server's lock never holds the API up while workers
        # write their final checkpoints.
        self.wait_for_stops = wait_for_stops
        self.stopped: list[tuple[tuple[str, str], subprocess.Popen]] = []
        self.procs: dict[tuple[str, str], subprocess.Popen] = {}
        self.ports: dict[tuple, int] = {}
        self.started: list[str] = []  # pod names, in start order
        self.exits: list[tuple[str, int]] = []  # (pod name, exit code), in exit order

    def step(self) -> None:
        self.sim.step()
        stopping = []
        for key, proc in list(self.procs.items()):
            pod = self.sim.pods.get(key)
            if pod is None or pod["phase"] not in ("Running",):
                if proc.poll() is None:  # deleted or evicted: the container gets SIGTERM
                    proc.send_signal(signal.SIGTERM)
                stopping.append((key, proc))
            elif proc.poll() is not None:
                pod.update(phase="Succeeded" if proc.returncode == 0 else "Failed",
                           reason=None if proc.returncode == 0 else "Error", exit_code=proc.returncode)
                self.exits.append((key[1], proc.returncode))
                del self.procs[key]
        for key, proc in stopping:
            del self.procs[key]
            if self.wait_for_stops:
                self.exits.append((key[1], proc.wait(timeout=60)))
            else:
                self.stopped.append((key, proc))
        for key, proc in list(self.stopped):
            if proc.poll() is not None:
                self.exits.append((key[1], proc.returncode))
                self.stopped.remove((key, proc))
        for owner in {p["owner"] for p in self.sim.pods.values()}:
            if not any(k for k in self.procs if self.sim.pods.get(k, {}).get("owner") == owner):
                self.ports.pop(owner, None)  # the next start of this gang rendezvouses afresh
        for key, pod in list(self.sim.pods.items()):
            if pod["phase"] == "Running" and key not in self.procs and pod.get("_ran") is None:
                self._start(key, pod)

    def _start(self, key: tuple[str, str], pod: dict) -> None:
        spec = pod["template"]["spec"]
        container = spec["containers"][0]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        port = self.ports.setdefault(pod["owner"], _free_port())
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = item["value"]
            elif "job-completion-index" in item["valueFrom"]["fieldRef"]["fieldPath"]:
                env[item["name"]] = str(pod["index"])
        for source in container.get("envFrom", []):
            secret = self.sim.secrets[(pod["namespace"], source["secretRef"]["name"])]
            env.update(secret.get("stringData") or {})
        if pod["owner"][0] == "vcjob":  # Volcano's pytorch plugin
            job = self.sim.vcjobs[pod["owner"][1:]]
            tasks = job["spec"]["tasks"]
            env["WORLD_SIZE"] = str(sum(t["replicas"] for t in tasks))
            task, index = pod["name"].rsplit("-", 2)[1:]
            env["RANK"] = "0" if task == "master" else str(1 + int(index))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # pod DNS -> this machine
        # The simulated nodes advertise GPUs this machine may not have: their workers use what is here.
        env["HYBRIDFLOW_DEVICE"] = "auto"
        command = [sys.executable if c == "python" else c for c in container["command"]]
        log = open(self.log_dir / f"{pod['name']}.log", "ab")  # noqa: SIM115 - kept by the process
        pod["_ran"] = True
        self.procs[key] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.started.append(pod["name"])

    def stop(self) -> None:
        for proc in [*self.procs.values(), *(proc for _, proc in self.stopped)]:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)
        self.procs.clear()
        self.stopped.clear()

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.log_dir.glob("*.log")))


@contextmanager
def h100_pool(scheduler: str, monkeypatch, tmp_path: Path, *, preemption: bool):
    """A cluster simulator of 2 nodes x 4 H100 (pool ``h100``) behind team queue ``vision`` of 8 GPUs
    in namespace ``hybridflow``, installed as the kubernetes client, with priority preemption on or
    off (Volcano's preempt action, Kueue's withinClusterQueue), and a kubelet running the gang
    worker script. Yields (sim, kubelet, script)."""
    from tests.support.gang_worker import WORKER
    from tests.support.k8s_sim import SimCluster, install

    sim = SimCluster({f"h100-{i}": {"gpus": 4, "labels": {"hybridflow.io/pool": "h100"}} for i in (1, 2)})
    if scheduler == "volcano":
        sim.add_volcano_queue("vision")
        if preemption:
            sim.volcano_actions.append("preempt")
    else:
        sim.add_kueue_queues("gpus", 8, ["hybridflow/vision"], **({"preemption": "LowerPriority"} if preemption else {}))
    install(monkeypatch, sim)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    kubelet = Kubelet(sim, tmp_path)
    try:
        yield sim, kubelet, script
    finally:
        kubelet.stop()
