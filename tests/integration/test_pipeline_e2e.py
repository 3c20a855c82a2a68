"""The training pipeline end to end through Airflow on the embedded default, as a user runs it:
``hybridflow demo`` (``airflow dags test``) with SQLite or PostgreSQL metadata, rclone S3 caches
on loopback and real gang training."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml
from tests.support.deploy_settings import quick_serving

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
    quick_serving(pipeline)  # short gate and canary windows: each deploy measures for seconds
    (config / "pipeline.yaml").write_text(yaml.safe_dump(pipeline))
    env = {**os.environ, "HYBRIDFLOW_HOME": str(home), "HYBRIDFLOW_CONFIG_DIR": str(config)}
    subprocess.run([BIN / "hybridflow", "dev", "up"], env=env, check=True, timeout=300)
    airflow_env = {**env}
    for line in (home / "dev" / "airflow.env").read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        airflow_env[key] = shlex.split(value)[0]
    subprocess.run([BIN / "airflow", "db", "migrate"], env=airflow_env, check=True, timeout=300, capture_output=True)
    yield {"home": home, "env": env, "airflow_env": airflow_env, "port": pipeline["serving"]["port"]}
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


def _ledger_rows(estate, sql: str, **params) -> list[tuple]:
    """Rows of a query on the demo's ledger (HYBRIDFLOW_LEDGER_URL, else its SQLite file in the home)."""
    from sqlalchemy import create_engine, text

    url = os.environ.get("HYBRIDFLOW_LEDGER_URL") or f"sqlite:///{estate['home'] / 'ledger' / 'ledger.db'}"
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql), params)]
    finally:
        engine.dispose()


def _recorded_day(record: dict) -> str:
    return datetime.fromisoformat(record["recorded_at"]).astimezone(UTC).date().isoformat()


def _predict(port: int, rows: list, endpoint: str = "digits") -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/models/{endpoint}:predict", data=json.dumps({"instances": rows}).encode(),
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def _known_inputs(home: Path, n: int = 100):
    import pandas as pd

    test = pd.read_csv(home / "private" / "datasets" / "digits" / "test.csv").head(n)
    return test.drop(columns=["label"]).values.tolist(), test["label"].tolist()


def _breast_cancer_inputs(home: Path):
    """Held-out rows as objects {column: value}, the way a client names the signature's inputs."""
    import pandas as pd

    test = pd.read_parquet(home / "private" / "datasets" / "breast-cancer" / "test.parquet")
    return test.drop(columns=["malignant"]).to_dict(orient="records"), test["malignant"].tolist()


def test_private_run_end_to_end(estate):
    proc, record = _demo(estate, {})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert record is not None
    assert record["cluster"] == "onprem-a" and record["location"] == "private"
    assert (record["model"], record["dataset"], record["classification"]) == ("digits-mlp", "digits", "internal")
    assert record["metric"]["name"] == "accuracy" and record["metric"]["value"] >= 0.85 and record["metric"]["passed"]
    assert record["dataset_version"] and record["training_metrics"]["loss"] < 0.5
    for key in ("validation_report", "evaluation_report"):
        assert Path(record["artefacts"][key]).is_file(), key
    for key in ("model", "compressed_model"):  # model bundles: weights and the card that loads them
        assert (Path(record["artefacts"][key]) / "model.json").is_file(), key
    assert record["checkpoints"]["count"] >= 1 and record["checkpoints"]["final_step"] == 300
    scratch = estate["home"] / "scratch" / "onprem-a" / "checkpoints" / record["run_key"]
    assert list(scratch.glob("step-000000300/MANIFEST.json")), "the final checkpoint is not on cluster scratch"
    assert record["training"]["steps_trained"] == 300 and record["training"]["preemptions"] == 0
    assert record["gpu_hours"] > 0 and record["workers"] == 2
    assert record["compression"]["selected"] in ("int8", "fp16")
    rows, labels = _known_inputs(estate["home"])
    answer = _predict(estate["port"], rows)
    assert answer["version"] == record["model_version"]
    correct = sum(p == y for p, y in zip(answer["predictions"], labels, strict=True))
    assert correct / len(labels) >= 0.9
    assert "finished" in proc.stdout and record["endpoint"] in proc.stdout
    # The demo metered the run and allocated its day, as gpu_metering, gpu_cost_nightly and gpu_budgets do.
    day = _recorded_day(record)
    [(samples,)] = _ledger_rows(estate, "SELECT count(*) FROM gpu_sample WHERE run_key = :k", k=record["run_key"])
    assert samples > 0, "no GPU sample of the run's gang was metered"
    [(hours, effective, cost, attempts)] = _ledger_rows(
        estate, "SELECT sum(gpu_hours), sum(effective_gpu_hours), sum(cost_usd), sum(attempts) FROM allocation "
        "WHERE day = :d AND project = :p AND cluster = :c", d=day, p=record["project"], c=record["cluster"])
    assert hours == pytest.approx(record["gpu_hours"], abs=1e-6) and attempts == 1
    assert 0 < effective <= hours and cost == pytest.approx(hours * record["price_per_gpu_hour"], rel=1e-9)
    assert (estate["home"] / "private" / "reports" / "allocation" / day / "report.html").is_file()
    [(spend,)] = _ledger_rows(estate, "SELECT spend_usd FROM budget_state WHERE project = :p AND period = :m",
                              p=record["project"], m=day[:7])
    assert spend >= cost > 0
    assert f"allocated {day}: " in proc.stdout and "budget " + day[:7] in proc.stdout
    # The run's Cost & budget tab reads the same: its attempt as allocated, with the metered utilisation.
    from hybridflow.ui.costs import allocated_attempts

    [allocated] = allocated_attempts(estate["home"] / "private", record)
    assert allocated["gpu_hours"] == pytest.approx(hours) and allocated["mean_util_pct"] > 0


def test_public_run_stages_data_and_replaces_the_served_version(estate):
    before = _predict(estate["port"], _known_inputs(estate["home"], 1)[0])["version"]
    proc, record = _demo(estate, {"cluster_preference": "public", "gpu_type": "H100-80GB", "hyperparameters": {"steps": 200}})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert record["cluster"] == "cloud-east" and record["location"] == "public"
    assert record["pricing_class"] == "on_demand"
    staged = record["staging"]
    assert staged["objects_total"] == 4  # train.csv, test.csv and the two suites kept with them
    bucket = estate["home"] / "clouds" / "cloud-east" / "hf-cache-cloud-east"
    assert list(bucket.glob("datasets/digits/versions/*.json")), "no dataset manifest in the cloud cache"
    assert list(bucket.glob(f"checkpoints/{record['run_key']}/step-*/MANIFEST.json")), "no checkpoints in the cache"
    # ... and replicated to private storage, the run's second place.
    replica = estate["home"] / "private" / "checkpoints" / record["run_key"]
    assert list(replica.glob("step-000000200/MANIFEST.json")), "the final checkpoint is not in private storage"
    assert record["checkpoints"]["replica"] == replica.resolve().as_uri()
    rows, labels = _known_inputs(estate["home"])
    answer = _predict(estate["port"], rows)
    assert answer["version"] == record["model_version"] != before
    assert sum(p == y for p, y in zip(answer["predictions"], labels, strict=True)) / len(labels) >= 0.9
    # A second demo the same day allocates the day again: every attempt of the day counted once.
    day = _recorded_day(record)
    [(allocated,)] = _ledger_rows(estate, "SELECT sum(attempts) FROM allocation WHERE day = :d", d=day)
    start = datetime.fromisoformat(day)
    [(held,)] = _ledger_rows(estate, "SELECT count(*) FROM attempt WHERE started_at < :end AND ended_at > :start",
                             start=start, end=start + timedelta(days=1))
    assert allocated == held >= 1
    [(clouds,)] = _ledger_rows(estate, "SELECT sum(gpu_hours) FROM allocation WHERE day = :d AND cluster = :c",
                               d=day, c="cloud-east")
    assert clouds == pytest.approx(record["gpu_hours"], abs=1e-6)


def test_bad_trigger_input_is_refused_at_admit_and_nothing_runs(estate):
    runs_before = sorted((estate["home"] / "private" / "runs").glob("*"))
    proc, record = _demo(estate, {"project": "no-such-project"})
    assert proc.returncode != 0
    assert record is None
    log = max((estate["home"] / "dev").glob("demo-*.log"), key=lambda p: p.stat().st_mtime).read_text()
    assert "AdmissionError: project:" in log and "no-such-project" in log
    assert sorted((estate["home"] / "private" / "runs").glob("*")) == runs_before


def _committed_since(root: Path, since: float) -> list[Path]:
    return [p for p in root.glob("*/step-*/MANIFEST.json") if p.stat().st_mtime >= since]


def _worker_pids(spec_marker: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "hybridflow.training.worker" in cmdline and spec_marker in cmdline:
            pids.append(int(proc.name))
    return pids


def test_breast_cancer_run_survives_a_killed_worker_and_serves(estate):
    """The second example, a different shape (Parquet, 30 float columns, ROC AUC, restricted data),
    trained with FSDP and AdamW as its Params ask (sharding zero3: sharded checkpoints): SIGKILL one of its training workers mid-run; the train task
    fails, Airflow retries it in the same DAG run, the retry resumes from the newest committed
    checkpoint, and the model is evaluated, compressed, deployed and answers on its own endpoint."""
    started = time.time()
    conf = {"model": "breast-cancer", "hyperparameters": {"steps": 3000}, "checkpoint_every_steps": 100,
            "sharding": "zero3", "optimizer": "adamw"}
    cmd = [BIN / "airflow", "dags", "test", "hybrid_training", "-c", json.dumps(conf)]
    ckpt_root = estate["home"] / "private" / "checkpoints"
    log_path = estate["home"] / "gang-kill.log"
    log_file = open(log_path, "wb")  # noqa: SIM115 - a file, not a pipe: a full pipe would stall Airflow
    run = subprocess.Popen(
        cmd, env=estate["airflow_env"], stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and run.poll() is None and not _committed_since(ckpt_root, started):
            time.sleep(0.2)
        committed = _committed_since(ckpt_root, started)
        assert committed, "no checkpoint was committed before the deadline"
        run_key = committed[0].parents[1].name
        victims = _worker_pids(run_key)
        assert victims, "no running training worker found to kill"
        os.kill(max(victims), signal.SIGKILL)
        run.wait(timeout=900)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        log_file.close()
    output = log_path.read_text(errors="replace")
    assert run.returncode == 0, output[-4000:]
    record = json.loads(next((estate["home"] / "private" / "records").glob(f"*/{run_key}.json")).read_text())
    # The data's classification came from the catalogue: restricted, so private, and never staged.
    assert (record["model"], record["classification"], record["location"]) == ("breast-cancer", "restricted", "private")
    assert record["staging"] is None
    assert not list((estate["home"] / "clouds").rglob("datasets/breast-cancer/*"))
    assert record["checkpoints"]["resumed_from_step"] > 0
    assert record["checkpoints"]["final_step"] == 3000
    assert [a["outcome"] for a in record["train_attempts"]] == ["failed", "succeeded"]
    assert "resuming from checkpoint step" in output.lower() and "sharded" in output
    assert "precision fp32, optimizer adamw, sharding zero3" in output
    metric = record["metric"]
    assert metric["name"] == "roc_auc" and metric["value"] >= metric["gate"] == 0.95
    # Served on its own endpoint, with requests checked against its signature.
    rows, labels = _breast_cancer_inputs(estate["home"])
    answer = _predict(estate["port"], rows, endpoint="breast-cancer")
    assert answer["version"] == record["model_version"]
    from sklearn.metrics import roc_auc_score

    assert roc_auc_score(labels, answer["predictions"]) >= 0.95
    bad = urllib.request.Request(
        f"http://127.0.0.1:{estate['port']}/v1/models/breast-cancer:predict",
        data=json.dumps({"instances": [{"mean_radius": "big"}]}).encode(), method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(bad, timeout=10)
    assert refused.value.code == 400
    # The digits endpoint still serves its own model next to it.
    assert _predict(estate["port"], _known_inputs(estate["home"], 1)[0])["model"] == "digits"


TRAIN_ONCE = r"""
import json, sys
from types import SimpleNamespace
from hybridflow import pipeline
from hybridflow.operators.train import GangTrainOperator
from hybridflow.runs import RunIdentity

try_number = int(sys.argv[1])
identity = RunIdentity("hybrid_training", "manual__operator-kill-test", try_number)
run = pipeline.admit({"hyperparameters": {"steps": 3000}, "checkpoint_every_steps": 100, "deploy": False}, identity)
pipeline.validate_data(run)
placement = pipeline.choose_cluster(run)
staged = pipeline.stage_data(run, placement)
op = GangTrainOperator(task_id="train", run=run, placement=placement, staged=staged)
context = {
    "dag": SimpleNamespace(dag_id=identity.dag_id),
    "run_id": identity.run_id,
    "ti": SimpleNamespace(try_number=try_number),
    "dag_run": SimpleNamespace(triggering_user_name="test"),
}
print("RESULT " + json.dumps(op.execute(context)))
"""


def test_killed_train_task_cleared_resumes_from_its_newest_checkpoint(estate):
    """SIGKILL the train task's own process (what a killed Airflow worker does), then run the task
    again in the same DAG run, as clearing it does: the gang resumes, and both tries are recorded."""
    started = time.time()
    ckpt_root = estate["home"] / "private" / "checkpoints"
    first = subprocess.Popen(
        [sys.executable, "-c", TRAIN_ONCE, "1"], env=estate["airflow_env"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and first.poll() is None and not _committed_since(ckpt_root, started):
            time.sleep(0.2)
        assert _committed_since(ckpt_root, started), "no checkpoint was committed before the deadline"
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    run_key = _committed_since(ckpt_root, started)[0].parents[1].name
    deadline = time.monotonic() + 60
    while _worker_pids(run_key) and time.monotonic() < deadline:
        time.sleep(0.2)  # workers stop on their own when their launcher dies
    assert not _worker_pids(run_key), "training workers outlived their killed task"

    second = subprocess.run(
        [sys.executable, "-c", TRAIN_ONCE, "2"], env=estate["airflow_env"],
        capture_output=True, text=True, timeout=900, check=False,
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    result = json.loads(second.stdout.split("RESULT ", 1)[1])
    assert result["start_step"] > 0 and result["final_step"] == 3000
    assert [a["outcome"] for a in result["attempts"]] == ["interrupted", "succeeded"]
    import pandas as pd

    from hybridflow.evaluation import evaluate_bundle

    held_out = pd.read_csv(estate["home"] / "private" / "datasets" / "digits" / "test.csv")
    assert evaluate_bundle(Path(result["bundle"]), held_out)["metric"]["value"] >= 0.85
