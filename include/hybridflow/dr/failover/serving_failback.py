"""Serving failback of the local deploy target (a Kubernetes target's pool:
:mod:`hybridflow.dr.failover.serving_k8s_failback`): an endpoint served on the disaster-recovery side
(:mod:`hybridflow.dr.failover.serving`) goes back to the primary's serving version only through the
deploy gate.

For each endpoint whose ``active.json`` has a ``takeover`` entry: the primary's version (the stable
``version``/``url`` the entry stands in front of) must answer a prediction from its own version (the
smoke check), then pass :func:`hybridflow.serving.rollout.run_gate` with ``serving.gate``, measured
side by side with the DR-side server that serves now. Only then is the ``takeover`` entry removed (the
gateway routes to the primary again) and the DR-side server stopped. Otherwise serving stays on the
DR side, and the outcome names the failed check and the gate's figures; a later ``up`` tries again.

The load rows are one instance made from the model's signature (each column at its minimum): the
failback has no held-out data, and the gate judges latency, throughput and errors, not accuracy.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from hybridflow.dr.failover.serving import TAKEOVER, serving_cluster, stop_server, takeovers
from hybridflow.serving.processes import Log, now


def _rows(entry: dict[str, Any]) -> list[list[Any]]:
    from hybridflow.serving.takeover import probe_rows

    return probe_rows(Path(entry["bundle"]))


def _gate(edir: Path, active: dict[str, Any], gate: Any, log: Log) -> tuple[dict[str, Any] | None, str | None]:
    """(the gate's outcome or None, why the primary cannot take serving back or None)."""
    from hybridflow.serving.checks import StepFailed, predict
    from hybridflow.serving.rollout import run_gate

    endpoint, dr = edir.name, active[TAKEOVER]
    version, url = active.get("version"), active.get("url")
    try:
        rows = _rows(dr)
        predict(url, endpoint, rows, str(version))
    except (StepFailed, OSError, ValueError, KeyError) as exc:
        return None, f"the primary's version {version} at {url} did not answer the smoke check: {exc}"
    outcome, _, _ = run_gate(url, dr["url"], endpoint, rows, gate, version=str(version),
                             serving_version=f"{dr['version']} on {dr.get('cluster')}", log=log)
    if not outcome["passed"]:
        return outcome, "the gate: " + "; ".join(outcome["reasons"])
    return outcome, None


def _fail_back_endpoint(edir: Path, serving: Any, log: Log) -> dict[str, Any]:
    from hybridflow.serving.takeover import DRAIN_S, hand_back_locally

    def judge(active: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        dr = active[TAKEOVER]
        outcome, failed = _gate(edir, active, serving.gate, log)
        out = {"primary": {"version": active.get("version"), "url": active.get("url")},
               "dr": {k: dr.get(k) for k in ("cluster", "version", "url", "pid", "source")}, "gate": outcome,
               "at": now()}
        if failed:
            return {**out, "state": "on dr", "reason": f"{failed}; serving stays on the DR side until a later "
                                                       f"`hybridflow cluster up` passes"}, False
        return out, True

    active, out = hand_back_locally(edir, judge)
    if active is None:
        return {"state": "on primary", "note": "moved back already"}
    if out.get("state") == "on dr":
        return out
    time.sleep(DRAIN_S)  # requests already forwarded to the DR side finish first
    return {**out, "state": "on primary", "dr_stopped": stop_server(edir, active[TAKEOVER])}


def fail_back(cluster_name: str, estate: Any, state_dir: Any, *, log: Log = None) -> dict[str, Any] | None:
    """Move every endpoint served on the DR side for ``cluster_name`` back through the gate; None
    when nothing serves there for it. ``moved_back`` False: at least one endpoint stays on DR. An
    inference pool of a Kubernetes target: :mod:`hybridflow.dr.failover.serving_k8s_failback`."""
    from hybridflow.serving import target_name

    if target_name(estate.pipeline.serving) != "local" and estate.pipeline.serving.kubernetes is not None:
        from hybridflow.dr.failover.serving_k8s_failback import fail_back_pool

        return fail_back_pool(cluster_name, estate, state_dir, log=log)
    where, _ = serving_cluster(estate)
    taken = takeovers(state_dir) if where == cluster_name else {}
    if not taken:
        return None
    root = Path(state_dir).resolve() / "serving"
    endpoints = {e: _fail_back_endpoint(root / e, estate.pipeline.serving, log) for e in taken}
    return {"moved_back": all(o["state"] == "on primary" for o in endpoints.values()), "endpoints": endpoints}
