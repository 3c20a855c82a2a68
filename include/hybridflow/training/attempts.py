"""A run's training attempts: one entry per gang launch in ``train-attempts.json`` in the run's folder
(try, cluster, workers, gang, start, seconds, outcome and the steps it achieved), noted before the
gang starts and again when it ends, and put in the ledger each time so GPU time is billed even for
runs that never reach their record step.

On a Kubernetes cluster the gang scheduler restarts a preempted or evicted gang itself, within the
same attempt (Volcano's RestartJob, Kueue's eviction and readmission): the attempt's ``preemptions``
says how often, as the cluster counts it against ``training.preemption_retries``."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hybridflow.backends.base import MISSING
from hybridflow.runs import write_json_atomic

ATTEMPTS_FILE = "train-attempts.json"


def begin_attempt(job: Any, label: str, gang: str | None, log: Any) -> dict:
    """Note ``job``'s attempt ``label`` as running (earlier ones left running as interrupted) and bill it."""
    attempt = start_attempt(job.attempts_path, job.identity.try_number, label, job.admitted.request.workers,
                            job.cluster.name, progress_of=lambda earlier: attempt_progress(job.places(), earlier, log),
                            gang=gang)
    note_in_ledger(read_attempts(job.attempts_path), **job.bill())
    return attempt


def end_attempt(job: Any, attempt: dict, outcome: str, log: Any, reason: str | None = None) -> list[dict]:
    """Note how ``attempt`` ended (and why, e.g. a move to make room) and what it achieved, and bill
    it; every attempt of the run."""
    progress = attempt_progress(job.places(), attempt["attempt"], log)
    if reason:
        progress["reason"] = reason
    if outcome != "not_admitted":
        restarts = gang_preemptions(job.backend, attempt.get("gang"), log)
        if restarts is not None:
            progress["preemptions"] = restarts
    attempts = finish_attempt(job.attempts_path, attempt, outcome, progress)
    note_in_ledger(attempts, **job.bill())
    return attempts


def attempt_progress(places: list, label: str, log) -> dict:
    """What an attempt achieved: its start and last step (from the gang's report in the primary
    place, ``places[0]``) and the newest checkpoint committed in either place. Missing facts stay None (a killed gang reports no
    last step); reading them never hides the attempt's own outcome."""
    from hybridflow.training.checkpoint import CheckpointStore
    from hybridflow.training.context import attempt_status_key

    out: dict = {"start_step": None, "last_step": None, "last_committed_step": None}
    try:
        status = json.loads(places[0].get_bytes(attempt_status_key(label)))
        out.update({k: status.get(k) for k in ("start_step", "last_step", "sigterm_to_commit_s", "device", "backend",
                                               "device_name") if k in status})
    except FileNotFoundError:
        pass
    except Exception as exc:
        log.warning("could not read the gang's report of attempt %s: %s", label, exc)
    committed: list[int] = []
    for place in places:
        try:
            committed += CheckpointStore(place).committed_steps()
        except Exception as exc:
            log.warning("could not list checkpoints in %s: %s", place.uri, exc)
    out["last_committed_step"] = max(committed, default=None)
    return out


def gang_preemptions(backend: Any, gang: str | None, log: Any) -> int | None:
    """How often the cluster's scheduler restarted gang ``gang`` after a preemption or eviction; None
    where the train task relaunches gangs itself (it counts those), or when the gang cannot be read
    (e.g. already deleted)."""
    if backend is None or backend.supervised_by_task or not gang:
        return None
    try:
        status = backend.status(gang)
    except Exception as exc:  # noqa: BLE001 - the attempt's own outcome is noted regardless
        log.warning("could not read how often gang %s was preempted: %s", gang, exc)
        return None
    return None if status.phase == MISSING else status.retries


def read_attempts(path: Path) -> list[dict]:
    return json.loads(path.read_text()) if path.is_file() else []


def _write_attempts(path: Path, attempts: list[dict]) -> None:
    write_json_atomic(path, attempts)


def note_in_ledger(attempts: list[dict], *, run_key: str, admitted, identity, placement: dict, log) -> None:
    """Put the run's attempts in the ledger as they start and end, so the nightly allocation bills
    GPU time of runs that fail, or are still going, before their record step; the run record
    replaces these rows when it is written. Best effort: the ledger never stops training."""
    req = admitted.request
    provisional = {
        "run_key": run_key, "project": req.project, "team": admitted.team,
        "cluster": placement.get("cluster"), "gpu_type": req.gpu_type,
        "pricing_class": placement.get("pricing_class"), "price_per_gpu_hour": placement.get("price_per_gpu_hour"),
        "workers": req.workers, "priority": req.priority, "dag_id": identity.dag_id, "run_id": identity.run_id,
        "budget_override": req.budget_override,
        "train_attempts": [{k: v for k, v in a.items() if not k.startswith("_")} for a in attempts],
        "recorded_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    try:
        from hybridflow.ledger import ingest_run_record

        ingest_run_record(provisional)
    except Exception as exc:  # noqa: BLE001 - billing catches up from the run record
        log.warning("could not note the training attempts in the ledger (%s); the run record brings them", exc)


def start_attempt(
    path: Path,
    try_number: int,
    label: str,
    workers: int,
    cluster: str,
    progress_of: Callable[[str], dict] | None = None,
    gang: str | None = None,
) -> dict:
    """Note the attempt before the gang starts, so a killed try still counts its GPU time."""
    attempts = read_attempts(path)
    for earlier in attempts:
        if earlier["outcome"] == "running":
            # That try's process died without finishing: it ran at least until this one started
            # (an upper bound; the gang backend stops orphaned workers on launcher death).
            earlier["outcome"] = "interrupted"
            if progress_of is not None and earlier.get("attempt"):
                earlier.update(progress_of(earlier["attempt"]))
    attempt = {
        "try_number": try_number,
        "attempt": label,
        "cluster": cluster,
        "workers": workers,
        # The gang's job name: metering ties GPU samples of its pods to the run by it.
        "gang": gang,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": None,
        "outcome": "running",
    }
    attempts.append(attempt)
    _write_attempts(path, attempts)
    attempt["_t0"] = time.time()
    return attempt


def finish_attempt(path: Path, attempt: dict, outcome: str, progress: dict | None = None) -> list[dict]:
    attempts = read_attempts(path)
    for a in attempts:
        if a.get("attempt") == attempt["attempt"] and a["started_at"] == attempt["started_at"]:
            a["seconds"] = round(time.time() - attempt["_t0"], 3)
            a["outcome"] = outcome
            a.update(progress or {})
    _write_attempts(path, attempts)
    return attempts
