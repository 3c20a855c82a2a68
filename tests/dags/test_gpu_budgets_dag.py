"""One run of the gpu_budgets DAG through Airflow (``dag.test``): the month's spend in the ledger
becomes budget state, and the 80 % notification reaches the webhook Connection."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

pytestmark = pytest.mark.airflow


class _Receiver(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        self.server.received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def airflow_db():
    """The session's Airflow metadata database, migrated (tests/conftest.py points Airflow at it)."""
    airflow = Path(sys.executable).with_name("airflow")
    subprocess.run([str(airflow), "db", "migrate"], env=dict(os.environ), check=True, timeout=300, capture_output=True)


def test_gpu_budgets_run_records_the_months_state_and_notifies_once(airflow_db, tmp_path, monkeypatch):
    from airflow.dag_processing.dagbag import DagBag

    from hybridflow.budgets.store import BudgetStore
    from hybridflow.ledger import upgrade
    from hybridflow.settings import REPO_ROOT

    now = datetime.now(UTC)
    period = f"{now.year:04d}-{now.month:02d}"
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    engine = create_engine(url)
    upgrade(engine)  # as the nightly allocation leaves the ledger
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO allocation (day, project, team, cluster, gpu_model, pricing_class, gpu_hours, "
                          "cost_usd, waste, waste_gpu_hours, preempted_gpu_hours, attempts) VALUES (:d, 'ranking', "
                          "'t', 'onprem-a', 'A100-80GB', 'onprem', 1, 7000.0, false, 0, 0, 1)"),
                     {"d": now.date().isoformat()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    server.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HYBRIDFLOW_LEDGER_URL", url)
    monkeypatch.setenv(
        "AIRFLOW_CONN_HYBRIDFLOW_BUDGET_WEBHOOK",
        json.dumps({"conn_type": "http", "host": f"http://127.0.0.1:{server.server_address[1]}/hook"}),
    )
    try:
        dag = DagBag(dag_folder=str(REPO_ROOT / "dags" / "gpu_budgets.py")).get_dag("gpu_budgets")
        dag_run = dag.test()
        assert dag_run.state == "success"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    state = BudgetStore(engine).get("ranking", period)
    assert state is not None and state.spend_usd == 7000.0 and not state.frozen and state.notified == (0.8,)
    assert [n["key"] for n in server.received] == [f"budget/ranking/{period}/0.8"]
