"""The budget loop end to end on the embedded default: a project's interruptible batch run is
training when the nightly evaluation finds its month over budget; the webhook hears 80 % and 100 %
once each, the gang commits a final checkpoint and stops for good, the train task fails saying why,
and admit refuses the project's next normal run until the budget is raised."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from tests.support.train_task import seed_examples, train_task

from hybridflow.backends.local import pid_alive
from hybridflow.errors import AdmissionError
from hybridflow.settings import REPO_ROOT
from hybridflow.storage.objectstore import LocalObjectStore

NOW = datetime.now(UTC)
PERIOD = f"{NOW.year:04d}-{NOW.month:02d}"


class _Receiver(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        self.server.received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def budget_home(tmp_path, monkeypatch):
    home, config = tmp_path / "home", tmp_path / "config"
    shutil.copytree(REPO_ROOT / "config", config)
    (config / "budgets.yaml").write_text("projects:\n  digits-ocr: {monthly_usd: 100}\n")
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(home))
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(config))
    monkeypatch.setenv("HYBRIDFLOW_LEDGER_URL", ledger)
    seed_examples(home)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    server.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv(
        "AIRFLOW_CONN_HYBRIDFLOW_BUDGET_WEBHOOK",
        json.dumps({"conn_type": "http", "host": f"http://127.0.0.1:{server.server_address[1]}/budget"}),
    )
    try:
        yield home, config, create_engine(ledger), server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _allocate(engine, cost_usd: float) -> None:
    """What the nightly allocation leaves in the ledger for today (the train task has already put the
    run's attempts there, so the ledger's tables exist)."""
    from hybridflow.ledger import upgrade

    upgrade(engine)
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM allocation"))
        conn.execute(text("INSERT INTO allocation (day, project, team, cluster, gpu_model, pricing_class, gpu_hours, "
                          "cost_usd, waste, waste_gpu_hours, preempted_gpu_hours, attempts) "
                          "VALUES (:d, 'digits-ocr', 'perception', 'onprem-a', 'A100-80GB', 'onprem', 1.0, :c, "
                          "false, 0, 0, 1)"), {"d": NOW.date().isoformat(), "c": cost_usd})


def _worker_pids(job_dir: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(job_dir) in cmdline and "hybridflow.training.worker" in cmdline and pid_alive(int(proc.name)):
            pids.append(int(proc.name))
    return pids


def test_a_spent_budget_stops_the_running_gang_and_refuses_new_runs(budget_home):
    from airflow.sdk.exceptions import AirflowFailException

    from hybridflow import pipeline
    from hybridflow.budgets.nightly import evaluate_budgets
    from hybridflow.runs import RunIdentity
    from hybridflow.training.checkpoint import CheckpointStore

    home, config, engine, webhook = budget_home
    params = {"cluster_preference": "private", "priority": "batch", "interruptible": True,
              "hyperparameters": {"steps": 100_000}, "checkpoint_every_steps": 50, "workers": 1}
    run, _, _, op, context = train_task("budget-freeze", params)
    outcome: dict = {}

    def train() -> None:
        try:
            outcome["result"] = op.execute(context)
        except BaseException as exc:  # handed to the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    gang = home / "state" / "jobs" / f"train-{run['run_key']}"
    checkpoints = CheckpointStore(LocalObjectStore(home / "private" / "checkpoints" / run["run_key"]))
    try:
        deadline = time.monotonic() + 120
        while not checkpoints.committed_steps():
            assert thread.is_alive() and time.monotonic() < deadline, outcome
            time.sleep(0.05)

        _allocate(engine, 85.0)  # 85 %: a notification, nothing stops
        first = evaluate_budgets(PERIOD)
        assert first["projects"][0]["notified"] == [0.8] and first["projects"][0]["stopped"] == []
        assert thread.is_alive()

        _allocate(engine, 104.0)  # the next night: over budget
        second = evaluate_budgets(PERIOD)
        assert second["projects"][0]["frozen"] and second["projects"][0]["stopped"] == [f"train-{run['run_key']}"]
        thread.join(60)
        assert not thread.is_alive()
        assert evaluate_budgets(PERIOD)["projects"][0]["notified"] == []  # cleared and re-run: nothing new
    finally:
        for pid in _worker_pids(gang):
            os.kill(pid, signal.SIGKILL)

    err = outcome.get("error")
    assert isinstance(err, AirflowFailException), outcome  # no Airflow retry restarts the spend
    assert "has spent 104.00 USD of its 100.00 USD budget" in str(err) and "clear the train task" in str(err)
    attempts = json.loads((home / "private" / "runs" / run["run_key"] / "train-attempts.json").read_text())
    assert [a["outcome"] for a in attempts] == ["stopped"]  # not relaunched as a preemption
    assert attempts[0]["last_committed_step"] > 0
    assert [(n["threshold"], n["project"]) for n in webhook.received] == [(0.8, "digits-ocr"), (1.0, "digits-ocr")]

    # Clearing the train task while frozen does not resume the spend.
    with pytest.raises(AirflowFailException, match="^not started: priority: project 'digits-ocr' has spent"):
        op.execute(context)
    assert not (gang / "try-1-relaunch-1").exists() and len(json.loads(
        (home / "private" / "runs" / run["run_key"] / "train-attempts.json").read_text())) == 1
    with pytest.raises(AdmissionError, match="^priority: project 'digits-ocr' has spent 104.00 USD"):
        pipeline.admit({"cluster_preference": "private"}, RunIdentity("hybrid_training", "manual__next", 1))
    # Raising the budget lets the project's runs in again.
    (config / "budgets.yaml").write_text("projects:\n  digits-ocr: {monthly_usd: 500}\n")
    assert pipeline.admit({"cluster_preference": "private"}, RunIdentity("hybrid_training", "manual__next", 1))
