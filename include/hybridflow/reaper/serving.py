"""Serving versions that are neither stable nor canary: nothing routes to them, yet they hold a
process (and its files) or a Deployment and a bundle on the models volume.

On the local target (hybridflow.serving.deploy) the stable version is the one ``active.json`` names;
every other version recorded under ``<endpoint>/versions/`` is a leftover: its server process is
stopped (by recorded pid, only if that pid is still our server) and its files removed. An endpoint
whose lock a deploy holds is skipped whole: the version it is staging is not touched.

On the kubernetes target (hybridflow.serving.k8s) only objects with the product's labels are looked
at: a Deployment of an endpoint whose track is neither stable nor canary is deleted, and a version's
bundle on the models volume that no Deployment, pod or InferenceService of the endpoint runs is
removed once it is older than the grace period (a deploy publishes the bundle just before it starts
the canary). A Deployment another controller owns (``ownerReferences``: KServe's RawDeployment
predictors carry the InferenceService's labels) is never touched: its owner manages it. Every call
is bounded by ``timeout_s``.
"""

from __future__ import annotations

import fcntl
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from hybridflow.errors import DeploymentError
from hybridflow.reaper.base import Finder, Leftover
from hybridflow.serving.deploy import SERVER_MODULE
from hybridflow.serving.k8s_manifests import (
    DNS_LABEL_RE,
    ENDPOINT_LABEL,
    GPU_RESOURCE,
    TRACK_LABEL,
    VERSION_LABEL,
)
from hybridflow.serving.kserve_manifests import GROUP as KSERVE_GROUP
from hybridflow.serving.kserve_manifests import PLURAL as KSERVE_PLURAL
from hybridflow.serving.kserve_manifests import SERVING_ANNOTATION as SERVING_VERSION_ANNOTATION
from hybridflow.serving.kserve_manifests import VERSION as KSERVE_VERSION
from hybridflow.serving.processes import alive, is_ours, read_json, terminate
from hybridflow.serving.router import ACTIVE_FILE, known_endpoints

KIND = "serving-version"
ROUTED_TRACKS = ("stable", "canary")
_VERSION_FILE_RE = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9_.]*$")


class EndpointBusy(Exception):
    """A deploy holds the endpoint's lock."""


@contextmanager
def _unless_deploying(edir: Path) -> Iterator[None]:
    """The endpoint's lock, taken without waiting: a deploy holding it raises EndpointBusy."""
    with open(edir / ".lock", "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise EndpointBusy(f"a deploy of {edir.name} is under way") from exc
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _ready_marker(edir: Path, version: str) -> str:
    return str(edir / "versions" / f"{version}.ready")  # how the deployer names its server (deploy._ready_file)


def _parse_time(value: Any) -> datetime | None:
    try:
        ts = datetime.fromisoformat(str(value))
    except ValueError:
        return None
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)


class LocalServingFinder(Finder):
    """Versions of the local deploy target's endpoints that ``active.json`` does not name.

    What to pass: ``place``, the name the sweep reports it under (e.g. ``serving``); ``state_root``,
    the local target's state folder, ``<HYBRIDFLOW_HOME state dir>/serving`` as
    ``LocalTarget.from_estate`` builds it; ``grace`` (optional, default 24 h), how long the files of a
    version whose process is no longer running are kept after it last changed (its log tells why a
    deploy failed). A version whose process still runs is a leftover at once.
    """

    kind = KIND

    def __init__(self, place: str, state_root: Path | str, grace: timedelta = timedelta(hours=24)) -> None:
        self.place, self.root, self.grace = place, Path(state_root).resolve(), grace

    def find(self, now: datetime) -> list[Leftover]:
        found: list[Leftover] = []
        for endpoint in known_endpoints(self.root):
            edir = self.root / endpoint
            try:
                with _unless_deploying(edir):
                    found += self._leftovers(edir, now)
            except EndpointBusy:
                continue  # the version being staged is the deploy's to keep or stop
        return found

    def _leftovers(self, edir: Path, now: datetime) -> list[Leftover]:
        active = read_json(edir / ACTIVE_FILE) or {}
        out = []
        for path in sorted((edir / "versions").glob("*.json")):
            version, record = path.stem, read_json(path) or {}
            canary = active.get("canary") or {}  # a canary the gateway still sends a share to is routed
            if version in (active.get("version"), canary.get("version")) or not _VERSION_FILE_RE.match(version):
                continue
            pid = record.get("pid")
            if pid and pid in (active.get("pid"), canary.get("pid")):
                continue
            running = bool(pid) and is_ours(pid, SERVER_MODULE, _ready_marker(edir, version)) and alive(pid)
            changed = datetime.fromtimestamp(path.stat().st_mtime, UTC)
            if not running and now - changed < self.grace:
                continue
            state = f"its server (pid {pid}) still runs" if running else f"{record.get('status') or 'stopped'}"
            out.append(Leftover(
                self.place, self.kind, f"{edir.name}/{version}", since=_parse_time(record.get("started_at")),
                reason=f"{edir.name} serves {active.get('version') or 'no version'}; {version} is neither stable "
                       f"nor canary ({state})",
                detail={"endpoint": edir.name, "version": version, "pid": pid if running else None},
            ))
        return out

    def release(self, leftover: Leftover) -> None:
        """Stop the version's server if it still runs and remove its files, under the endpoint's lock."""
        endpoint, version = leftover.detail["endpoint"], leftover.detail["version"]
        edir = self.root / endpoint
        if not edir.is_dir():
            return
        try:
            with _unless_deploying(edir):
                active = read_json(edir / ACTIVE_FILE) or {}
                if version in (active.get("version"), (active.get("canary") or {}).get("version")):
                    raise DeploymentError(f"{endpoint} version {version} became active since it was found; kept")
                marker = _ready_marker(edir, version)
                record = read_json(edir / "versions" / f"{version}.json") or {}
                for pid in {leftover.detail.get("pid"), record.get("pid")} - {None, active.get("pid")}:
                    terminate(pid, SERVER_MODULE, marker)
                for suffix in (".ready", ".log", ".json"):  # the record last: it is how a version is found
                    (edir / "versions" / f"{version}{suffix}").unlink(missing_ok=True)
        except EndpointBusy as exc:
            raise DeploymentError(f"{exc}; {endpoint} version {version} is left for the next sweep") from exc


def _gpus(obj: Any, replicas: int) -> int:
    containers = obj.spec.template.spec.containers or []
    per_pod = sum(int(((c.resources.limits if c.resources else None) or {}).get(GPU_RESOURCE, 0)) for c in containers)
    return per_pod * replicas


class KubernetesServingFinder(Finder):
    """Leftover versions of the inference pool's endpoints on a Kubernetes cluster.

    What to pass: ``place``, the cluster's name (``serving.kubernetes.cluster``); ``hook``, the
    provider's hook of that cluster (``hybridflow.hooks.kubernetes.kubernetes_hook(cluster.conn_id)``);
    ``namespace``, ``serving.kubernetes.namespace``; ``models_dir`` (optional),
    ``serving.kubernetes.models_dir`` where the sweep can reach the models volume (None: bundles are
    not looked at); ``grace`` (optional, default 24 h), the age a bundle must reach before it can go.
    """

    kind = KIND

    def __init__(self, place: str, hook: Any, namespace: str, models_dir: Path | str | None = None,
                 grace: timedelta = timedelta(hours=24), timeout_s: float = 30.0) -> None:
        self.place, self.hook, self.namespace, self.grace = place, hook, namespace, grace
        self.models_dir = Path(models_dir) if models_dir is not None else None
        self.timeout_s = timeout_s

    def _inference_services(self) -> list[dict]:
        """The endpoints' InferenceServices; none where KServe is not installed (its API is a 404)."""
        try:
            got = self.hook.custom_object_client.list_namespaced_custom_object(
                group=KSERVE_GROUP, version=KSERVE_VERSION, namespace=self.namespace, plural=KSERVE_PLURAL,
                label_selector=ENDPOINT_LABEL, _request_timeout=self.timeout_s)
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                return []
            raise
        return got.get("items", [])

    def _listed(self) -> tuple[list, dict[str, set[str]]]:
        """The endpoints' Deployments, and per endpoint the versions its Deployments, pods and
        InferenceServices run."""
        apps, core = self.hook.apps_v1_client, self.hook.core_v1_client
        kw = {"label_selector": ENDPOINT_LABEL, "_request_timeout": self.timeout_s}
        deployments = apps.list_namespaced_deployment(self.namespace, **kw).items
        pods = core.list_namespaced_pod(self.namespace, **kw).items
        in_use: dict[str, set[str]] = {}
        for obj in [*deployments, *pods]:
            labels = obj.metadata.labels or {}
            in_use.setdefault(labels[ENDPOINT_LABEL], set()).add(labels.get(VERSION_LABEL))
        for isvc in self._inference_services():
            meta = isvc.get("metadata") or {}
            versions = in_use.setdefault((meta.get("labels") or {})[ENDPOINT_LABEL], set())
            versions.add((meta.get("labels") or {}).get(VERSION_LABEL))
            versions.add((meta.get("annotations") or {}).get(SERVING_VERSION_ANNOTATION))
        return deployments, in_use

    def find(self, now: datetime) -> list[Leftover]:
        deployments, in_use = self._listed()
        found = []
        for dep in deployments:
            labels = dep.metadata.labels or {}
            if labels.get(TRACK_LABEL) in ROUTED_TRACKS or dep.metadata.owner_references:
                continue  # routed, or another controller's (KServe's predictor Deployments): not ours to delete
            found.append(Leftover(
                self.place, self.kind, f"deployment/{dep.metadata.name}", gpus=_gpus(dep, dep.spec.replicas or 0),
                since=dep.metadata.creation_timestamp,
                reason=f"Deployment of {labels[ENDPOINT_LABEL]} version {labels.get(VERSION_LABEL)} on track "
                       f"{labels.get(TRACK_LABEL)!r}, neither stable nor canary",
                detail={"deployment": dep.metadata.name},
            ))
        return found + self._bundles(in_use, now)

    def _bundles(self, in_use: dict[str, set[str]], now: datetime) -> list[Leftover]:
        """Version folders on the models volume of endpoints with Deployments, that nothing runs."""
        found = []
        for endpoint, versions in sorted(in_use.items()) if self.models_dir is not None else ():
            edir = self.models_dir / endpoint
            if not DNS_LABEL_RE.match(endpoint) or not edir.is_dir() or edir.is_symlink():
                continue
            for vdir in sorted(edir.iterdir()):
                if vdir.name in versions or vdir.name.startswith(".") or vdir.is_symlink() or not vdir.is_dir():
                    continue
                changed = datetime.fromtimestamp(vdir.stat().st_mtime, UTC)
                if now - changed < self.grace:
                    continue  # possibly published by a deploy about to start its canary
                found.append(Leftover(
                    self.place, self.kind, f"bundle/{endpoint}/{vdir.name}", since=changed,
                    reason=f"no Deployment or pod of {endpoint} runs version {vdir.name}",
                    detail={"bundle": str(vdir), "endpoint": endpoint, "version": vdir.name},
                ))
        return found

    def release(self, leftover: Leftover) -> None:
        """Delete the Deployment (its pods go with it) or remove the bundle's folder."""
        if "deployment" in leftover.detail:
            try:
                self.hook.apps_v1_client.delete_namespaced_deployment(
                    name=leftover.detail["deployment"], namespace=self.namespace, _request_timeout=self.timeout_s)
            except Exception as exc:
                if getattr(exc, "status", None) != 404:
                    raise
            return
        endpoint, version = leftover.detail["endpoint"], leftover.detail["version"]
        if version in self._listed()[1].get(endpoint, set()):  # a deploy started it since it was found
            raise DeploymentError(f"{endpoint} version {version} runs again since it was found; its bundle is kept")
        bundle = Path(leftover.detail["bundle"])
        if bundle.exists():
            shutil.rmtree(bundle)


def finders(estate: Any, settings: Any, config: Any = None) -> list[Finder]:
    """The serving finder of the estate's deploy target (``serving.target`` in pipeline.yaml): the
    local target's state folder, reported as place ``serving``; or the inference pool's cluster,
    namespace and models volume (the hook is made here, from the cluster's Connection)."""
    from hybridflow.serving import target_name

    serving = estate.pipeline.serving
    if target_name(serving) == "local":
        return [LocalServingFinder("serving", Path(settings.state_dir) / "serving")]
    from hybridflow.hooks.kubernetes import kubernetes_hook

    k8s = serving.kubernetes
    return [KubernetesServingFinder(k8s.cluster, kubernetes_hook(estate.clusters[k8s.cluster].conn_id), k8s.namespace,
                                    models_dir=k8s.models_dir)]
