"""A gang not admitted in time moves: the run is placed again on another eligible cluster that would
admit it now and its data staged there (:func:`fail_over`; the run's page shows the move from
placement.json). A retried train task resumes where the run's newest checkpoint was committed
(:func:`resume_placement`), which is where an earlier try moved it."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
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
    data there, and note the move in placement.json for the run's page. Returns (placement, staged), or None when no eligible cluster has room now:
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
    carry_checkpoint(run, decision.cluster, estate, settings)
    out = decision.to_xcom()
    staged = stage_data(run, out, settings)
    out["staged_source"] = staged["source"]
    write_json_atomic(run_dir(settings.private_root, run["run_key"]) / PLACEMENT_FILE, out)
    return out, staged


def resume_placement(run: Mapping[str, Any], placement: Mapping[str, Any], staged: Mapping[str, Any], estate,
                     settings: Settings | None = None) -> tuple[dict, dict]:
    """The placement a train task works on: the placement step's (its XCom), unless the run's newest
    checkpoint was committed on another cluster after that placement was decided: an earlier try of
    the task moved the gang there (:func:`fail_over`). Then the run is placed on that cluster again
    (if the rules still allow it there) and its data staged there, so the retry resumes where the work is.

    The checkpoints are the record of where the run trained: Airflow clears a task's own XComs when a
    new try starts, and a copy of the move kept elsewhere would be a second channel that can go stale
    (a re-run placement step decides afresh: its decision is newer than every checkpoint)."""
    from hybridflow.errors import PlacementError
    from hybridflow.placement.decide import decide
    from hybridflow.placement.stage import stage_data
    from hybridflow.request import AdmittedRun

    settings = settings or get_settings()
    decided_at = float(placement.get("decided_at") or 0)
    newest = newest_checkpoint(run, estate, settings) if decided_at else None
    if newest is None or newest.cluster == placement["cluster"] or newest.committed_at <= decided_at:
        return dict(placement), dict(staged)
    why = f"its newest checkpoint (step {newest.step}, {newest.uri}) was committed there by an earlier try"
    try:
        decision = decide(AdmittedRun.from_xcom(dict(run)), estate, settings, resume_on=(newest.cluster, why))
    except PlacementError as exc:
        log.warning("The run's newest checkpoint is on %s, where it cannot be placed now; training on %s:\n%s",
                    newest.cluster, placement["cluster"], exc)
        return dict(placement), dict(staged)
    log.warning("Resuming on %s, not %s: %s", newest.cluster, placement["cluster"], why)
    out = {**decision.to_xcom(), "failovers": [{"cluster": placement["cluster"], "reason": why}]}
    moved = stage_data(run, out, settings)
    out["staged_source"] = moved["source"]
    # For the run's page (hybridflow.ui.runs), as a move is shown; never read back.
    write_json_atomic(run_dir(settings.private_root, run["run_key"]) / PLACEMENT_FILE, out)
    return out, moved


@dataclass(frozen=True)
class NewestCheckpoint:
    cluster: str  # where the gang that committed it ran
    step: int
    committed_at: float  # epoch, the manifest's time
    uri: str
    spec: Any = field(default=None, compare=False)  # the place it is in (a StoreSpec)


def carry_checkpoint(run: Mapping[str, Any], cluster_name: str, estate, settings: Settings) -> int | None:
    """Copy the run's newest checkpoint into ``cluster_name``'s primary checkpoint place when neither
    of that cluster's places holds it (a gang that trained elsewhere, then moved or failed over, with
    its checkpoints in that cluster's bucket): its gang there resumes from it instead of step 0. The
    copy is verified as it is read and names ``cluster_name`` as where it now is. The step copied;
    None when there was nothing to copy or it could not be read (the gang then starts afresh)."""
    from hybridflow.placement.places import checkpoint_replica_spec, checkpoint_store_spec
    from hybridflow.storage.objectstore import open_store
    from hybridflow.training.checkpoint import CheckpointStore

    newest = newest_checkpoint(run, estate, settings)
    if newest is None or newest.spec is None:
        return None
    cluster = estate.clusters[cluster_name]
    places = [checkpoint_store_spec(run["run_key"], cluster, settings),
              checkpoint_replica_spec(run["run_key"], cluster, settings)]
    try:
        if any(newest.step in CheckpointStore(open_store(p)).committed_steps() for p in places):
            return None
        checkpoint = CheckpointStore(open_store(newest.spec)).load(newest.step)
        CheckpointStore(open_store(places[0])).save(
            newest.step, checkpoint.shards, {**checkpoint.meta, "cluster": cluster_name, "carried_from": newest.uri})
    except Exception as exc:  # noqa: BLE001 - the move goes on; only its head start is lost
        log.warning("could not carry checkpoint step %d from %s to %s (%s: %s); its gang starts from the newest "
                    "checkpoint it finds there", newest.step, newest.uri, cluster_name, type(exc).__name__, exc)
        return None
    log.info("Checkpoint step %d carried from %s to %s's %s", newest.step, newest.uri, cluster_name, places[0].uri)
    return newest.step


def newest_checkpoint(run: Mapping[str, Any], estate, settings: Settings) -> NewestCheckpoint | None:
    """The run's newest committed checkpoint across the checkpoint places of every cluster placement
    could choose for it, with the cluster its manifest names (None: no checkpoint names one). A place
    that cannot be read is skipped with a warning: the others still say where the work is."""
    from hybridflow.placement.decide import eligible
    from hybridflow.placement.places import checkpoint_replica_spec, checkpoint_store_spec
    from hybridflow.request import AdmittedRun
    from hybridflow.storage.objectstore import open_store
    from hybridflow.training.checkpoint import CheckpointStore

    run_key = run["run_key"]
    specs = {}
    for cluster in eligible(AdmittedRun.from_xcom(dict(run)), estate):
        for spec in (checkpoint_store_spec(run_key, cluster, settings), checkpoint_replica_spec(run_key, cluster, settings)):
            specs.setdefault((spec.uri, spec.endpoint_url), spec)
    found: list[NewestCheckpoint] = []
    for (uri, _), spec in specs.items():
        try:
            place = CheckpointStore(open_store(spec))
            steps = place.committed_steps()
            if not steps:
                continue
            manifest = place.manifest(steps[-1])
        except Exception as exc:  # noqa: BLE001 - any store error: the other places still answer
            log.warning("cannot read the checkpoints in %s (%s: %s); looking in the other places",
                        uri, type(exc).__name__, exc)
            continue
        if manifest.meta.get("cluster"):
            found.append(NewestCheckpoint(str(manifest.meta["cluster"]), manifest.step, manifest.time, uri, spec))
    return max(found, key=lambda c: (c.step, c.committed_at), default=None)
