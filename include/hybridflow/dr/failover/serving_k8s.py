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

from pathlib import Path
from typing import Any

from hybridflow.errors import ConfigError
from hybridflow.serving.processes import now, read_json, say, write_json
from hybridflow.serving.takeover import dr_pool, pool_target

TAKEOVER_FILE = "takeover-k8s.json"

__all__ = ["dr_pool", "dr_target", "fail_over_pool", "pool_takeovers", "start_on_dr", "stop_on_dr"]


def dr_target(estate: Any, dr: Any, endpoint: str, *, log: Any = None) -> Any:
    """The deploy target of ``endpoint`` on the DR cluster's pool (:func:`hybridflow.serving.takeover.pool_target`)."""
    return pool_target(estate, dr, endpoint, log=log)


def start_on_dr(estate: Any, dr: Any, spec: Any, endpoint: str, version: str | None, scratch: Path, *,
                log: Any = None) -> dict[str, Any]:
    """Serve ``endpoint`` on the DR pool from its replica (``version`` when replicated, else the newest);
    NoReplica when none is, DeploymentError when it does not come up (see the module doc)."""
    from hybridflow.dr.failover.serving import fetch_replica

    target = dr_target(estate, dr, endpoint, log=log)  # a DR cluster that cannot serve fails before the fetch
    body, bundle, source = fetch_replica(spec, endpoint, version, Path(scratch) / endpoint)
    chosen = str(body["version"])
    url, prediction, started = target.take_over(chosen, bundle)
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
    return dr_target(estate, dr, endpoint).remove()


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
    from hybridflow.serving.takeover import served_versions

    return served_versions(estate)


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
