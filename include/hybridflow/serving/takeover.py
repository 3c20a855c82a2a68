"""Serving an endpoint from the disaster-recovery side: what a deploy target does when the cluster it
serves for is declared down (:mod:`hybridflow.dr.failover` decides when and with which replica).

- The local target (the model gateway): a DR-side model server of the replica, detached, checked with
  one prediction, then the ``takeover`` entry of the endpoint's ``active.json``, which the gateway
  routes every request to, ahead of the stable version and any canary (:func:`take_over_locally`,
  :func:`hand_back_locally`, :func:`stop_local_server`).
- A Kubernetes target: the DR cluster's own inference pool (``clusters.<dr>.dr.serving``), as a
  :class:`~hybridflow.serving.kserve.KServeTarget` or :class:`~hybridflow.serving.k8s.KubernetesTarget`
  made by :func:`pool_target` (:meth:`~hybridflow.serving.base.DeployTarget.take_over`, ``remove``).

A takeover has no held-out data: its checks are what can be shown honestly without it, one prediction
made from the model's signature (:func:`probe_rows`) where the server can be reached from here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridflow.errors import ConfigError
from hybridflow.serving.processes import DRAIN_S, now, read_json, write_json
from hybridflow.serving.router import ACTIVE_FILE, TAKEOVER

SERVER_MODULE = "hybridflow.serving.server"
POLL_S = 0.5
API_TIMEOUT_S = 30.0

__all__ = ["DRAIN_S", "TAKEOVER", "answering", "dr_pool", "hand_back_locally", "local_active", "local_endpoints", "local_takeovers", "pool_target",
           "probe_instance", "probe_rows", "replica_server", "served_versions", "stop_local_server", "take_over_locally"]


def probe_instance(signature: dict[str, Any]) -> list[Any]:
    """One valid instance of the signature: each column at its minimum (0 where it has none)."""
    from hybridflow.serving.schema import InputSchema

    row: list[Any] = []
    for _name, kind, lo, hi in InputSchema(signature).columns:
        if kind == "bool":
            row.append(False)
            continue
        value = lo if lo is not None else (min(0.0, hi) if hi is not None else 0.0)
        row.append(int(value) if kind == "int" else float(value))
    return row


def probe_rows(bundle: Path) -> list[list[Any]]:
    """One instance made from the bundle's signature (each column at its minimum)."""
    from hybridflow.bundle import read_card

    return [probe_instance(read_card(Path(bundle)).signature)]


def replica_server(bundle: Path, endpoint: str, version: str, *, start_timeout_s: float) -> Any:
    """A model server of ``bundle`` on 127.0.0.1 (an ephemeral port), owned by the caller (a drill's
    serving check on this machine): its ``server_address`` and ``proc``; ``server_close()`` stops it."""
    from hybridflow.serving.server import ServerProcess

    return ServerProcess(bundle, endpoint, version, 0, start_timeout_s=start_timeout_s)


# --- the local target: a DR-side server behind the gateway ---------------------------------------------

def _ready_file(edir: Path, version: str) -> Path:
    return edir / TAKEOVER / f"{version}.ready"


def _start_server(edir: Path, endpoint: str, version: str, bundle: Path, settings: Any) -> dict[str, Any]:
    """The DR-side model server of ``bundle``, detached, ready, healthy and answering one prediction."""
    from hybridflow.serving.checks import StepFailed, predict, url_of, wait_healthy, wait_ready
    from hybridflow.serving.deploy import START_TIMEOUT_S, server_command
    from hybridflow.serving.processes import log_size, spawn, stop_child

    folder = edir / TAKEOVER
    ready, log_path = _ready_file(edir, version), folder / f"{version}.log"
    ready.unlink(missing_ok=True)
    since = log_size(log_path)
    python, flags = server_command(settings.server)
    proc = spawn([SERVER_MODULE, "--bundle", str(bundle), "--endpoint", endpoint, "--version", version, "--port", "0",
                  "--ready-file", str(ready), *flags], log_path, folder, python=python)
    try:
        url = url_of(wait_ready(proc, ready, log_path, since, START_TIMEOUT_S))
        wait_healthy(url, endpoint, version, proc.pid)
        answer = predict(url, endpoint, probe_rows(bundle), version)
    except (StepFailed, OSError):
        stop_child(proc)
        raise
    return {"version": version, "url": url, "pid": proc.pid, "log": str(log_path), "prediction": answer[0],
            "healthy_at": now()}


def stop_local_server(edir: Path, entry: dict[str, Any]) -> bool:
    """Stop the DR-side server ``entry`` names, if that pid is still the server started for it."""
    from hybridflow.serving.processes import terminate

    return terminate(entry.get("pid"), SERVER_MODULE, str(_ready_file(edir, str(entry.get("version")))))


def local_active(edir: Path) -> dict[str, Any]:
    """The endpoint's ``active.json`` (what the gateway routes to), empty when it has none."""
    return read_json(edir / ACTIVE_FILE) or {}


def answering(entry: Any, endpoint: str) -> bool:
    """Whether the takeover server ``entry`` names is alive and answers as the endpoint's server."""
    from hybridflow.serving.checks import backend_healthy

    return isinstance(entry, dict) and backend_healthy(entry, endpoint)


def local_endpoints(root: Path) -> list[str]:
    """Endpoints of the gateway under ``root`` whose active.json names a backend URL."""
    from hybridflow.serving.router import known_endpoints

    return [e for e in known_endpoints(root) if (read_json(root / e / ACTIVE_FILE) or {}).get("url")]


def local_takeovers(root: Path) -> dict[str, dict[str, Any]]:
    """``{endpoint: active.json}`` of the gateway's endpoints (under ``root``) served on the DR side now."""
    from hybridflow.serving.router import known_endpoints

    found = {e: read_json(root / e / ACTIVE_FILE) or {} for e in known_endpoints(root)}
    return {e: a for e, a in found.items() if isinstance(a.get(TAKEOVER), dict)}


def take_over_locally(edir: Path, version: str, bundle: Path, settings: Any, *, cluster: str,
                      record: dict[str, Any]) -> dict[str, Any]:
    """Serve ``version`` of ``bundle`` from the DR side (under the endpoint's lock: no deploy switches it
    meanwhile): ``{"dr": entry, "started": bool, "primary": {...}}``; a takeover server that answers
    already starts nothing. StepFailed when the DR-side server does not answer (a failed move)."""
    from hybridflow.serving.checks import StepFailed, backend_healthy
    from hybridflow.serving.processes import endpoint_lock

    endpoint = edir.name
    with endpoint_lock(edir):
        active = read_json(edir / ACTIVE_FILE) or {}
        primary = {"version": active.get("version"), "url": active.get("url"), "pid": active.get("pid")}
        standing = active.get(TAKEOVER)
        if isinstance(standing, dict) and backend_healthy(standing, endpoint):
            return {"dr": standing, "started": False, "primary": primary}
        (edir / TAKEOVER).mkdir(parents=True, exist_ok=True)
        if isinstance(standing, dict):
            stop_local_server(edir, standing)  # an earlier takeover server that no longer answers
        try:
            server = _start_server(edir, endpoint, version, bundle, settings)
        except (StepFailed, OSError) as exc:
            # A failed move, not a choice: the drain stays incomplete and a rerun starts it again.
            raise StepFailed(f"the DR-side server of {record.get('source') or version} did not answer: {exc}") from exc
        entry = {**server, "cluster": cluster, **record, "bundle": str(bundle), "since": now()}
        write_json(edir / ACTIVE_FILE, {**active, TAKEOVER: entry})
    return {"dr": entry, "started": True, "primary": primary}


def hand_back_locally(edir: Path, judge: Callable[[dict[str, Any]], tuple[Any, bool]]) -> tuple[dict | None, Any]:
    """Under the endpoint's lock (no deploy switches it meanwhile): ``judge(active)`` decides whether the
    primary's version takes serving back, and when it does the ``takeover`` entry is removed (the
    gateway routes to the primary again). (active.json as it was, or None when the DR side serves
    nothing for the endpoint; the verdict). The DR-side server is stopped by the caller after a drain."""
    from hybridflow.serving.processes import endpoint_lock

    with endpoint_lock(edir):
        active = read_json(edir / ACTIVE_FILE) or {}
        if not isinstance(active.get(TAKEOVER), dict):
            return None, None
        verdict, passed = judge(active)
        if passed:
            write_json(edir / ACTIVE_FILE, {k: v for k, v in active.items() if k != TAKEOVER})
    return active, verdict


# --- a Kubernetes target: the DR cluster's inference pool ----------------------------------------------

def dr_pool(dr: Any) -> Any:
    """``clusters.<dr>.dr.serving``; a clear ConfigError when the DR cluster cannot serve."""
    at = f"clusters.{dr.name}.dr.serving"
    if not dr.runs_pods:
        raise ConfigError(f"{at}: the DR cluster {dr.name} has backend {dr.backend}; a Kubernetes inference pool "
                          f"(serving.kubernetes) fails over only to a backend: kubernetes DR cluster with dr.serving")
    serving = dr.dr.serving if dr.dr is not None else None
    if serving is None:
        raise ConfigError(f"{at}: not set; add the DR inference pool to clusters.yaml: dr: {{serving: {{node_pool: "
                          f"<one of {', '.join(p.name for p in dr.node_pools)}>, models_claim: <PVC of the DR "
                          f"models volume>, models_dir: <where the workers mount it>}}}} (namespace, replicas, "
                          f"ready_timeout_s optional)")
    return serving


def pool_target(estate: Any, dr: Any, endpoint: str, *, log: Any = None) -> Any:
    """The deploy target of ``endpoint`` on the DR cluster's pool (KServeTarget or KubernetesTarget)."""
    from hybridflow.hooks.kubernetes import kubernetes_hook
    from hybridflow.serving.k8s import InferenceRollout, KubernetesTarget
    from hybridflow.serving.k8s_manifests import InferencePool, service_url
    from hybridflow.serving.kserve import InferenceServiceApi, KServeTarget
    from hybridflow.serving.runtime import server_args

    serving = estate.pipeline.serving
    k8s = serving.kubernetes
    if k8s is None:
        raise ConfigError("serving.kubernetes: not set; the DR inference pool takes its kind and image from it")
    ds = dr_pool(dr)
    pool = InferencePool(endpoint=endpoint, namespace=ds.namespace, pool=dr.pool(ds.node_pool),
                         models_claim=ds.models_claim, replicas=ds.replicas, port=k8s.port,
                         gpus_per_replica=k8s.gpus_per_replica)
    hook = kubernetes_hook(dr.conn_id)
    if k8s.kind == "kserve":
        where = {"cluster": dr.name, "namespace": ds.namespace, "inference_service": endpoint}
        return KServeTarget(InferenceServiceApi(hook, ds.namespace, endpoint), pool, image=k8s.image,
                            settings=serving, server_args=list(server_args(serving.server)), models_dir=Path(ds.models_dir),
                            timeout_s=ds.ready_timeout_s, poll_s=POLL_S, log=log, where=where)
    where = {"cluster": dr.name, "namespace": ds.namespace, "deployment": endpoint,
             "endpoint_url": service_url(endpoint, ds.namespace)}
    return KubernetesTarget(InferenceRollout(hook, pool), image=k8s.image, canary_percent=k8s.canary_percent,
                            timeout_s=ds.ready_timeout_s, models_dir=Path(ds.models_dir), poll_s=POLL_S, log=log,
                            where=where)


def served_versions(estate: Any) -> dict[str, str | None]:
    """``{endpoint: version}`` of the inference pool's endpoints, asked of the primary's API server
    (raises if it does not answer)."""
    from hybridflow.hooks.kubernetes import kubernetes_hook
    from hybridflow.serving.k8s_manifests import ENDPOINT_LABEL, TRACK_LABEL, VERSION_LABEL
    from hybridflow.serving.kserve_manifests import (
        GROUP,
        PLURAL,
        SERVING_ANNOTATION,
        VERSION,
        predictor_version,
    )

    k8s = estate.pipeline.serving.kubernetes
    hook = kubernetes_hook(estate.clusters[k8s.cluster].conn_id)
    if k8s.kind == "kserve":
        listed = hook.custom_object_client.list_namespaced_custom_object(
            group=GROUP, version=VERSION, plural=PLURAL, namespace=k8s.namespace, label_selector=ENDPOINT_LABEL,
            _request_timeout=API_TIMEOUT_S)
        out = {}
        for item in listed.get("items") or []:
            meta = item.get("metadata") or {}
            out[meta["name"]] = (meta.get("annotations") or {}).get(SERVING_ANNOTATION) or \
                predictor_version((item.get("spec") or {}).get("predictor"))
        return out
    listed = hook.apps_v1_client.list_namespaced_deployment(
        namespace=k8s.namespace, label_selector=f"{TRACK_LABEL}=stable", _request_timeout=API_TIMEOUT_S)
    return {(d.metadata.labels or {})[ENDPOINT_LABEL]: (d.metadata.labels or {}).get(VERSION_LABEL)
            for d in listed.items if ENDPOINT_LABEL in (d.metadata.labels or {})}
