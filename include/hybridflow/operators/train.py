"""The train task: one gang job on the chosen cluster, resumed from its newest checkpoint on retry."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator

from hybridflow.runs import RunIdentity, run_dir, write_json_atomic


class GangTrainOperator(BaseOperator):
    """Run distributed training as a gang (all workers or none) and bring the model home.

    The gang job's name derives from the DAG run, so a retry or a cleared task takes the same slots
    and the same checkpoint prefix, and resumes where the last committed checkpoint left off.
    """

    template_fields: Sequence[str] = ("run", "placement", "staged")
    ui_color = "#f0e4ff"

    def __init__(self, *, run: Any, placement: Any, staged: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.run = run
        self.placement = placement
        self.staged = staged
        self._job_name: str | None = None
        self._backend = None

    def execute(self, context) -> dict:
        from hybridflow.admission import AdmittedRun
        from hybridflow.backends.local import GangJob, LocalGangBackend
        from hybridflow.config import load_estate
        from hybridflow.errors import GangError
        from hybridflow.pipeline import cache_store_spec, checkpoint_store_spec
        from hybridflow.settings import get_settings
        from hybridflow.storage.objectstore import open_store

        settings = get_settings()
        estate = load_estate(settings.config_dir)
        identity = RunIdentity.from_context(context)
        admitted = AdmittedRun.from_xcom(dict(self.run))
        req = admitted.request
        cluster = estate.clusters[self.placement["cluster"]]
        if cluster.backend != "local":
            raise GangError(f"cluster {self.placement['cluster']!r} uses backend {cluster.backend!r}, not available here")
        run_key = self.run["run_key"]
        ckpt_spec = checkpoint_store_spec(run_key, cluster, settings)
        training_cfg = estate.pipeline.training
        spec = {
            "run_key": run_key,
            "source": self.staged["source"],
            "checkpoint_store": ckpt_spec.to_dict(),
            "train_steps": req.train_steps,
            "checkpoint_every_steps": req.checkpoint_every_steps,
            "checkpoint_every_seconds": 300 if req.interruptible else None,
            "batch_size": training_cfg.batch_size,
            "learning_rate": training_cfg.learning_rate,
            "keep": training_cfg.checkpoint_keep,
        }
        # Staged data and cache checkpoints share the cluster's cache connection.
        env = cache_store_spec(cluster).credential_env() if cluster.cache else {}

        self._job_name = f"train-{run_key}"
        self._backend = LocalGangBackend(settings.state_dir, cluster.name, cluster.total_gpus)
        attempts_path = run_dir(settings.private_root, run_key) / "train-attempts.json"
        attempt = _start_attempt(attempts_path, identity.try_number, req.workers, cluster.name)
        outcome = "failed"
        try:
            result = self._backend.run(
                GangJob(
                    name=self._job_name,
                    workers=req.workers,
                    spec=spec,
                    env=env,
                    attempt=f"try-{identity.try_number}",
                ),
                admission_timeout_s=training_cfg.gang_admission_timeout_s,
                log=self.log,
            )
            outcome = "succeeded"
        finally:
            attempts = _finish_attempt(attempts_path, attempt, outcome)

        store = open_store(ckpt_spec)
        summary = json.loads(store.get_bytes("result.json"))
        model_path = run_dir(settings.private_root, run_key) / "model" / "model.pt"
        model_path.parent.mkdir(parents=True, exist_ok=True)
        store.get_file("model/final.pt", model_path)
        gpu_seconds = sum(a["seconds"] * a["workers"] for a in attempts if a.get("seconds") is not None)
        self.log.info(
            "Gang %s finished: steps %s..%s, %s checkpoints, model at %s",
            self._job_name,
            summary["start_step"],
            summary["final_step"],
            summary["checkpoints_written"],
            model_path,
        )
        return {
            "job_name": self._job_name,
            "cluster": cluster.name,
            "model_path": str(model_path),
            "checkpoint_store": ckpt_spec.uri,
            "checkpoints_written": summary["checkpoints_written"],
            "start_step": summary["start_step"],
            "final_step": summary["final_step"],
            "final_loss": summary.get("final_loss"),
            "seconds": round(result.seconds, 3),
            "gpu_seconds": round(gpu_seconds, 3),
            "attempts": attempts,
        }

    def on_kill(self) -> None:
        if self._backend is not None and self._job_name:
            self._backend.cancel(self._job_name)


def _read_attempts(path: Path) -> list[dict]:
    return json.loads(path.read_text()) if path.is_file() else []


def _write_attempts(path: Path, attempts: list[dict]) -> None:
    write_json_atomic(path, attempts)


def _start_attempt(path: Path, try_number: int, workers: int, cluster: str) -> dict:
    """Note the attempt before the gang starts, so a killed try still counts its GPU time."""
    attempts = _read_attempts(path)
    for earlier in attempts:
        if earlier["outcome"] == "running":
            # That try's process died without finishing: it ran at least until this one started
            # (an upper bound; the gang backend stops orphaned workers on launcher death).
            earlier["outcome"] = "interrupted"
    attempt = {
        "try_number": try_number,
        "cluster": cluster,
        "workers": workers,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": None,
        "outcome": "running",
    }
    attempts.append(attempt)
    _write_attempts(path, attempts)
    attempt["_t0"] = time.time()
    return attempt


def _finish_attempt(path: Path, attempt: dict, outcome: str) -> list[dict]:
    attempts = _read_attempts(path)
    for a in attempts:
        if a["started_at"] == attempt["started_at"] and a["try_number"] == attempt["try_number"]:
            a["seconds"] = round(time.time() - attempt["_t0"], 3)
            a["outcome"] = outcome
    _write_attempts(path, attempts)
    return attempts
