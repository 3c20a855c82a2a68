"""Serving on Kubernetes: the private inference pool as a Deployment behind a Service, with a canary.

The Service selects every pod of the endpoint (``hybridflow.io/endpoint``); the stable and the
canary Deployments differ only in ``hybridflow.io/track`` and version, so the canary's share of
requests is its share of ready pods. Promote makes the canary's release the stable one (the stable
Deployment rolls to it with surge, never dropping below its replica count) and removes the canary;
rollback removes the canary and leaves the stable release serving throughout.

Every pod runs the model server on a model bundle published to the models volume at
``<mount>/<endpoint>/<version>/<variant>/`` (:func:`publish_model`); Deployments and the Service are
named after the endpoint (the model's serving endpoint), and a pod is ready once its server loaded
the bundle and answers ``/healthz``.

Manifests are pure functions (validated in tests with kubernetes-validate); :class:`InferenceRollout`
applies them through the provider's hook (``apps_v1_client`` / ``core_v1_client``), idempotently:
a re-run replaces what is there instead of failing on AlreadyExists.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.bundle import VARIANTS
from hybridflow.config import NodePool
from hybridflow.errors import DeploymentError

ENDPOINT_LABEL = "hybridflow.io/endpoint"
TRACK_LABEL = "hybridflow.io/track"
VERSION_LABEL = "hybridflow.io/version"
GPU_RESOURCE = "nvidia.com/gpu"
MODELS_MOUNT = "/models"

_DNS_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_VERSION_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


@dataclass(frozen=True)
class InferencePool:
    """Where an endpoint serves: namespace, node pool, replica count and the models volume."""

    endpoint: str
    namespace: str
    pool: NodePool
    models_claim: str  # PersistentVolumeClaim on private storage holding <endpoint>/<version>/<variant>/
    replicas: int = 2
    port: int = 8080
    gpus_per_replica: int = 1

    def check(self) -> None:
        for field, value in (("endpoint", self.endpoint), ("namespace", self.namespace),
                             ("models_claim", self.models_claim)):
            if not _DNS_RE.match(value or "") or len(value) > 50:
                raise DeploymentError(f"{field}: {value!r} is not a DNS-1123 label of at most 50 characters")
        if not 1 <= self.replicas <= 100:
            raise DeploymentError(f"replicas: {self.replicas} must be in 1..100")
        if not 1 <= self.port <= 65535:
            raise DeploymentError(f"port: {self.port} must be in 1..65535")
        if self.gpus_per_replica < 0:
            raise DeploymentError(f"gpus_per_replica: {self.gpus_per_replica} must be >= 0")


@dataclass(frozen=True)
class Release:
    """One model version as served: image, version and the bundle's variant (fp32 | int8 | fp16)."""

    version: str
    variant: str
    image: str

    def check(self) -> None:
        if not _VERSION_RE.match(self.version or ""):
            raise DeploymentError(f"version: {self.version!r} must be a Kubernetes label value (e.g. v3)")
        if self.variant not in VARIANTS:
            raise DeploymentError(f"variant: {self.variant!r} is not one of {', '.join(VARIANTS)}")
        if not self.image or any(c.isspace() for c in self.image):
            raise DeploymentError(f"image: {self.image!r} is not a container image reference")


def bundle_path(root: str | Path, endpoint: str, release: Release) -> str:
    """Where a release's bundle lives under the models volume (the mount in a pod, the folder here)."""
    return f"{root}/{endpoint}/{release.version}/{release.variant}"


def _deployment(pool: InferencePool, release: Release, track: str, replicas: int) -> dict:
    pool.check()
    release.check()
    name = pool.endpoint if track == "stable" else f"{pool.endpoint}-canary"
    selector = {ENDPOINT_LABEL: pool.endpoint, TRACK_LABEL: track}
    labels = {**selector, VERSION_LABEL: release.version}
    container = {
        "name": "server",
        "image": release.image,
        "command": ["python", "-m", "hybridflow.serving.server",
                    "--bundle", bundle_path(MODELS_MOUNT, pool.endpoint, release),
                    "--endpoint", pool.endpoint, "--version", release.version, "--port", str(pool.port),
                    "--host", "0.0.0.0"],  # noqa: S104 - the pod's Service and probes reach it on the pod IP
        "ports": [{"name": "http", "containerPort": pool.port}],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "initialDelaySeconds": 30},
        "volumeMounts": [{"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True}],
    }
    if pool.gpus_per_replica:
        container["resources"] = {"limits": {GPU_RESOURCE: pool.gpus_per_replica}}
    pod: dict[str, Any] = {
        "containers": [container],
        "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": pool.models_claim, "readOnly": True}}],
        "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
    }
    if pool.pool.node_labels:
        pod["nodeSelector"] = dict(sorted(pool.pool.node_labels.items()))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": pool.namespace, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            # Never fewer ready pods than asked: a new version comes up before an old one goes.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }


def stable_deployment(pool: InferencePool, release: Release) -> dict:
    return _deployment(pool, release, "stable", pool.replicas)


def canary_replicas(pool: InferencePool, percent: int) -> int:
    """Canary pods giving about ``percent`` of requests next to the stable replicas."""
    if not 1 <= percent <= 50:
        raise DeploymentError(f"canary_percent: {percent} must be in 1..50 (promote instead of a larger canary)")
    return max(1, round(pool.replicas * percent / (100 - percent)))


def canary_deployment(pool: InferencePool, release: Release, percent: int) -> dict:
    return _deployment(pool, release, "canary", canary_replicas(pool, percent))


def service(pool: InferencePool) -> dict:
    """The endpoint's Service: both tracks behind one address."""
    pool.check()
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": pool.endpoint, "namespace": pool.namespace, "labels": {ENDPOINT_LABEL: pool.endpoint}},
        "spec": {"selector": {ENDPOINT_LABEL: pool.endpoint},
                 "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
    }


class InferenceRollout:
    """Apply an endpoint's objects through the provider's hook: deploy, canary, promote, rollback."""

    def __init__(self, hook: Any, pool: InferencePool) -> None:
        self.hook, self.pool = hook, pool

    def _apply(self, body: dict) -> None:
        api = self.hook.apps_v1_client if body["kind"] == "Deployment" else self.hook.core_v1_client
        kind = "deployment" if body["kind"] == "Deployment" else "service"
        name, ns = body["metadata"]["name"], self.pool.namespace
        try:
            getattr(api, f"create_namespaced_{kind}")(namespace=ns, body=body)
        except Exception as exc:
            if getattr(exc, "status", None) != 409:
                raise
            getattr(api, f"patch_namespaced_{kind}")(name=name, namespace=ns, body=body)

    def _delete_canary(self) -> bool:
        try:
            self.hook.apps_v1_client.delete_namespaced_deployment(name=f"{self.pool.endpoint}-canary",
                                                                  namespace=self.pool.namespace)
        except Exception as exc:
            if getattr(exc, "status", None) != 404:
                raise
            return False
        return True

    def deploy(self, release: Release) -> None:
        """Serve ``release`` as the stable track (first deployment, or a direct update)."""
        self._apply(service(self.pool))
        self._apply(stable_deployment(self.pool, release))

    def canary(self, release: Release, percent: int = 10) -> None:
        self._apply(canary_deployment(self.pool, release, percent))

    def promote(self, release: Release) -> None:
        """The canary's release becomes stable; then the canary goes."""
        self._apply(stable_deployment(self.pool, release))
        self._delete_canary()

    def rollback(self) -> bool:
        """Remove the canary; the stable release kept serving. True if there was a canary."""
        return self._delete_canary()

    def track(self, track: str = "stable") -> TrackStatus | None:
        """The version a track's Deployment runs and whether all its pods serve it; None if absent."""
        name = self.pool.endpoint if track == "stable" else f"{self.pool.endpoint}-canary"
        try:
            dep = self.hook.apps_v1_client.read_namespaced_deployment(name=name, namespace=self.pool.namespace)
        except Exception as exc:
            if getattr(exc, "status", None) != 404:
                raise
            return None
        want = dep.spec.replicas or 0
        st = dep.status
        ready = bool(st) and (st.observed_generation or 0) >= (dep.metadata.generation or 0) and \
            (st.updated_replicas or 0) == want and (st.ready_replicas or 0) == want and \
            (st.replicas or 0) == want  # no pod of an older version left
        return TrackStatus((dep.metadata.labels or {}).get(VERSION_LABEL), ready)


@dataclass(frozen=True)
class TrackStatus:
    version: str | None
    ready: bool


def publish_model(bundle_dir: Path, models_dir: Path, endpoint: str, release: Release) -> Path:
    """Put the model bundle where the serving pods read it (``<models_dir>/<endpoint>/<version>/<variant>/``
    on the models volume), atomically: it is copied into a temporary folder (the card last) that is then
    renamed into place, so a pod never loads half a bundle. Re-publishing the same bytes is a no-op."""
    from hybridflow.bundle import CARD_FILE, WEIGHTS_FILE, read_card

    release.check()
    if not _DNS_RE.match(endpoint or "") or len(endpoint) > 50:
        raise DeploymentError(f"endpoint: {endpoint!r} is not a DNS-1123 label of at most 50 characters")
    bundle_dir = Path(bundle_dir)
    try:
        card = read_card(bundle_dir)
    except (FileNotFoundError, ValueError) as exc:
        raise DeploymentError(f"cannot publish {bundle_dir}: {exc}") from exc
    if card.variant != release.variant:
        raise DeploymentError(f"variant: the bundle {bundle_dir} is {card.variant}, the release says {release.variant}")
    if not (bundle_dir / WEIGHTS_FILE).is_file():
        raise DeploymentError(f"cannot publish {bundle_dir}: it has no {WEIGHTS_FILE}")
    files = sorted((p.name for p in bundle_dir.iterdir() if p.is_file() and not p.name.startswith(".")),
                   key=lambda name: name == CARD_FILE)  # the card last
    target = Path(bundle_path(models_dir, endpoint, release))
    if _same_files(bundle_dir, target, files):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent))
    old = None
    try:
        for name in files:
            _copy_synced(bundle_dir / name, tmp / name)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the bundle from the pods' user
        if target.exists():
            # A directory cannot be renamed over a non-empty one: move the stale copy aside first.
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
            os.replace(target, old / "bundle")
            try:
                os.replace(tmp, target)
            except OSError:
                os.replace(old / "bundle", target)  # put the previous copy back rather than leave none
                raise
        else:
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return target


def _copy_synced(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)
    with open(dst, "rb") as fh:
        os.fsync(fh.fileno())
    os.chmod(dst, 0o644)


def _same_files(src: Path, dst: Path, files: list[str]) -> bool:
    if not dst.is_dir():
        return False
    present = sorted(p.name for p in dst.iterdir() if p.is_file() and not p.name.startswith("."))
    if present != sorted(files):
        return False
    return all((dst / n).stat().st_size == (src / n).stat().st_size and _sha256(dst / n) == _sha256(src / n)
               for n in files)


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def roll_out(rollout: InferenceRollout, release: Release, *, canary_percent: int, timeout_s: float,
             poll_s: float = 5.0, log: Any = None, sleep: Callable[[float], None] = time.sleep,
             clock: Callable[[], float] = time.monotonic) -> dict:
    """Serve ``release`` on the pool: first release straight to stable; later ones as a canary that
    must become ready (its pods load the model and pass the readiness probe) within ``timeout_s``
    before it is promoted; otherwise it is rolled back and the stable version keeps serving.
    Re-running for the version already stable changes nothing."""

    def wait(track: str) -> bool:
        deadline = clock() + timeout_s
        while True:
            status = rollout.track(track)
            if status is not None and status.version == release.version and status.ready:
                return True
            if clock() >= deadline:
                return False
            sleep(poll_s)

    stable = rollout.track("stable")
    if stable is not None and stable.version == release.version:
        rollout.rollback()  # a canary left by an interrupted try of this version
        return {"strategy": "unchanged", "version": release.version, "previous": release.version}
    if stable is None:
        rollout.deploy(release)
        if not wait("stable"):
            raise DeploymentError(f"version {release.version} did not become ready on {rollout.pool.namespace}/"
                                  f"{rollout.pool.endpoint} within {timeout_s:.0f} s; see its pods' events and logs")
        return {"strategy": "first", "version": release.version, "previous": None}
    rollout.canary(release, canary_percent)
    if log is not None:
        log.info("canary %s takes %d%% of %s's pods next to %s", release.version, canary_percent,
                 rollout.pool.endpoint, stable.version)
    if not wait("canary"):
        rollout.rollback()
        raise DeploymentError(f"canary {release.version} did not become ready within {timeout_s:.0f} s: rolled "
                              f"back, {stable.version} still serves {rollout.pool.endpoint}")
    rollout.promote(release)
    if not wait("stable"):
        raise DeploymentError(f"{rollout.pool.endpoint} did not finish rolling to {release.version} within "
                              f"{timeout_s:.0f} s (the Deployment keeps old pods until new ones are ready)")
    return {"strategy": "canary", "version": release.version, "previous": stable.version,
            "canary_percent": canary_percent}
