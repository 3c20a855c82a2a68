"""Serving failback of a Kubernetes deploy target: an endpoint served by the DR cluster's pool
(:mod:`hybridflow.dr.failover.serving_k8s`) goes back to the primary's inference pool only through the deploy gate.

For each endpoint with a takeover record (``state/serving/<endpoint>/takeover-k8s.json``):

- ``kserve``: the primary's InferenceService must be ready with all traffic on its version, answer a
  prediction made from the model's signature from that version at its ``status.url`` (the smoke
  check), then pass :func:`hybridflow.serving.rollout.run_gate` with ``serving.gate``, measured side by
  side with the DR pool's InferenceService that serves now;
- ``deployment``: the primary's stable Deployment must be ready (every pod loaded the bundle and answers
  ``/healthz``). Its Service is in-cluster only and cannot be reached from the machine running the
  failback, so neither a prediction nor the gate's load test is made; ``checked`` says so.

Only then is the DR pool's InferenceService (or Deployments and Service) removed and the record
cleared. Otherwise serving stays on the DR side, the outcome says why, and a later ``up`` tries again.
What routes clients between the two pools (DNS, a load balancer) is outside the estate: the outcome
names both URLs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridflow.dr.failover.serving_k8s import clear_record, pool_takeovers, stop_on_dr
from hybridflow.serving.processes import Log, now


def _primary(estate: Any, endpoint: str, state_dir: Any, log: Log) -> tuple[Any, str]:
    """(what the primary serves, its URL) or ValueError saying why it cannot take serving back."""
    from hybridflow.serving import deploy_target

    k8s = estate.pipeline.serving.kubernetes
    target = deploy_target(estate, endpoint, state_dir=Path(state_dir), log=log)
    try:
        current = target.current()
    except Exception as exc:  # noqa: BLE001 - a cluster still down does not answer
        raise ValueError(f"the API server of {k8s.cluster} did not answer ({type(exc).__name__}: {exc})") from exc
    kind = "InferenceService" if k8s.kind == "kserve" else "Deployment"
    if current is None:
        raise ValueError(f"{k8s.cluster} has no {kind} {k8s.namespace}/{endpoint}; deploy the endpoint there first")
    detail = current.detail
    if not detail.get("ready") or detail.get("canary") is not None:
        raise ValueError(f"the {kind} {k8s.namespace}/{endpoint} on {k8s.cluster} is not ready with all traffic on "
                         f"{current.version}")
    if k8s.kind == "kserve":
        return current, str(detail.get("url"))
    return current, target.where["endpoint_url"]


def _checks(estate: Any, endpoint: str, record: dict[str, Any], state_dir: Any,
            log: Log) -> tuple[dict[str, Any], str | None]:
    """(what was checked of the primary, why it cannot take serving back or None)."""
    from hybridflow.serving.checks import StepFailed, predict
    from hybridflow.serving.rollout import run_gate

    try:
        current, url = _primary(estate, endpoint, state_dir, log)
    except ValueError as exc:
        return {}, str(exc)
    version = str(current.version)
    out: dict[str, Any] = {"primary": {"cluster": estate.pipeline.serving.kubernetes.cluster, "version": version,
                                       "url": url}}
    if estate.pipeline.serving.kubernetes.kind != "kserve":
        return {**out, "checked": "readiness of the primary's stable Deployment (its in-cluster Service cannot be "
                                  "reached from here: no prediction, no gate)"}, None
    try:
        from hybridflow.serving.takeover import probe_rows

        rows = probe_rows(Path(record["bundle"]))
        predict(url, endpoint, rows, version)
    except (StepFailed, OSError, ValueError, KeyError) as exc:
        return out, f"the primary's version {version} at {url} did not answer the smoke check: {exc}"
    gate, _, _ = run_gate(url, record["url"], endpoint, rows, estate.pipeline.serving.gate, version=version,
                          serving_version=f"{record.get('version')} on {record.get('cluster')}", log=log)
    out.update(checked="readiness, one prediction and the gate side by side with the DR pool", gate=gate)
    if not gate["passed"]:
        return out, "the gate: " + "; ".join(gate["reasons"])
    return out, None


def _fail_back_endpoint(estate: Any, endpoint: str, record: dict[str, Any], state_dir: Any,
                        log: Log) -> dict[str, Any]:
    checked, failed = _checks(estate, endpoint, record, state_dir, log)
    dr = {k: record.get(k) for k in ("cluster", "namespace", "version", "url", "source")}
    out = {**checked, "dr": dr, "at": now()}
    if failed:
        return {**out, "state": "on dr", "reason": f"{failed}; serving stays on the DR side until a later "
                                                   f"`hybridflow cluster up` passes"}
    cluster = estate.clusters.get(str(record.get("cluster")))
    try:
        stopped = stop_on_dr(estate, cluster, endpoint) if cluster is not None else False
    except Exception as exc:  # noqa: BLE001 - the primary serves; what is left on the DR pool is named
        return {**out, "state": "on dr", "reason": f"the primary passed, but the DR pool's {endpoint} on "
                                                   f"{record.get('cluster')} could not be removed ({exc}); a "
                                                   f"later `hybridflow cluster up` tries again"}
    clear_record(state_dir, endpoint)
    return {**out, "state": "on primary", "dr_stopped": stopped}


def fail_back_pool(cluster_name: str, estate: Any, state_dir: Any, *, log: Log = None) -> dict[str, Any] | None:
    """Move every endpoint the DR pool serves for ``cluster_name`` back through the checks; None when
    nothing serves there for it. ``moved_back`` False: at least one endpoint stays on DR."""
    k8s = estate.pipeline.serving.kubernetes
    taken = pool_takeovers(state_dir) if k8s is not None and k8s.cluster == cluster_name else {}
    if not taken:
        return None
    endpoints = {e: _fail_back_endpoint(estate, e, r, state_dir, log) for e, r in sorted(taken.items())}
    return {"moved_back": all(o["state"] == "on primary" for o in endpoints.values()), "endpoints": endpoints}
