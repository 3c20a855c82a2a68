"""Kubernetes objects of an endpoint's inference pool: a stable and a canary Deployment behind one Service.

The Service selects every pod of the endpoint (``hybridflow.io/endpoint``); the stable and the
canary Deployments differ only in ``hybridflow.io/track`` and version, so the canary's share of
requests is its share of ready pods. Every pod runs the model server on the bundle at
``<mount>/<endpoint>/<version>/<variant>/`` of the models volume; a pod is ready once its server
loaded the bundle and answers ``/healthz``. Pure functions, validated in tests with
kubernetes-validate.
"""

from __future__ import annotations

import re
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

DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
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
            if not DNS_LABEL_RE.match(value or "") or len(value) > 50:
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


def service_url(endpoint: str, namespace: str) -> str:
    """The endpoint's Service inside its cluster (port 80, see :func:`service`)."""
    return f"http://{endpoint}.{namespace}.svc"


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

