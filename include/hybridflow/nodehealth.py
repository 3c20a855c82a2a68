"""Node health: turn metering's per-node findings into cordons, taints and gang restarts.

Policy (one place, so the metering DAG and operators agree):

- a non-zero Xid or any uncorrectable (double-bit) ECC error marks the node unhealthy at once:
  the GPU has faulted and the work on it is already suspect. Xids come from the exporter's last-Xid
  gauge (``DCGM_FI_DEV_XID_ERRORS``) and from its per-Xid counts over a window
  (``DCGM_EXP_XID_ERRORS_COUNT``, also read as ``DCGM_FI_DEV_XID_ERRORS_ACTIVE``); the finding's
  ``detail`` names the counted ones;
- a failed health probe (exporter did not answer) marks it unhealthy only on the second pass in a
  row: one missed scrape is usually the network or a restarting exporter, not the GPU;
- correctable (single-bit) ECC errors are reported but not acted on.

Probe streaks live in a small JSON state file (``<HYBRIDFLOW_HOME>/state/nodehealth.json``),
locked while read and written, because each cluster is metered by its own task. An unhealthy node
stays unhealthy here until an operator restores it (``hybridflow node restore <cluster> <node>``:
:func:`restore_node` uncordons it and clears the mark).

On a ``kubernetes`` cluster an unhealthy node is cordoned (``spec.unschedulable``), tainted
``hybridflow.io/gpu-unhealthy=<reason>:NoSchedule`` and every gang with a pod on it is restarted as a
whole (all its pods deleted: Volcano's PodEvicted -> RestartJob policy, or the Job controller for a
Kueue-managed Job, recreates them away from the cordoned node). On a ``local`` cluster the decision
is only logged and recorded.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hybridflow.backends import node_actions
from hybridflow.metering.collect import NodeFinding

__all__ = ["NodeFinding", "NodeDecision", "decide", "report_findings", "clear_node", "restore_node",
           "PROBE_FAILURES_TO_CORDON"]

log = logging.getLogger(__name__)

STATE_FILE = "nodehealth.json"
PROBE_FAILURES_TO_CORDON = 2


@dataclass(frozen=True)
class NodeDecision:
    """What node health concluded for one node in one pass."""

    cluster: str
    node: str
    unhealthy: bool
    reason: str  # taint value: xid-79, ecc-dbe, probe-failed, or "" when healthy
    probe_fail_streak: int
    newly_unhealthy: bool  # first pass that found it unhealthy: act now
    actions: tuple[str, ...] = ()


def _reason(finding: NodeFinding, streak: int) -> str:
    if finding.xid_codes:
        return "xid-" + "-".join(str(c) for c in finding.xid_codes)
    if finding.ecc_dbe:
        return "ecc-dbe"
    if streak >= PROBE_FAILURES_TO_CORDON:
        return "probe-failed"
    return ""


def decide(finding: NodeFinding, previous: dict | None) -> tuple[NodeDecision, dict]:
    """Pure policy: the decision for ``finding`` given the node's previous state, and its new state."""
    previous = previous or {}
    streak = 0 if finding.probe_ok else int(previous.get("probe_fail_streak", 0)) + 1
    reason = _reason(finding, streak)
    was_unhealthy = bool(previous.get("unhealthy"))
    unhealthy = was_unhealthy or bool(reason)
    state = {
        "probe_fail_streak": streak,
        "unhealthy": unhealthy,
        "reason": previous.get("reason", "") if was_unhealthy else reason,
        "actioned": bool(previous.get("actioned")) if was_unhealthy else False,
        "since": previous.get("since"),
        "last": asdict(finding),
    }
    decision = NodeDecision(finding.cluster, finding.node, unhealthy, state["reason"], streak,
                            newly_unhealthy=unhealthy and not was_unhealthy)
    return decision, state


# --- state file --------------------------------------------------------------------------------


def _state_path() -> Path:
    from hybridflow.settings import get_settings

    return get_settings().state_dir / STATE_FILE


@contextmanager
def _locked_state(path: Path) -> Iterator[dict]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            state = json.loads(path.read_text()) if path.exists() and path.stat().st_size else {}
            yield state
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
            os.replace(tmp, path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_state(path: Path | None = None) -> dict:
    """{cluster: {node: state}} as last written."""
    path = path or _state_path()
    return json.loads(path.read_text()) if path.exists() and path.stat().st_size else {}


def clear_node(cluster: str, node: str, *, state_path: Path | None = None) -> bool:
    """Forget a node's unhealthy mark (after it was repaired and uncordoned). True if it was known."""
    with _locked_state(state_path or _state_path()) as state:
        return state.get(cluster, {}).pop(node, None) is not None


# --- Kubernetes actions ------------------------------------------------------------------------

def _default_hook(conn_id: str) -> Any:
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    return KubernetesHook(conn_id=conn_id)


def restore_node(cluster_name: str, node: str, *, estate: Any = None, state_path: Path | None = None,
                 hook_factory: Callable[[str], Any] = _default_hook) -> list[str]:
    """An operator's "this node is repaired": uncordon it on a kubernetes cluster, then forget its
    unhealthy mark so node health judges it afresh. The mark stays if the API call fails."""
    if estate is None:
        from hybridflow.config import load_estate
        from hybridflow.settings import get_settings

        estate = load_estate(get_settings().config_dir)
    cluster = estate.clusters.get(cluster_name)
    if cluster is None:
        raise ValueError(f"cluster {cluster_name!r} is not in clusters.yaml; use one of: {', '.join(sorted(estate.clusters))}")
    done = []
    actions = node_actions(cluster, hook_factory)
    if actions is not None:
        done += actions.uncordon(node)
    known = clear_node(cluster_name, node, state_path=state_path)
    return done + [f"cleared the unhealthy mark of {cluster_name}/{node}" if known
                   else f"{cluster_name}/{node} had no unhealthy mark"]


# --- intake ------------------------------------------------------------------------------------


def report_findings(
    findings: Iterable[NodeFinding],
    *,
    estate: Any = None,
    state_path: Path | None = None,
    hook_factory: Callable[[str], Any] = _default_hook,
    now: datetime | None = None,
) -> list[NodeDecision]:
    """Apply the policy to one pass's findings, act on newly unhealthy nodes, and return the decisions.

    A node whose action failed (API down) keeps ``actioned: false`` and is acted on again next pass.
    """
    if estate is None:
        from hybridflow.config import load_estate
        from hybridflow.settings import get_settings

        estate = load_estate(get_settings().config_dir)
    stamp = (now or datetime.now(UTC)).isoformat()
    decisions: list[NodeDecision] = []
    hooks: dict[str, Any] = {}
    with _locked_state(state_path or _state_path()) as state:
        for finding in findings:
            nodes = state.setdefault(finding.cluster, {})
            decision, node_state = decide(finding, nodes.get(finding.node))
            if decision.newly_unhealthy:
                node_state["since"] = stamp
            nodes[finding.node] = node_state
            if decision.unhealthy and not node_state["actioned"]:
                actions = _act(estate, finding.cluster, finding.node, decision.reason, hook_factory, hooks)
                node_state["actioned"] = actions is not None
                node_state["actions"] = actions or []
                decision = NodeDecision(**{**asdict(decision), "actions": tuple(actions or ())})
            elif not finding.probe_ok:
                log.info("node %s/%s: probe failed (%d in a row; %d cordon it)", finding.cluster, finding.node,
                         decision.probe_fail_streak, PROBE_FAILURES_TO_CORDON)
            decisions.append(decision)
    return decisions


def _act(estate: Any, cluster_name: str, node: str, reason: str, hook_factory: Callable[[str], Any],
         hooks: dict[str, Any]) -> list[str] | None:
    cluster = estate.clusters.get(cluster_name)
    if cluster is None or not cluster.runs_pods:
        # Local clusters have no scheduler to steer: the decision is the record.
        log.warning("node %s/%s is unhealthy (%s); recorded (no cordon on a %s cluster)", cluster_name, node,
                    reason, "unknown" if cluster is None else cluster.backend)
        return ["recorded"]
    try:
        if cluster_name not in hooks:
            hooks[cluster_name] = node_actions(cluster, hook_factory)
        actions = hooks[cluster_name]
        done = actions.cordon(node, reason) + actions.restart_gangs_on(node)
    except Exception as exc:  # noqa: BLE001 - the API may be down; retry the action on the next pass
        log.error("node %s/%s is unhealthy (%s) but could not be cordoned: %s; retrying next pass",
                  cluster_name, node, reason, exc)
        return None
    log.warning("node %s/%s is unhealthy (%s): %s", cluster_name, node, reason, "; ".join(done))
    return done
