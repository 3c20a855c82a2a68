"""The KServe object of an endpoint: one serving.kserve.io/v1beta1 InferenceService named after it.

Its predictor is a custom container running the model server (``python -m hybridflow.serving.server``,
the same command as a Deployment's pods, with the ``serving.server`` settings as flags) on the bundle at
``<mount>/<endpoint>/<version>/<variant>/`` of the models volume, on the inference node pool, with the
replica count as both ``minReplicas`` and ``maxReplicas`` and the pool's GPUs per replica. A new version
is a new predictor spec: KServe makes a new revision of it and ``canaryTrafficPercent`` says what share
of the traffic that revision takes (0: none, the previous rolled-out revision keeps everything; absent:
the new revision takes everything once ready). Tag routing is on, so each revision in the traffic
table has its own URL (``latest`` and ``prev``) where it can be tested before and while it takes traffic.
Pure functions; tests validate them against the KServe v0.20.0 CRD.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from hybridflow.errors import DeploymentError
from hybridflow.serving.k8s_manifests import (
    ENDPOINT_LABEL,
    GPU_RESOURCE,
    MODELS_MOUNT,
    VERSION_LABEL,
    InferencePool,
    Release,
    bundle_path,
)

GROUP = "serving.kserve.io"
VERSION = "v1beta1"
PLURAL = "inferenceservices"
KIND = "InferenceService"
CONTAINER = "kserve-container"  # the name KServe gives a custom predictor's serving container
# The version that takes all of the endpoint's traffic (written once a version is promoted or restored).
SERVING_ANNOTATION = "hybridflow.io/serving-version"
VARIANT_ANNOTATION = "hybridflow.io/variant"
TAG_ROUTING = "serving.kserve.io/enable-tag-routing"
DEPLOYMENT_MODE = "serving.kserve.io/deploymentMode"  # canary traffic splitting needs Serverless


def predictor(pool: InferencePool, release: Release, server_args: Sequence[str] = ()) -> dict[str, Any]:
    """The predictor of ``release``: the model server in the serving image, reading the models volume."""
    pool.check()
    release.check()
    flags = [str(a) for a in server_args]
    if any(f in ("--bundle", "--endpoint", "--version", "--port", "--host", "--ready-file") for f in flags):
        raise DeploymentError(f"server_args: {flags} must hold only the serving.server settings; the bundle, "
                              "endpoint, version, port and host are set from the release and the pool")
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": release.image,
        "command": ["python", "-m", "hybridflow.serving.server",
                    "--bundle", bundle_path(MODELS_MOUNT, pool.endpoint, release),
                    "--endpoint", pool.endpoint, "--version", release.version, "--port", str(pool.port),
                    "--host", "0.0.0.0", *flags],  # noqa: S104 - the revision's pods are reached on their IP
        "ports": [{"containerPort": pool.port, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": pool.port}, "periodSeconds": 5},
        "volumeMounts": [{"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True}],
    }
    if pool.gpus_per_replica:
        gpus = str(pool.gpus_per_replica)
        container["resources"] = {"limits": {GPU_RESOURCE: gpus}, "requests": {GPU_RESOURCE: gpus}}
    spec: dict[str, Any] = {
        "minReplicas": pool.replicas,
        "maxReplicas": pool.replicas,
        "labels": {ENDPOINT_LABEL: pool.endpoint, VERSION_LABEL: release.version},
        "containers": [container],
        "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": pool.models_claim, "readOnly": True}}],
        "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
    }
    if pool.pool.node_labels:
        spec["nodeSelector"] = dict(sorted(pool.pool.node_labels.items()))
    return spec


def inference_service(pool: InferencePool, release: Release, server_args: Sequence[str] = (), *,
                      canary_percent: int | None = None, serving_version: str | None = None) -> dict[str, Any]:
    """The endpoint's InferenceService running ``release``. ``canary_percent``: its revision's share of
    the traffic next to the previous rolled-out revision (None: all of it once ready);
    ``serving_version``: the version that takes all traffic now (recorded as an annotation)."""
    spec = predictor(pool, release, server_args)
    if canary_percent is not None:
        if not 0 <= canary_percent <= 100:
            raise DeploymentError(f"canaryTrafficPercent: {canary_percent} must be in 0..100")
        spec["canaryTrafficPercent"] = canary_percent
    annotations = {TAG_ROUTING: "true", DEPLOYMENT_MODE: "Serverless", VARIANT_ANNOTATION: release.variant}
    if serving_version is not None:
        annotations[SERVING_ANNOTATION] = serving_version
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {"name": pool.endpoint, "namespace": pool.namespace,
                     "labels": {ENDPOINT_LABEL: pool.endpoint, VERSION_LABEL: release.version},
                     "annotations": annotations},
        "spec": {"predictor": spec},
    }


def predictor_version(predictor_spec: dict[str, Any] | None) -> str | None:
    """The model version a predictor spec runs (its pods' version label)."""
    return ((predictor_spec or {}).get("labels") or {}).get(VERSION_LABEL)


def restore(previous: dict[str, Any], current: dict[str, Any] | None, version: str,
            variant: str | None) -> dict[str, Any]:
    """A merge patch turning the ``current`` predictor spec back into ``previous`` (both as read from the
    cluster), serving everything: the labels and annotations follow it, ``canaryTrafficPercent`` goes."""
    spec: dict[str, Any] = {key: None for key in (current or {}) if key not in previous}
    spec.update(copy.deepcopy(previous))
    spec["canaryTrafficPercent"] = None
    annotations: dict[str, Any] = {SERVING_ANNOTATION: version}
    if variant:
        annotations[VARIANT_ANNOTATION] = variant
    # A merge patch replaces lists whole; a key set to None is removed.
    return {"metadata": {"labels": {VERSION_LABEL: version}, "annotations": annotations},
            "spec": {"predictor": spec}}
