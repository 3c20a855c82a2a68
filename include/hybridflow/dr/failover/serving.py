"""Serving failover: a cluster declared down that hosts serving has each endpoint moved to the
disaster-recovery side. This module does it for the local deploy target (the model gateway's
endpoints); an inference pool of a Kubernetes target moves to the DR cluster's own pool
(:mod:`hybridflow.dr.failover.serving_k8s`).

**Which cluster hosts serving.** On a Kubernetes target (``kubernetes``, ``kserve``) the inference
pool's ``serving.kubernetes.cluster``. On the local target the model servers behind the gateway stand
for the estate's one private ``role: primary`` cluster; with none or several, no cluster is named and
nothing is moved (the outcome says why).

**Failover** (:func:`fail_over`, run by the drain of ``hybridflow cluster down``). For every endpoint
whose ``active.json`` names a backend: the active version's replica in the DR store, or the newest
replicated version when the active one is not replicated (``source`` says which), is fetched and
verified against its manifest onto the DR cluster's scratch, started with the project's model server
(detached, so it outlives the command), and checked with one prediction made from the model's
signature. Only then does ``active.json`` get a ``takeover`` entry (``version``, ``url``, ``pid``,
``cluster``, ...), which the gateway routes every request to, ahead of the stable version and any
canary. With no replica, the outcome says so and routing is left as it is. An endpoint whose takeover
server answers already starts nothing. Any other error moving an endpoint is that endpoint's outcome
(``state`` ``failed``); the others are moved all the same (:func:`move_each`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from hybridflow.serving.takeover import TAKEOVER  # the active.json entry of a takeover

log = logging.getLogger(__name__)


class NoReplica(Exception):
    """No verified replica of the endpoint's model is in the DR store."""


def serving_cluster(estate: Any) -> tuple[str | None, str]:
    """(the cluster whose outage takes serving with it, or None; how it was chosen)."""
    from hybridflow.serving import target_name

    serving = estate.pipeline.serving
    target = target_name(serving)
    if target != "local":
        pool = serving.kubernetes
        if pool is None:
            return None, f"serving.target {target} names no serving.kubernetes.cluster"
        return pool.cluster, f"the inference pool ({target}) runs on serving.kubernetes.cluster {pool.cluster}"
    primaries = sorted(n for n, c in estate.clusters.items() if c.role == "primary" and c.location == "private")
    if len(primaries) != 1:
        return None, (f"the model gateway (serving.target local) stands for the one private role: primary cluster, "
                      f"and clusters.yaml has {len(primaries)} ({', '.join(primaries) or 'none'})")
    return primaries[0], f"the model gateway (serving.target local) serves for the private primary {primaries[0]}"


def endpoints_served(root: Path) -> list[str]:
    """Endpoints of the gateway under ``root`` whose active.json names a backend URL."""
    from hybridflow.serving.takeover import local_endpoints

    return local_endpoints(root)


def fetch_replica(spec: Any, endpoint: str, version: str | None, dest: Path) -> tuple[dict[str, Any], Path, str]:
    """(the replica's manifest, the bundle fetched and verified into ``dest``, which version and why):
    ``version`` when it is replicated, else the newest replicated one."""
    from hybridflow.dr.drills.replicas import fetch_bundle, model_manifests
    from hybridflow.storage.objectstore import open_store

    store = open_store(spec)
    manifests = model_manifests(store, endpoint)
    if not manifests:
        raise NoReplica(f"no model of {endpoint} is replicated to the DR store {store.uri}; run dr_replication")
    same = [m for m in manifests if str(m.get("version")) == str(version)]
    body = same[0] if same else manifests[0]
    chosen = str(body["version"])
    if same:
        source = f"the active version {chosen}, replicated"
    elif version is None:
        source = f"the newest replicated version {chosen} (the version served could not be asked)"
    else:
        source = f"the newest replicated version {chosen} (the active version {version} is not replicated)"

    bundle = dest / chosen
    try:
        fetch_bundle(store, body, bundle)
    except ValueError as exc:
        raise NoReplica(str(exc)) from exc
    return body, bundle, source


def move_each(endpoints: Iterable[str], move: Callable[[str], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{endpoint: move(endpoint)}``, each endpoint on its own: an error moving one (a corrupt DR
    manifest, a store error, a full disk) becomes its outcome, ``state`` ``failed`` with the error,
    and the others are still moved. The drain then fails naming it (a rerun moves it)."""
    moved: dict[str, dict[str, Any]] = {}
    for endpoint in endpoints:
        try:
            moved[endpoint] = move(endpoint)
        except Exception as exc:  # noqa: BLE001 - one endpoint's failure must not keep the others on the primary
            log.exception("serving failover of %s failed", endpoint)
            moved[endpoint] = {"state": "failed", "error": f"{type(exc).__name__}: {exc}",
                               "reason": "the failover failed; serving left as it was until the drain is run again"}
    return moved


def stop_server(edir: Path, entry: dict[str, Any]) -> bool:
    """Stop the takeover server ``entry`` names, if that pid is still the server started for it."""
    from hybridflow.serving.takeover import stop_local_server

    return stop_local_server(edir, entry)


def _take_over(edir: Path, dr: Any, spec: Any, scratch: Path, settings: Any) -> dict[str, Any]:
    """Move one endpoint to the DR side: the active version's replica (else the newest), served there."""
    from hybridflow.serving.takeover import answering, local_active, take_over_locally

    endpoint = edir.name
    active = local_active(edir)
    primary = {"version": active.get("version"), "url": active.get("url"), "pid": active.get("pid")}
    if answering(active.get(TAKEOVER), endpoint):
        return {"state": "on dr", "primary": primary, "dr": active[TAKEOVER], "note": "served on the DR side already"}
    try:
        body, bundle, source = fetch_replica(spec, endpoint, active.get("version"), scratch / endpoint)
    except NoReplica as exc:
        return {"state": "not moved", "primary": primary, "reason": f"{exc}; serving left as it was"}
    record = {"model": body.get("model"), "source": source, "replica": body["_key"],
              "replicated_at": body.get("replicated_at")}
    served = take_over_locally(edir, str(body["version"]), bundle, settings, cluster=dr.name, record=record)
    out = {"state": "on dr", "primary": served["primary"], "dr": served["dr"]}
    return out if served["started"] else {**out, "note": "served on the DR side already"}


def fail_over(cluster_name: str, estate: Any, state_dir: Any, *, dr_spec: Any = None) -> dict[str, Any]:
    """Drain the serving entry of ``cluster_name`` to the DR side (see the module doc); the outcome
    kept with the fence as its drain's ``serving``."""
    from hybridflow.dr.fencing.drain import serving_on
    from hybridflow.serving import target_name

    serving = estate.pipeline.serving
    if target_name(serving) != "local":
        if serving.kubernetes is None:
            return serving_on(cluster_name, estate)
        from hybridflow.dr.failover.serving_k8s import fail_over_pool

        return fail_over_pool(cluster_name, estate, state_dir, dr_spec=dr_spec)
    where, why = serving_cluster(estate)
    if where != cluster_name:
        return {"entry": None, "drained": False, "rule": why, "note": f"no serving entry on {cluster_name}: {why}"}
    root = Path(state_dir).resolve() / "serving"
    entry = f"the model gateway on 127.0.0.1:{serving.port}"
    endpoints = endpoints_served(root)
    if not endpoints:
        return {"entry": None, "drained": False, "rule": why, "endpoints": {},
                "note": f"no serving entry on {cluster_name}: no endpoint of the model gateway (serving.target local) "
                        "names a backend; nothing to move"}
    try:
        dr, spec, scratch = dr_side(estate, state_dir, dr_spec)
    except Exception as exc:  # noqa: BLE001 - the fence stands; a rerun of the drain retries the store
        return dr_store_failed(entry, why, exc)
    moved = move_each(endpoints, lambda e: _take_over(root / e, dr, spec, scratch, serving))
    return {"entry": entry, "drained": all(m["state"] == "on dr" for m in moved.values()), "rule": why,
            "dr_cluster": dr.name, "endpoints": moved}


def dr_store_failed(entry: str, rule: str, exc: Exception) -> dict[str, Any]:
    """The serving part of a drain whose DR store could not be opened: failed, so it is run again."""
    error = f"the DR store cannot be opened ({type(exc).__name__}: {exc})"
    return {"entry": entry, "drained": False, "rule": rule, "endpoints": {}, "failed": True, "error": error,
            "note": f"serving left as it was: {error}"}


def dr_side(estate: Any, state_dir: Any, dr_spec: Any) -> tuple[Any, Any, Path]:
    """(the DR cluster, its store, where replicas are fetched to: its scratch's ``serving`` folder)."""
    from hybridflow.dr.replication.scope import dr_cluster
    from hybridflow.placement.places import cache_store_spec, scratch_root
    from hybridflow.settings import Settings

    dr = dr_cluster(estate)
    spec = dr_spec if dr_spec is not None else cache_store_spec(dr)
    home = Settings(home=Path(state_dir).resolve().parent, config_dir=Path("."))  # state_dir is <home>/state
    return dr, spec, scratch_root(dr, home) / "serving"


def takeovers(state_dir: Any) -> dict[str, dict[str, Any]]:
    """``{endpoint: active.json}`` of the endpoints served on the DR side now."""
    from hybridflow.serving.takeover import local_takeovers

    return local_takeovers(Path(state_dir).resolve() / "serving")
