"""A cluster declared up again (failback): what it served on the disaster-recovery side moves back
only through the deploy gate, then its fence is lifted and placement uses it again."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from hybridflow.fencing import (
    FenceChange,
    FencingError,
    down_clusters,
    estate_or_loaded,
    lift_fence,
    state_path,
)


def declare_up(cluster: str, *, by: str | None = None, estate: Any = None, path: Path | None = None,
               now: datetime | None = None, log: Any = None) -> FenceChange:
    """Lift the fence of ``cluster``. Idempotent: a cluster that is not down changes nothing. Endpoints
    served on the DR side for it move back only through the deploy gate
    (:func:`hybridflow.dr.failover.serving_failback.fail_back`, also tried when the cluster is up already);
    the record's ``serving`` says what moved and what stays, and why."""
    from hybridflow.dr.failover.serving_failback import fail_back

    estate = estate_or_loaded(estate)
    path = path or state_path()
    if cluster not in estate.clusters and cluster not in down_clusters(path):
        raise FencingError(f"cluster {cluster!r} is not in clusters.yaml; use one of: {', '.join(sorted(estate.clusters))}")
    serving = fail_back(cluster, estate, path.parent, log=log) if cluster in estate.clusters else None
    return lift_fence(cluster, serving, by=by, path=path, now=now)
