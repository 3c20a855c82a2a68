"""The ``cluster_fence`` DAG's task unit: its trigger form does what ``hybridflow cluster down`` and
``hybridflow cluster up`` do (:mod:`hybridflow.dr.fencing.drain`, :mod:`hybridflow.fencing`).

Kept free of Airflow and heavy imports at module level: the DAG file reads :data:`FENCE_PARAMS`
while it is parsed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridflow.fencing import REASON_MAX_CHARS

# Who may trigger the DR DAGs (cluster_fence, dr_drill): the Airflow role granted them through the DAGs'
# access_control (the FAB auth manager syncs it into per-DAG permissions). docs/dr-fencing.md#who-may-declare
DR_OPERATOR_ROLE = "DR operator"
DR_ACCESS_CONTROL: dict[str, dict[str, set[str]]] = {
    DR_OPERATOR_ROLE: {"DAGs": {"can_read", "can_edit"}, "DAG Runs": {"can_read", "can_create"}},
}

FENCE_PARAMS: dict[str, dict[str, Any]] = {
    "action": {
        "default": "down",
        "type": "string",
        "enum": ["down", "up"],
        "title": "Action",
        "description": "down: fence the cluster (no new placements, its running gangs checkpointed and stopped, "
        "the model gateway's endpoints served on the DR side from the replicated models; a primary down puts the "
        "estate in takeover). up: lift the fence (failback); serving moves back only after the primary passes "
        "the deploy gate.",
    },
    "cluster": {
        "default": None,
        "type": ["null", "string"],
        "title": "Cluster",
        "description": "A cluster of config/clusters.yaml; never the disaster-recovery pool (role: dr).",
    },
    "reason": {
        "default": None,
        "type": ["null", "string"],
        "maxLength": REASON_MAX_CHARS,
        "title": "Reason",
        "description": "down: why the cluster is declared down (kept with the fence), e.g. power loss in dc-1; "
        f"at most {REASON_MAX_CHARS} characters.",
    },
}


def fence_task(params: Mapping[str, Any], by: str | None = None) -> dict[str, Any]:
    """Declare ``params["cluster"]`` down or up as ``by`` (the user who triggered the run). Bad input
    fails the task without a retry, naming the Param, and changes nothing."""
    from airflow.sdk.exceptions import AirflowFailException

    from hybridflow.dr.fencing.drain import fence_and_drain
    from hybridflow.dr.fencing.failback import declare_up
    from hybridflow.fencing import FencingError, serving_stayed

    action, cluster = params.get("action"), params.get("cluster")
    if action not in ("down", "up"):
        raise AirflowFailException(f"action: {action!r} is neither 'down' nor 'up'")
    if not cluster:
        raise AirflowFailException("cluster: empty; name a cluster of config/clusters.yaml, e.g. onprem-a")
    reason = params.get("reason") or ""  # its length is capped where every declaration passes (check_down)
    try:
        if action == "down":
            return fence_and_drain(cluster, reason, by=by)
        change = declare_up(cluster, by=by)
    except FencingError as exc:
        raise AirflowFailException(f"cluster {action}: {exc}") from exc
    stayed = serving_stayed(change)
    if stayed:  # the fence is lifted; a rerun retries the serving failback
        raise AirflowFailException(f"cluster up: {cluster} takes placements again, but serving stays on the "
                                   "disaster-recovery side: " + "; ".join(stayed))
    return change.to_dict()
