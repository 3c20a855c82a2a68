"""A real Kubernetes control plane on 127.0.0.1, from binaries built from their Go modules
(:mod:`hybridflow.devenv.k8s.build`): etcd, kube-apiserver, kube-controller-manager (the Job, garbage
collection, node lifecycle and other controllers), kube-scheduler, kwok for fake GPU nodes, and the
gang schedulers and serving controller the product drives (Kueue, Volcano, KServe in RawDeployment
mode), each with its CRDs from the same module.

Everything lives in one folder (certificates, etcd's data, logs, the admin kubeconfig, ``state.json``
with the pids); ``up`` is idempotent (a running plane is reused), ``down`` ends only the processes
``up`` recorded. A failed ``up`` stops what it started and names the cause and the fix.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml

from hybridflow.devenv.k8s import addons
from hybridflow.devenv.k8s import processes as proc
from hybridflow.devenv.k8s.certs import Pki, ensure_pki, issue
from hybridflow.devenv.k8s.nodes import FakeNode
from hybridflow.devenv.k8s.processes import ControlPlaneError

DEFAULT_PORT = 16443
ADDONS = ("kueue", "volcano", "kserve")
CORE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


def ready_timeout_s() -> float:
    return float(os.environ.get("HYBRIDFLOW_K8S_READY_TIMEOUT_S", "120"))


@dataclass
class Started:
    name: str
    pid: int
    binary: str


class ControlPlane:
    def __init__(self, root: Path, *, port: int | None = None, addons: Iterable[str] = ADDONS,
                 log: Callable[[str], None] = print) -> None:
        self.root = Path(root)
        self.port = port
        self.addons = tuple(addons)
        unknown = set(self.addons) - set(ADDONS)
        if unknown:
            raise ControlPlaneError(f"unknown addon(s) {sorted(unknown)}; choose from {list(ADDONS)}")
        self.log = log
        self.started: list[Started] = []

    # -- where things are ------------------------------------------------------------------------
    @property
    def state_path(self) -> Path:
        return self.root / "state.json"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pki(self) -> Pki:
        return Pki(self.root / "pki")

    def state(self) -> dict:
        try:
            return json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return {}

    def running(self) -> bool:
        state = self.state()
        procs = state.get("processes", [])
        return bool(procs) and all(proc.runs(p["pid"], p["binary"]) for p in procs)

    def server(self) -> str:
        return f"https://127.0.0.1:{self.state()['port']}"

    # -- up and down -----------------------------------------------------------------------------
    def up(self, nodes: list[FakeNode]) -> dict:
        """Start the plane (or reuse the running one) and register ``nodes``; the state as a dict."""
        if self.running():
            self.log(f"control plane already up at {self.server()} (kubeconfig {self.kubeconfig})")
            self._register_nodes(nodes)
            return self.state()
        if self.state():
            self.down()  # a half-dead plane from an earlier run: start afresh
        from hybridflow.devenv.k8s.build import binaries, build

        port = self.port or DEFAULT_PORT
        if proc.port_in_use(port):
            raise ControlPlaneError(f"port {port} on 127.0.0.1 is in use: stop what listens there, or choose "
                                    "another with --port (or HYBRIDFLOW_K8S_PORT)")
        needed = [*CORE, *(b for a in self.addons for b in addons.BINARIES[a])]
        build(needed, log=self.log)
        self.bins = {name: str(path) for name, path in binaries().items()}
        begun = time.monotonic()
        try:
            self._start_core(port)
            self._register_nodes(nodes)
            for addon in self.addons:
                t0 = time.monotonic()
                getattr(self, f"_start_{addon}")()
                self.log(f"{addon} set up in {time.monotonic() - t0:.1f} s")
        except BaseException:
            self.down()
            raise
        self.log(f"control plane up at https://127.0.0.1:{port} in {time.monotonic() - begun:.1f} s; "
                 f"kubeconfig {self.kubeconfig}")
        return self.state()

    def down(self) -> list[str]:
        """Stop every process this plane recorded (newest first); the names of those stopped."""
        state = self.state()
        recorded = [Started(**p) for p in state.get("processes", [])]
        known = {(s.pid, s.binary) for s in recorded}
        recorded += [s for s in self.started if (s.pid, s.binary) not in known]
        stopped = [s.name for s in reversed(recorded) if proc.stop(s.pid, s.binary)]
        self.started.clear()
        if self.state_path.exists():
            self.state_path.unlink()
        shutil.rmtree(self.root / "etcd", ignore_errors=True)  # a fresh plane next time
        return stopped

    # -- the core --------------------------------------------------------------------------------
    def _save(self, **extra) -> None:
        state = self.state()
        state.update(extra)
        state["processes"] = [vars(s) for s in self.started]
        self.root.mkdir(parents=True, exist_ok=True)
        self.state_path.write_text(json.dumps(state, indent=2))

    def _spawn(self, name: str, binary: str, args: list[str], probe: Callable[[], bool], *, fix: str = "",
               env: dict[str, str] | None = None) -> None:
        path = self.bins[binary]
        t0 = time.monotonic()
        child = proc.start(name, [path, *args], self.logs, env=env)
        self.started.append(Started(name, child.pid, path))
        self._save()
        proc.wait_ready(name, child, probe, self.logs / f"{name}.log", timeout_s=ready_timeout_s(), fix=fix)
        self.log(f"{name} ready in {time.monotonic() - t0:.1f} s")

    def _https_ok(self, url: str) -> bool:
        import requests

        pki = self.pki
        got = requests.get(url, cert=(str(pki.crt("admin")), str(pki.key("admin"))), verify=str(pki.ca_crt), timeout=3)
        return got.status_code == 200

    def _start_core(self, port: int) -> None:
        import requests

        self.root.mkdir(parents=True, exist_ok=True)
        pki = ensure_pki(self.root / "pki")
        etcd_port, peer_port = proc.free_port(), proc.free_port()
        self._save(port=port, started_at=time.time())
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        self._spawn("etcd", "etcd", [
            "--name=hybridflow", f"--data-dir={self.root / 'etcd'}", f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}", f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-cluster=hybridflow=http://127.0.0.1:{peer_port}", "--unsafe-no-fsync",
            "--log-level=warn",
        ], lambda: requests.get(f"{etcd_url}/health", timeout=2).json().get("health") == "true")
        self._spawn("kube-apiserver", "kube-apiserver", [
            f"--etcd-servers={etcd_url}", "--bind-address=127.0.0.1", f"--secure-port={port}",
            "--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none",
            f"--tls-cert-file={pki.crt('apiserver')}", f"--tls-private-key-file={pki.key('apiserver')}",
            f"--client-ca-file={pki.ca_crt}", "--authorization-mode=Node,RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.sa_pub}", f"--service-account-signing-key-file={pki.sa_key}",
            "--service-cluster-ip-range=10.96.0.0/16", "--allow-privileged=true", "--profiling=false",
            "--enable-priority-and-fairness=false", f"--cert-dir={self.root / 'pki'}",
        ], lambda: self._https_ok(f"https://127.0.0.1:{port}/readyz"),
            fix="Is the port free, and etcd's log clean? See the logs folder.")
        self._write_kubeconfig(port, pki)
        kube = str(self.kubeconfig)
        self._spawn("kube-controller-manager", "kube-controller-manager", [
            f"--kubeconfig={kube}", f"--authentication-kubeconfig={kube}", f"--authorization-kubeconfig={kube}",
            "--bind-address=127.0.0.1", f"--secure-port={proc.free_port()}", "--leader-elect=false",
            f"--service-account-private-key-file={pki.sa_key}", f"--root-ca-file={pki.ca_crt}",
            "--use-service-account-credentials=false", "--controllers=*,-nodeipam,-cloud-node-lifecycle",
            "--concurrent-job-syncs=5", "--profiling=false",
        ], lambda: self._default_service_account())
        sched_port = proc.free_port()
        self._spawn("kube-scheduler", "kube-scheduler", [
            f"--kubeconfig={kube}", f"--authentication-kubeconfig={kube}", f"--authorization-kubeconfig={kube}",
            "--bind-address=127.0.0.1", f"--secure-port={sched_port}", "--leader-elect=false", "--profiling=false",
        ], lambda: _insecure_ok(f"https://127.0.0.1:{sched_port}/healthz"))
        kwok_port = proc.free_port()
        stages = addons.kwok_stages(self.root / "kwok.yaml")
        self._spawn("kwok", "kwok", [
            f"--kubeconfig={kube}", f"--config={stages}", "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake", "--node-ip=127.0.0.1",
            "--cidr=10.244.0.0/16", f"--server-address=127.0.0.1:{kwok_port}",
        ], lambda: _plain_ok(f"http://127.0.0.1:{kwok_port}/healthz"))

    def _write_kubeconfig(self, port: int, pki: Pki) -> None:
        def b64(path: Path) -> str:
            return base64.b64encode(path.read_bytes()).decode()

        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "hybridflow-local",
            "clusters": [{"name": "hybridflow-local", "cluster": {
                "server": f"https://127.0.0.1:{port}", "certificate-authority-data": b64(pki.ca_crt)}}],
            "users": [{"name": "hybridflow-admin", "user": {
                "client-certificate-data": b64(pki.crt("admin")), "client-key-data": b64(pki.key("admin"))}}],
            "contexts": [{"name": "hybridflow-local",
                          "context": {"cluster": "hybridflow-local", "user": "hybridflow-admin"}}],
        }
        self.kubeconfig.write_text(yaml.safe_dump(config, sort_keys=False))
        self.kubeconfig.chmod(0o600)

    def api(self):
        """A kubernetes ApiClient for the admin kubeconfig."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def _default_service_account(self) -> bool:
        from kubernetes import client

        with self.api() as api:
            client.CoreV1Api(api).read_namespaced_service_account("default", "default", _request_timeout=3)
        return True

    def _register_nodes(self, nodes: list[FakeNode]) -> None:
        if not nodes:
            return
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        t0 = time.monotonic()
        with self.api() as api:
            core = client.CoreV1Api(api)
            for node in nodes:
                try:
                    core.create_node(node.manifest())
                except ApiException as exc:
                    if exc.status != 409:
                        raise
                cap = node.capacity()
                core.patch_node_status(node.name, {"status": {"capacity": cap, "allocatable": cap}})
            fakes = {n.name for n in nodes if n.kwok}
            deadline = time.monotonic() + ready_timeout_s()
            while fakes:
                ready = {n.metadata.name for n in core.list_node(_request_timeout=5).items
                         if any(c.type == "Ready" and c.status == "True" for c in (n.status.conditions or []))}
                fakes -= ready
                if not fakes:
                    break
                if time.monotonic() > deadline:
                    raise ControlPlaneError(f"kwok did not make nodes {sorted(fakes)} Ready within "
                                            f"{ready_timeout_s():.0f} s; see {self.logs / 'kwok.log'}")
                time.sleep(0.5)
        self.log(f"{len(nodes)} node(s) registered in {time.monotonic() - t0:.1f} s")

    # -- addons ----------------------------------------------------------------------------------
    def _webhook_cert(self, name: str) -> Path:
        """A serving certificate for a controller's webhook server on 127.0.0.1, as tls.crt/tls.key."""
        crt, key = issue(self.pki, f"{name}-webhook", cn=f"{name}-webhook", dns=("localhost",), ips=("127.0.0.1",),
                         server=True)
        certs = self.root / f"{name}-webhook-certs"
        certs.mkdir(exist_ok=True)
        shutil.copyfile(crt, certs / "tls.crt")
        shutil.copyfile(key, certs / "tls.key")
        (certs / "tls.key").chmod(0o600)
        return certs

    def _start_kueue(self) -> None:
        addons.apply_crds(self, "kueue")
        certs = self._webhook_cert("kueue")
        _kueue_metrics_cert(certs)
        webhook_port, probe_port, metrics_port = proc.free_port(), proc.free_port(), proc.free_port()
        config = addons.kueue_config(self.root / "kueue.yaml", webhook_port=webhook_port, probe_port=probe_port,
                                     metrics_port=metrics_port, cert_dir=certs)
        addons.ensure_namespace(self, "kueue-system")
        self._spawn("kueue", "kueue", [f"--config={config}", f"--kubeconfig={self.kubeconfig}",
                                       "--feature-gates=VisibilityOnDemand=false", "--zap-log-level=info"],
                    lambda: _plain_ok(f"http://127.0.0.1:{probe_port}/readyz"))
        addons.register_webhooks(self, "kueue", webhook_port)

    def _start_volcano(self) -> None:
        addons.apply_crds(self, "volcano")
        addons.ensure_namespace(self, "volcano-system")
        conf = addons.volcano_scheduler_conf(self.root / "volcano-scheduler.yaml")
        health = proc.free_port()
        self._spawn("vc-scheduler", "vc-scheduler", [
            f"--kubeconfig={self.kubeconfig}", f"--scheduler-conf={conf}", "--leader-elect=false",
            "--enable-healthz=true", f"--healthz-address=127.0.0.1:{health}",
            f"--listen-address=127.0.0.1:{proc.free_port()}", "--schedule-period=500ms", "--cache-dumper=false",
        ], lambda: _plain_ok(f"http://127.0.0.1:{health}/healthz"))
        health = proc.free_port()
        self._spawn("vc-controller-manager", "vc-controller-manager", [
            f"--kubeconfig={self.kubeconfig}", "--leader-elect=false", "--enable-healthz=true",
            f"--healthz-address=127.0.0.1:{health}",
        ], lambda: _plain_ok(f"http://127.0.0.1:{health}/healthz"))

    def _start_kserve(self) -> None:
        addons.apply_crds(self, "kserve")
        addons.ensure_namespace(self, "kserve")
        addons.kserve_config(self)
        certs = self._webhook_cert("kserve")
        # KServe reads its webhook certificate from $TMPDIR/k8s-webhook-server/serving-certs (no flag).
        tmp = self.root / "kserve-tmp"
        (tmp / "k8s-webhook-server").mkdir(parents=True, exist_ok=True)
        serving = tmp / "k8s-webhook-server" / "serving-certs"
        if not serving.exists():
            serving.symlink_to(certs)
        webhook_port, probe_port = proc.free_port(), proc.free_port()
        self._spawn("kserve-controller", "kserve-manager", [
            f"--kubeconfig={self.kubeconfig}", f"--metrics-addr=127.0.0.1:{proc.free_port()}",
            f"--health-probe-addr=127.0.0.1:{probe_port}", "--leader-elect=false", f"--webhook-port={webhook_port}",
        ], lambda: _plain_ok(f"http://127.0.0.1:{probe_port}/readyz"), env={"POD_NAMESPACE": "kserve", "TMPDIR": str(tmp)})
        addons.register_webhooks(self, "kserve", webhook_port)


# Kueue reads its metrics server's certificate from this fixed folder whenever its internal certificate
# management is off (which it must be here: that management issues certificates for an in-cluster
# Service name, not for 127.0.0.1).
KUEUE_METRICS_CERTS = Path("/etc/kueue/metrics/certs")


def _kueue_metrics_cert(webhook_certs: Path) -> None:
    if (KUEUE_METRICS_CERTS / "tls.crt").is_file() and (KUEUE_METRICS_CERTS / "tls.key").is_file():
        return
    try:
        KUEUE_METRICS_CERTS.mkdir(parents=True, exist_ok=True)
        for name in ("tls.crt", "tls.key"):
            shutil.copyfile(webhook_certs / name, KUEUE_METRICS_CERTS / name)
        (KUEUE_METRICS_CERTS / "tls.key").chmod(0o600)
    except OSError as exc:
        raise ControlPlaneError(f"Kueue reads its metrics certificate from {KUEUE_METRICS_CERTS}, which cannot be "
                                f"written here ({exc}): run `hybridflow dev k8s up` as root once, or create that "
                                "folder writable by this user, or leave Kueue out with --addons volcano") from exc


def _plain_ok(url: str) -> bool:
    import requests

    return requests.get(url, timeout=2).status_code == 200


def _insecure_ok(url: str) -> bool:
    import requests
    import urllib3

    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    return requests.get(url, verify=False, timeout=2).status_code == 200  # noqa: S501 - loopback health only


def default_root() -> Path:
    from hybridflow.settings import get_settings

    return Path(os.environ.get("HYBRIDFLOW_K8S_DIR") or get_settings().home / "dev" / "k8s")
