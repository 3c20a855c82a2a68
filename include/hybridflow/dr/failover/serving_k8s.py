"""Serving failover of a Kubernetes deploy target: the endpoints of the inference pool on a cluster
declared down are served from the disaster-recovery cluster's own inference pool.

**The DR pool** (:func:`dr_target`) is ``clusters.<dr>.dr.serving`` of a ``backend: kubernetes`` DR
cluster: its namespace, node pool, models volume and replica count (the minimum service), reached
through the DR cluster's Connection, in the kind (``kserve`` or ``deployment``) and with the image of
``serving.kubernetes``.

**Starting an endpoint there** (:func:`start_on_dr`): the replica is fetched from the DR store and
verified against its manifest (:func:`hybridflow.dr.failover.serving.fetch_replica`), published on
the DR models volume, and served:

- ``kserve``: one InferenceService taking all traffic, created from the same manifest as a deploy's.
  A takeover has no held-out data, so its check is what can be shown honestly without it: the
  revision ready with all traffic, then one prediction, made from the model's signature, answered by
  that version at ``status.url``;
- ``deployment``: the stable Deployment and its Service (:func:`hybridflow.serving.base.roll` with the
  Deployment target, another version in place rolled as a canary). Its check is readiness alone: every
  pod loaded the bundle and answers ``/healthz``. The Service's address is in-cluster
  (``http://<endpoint>.<namespace>.svc``) and not reachable from the machine running the failover, so
  no prediction is made and ``prediction`` is None.

An endpoint that serves the version asked already (ready, all traffic; for ``kserve`` also answering)
starts nothing.

**Failover** (:func:`fail_over_pool`, from :func:`hybridflow.dr.failover.serving.fail_over`). Which
endpoints move: those the primary's API server lists in ``serving.kubernetes.namespace``
(InferenceServices, or stable Deployments, labelled with the endpoint), each from the version it
serves. A cluster declared down often does not answer; then every endpoint with a model in the DR
store moves (only those of ``dr.replicate.endpoints`` when it names some), from its newest replica,
since the version served cannot be asked. The takeover is kept in
``state/serving/<endpoint>/takeover-k8s.json``; the failback (:mod:`hybridflow.dr.failover.serving_k8s_failback`)
reads it to know what to move back and removes it once the primary serves again.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from hybridflow.errors import ConfigError, DeploymentError
from hybridflow.serving.processes import now, read_json, say, write_json

TAKEOVER_FILE = "takeover-k8s.json"
POLL_S = 0.5
API_TIMEOUT_S = 30.0


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


def dr_target(estate: Any, dr: Any, endpoint: str, *, log: Any = None) -> Any:
    """The deploy target of ``endpoint`` on the DR cluster's pool (KServeTarget or KubernetesTarget)."""
    from hybridflow.hooks.kubernetes import kubernetes_hook
    from hybridflow.serving.k8s import InferenceRollout, KubernetesTarget
    from hybridflow.serving.k8s_manifests import InferencePool
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


def service_url(endpoint: str, namespace: str) -> str:
    """The endpoint's Service inside its cluster (port 80, see k8s_manifests.service)."""
    return f"http://{endpoint}.{namespace}.svc"


def probe_rows(bundle: Path) -> list[list[Any]]:
    """One instance made from the bundle's signature (each column at its minimum)."""
    from hybridflow.bundle import read_card
    from hybridflow.dr.drills.takeover import probe_instance

    return [probe_instance(read_card(Path(bundle)).signature)]


def _isvc_ready(target: Any, version: str) -> Any:
    """The InferenceService's state once ``version``'s revision is ready with all traffic."""
    return target.wait_for(f"{version} on the DR side ready with all traffic",
                           lambda s: s.serves_latest() and s.share(s.latest_ready) == 100 and bool(s.url))


def _serve_kserve(target: Any, version: str, bundle: Path) -> tuple[str, Any, bool]:
    """(status.url, the probe's answer, whether anything was started) of ``version`` on the DR pool."""
    from hybridflow.bundle import read_card
    from hybridflow.serving.checks import StepFailed, predict
    from hybridflow.serving.k8s import publish_model
    from hybridflow.serving.k8s_manifests import Release
    from hybridflow.serving.kserve_manifests import inference_service

    endpoint, rows = target.endpoint, probe_rows(bundle)
    current = target.current()
    detail = current.detail if current is not None else {}
    if current is not None and current.version == version and detail.get("ready") and detail.get("canary") is None:
        try:
            return str(detail.get("url")), predict(str(detail.get("url")), endpoint, rows, version)[0], False
        except (StepFailed, OSError):
            pass  # it stands but does not answer: applied again below
    release = Release(version=version, variant=read_card(bundle).variant, image=target.image)
    published = publish_model(bundle, target.models_dir, endpoint, release)
    say(target.log, f"{endpoint} {version} published on the DR models volume at {published}")
    body = inference_service(target.pool, release, target.server_args, serving_version=version)
    if current is not None:
        body["spec"]["predictor"]["canaryTrafficPercent"] = None  # all traffic to this version
    target.api.apply(body, replacing=None if current is None else detail.get("predictor") or {})
    state = _isvc_ready(target, version)
    try:
        answer = predict(state.url, endpoint, rows, version)
    except (StepFailed, OSError) as exc:
        raise DeploymentError(f"{version} on the DR side is ready but did not answer a prediction at {state.url}: "
                              f"{exc}") from exc
    return state.url, answer[0], True


def _serve_deployment(target: Any, version: str, bundle: Path) -> tuple[str, Any, bool]:
    """(the in-cluster Service URL, None, whether anything was started): readiness is the check."""
    from hybridflow.bundle import read_card
    from hybridflow.serving.base import DeployRequest, roll

    current = target.current()
    started = not (current is not None and current.version == version and current.detail.get("ready"))
    if not started:
        return target.where["endpoint_url"], None, False
    roll(target, DeployRequest(version, bundle_dir=bundle, variant=read_card(bundle).variant))
    deadline = time.monotonic() + target.timeout_s  # a version kept by roll may still be rolling out
    while True:
        serving = target.current()
        if serving is not None and serving.version == version and serving.detail.get("ready"):
            return target.where["endpoint_url"], None, True
        if time.monotonic() >= deadline:
            raise DeploymentError(f"{version} on the DR side did not become ready within {target.timeout_s:g} s; "
                                  "see its pods' events and logs")
        time.sleep(target.poll_s)


def start_on_dr(estate: Any, dr: Any, spec: Any, endpoint: str, version: str | None, scratch: Path, *,
                log: Any = None) -> dict[str, Any]:
    """Serve ``endpoint`` on the DR pool from its replica (``version`` when replicated, else the newest);
    NoReplica when none is, DeploymentError when it does not come up (see the module doc)."""
    from hybridflow.dr.failover.serving import fetch_replica

    target = dr_target(estate, dr, endpoint, log=log)  # a DR cluster that cannot serve fails before the fetch
    body, bundle, source = fetch_replica(spec, endpoint, version, Path(scratch) / endpoint)
    chosen = str(body["version"])
    serve = _serve_kserve if estate.pipeline.serving.kubernetes.kind == "kserve" else _serve_deployment
    url, prediction, started = serve(target, chosen, bundle)
    name_key = "inference_service" if "inference_service" in target.where else "deployment"
    out = {"version": chosen, "url": url, "cluster": dr.name, "namespace": target.where["namespace"],
           name_key: endpoint, "kind": estate.pipeline.serving.kubernetes.kind, "source": source,
           "prediction": prediction, "healthy_at": now(), "started": started, "model": body.get("model"),
           "replica": body.get("_key"), "replicated_at": body.get("replicated_at"), "bundle": str(bundle)}
    say(log, f"{endpoint} {'served' if started else 'served already'} on {dr.name} ({out['namespace']}) from "
             f"{source} at {url}")
    return out


def stop_on_dr(estate: Any, dr: Any, endpoint: str) -> bool:
    """Remove the DR pool's InferenceService, or Deployments and Service, of ``endpoint``; whether any was there."""
    target = dr_target(estate, dr, endpoint)
    if estate.pipeline.serving.kubernetes.kind == "kserve":
        return bool(target.api.delete())
    hook, ns = target.rollout.hook, target.rollout.pool.namespace
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


# --- the takeover record ------------------------------------------------------------------------------

def record_path(state_dir: Any, endpoint: str) -> Path:
    return Path(state_dir).resolve() / "serving" / endpoint / TAKEOVER_FILE


def pool_takeovers(state_dir: Any) -> dict[str, dict[str, Any]]:
    """``{endpoint: record}`` of the endpoints the DR pool serves now."""
    root = Path(state_dir).resolve() / "serving"
    if not root.is_dir():
        return {}
    found = {p.parent.name: read_json(p) for p in sorted(root.glob(f"*/{TAKEOVER_FILE}"))}
    return {e: r for e, r in found.items() if isinstance(r, dict)}


def clear_record(state_dir: Any, endpoint: str) -> None:
    record_path(state_dir, endpoint).unlink(missing_ok=True)


# --- failover -----------------------------------------------------------------------------------------

def served_on_primary(estate: Any) -> dict[str, str | None]:
    """``{endpoint: version}`` of the pool's endpoints, asked of the primary's API server (raises if it
    does not answer)."""
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


def replicated_endpoints(dr: Any, spec: Any) -> dict[str, str | None]:
    """``{endpoint: None}`` of the endpoints with a model in the DR store (``dr.replicate.endpoints`` only, when set)."""
    from hybridflow.storage.objectstore import open_store

    keys = [i.key for i in open_store(spec).list("models/")]
    found = sorted({k.split("/")[1] for k in keys if k.count("/") >= 2})
    wanted = list(dr.dr.replicate.endpoints) if dr.dr is not None else []
    return {e: None for e in found if not wanted or e in wanted}


def _take_over(estate: Any, dr: Any, spec: Any, endpoint: str, version: str | None, scratch: Path,
               state_dir: Any) -> dict[str, Any]:
    from hybridflow.dr.failover.serving import NoReplica

    primary = {"cluster": estate.pipeline.serving.kubernetes.cluster, "version": version}
    try:
        served = start_on_dr(estate, dr, spec, endpoint, version, scratch)
    except NoReplica as exc:
        return {"state": "not moved", "primary": primary, "reason": f"{exc}; serving left as it was"}
    # Anything else (a corrupt manifest, a store error, a full disk, a pool that did not come up) is a
    # failed move: move_each records it as such, so the drain stays incomplete and a rerun retries it.
    path = record_path(state_dir, endpoint)
    standing = read_json(path) or {}
    record = {**served, "endpoint": endpoint, "primary": primary,
              "since": standing.get("since") if not served["started"] and standing else now()}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, record)
    out = {"state": "on dr", "primary": primary, "dr": record}
    return out if served["started"] else {**out, "note": "served on the DR side already"}


def fail_over_pool(cluster_name: str, estate: Any, state_dir: Any, *, dr_spec: Any = None) -> dict[str, Any]:
    """Serve the endpoints of the inference pool on ``cluster_name`` from the DR pool (see the module doc)."""
    from hybridflow.dr.failover.serving import dr_side, dr_store_failed, move_each, serving_cluster

    where, why = serving_cluster(estate)
    if where != cluster_name:
        return {"entry": None, "drained": False, "rule": why, "note": f"no serving entry on {cluster_name}: {why}"}
    k8s = estate.pipeline.serving.kubernetes
    entry = f"inference pool {k8s.namespace} on {cluster_name} ({k8s.kind})"
    try:
        dr, spec, scratch = dr_side(estate, state_dir, dr_spec)
    except Exception as exc:  # noqa: BLE001 - the fence stands; a rerun of the drain retries the store
        return dr_store_failed(entry, why, exc)
    try:
        endpoints, listed = served_on_primary(estate), f"the InferenceServices/Deployments of {k8s.namespace} on " \
                                                        f"{cluster_name}"
    except Exception as exc:  # noqa: BLE001 - a cluster declared down often does not answer
        endpoints = replicated_endpoints(dr, spec)
        listed = (f"the endpoints replicated to the DR store ({cluster_name} did not answer: {type(exc).__name__}; "
                  f"each from its newest replica)")
    base = {"entry": entry, "rule": why, "dr_cluster": dr.name, "endpoints_from": listed}
    try:
        dr_pool(dr)
    except ConfigError as exc:
        reason = f"{exc}; serving left as it was"
        return {**base, "drained": False, "endpoints": {e: {"state": "not moved", "reason": reason} for e in endpoints},
                "note": reason}
    moved = move_each(sorted(endpoints), lambda e: _take_over(estate, dr, spec, e, endpoints[e], scratch, state_dir))
    if not moved:
        return {**base, "drained": False, "endpoints": {}, "note": f"nothing to move: no endpoint in {listed}"}
    return {**base, "drained": all(m["state"] == "on dr" for m in moved.values()), "endpoints": moved}
