"""The kubernetes deploy target: the private inference pool as a Deployment behind a Service, with a canary.

The objects are built in :mod:`hybridflow.serving.k8s_manifests`. :class:`InferenceRollout` applies
them through the provider's hook (``apps_v1_client`` / ``core_v1_client``), idempotently: a re-run
replaces what is there instead of failing on AlreadyExists. :func:`publish_model` puts a bundle on
the models volume the pods read. :class:`KubernetesTarget` is the deploy contract on top: the first
version goes straight to stable; later ones start as a canary that must become ready before it is
promoted (the stable Deployment rolls to it with surge, never dropping below its replica count);
a canary that fails is removed and the stable release keeps serving throughout.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.errors import ConfigError, DeploymentError
from hybridflow.serving.base import DeployRequest, DeployTarget, Serving, Staged, roll
from hybridflow.serving.k8s_manifests import (
    DNS_LABEL_RE,
    VERSION_LABEL,
    InferencePool,
    Release,
    bundle_path,
    canary_deployment,
    service,
    stable_deployment,
)
from hybridflow.serving.processes import say

if TYPE_CHECKING:
    from hybridflow.config import Estate

READ_TIMEOUT_S = 30.0  # a read of the API server that holds nothing up for longer

__all__ = ["InferencePool", "InferenceRollout", "KubernetesTarget", "Release", "TrackStatus", "publish_model",
           "roll_out"]


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
    if not DNS_LABEL_RE.match(endpoint or "") or len(endpoint) > 50:
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


@dataclass(kw_only=True)
class _Track(Staged):
    """The new release and the Deployment track it runs on: ``stable`` (the first release) or ``canary``."""

    release: Release
    track: str
    promoted: bool = False


class KubernetesTarget(DeployTarget[_Track]):
    """Blue/green on the inference pool: readiness of the new release's pods is its check, promotion
    of the canary the switch."""

    name = "kubernetes"

    def __init__(self, rollout: InferenceRollout, *, image: str, canary_percent: int, timeout_s: float,
                 models_dir: Path | None = None, poll_s: float = 5.0, log: Any = None,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
                 where: dict[str, Any] | None = None) -> None:
        self.rollout, self.image, self.canary_percent, self.timeout_s = rollout, image, canary_percent, timeout_s
        self.models_dir, self.poll_s, self.log, self.sleep, self.clock = models_dir, poll_s, log, sleep, clock
        self.where = where or {}  # added to every result (cluster, namespace, endpoint_url)

    @classmethod
    def from_estate(cls, estate: Estate, endpoint: str, *, state_dir: Path, log: Any = None) -> KubernetesTarget:
        from hybridflow.hooks.kubernetes import kubernetes_hook

        k8s = estate.pipeline.serving.kubernetes
        if k8s is None:
            raise ConfigError("serving.kubernetes: not set; the kubernetes deploy target needs the inference pool "
                              "(cluster, node_pool, image, models_claim, models_dir) in pipeline.yaml")
        cluster = estate.clusters[k8s.cluster]
        pool = InferencePool(endpoint=endpoint, namespace=k8s.namespace, pool=cluster.pool(k8s.node_pool),
                             models_claim=k8s.models_claim, replicas=k8s.replicas, port=k8s.port,
                             gpus_per_replica=k8s.gpus_per_replica)
        where = {"cluster": k8s.cluster, "namespace": k8s.namespace,
                 "endpoint_url": f"http://{endpoint}.{k8s.namespace}.svc:{k8s.port}/v1/models/{endpoint}"}
        return cls(InferenceRollout(kubernetes_hook(cluster.conn_id), pool), image=k8s.image,
                   canary_percent=k8s.canary_percent, timeout_s=k8s.ready_timeout_s,
                   models_dir=Path(k8s.models_dir), log=log, where=where)

    @property
    def _pool(self) -> InferencePool:
        return self.rollout.pool

    def prepare(self, request: DeployRequest) -> Release:
        """The release; with a models volume, its bundle is published there first."""
        release = Release(version=request.version, variant=request.variant or "", image=self.image)
        if self.models_dir is not None and request.bundle_dir is not None:
            published = publish_model(Path(request.bundle_dir), self.models_dir, self._pool.endpoint, release)
            say(self.log, f"Model {release.version} ({release.variant}) published to {published}")
        return release

    def current(self) -> Serving | None:
        stable = self.rollout.track("stable")
        return None if stable is None else Serving(stable.version, {"ready": stable.ready})

    def keep(self, current: Serving, plan: Release) -> dict[str, Any] | None:
        self.rollout.rollback()  # a canary left by an interrupted try of this version
        return self._done({"strategy": "unchanged", "version": plan.version, "previous": plan.version})

    def stage(self, plan: Release, current: Serving | None) -> _Track:
        if current is None:
            self.rollout.deploy(plan)
            return _Track(plan.version, None, release=plan, track="stable")
        self.rollout.canary(plan, self.canary_percent)
        say(self.log, f"canary {plan.version} takes {self.canary_percent}% of {self._pool.endpoint}'s pods next "
                      f"to {current.version}")
        return _Track(plan.version, current, release=plan, track="canary")

    def _wait(self, track: str, version: str) -> bool:
        """Whether ``track`` runs ``version`` on all its pods, ready, within the timeout."""
        deadline = self.clock() + self.timeout_s
        while True:
            status = self.rollout.track(track)
            if status is not None and status.version == version and status.ready:
                return True
            if self.clock() >= deadline:
                return False
            self.sleep(self.poll_s)

    def check(self, staged: _Track) -> None:
        """Its pods load the model and pass the readiness probe within the timeout."""
        if self._wait(staged.track, staged.version):
            return
        pool, timeout = self._pool, f"{self.timeout_s:.0f} s"
        if staged.previous is None:
            raise DeploymentError(f"version {staged.version} did not become ready on {pool.namespace}/"
                                  f"{pool.endpoint} within {timeout}; see its pods' events and logs")
        raise DeploymentError(f"canary {staged.version} did not become ready within {timeout}: rolled "
                              f"back, {staged.previous.version} still serves {pool.endpoint}")

    def steps(self, staged: _Track) -> Sequence[int]:
        # The first release is stable already; a canary is promoted in one step.
        return () if staged.previous is None else (100,)

    def shift(self, staged: _Track, percent: int) -> None:
        """Promote: the canary's release becomes stable (rolling, with surge), then the canary goes."""
        staged.promoted = True
        self.rollout.promote(staged.release)
        if not self._wait("stable", staged.version):
            raise DeploymentError(f"{self._pool.endpoint} did not finish rolling to {staged.version} within "
                                  f"{self.timeout_s:.0f} s (the Deployment keeps old pods until new ones are ready)")

    def rollback(self, staged: _Track, error: BaseException) -> Exception | None:
        # Before promotion, removing the canary leaves stable serving; after it (or for a first release)
        # the stable Deployment keeps its old pods until new ones are ready, so there is nothing to undo.
        if staged.track == "canary" and not staged.promoted:
            self.rollout.rollback()
        return None

    def retire(self, staged: _Track) -> None:
        """Nothing left to stop: promotion removed the canary, and the rolling update the old pods."""

    def result(self, staged: _Track) -> dict[str, Any]:
        if staged.previous is None:
            return self._done({"strategy": "first", "version": staged.version, "previous": None})
        return self._done({"strategy": "canary", "version": staged.version, "previous": staged.previous.version,
                           "canary_percent": self.canary_percent})

    def _done(self, result: dict[str, Any]) -> dict[str, Any]:
        if self.where:
            say(self.log, f"Endpoint {self._pool.endpoint} on {self.where['cluster']}/{self.where['namespace']}: "
                          f"{result}")
        return {**result, **self.where}

    def live_versions(self) -> dict[str, str | None]:
        """The versions the stable and the canary Deployment run (their version label), each read bounded
        by the target's read timeout so an API server that does not answer cannot hold the caller."""
        pool, live = self.rollout.pool, {}
        for name in (pool.endpoint, f"{pool.endpoint}-canary"):
            try:
                dep = self.rollout.hook.apps_v1_client.read_namespaced_deployment(
                    name=name, namespace=pool.namespace, _request_timeout=READ_TIMEOUT_S)
            except Exception as exc:
                if getattr(exc, "status", None) != 404:
                    raise
                continue  # no such track
            version = (dep.metadata.labels or {}).get(VERSION_LABEL)
            if version:
                live.setdefault(version, None)
        return live

    # -- the disaster-recovery side (a target made by hybridflow.serving.takeover.pool_target) --
    def take_over(self, version: str, bundle: Path) -> tuple[str, Any, bool]:
        """Serve ``version`` of ``bundle`` as the stable Deployment (another version in place rolled as a
        canary): (the in-cluster Service URL, None, whether anything was started). Readiness is the
        check: the Service cannot be reached from here, so no prediction is made."""
        from hybridflow.bundle import read_card

        current = self.current()
        if current is not None and current.version == version and current.detail.get("ready"):
            return self.where["endpoint_url"], None, False
        roll(self, DeployRequest(version, bundle_dir=bundle, variant=read_card(bundle).variant))
        deadline = time.monotonic() + self.timeout_s  # a version kept by roll may still be rolling out
        while True:
            serving = self.current()
            if serving is not None and serving.version == version and serving.detail.get("ready"):
                return self.where["endpoint_url"], None, True
            if time.monotonic() >= deadline:
                raise DeploymentError(f"{version} on the DR side did not become ready within {self.timeout_s:g} s; "
                                      "see its pods' events and logs")
            time.sleep(self.poll_s)

    def remove(self) -> bool:
        """Delete the endpoint's Deployments and Service; whether any was there."""
        hook, ns, endpoint = self.rollout.hook, self.rollout.pool.namespace, self.rollout.pool.endpoint
        removed = False
        for client, kind, name in ((hook.apps_v1_client, "deployment", f"{endpoint}-canary"),
                                   (hook.apps_v1_client, "deployment", endpoint),
                                   (hook.core_v1_client, "service", endpoint)):
            try:
                getattr(client, f"delete_namespaced_{kind}")(name=name, namespace=ns)
                removed = True
            except Exception as exc:
                if getattr(exc, "status", None) != 404:
                    raise
        return removed


def roll_out(rollout: InferenceRollout, release: Release, *, canary_percent: int, timeout_s: float,
             poll_s: float = 5.0, log: Any = None, sleep: Callable[[float], None] = time.sleep,
             clock: Callable[[], float] = time.monotonic) -> dict:
    """Serve ``release`` (already on the models volume) on the pool: first release straight to stable;
    later ones as a canary that must become ready within ``timeout_s`` before it is promoted;
    otherwise it is rolled back and the stable version keeps serving. Re-running for the version
    already stable changes nothing."""
    target = KubernetesTarget(rollout, image=release.image, canary_percent=canary_percent, timeout_s=timeout_s,
                              poll_s=poll_s, log=log, sleep=sleep, clock=clock)
    return roll(target, DeployRequest(release.version, variant=release.variant))
