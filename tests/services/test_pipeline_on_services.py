"""The user's path on real Airflow 3 services (api-server, scheduler, dag-processor, triggerer;
PostgreSQL metadata; LocalExecutor), driven through the REST API only: trigger the training
pipeline with Params, fail a step for a reason an operator can fix, fix it, clear the task, and
run the nightly cost allocation of a day twice."""

from __future__ import annotations

import hashlib
import json
import shutil
import urllib.request
from pathlib import Path

import pytest
import yaml
from tests.services.airflow_stack import AirflowStack, config_copy, services_available

_MISSING = services_available()
pytestmark = [pytest.mark.services, pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))]
DAG = "hybrid_training"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("services")
    config = config_copy(root)
    with AirflowStack(root, config_dir=config) as running:
        print(f"\nservice logs: {running.logs}")
        running.wait_for_dag(DAG)
        running.unpause(DAG)
        yield running


def _records(stack, run_key: str) -> list[Path]:
    return list((stack.home / "private" / "records").glob(f"*/{run_key}.json"))


def _predict(port: int, rows: list[list[float]]) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models/digits:predict",
                                 data=json.dumps({"instances": rows}).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def _run_key(stack, run_id: str) -> str:
    xcom = stack.api("GET", f"/dags/{DAG}/dagRuns/{run_id}/taskInstances/admit/xcomEntries/return_value")
    value = xcom["value"]
    return (json.loads(value) if isinstance(value, str) else value)["run_key"]


def test_triggered_run_trains_places_records_and_serves(stack) -> None:
    run_id = stack.trigger(DAG, {"hyperparameters": {"steps": 120}, "checkpoint_every_steps": 40})
    assert stack.wait_for_run(DAG, run_id) == "success", stack.task_states(DAG, run_id)
    run_key = _run_key(stack, run_id)
    [record_path] = _records(stack, run_key)
    record = json.loads(record_path.read_text())
    assert record["run_id"] == run_id and record["cluster"] == "onprem-a"
    assert record["training"]["steps_trained"] == 120
    placement = json.loads((stack.home / "private" / "runs" / run_key / "placement.json").read_text())
    assert placement["cluster"] == "onprem-a" and len(placement["candidates"]) >= 2
    port = yaml.safe_load((stack.config_dir / "pipeline.yaml").read_text())["serving"]["port"]
    test_csv = (stack.home / "private" / "datasets" / "digits" / "test.csv").read_text().splitlines()
    row = [float(v) for v in test_csv[1].split(",")[:-1]]
    assert _predict(port, [row])["version"] == record["model_version"]


def test_failed_validation_fixed_and_cleared_completes_without_duplicates(stack) -> None:
    digits = stack.home / "private" / "datasets" / "digits"
    broken = stack.home / "private" / "datasets" / "digits-broken"
    shutil.copytree(digits, broken)
    # Its owner describes the copy in the catalogue, as any new dataset is.
    catalogue = yaml.safe_load((stack.config_dir / "datasets.yaml").read_text())
    entry = dict(catalogue["datasets"]["digits"], location="private://datasets/digits-broken")
    entry.pop("seed")
    catalogue["datasets"]["digits-broken"] = entry
    (stack.config_dir / "datasets.yaml").write_text(yaml.safe_dump(catalogue, sort_keys=False))
    good_train = (broken / "train.csv").read_text()
    lines = good_train.splitlines()
    lines[5] = ",".join(["99"] * (len(lines[5].split(",")) - 1) + ["3"])  # pixels must lie in 0..16
    (broken / "train.csv").write_text("\n".join(lines) + "\n")

    run_id = stack.trigger(DAG, {"dataset": "digits-broken", "hyperparameters": {"steps": 80},
                                 "checkpoint_every_steps": 40, "deploy": False})
    assert stack.wait_for_run(DAG, run_id) == "failed"
    states = stack.task_states(DAG, run_id)
    assert states["admit"] == "success" and states["validate_data"] == "failed", states
    log = stack.task_log(DAG, run_id, "validate_data", _last_try(stack, run_id))
    assert "pixel_0: expect_column_values_to_be_between" in log and "CSV line 6)" in log, log[-3000:]
    run_key = _run_key(stack, run_id)
    assert not _records(stack, run_key)

    (broken / "train.csv").write_text(good_train)  # the operator fixes the file ...
    stack.clear(DAG, run_id, ["validate_data"])  # ... and clears the failed step from the UI/API
    assert stack.wait_for_run(DAG, run_id) == "success", stack.task_states(DAG, run_id)
    assert len(_records(stack, run_key)) == 1
    # One gang job, one set of attempts, one ledger run: the clear redid the steps, it did not duplicate them.
    attempts = json.loads((stack.home / "private" / "runs" / run_key / "train-attempts.json").read_text())
    assert [a["outcome"] for a in attempts] == ["succeeded"]
    from sqlalchemy import create_engine, text

    ledger = create_engine(f"sqlite:///{stack.home / 'ledger' / 'ledger.db'}")
    with ledger.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM run WHERE run_key = :k"), {"k": run_key}).scalar() == 1


def _last_try(stack, run_id: str) -> int:
    ti = stack.api("GET", f"/dags/{DAG}/dagRuns/{run_id}/taskInstances/validate_data")
    return ti["try_number"]


def test_nightly_allocation_of_a_day_twice_is_identical(stack) -> None:
    from datetime import UTC, datetime

    nightly = "gpu_cost_nightly"
    stack.wait_for_dag(nightly)
    stack.unpause(nightly)
    day = datetime.now(UTC).date().isoformat()  # the day the runs above trained
    outputs = []
    for _ in range(2):
        run_id = stack.trigger(nightly, {"day": day})
        assert stack.wait_for_run(nightly, run_id, timeout=600) == "success", stack.task_states(nightly, run_id)
        folder = stack.home / "private" / "reports" / "allocation" / day
        files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in (".csv", ".json"))
        assert files, f"no allocation output in {folder}"
        outputs.append({p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files})
    assert outputs[0] == outputs[1]
