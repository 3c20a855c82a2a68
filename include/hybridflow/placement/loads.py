"""What placement decides on, read now: every cluster's load as its gang backend reports it, the GPUs
each team holds, and each cluster's expected wait for a run with ``start_by``
(:func:`hybridflow.placement.decide.decide` reads them)."""

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
