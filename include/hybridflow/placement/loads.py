"""What placement decides on, read now: every cluster's load as its gang backend reports it, the GPUs
each team holds, and each cluster's expected wait for a run with ``start_by``."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from hybridflow.settings import Settings

log = logging.getLogger(__name__)


def cluster_loads(estate, settings: Settings) -> dict:
    """Every cluster's GPUs in use, queued and held per team, as its backend reports them."""
    from hybridflow.backends import estate_load

    return estate_load(estate, settings.state_dir)


def team_usage(estate, settings: Settings) -> dict[str, int]:
    """GPUs each team's gangs hold right now, across the estate."""
    from hybridflow.backends import team_usage as held

    return held(cluster_loads(estate, settings))


def wait_estimates(run, estate, loads: Mapping[str, Any]) -> dict | None:
    """Each cluster's expected wait for the run's gang, for a run with ``start_by`` (None otherwise)."""
    if not run.start_by_s:
        return None
    from hybridflow.ledger.queue_waits import queue_wait_history
    from hybridflow.waits import estimate_waits

    cfg = estate.pipeline.placement
    try:
        history = queue_wait_history(days=cfg.wait_history_days, clusters=list(loads))
    except Exception as exc:  # noqa: BLE001 - no ledger: estimates from the clusters' load alone
        log.warning("queue wait history unavailable (%s); estimating from the clusters' load only", exc)
        history = []
    return estimate_waits(history, loads, run.workers, quantile=cfg.wait_quantile, min_samples=cfg.wait_min_samples,
                          days=cfg.wait_history_days)


def place_elsewhere(admitted, placement: Mapping[str, Any], cluster: str, reason: str, estate, settings: Settings):
    """Place a waiting gang again on a cluster that would admit it now, without ``cluster`` (why:
    ``reason``) and every cluster it already left; PlacementError when none would."""
    from hybridflow.placement.rules import place

    excluded = {f["cluster"]: f["reason"] for f in placement.get("failovers", [])}
    excluded[cluster] = reason
    return place(admitted, estate, cluster_loads(estate, settings), exclude=excluded, require_room=True)
