"""Run records: one JSON document per DAG run, the input of cost allocation and audits."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hybridflow.runs import RunIdentity, write_json_atomic

RECORD_FORMAT = "hybridflow.run-record/v1"


def build_record(admitted, identity: RunIdentity, steps: Mapping[str, Mapping[str, Any] | None]) -> dict:
    req = admitted.request
    placement = steps.get("choose_cluster") or {}
    trained = steps.get("train") or {}
    staged = steps.get("stage_data") or {}
    evaluated = steps.get("evaluate") or {}
    compressed = steps.get("compress") or {}
    deployed = steps.get("deploy") or {}
    gpu_seconds = float(trained.get("gpu_seconds", 0.0))
    return {
        "format": RECORD_FORMAT,
        "run_key": identity.run_key,
        "dag_id": identity.dag_id,
        "run_id": identity.run_id,
        "triggered_by": identity.triggered_by,
        "project": req.project,
        "team": admitted.team,
        "model": admitted.model,
        "hyperparameters": admitted.hyperparameters,
        "dataset": admitted.dataset,
        "dataset_location": admitted.dataset_location,
        "dataset_version": (steps.get("validate_data") or {}).get("version"),
        "classification": admitted.classification,
        "regions": admitted.regions or [],
        "priority": req.priority,
        "budget_override": req.budget_override or None,
        "cluster": placement.get("cluster"),
        "location": placement.get("location"),
        "pricing_class": placement.get("pricing_class"),
        "spot": placement.get("pricing_class") == "spot",
        "price_per_gpu_hour": placement.get("price_per_gpu_hour"),
        "gpu_type": req.gpu_type,
        "workers": req.workers,
        "gpu_seconds": gpu_seconds,
        "gpu_hours": round(gpu_seconds / 3600.0, 6),
        "train_attempts": trained.get("attempts", []),
        "training": training_summary(trained.get("attempts", []), trained.get("final_step")),
        "checkpoints": {
            "store": trained.get("checkpoint_store"),
            "replica": trained.get("checkpoint_replica"),
            "count": trained.get("checkpoints_written"),
            "resumed_from_step": trained.get("start_step"),
            "final_step": trained.get("final_step"),
        },
        "staging": staged.get("staging"),
        # The model's registered metric on the held-out split: {name, value, direction, gate, passed}.
        "metric": evaluated.get("metric"),
        "training_metrics": trained.get("metrics") or {},
        "compression": {k: compressed.get(k) for k in ("selected", "bundle", "metric", "baseline_metric", "variants")},
        "endpoint": deployed.get("endpoint_url"),
        "model_version": deployed.get("version"),
        # The deploy's gate and canary figures and its verdicts (hybridflow.serving.base.roll's outcome).
        "deploy": deploy_summary(deployed),
        "artefacts": {
            "model": trained.get("bundle"),
            "compressed_model": compressed.get("bundle"),
            "validation_report": ((steps.get("validate_data") or {}).get("reports") or {}).get("summary"),
            "evaluation_report": evaluated.get("report_path"),
        },
        "durations_s": {name: (out or {}).get("seconds") for name, out in steps.items()},
        "recorded_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


DEPLOY_KEYS = ("endpoint", "version", "previous_version", "model", "variant", "target", "status", "smoke_metric",
               "gate", "canary", "rolled_back")


def deploy_summary(deployed: Mapping[str, Any] | None) -> dict | None:
    """What a deploy measured and decided: the versions, the smoke metric, the gate's load test (new
    and serving version side by side, the bars, the verdict), each canary step's figures and verdict,
    and the rollback if there was one. None when nothing was deployed."""
    if not deployed or deployed.get("deployed") is False or not deployed.get("version"):
        return None
    return {key: deployed.get(key) for key in DEPLOY_KEYS}


def training_summary(attempts: list[Mapping[str, Any]], final_step: int | None) -> dict:
    """Steps and interruptions of a run's training, counted once each.

    ``steps_trained`` is the model's step count (``final_step``), however many attempts it took.
    ``steps_run`` adds up each attempt's own steps (its last step minus its start step), and
    ``steps_lost`` is the work done again: an attempt's last step minus the step the next attempt
    resumed from. An attempt killed outright (SIGKILL, lost node) reports no last step; those are
    counted in ``attempts_without_last_step`` instead of being guessed.
    """
    steps_run = 0
    steps_lost = 0
    unknown = 0
    for i, a in enumerate(attempts):
        start, last = a.get("start_step"), a.get("last_step")
        if start is None or last is None:
            unknown += 1
            continue
        steps_run += max(0, last - start)
        following = attempts[i + 1].get("start_step") if i + 1 < len(attempts) else None
        if following is not None:
            steps_lost += max(0, last - following)
    return {
        "steps_trained": final_step,
        "steps_run": steps_run,
        "steps_lost": steps_lost,
        "attempts": len(attempts),
        # A local attempt ends at each preemption; a Kubernetes gang restarts inside one attempt,
        # which carries the restarts its cluster counted.
        "preemptions": sum(1 for a in attempts if a.get("outcome") == "preempted")
        + sum(int(a.get("preemptions") or 0) for a in attempts),
        "failures": sum(1 for a in attempts if a.get("outcome") in ("failed", "interrupted")),
        "attempts_without_last_step": unknown,
    }


def record_path(private_root: Path, project: str, run_key: str) -> Path:
    return private_root / "records" / project / f"{run_key}.json"


def write_record(private_root: Path, rec: Mapping[str, Any]) -> Path:
    return write_json_atomic(record_path(private_root, rec["project"], rec["run_key"]), dict(rec))


def read_records(private_root: Path, project: str | None = None) -> list[dict]:
    base = private_root / "records"
    pattern = f"{project}/*.json" if project else "*/*.json"
    return [json.loads(p.read_text()) for p in sorted(base.glob(pattern))]
