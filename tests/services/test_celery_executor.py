"""The same pipeline, unchanged, under Airflow's distributed engine: the CeleryExecutor with Redis
(127.0.0.1:6379) as broker and a Celery worker process running every task."""

from __future__ import annotations

import json

import pytest
from tests.services.airflow_stack import AirflowStack, config_copy, services_available

_MISSING = services_available(redis=True)
pytestmark = [pytest.mark.services, pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))]
DAG = "hybrid_training"


def test_pipeline_runs_on_celery_workers(tmp_path) -> None:
    config = config_copy(tmp_path)
    with AirflowStack(tmp_path, executor="CeleryExecutor", config_dir=config) as stack:
        print(f"\nservice logs: {stack.logs}")
        stack.wait_for_dag(DAG)
        stack.unpause(DAG)
        run_id = stack.trigger(DAG, {"hyperparameters": {"steps": 80}, "checkpoint_every_steps": 40})
        assert stack.wait_for_run(DAG, run_id) == "success", stack.task_states(DAG, run_id)
        states = stack.task_states(DAG, run_id)
        assert set(states.values()) <= {"success", "skipped"} and states["train"] == "success"
        tis = stack.api("GET", f"/dags/{DAG}/dagRuns/{run_id}/taskInstances", params={"limit": 100})
        # Every task went through the Celery queue to the worker process.
        assert {ti["queue"] for ti in tis["task_instances"]} == {"default"}
        worker_log = (stack.logs / "celery-worker.log").read_text()
        ran = {t for t, state in states.items() if state == "success"}
        on_worker = {t for t in ran if f"run_id={run_id}/task_id={t}/" in worker_log}
        assert on_worker == ran, f"not run by the Celery worker: {ran - on_worker}"
        records = list((stack.home / "private" / "records").glob("*/*.json"))
        assert [json.loads(p.read_text())["run_id"] for p in records] == [run_id]
