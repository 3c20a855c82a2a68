"""The training pipeline end to end through Airflow on the embedded default, as a user runs it:
``hybridflow demo`` (``airflow dags test``) with SQLite or PostgreSQL metadata, rclone S3 caches
on loopback and real gang training."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

pytestmark = [pytest.mark.e2e, pytest.mark.airflow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def estate(tmp_path_factory):
    """An isolated home and config (free serving port); everything it starts is stopped after."""
    home = tmp_path_factory.mktemp("hf-home")
    config = tmp_path_factory.mktemp("hf-config")
    for f in (REPO / "config").glob("*.yaml"):
        shutil.copy(f, config / f.name)
    pipeline = yaml.safe_load((config / "pipeline.yaml").read_text())
    pipeline["serving"]["port"] = _free_port()
    (config / "pipeline.yaml").write_text(yaml.safe_dump(pipeline))
    env = {**os.environ, "HYBRIDFLOW_HOME": str(home), "HYBRIDFLOW_CONFIG_DIR": str(config)}
    yield {"home": home, "env": env, "port": pipeline["serving"]["port"]}
    subprocess.run([BIN / "hybridflow", "dev", "down"], env=env, check=False, timeout=120)


def _demo(estate, conf: dict) -> tuple[subprocess.CompletedProcess, dict | None]:
    started = time.time()
    proc = subprocess.run(
        [BIN / "hybridflow", "demo", "--quiet", "--conf", json.dumps(conf)],
        env=estate["env"], capture_output=True, text=True, timeout=900, check=False,
    )
    records = [p for p in (estate["home"] / "private" / "records").glob("*/*.json") if p.stat().st_mtime >= started]
    record = json.loads(max(records, key=lambda p: p.stat().st_mtime).read_text()) if records else None
    return proc, record


def _predict(port: int, rows: list[list[float]]) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/predict", data=json.dumps({"instances": rows}).encode(), method="POST"
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def _known_inputs(home: Path, n: int = 100):
    import pandas as pd

    test = pd.read_csv(home / "private" / "datasets" / "digits" / "test.csv").head(n)
    return test.drop(columns=["label"]).values.tolist(), test["label"].tolist()


def test_private_run_end_to_end(estate):
    proc, record = _demo(estate, {})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert record is not None
    assert record["cluster"] == "onprem-a" and record["location"] == "private"
    assert record["accuracy"] >= 0.85
    for key in ("model", "compressed_model", "validation_report", "evaluation_report"):
        assert Path(record["artefacts"][key]).is_file(), key
    assert record["checkpoints"]["count"] >= 1 and record["checkpoints"]["final_step"] == 300
    assert record["gpu_hours"] > 0 and record["workers"] == 2
    assert record["compression"]["selected"] in ("int8", "fp16")
    rows, labels = _known_inputs(estate["home"])
    answer = _predict(estate["port"], rows)
    assert answer["version"] == record["model_version"]
    correct = sum(p == y for p, y in zip(answer["predictions"], labels, strict=True))
    assert correct / len(labels) >= 0.9
    assert "finished" in proc.stdout and record["endpoint"] in proc.stdout


def test_public_run_stages_data_and_replaces_the_served_version(estate):
    before = _predict(estate["port"], _known_inputs(estate["home"], 1)[0])["version"]
    proc, record = _demo(estate, {"cluster_preference": "public", "workers": 2, "train_steps": 200})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert record["cluster"] == "cloud-east" and record["location"] == "public"
    assert record["pricing_class"] == "on_demand"
    staged = record["staging"]
    assert staged["objects_total"] == 2
    bucket = estate["home"] / "clouds" / "cloud-east" / "hf-cache-cloud-east"
    assert list(bucket.glob("datasets/digits/versions/*.json")), "no dataset manifest in the cloud cache"
    assert list(bucket.glob(f"checkpoints/{record['run_key']}/step-*/COMMITTED.json")), "no checkpoints in the cache"
    rows, labels = _known_inputs(estate["home"])
    answer = _predict(estate["port"], rows)
    assert answer["version"] == record["model_version"] != before
    assert sum(p == y for p, y in zip(answer["predictions"], labels, strict=True)) / len(labels) >= 0.9


def test_bad_trigger_input_is_refused_at_admit_and_nothing_runs(estate):
    runs_before = sorted((estate["home"] / "private" / "runs").glob("*"))
    proc, record = _demo(estate, {"project": "no-such-project"})
    assert proc.returncode != 0
    assert record is None
    log = max((estate["home"] / "dev").glob("demo-*.log"), key=lambda p: p.stat().st_mtime).read_text()
    assert "AdmissionError: project:" in log and "no-such-project" in log
    assert sorted((estate["home"] / "private" / "runs").glob("*")) == runs_before


def test_killed_train_task_resumes_from_its_newest_checkpoint(estate):
    """SIGKILL the task mid-training, then run the same DAG run again: training resumes, not restarts."""
    env = {**estate["env"]}
    env_file = estate["home"] / "dev" / "airflow.env"
    for line in env_file.read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value.strip("'")
    logical_date = "2026-01-01T00:00:00+00:00"
    conf = {"train_steps": 2000, "checkpoint_every_steps": 100, "deploy": False}
    cmd = [BIN / "airflow", "dags", "test", "hybrid_training", logical_date, "-c", json.dumps(conf)]
    ckpt_root = estate["home"] / "private" / "checkpoints"

    first = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    committed: list[Path] = []
    while time.monotonic() < deadline and first.poll() is None:
        committed = list(ckpt_root.glob("*manual-2026-01-01*/step-*/COMMITTED.json"))
        if committed:
            break
        time.sleep(0.5)
    assert committed, "no checkpoint was committed before the deadline"
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)

    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert second.returncode == 0, second.stdout[-4000:]
    records = list((estate["home"] / "private" / "records").glob("*/*manual-2026-01-01*.json"))
    assert len(records) == 1
    record = json.loads(records[0].read_text())
    assert record["checkpoints"]["resumed_from_step"] > 0
    assert record["checkpoints"]["final_step"] == 2000
    assert record["accuracy"] >= 0.85
    outcomes = [a["outcome"] for a in record["train_attempts"]]
    assert outcomes == ["interrupted", "succeeded"], outcomes
