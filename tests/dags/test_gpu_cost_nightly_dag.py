"""The gpu_cost_nightly DAG through Airflow (``dag.test``): run records the ledger missed are synced in,
a day is allocated into the ledger and private storage, the allocations asset gets an event naming the
day, and a re-run gives the same rows."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

pytestmark = pytest.mark.airflow


@pytest.fixture(scope="module")
def airflow_db():
    airflow = Path(sys.executable).with_name("airflow")
    subprocess.run([str(airflow), "db", "migrate"], env=dict(os.environ), check=True, timeout=300, capture_output=True)


def test_gpu_cost_nightly_allocates_its_day_and_emits_the_asset(airflow_db, tmp_path, monkeypatch):
    from airflow.dag_processing.dagbag import DagBag
    from tests.unit.test_ledger_runs import make_record

    from hybridflow.records import write_record
    from hybridflow.settings import REPO_ROOT

    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HYBRIDFLOW_LEDGER_URL", f"sqlite:///{tmp_path / 'ledger.db'}")
    # A run record written before the ledger existed: the DAG's first task brings it in.
    write_record(tmp_path / "home" / "private", make_record())
    dag = DagBag(dag_folder=str(REPO_ROOT / "dags" / "gpu_cost_nightly.py")).get_dag("gpu_cost_nightly")
    assert dag is not None
    ledger = create_engine(f"sqlite:///{tmp_path / 'ledger.db'}")
    results = []
    for _ in range(2):
        dag_run = dag.test(logical_date=datetime(2026, 11, 3, tzinfo=UTC))
        assert dag_run.state == "success"
        with ledger.connect() as conn:
            results.append(conn.execute(text("SELECT day, project, cluster, gpu_hours, cost_usd FROM allocation "
                                             "ORDER BY cluster")).all())
    assert results[0] == results[1] and {r[0] for r in results[0]} == {"2026-11-03"}
    assert (tmp_path / "home" / "private" / "reports" / "allocation" / "2026-11-03" / "report.html").is_file()

    from airflow.models.asset import AssetEvent
    from airflow.utils.session import create_session

    with create_session() as session:
        extras = [e.extra for e in session.query(AssetEvent).all() if e.asset.name == "hybridflow://ledger/allocations"]
    assert {"day": "2026-11-03"} in extras
