"""A gang not admitted in time moves: the run is placed again on another eligible cluster that would
admit it now, its data staged there, and both recorded in the run's placement.json, which the run's
page shows and a retried train task resumes from."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from hybridflow.runs import run_dir, write_json_atomic
from hybridflow.settings import Settings, get_settings

log = logging.getLogger(__name__)

PLACEMENT_FILE = "placement.json"


def fail_over(
    run: Mapping[str, Any], placement: Mapping[str, Any], cluster: str, reason: str, settings: Settings | None = None
) -> tuple[dict, dict] | None:
    """Move a gang that waited ``reason`` on ``cluster`` to another eligible cluster that would admit
    it now: place the run again without ``cluster`` (and every cluster it already left), stage its
    data there, and record both in placement.json (the run's page shows the move and a retried train
    task resumes there). Returns (placement, staged), or None when no eligible cluster has room now:
    the gang keeps its place in ``cluster``'s queue."""
    from hybridflow.config import load_estate
    from hybridflow.errors import PlacementError
    from hybridflow.placement.decide import decide
    from hybridflow.placement.stage import stage_data
    from hybridflow.request import AdmittedRun

    settings = settings or get_settings()
    estate = load_estate(settings.config_dir)
    leaving = {f["cluster"]: f["reason"] for f in placement.get("failovers", [])} | {cluster: reason}
    try:
        decision = decide(AdmittedRun.from_xcom(dict(run)), estate, settings, leaving=leaving)
    except PlacementError as exc:
        log.info("No other eligible cluster would admit the gang now; it keeps its place on %s:\n%s", cluster, exc)
        return None
    log.warning("Moving from %s (%s):\n%s", cluster, reason, decision.explain())
    out = decision.to_xcom()
    staged = stage_data(run, out, settings)
    out["staged_source"] = staged["source"]
    write_json_atomic(run_dir(settings.private_root, run["run_key"]) / PLACEMENT_FILE, out)
    return out, staged


def current_placement(run: Mapping[str, Any], placement: Mapping[str, Any], staged: Mapping[str, Any],
                      settings: Settings | None = None) -> tuple[dict, dict]:
    """The placement the train task works on: the placement step's, unless a failover since replaced
    it (placement.json with failovers; a re-run placement step rewrites that file without them)."""
    settings = settings or get_settings()
    path = run_dir(settings.private_root, run["run_key"]) / PLACEMENT_FILE
    try:
        recorded = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return dict(placement), dict(staged)
    if recorded.get("failovers") and recorded.get("staged_source"):
        return recorded, {"source": recorded["staged_source"]}
    return dict(placement), dict(staged)
