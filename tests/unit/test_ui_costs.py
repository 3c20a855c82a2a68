"""The GPU costs & budgets pages: each project's budget state as an operator reads it, the latest
allocation report, a run's cost and its project's budget, and that Airflow guards the pages."""

from __future__ import annotations

from datetime import UTC, date, datetime
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import create_engine

from hybridflow.budgets.evaluate import freeze_reason
from hybridflow.budgets.store import BudgetStore, metadata
from hybridflow.records import write_record
from hybridflow.runs import RunIdentity
from hybridflow.settings import REPO_ROOT
from hybridflow.ui.costs import add_cost_pages

AT = datetime(2026, 12, 20, 3, 0, tzinfo=UTC)
RUN_ID = "manual__2026-12-19T10:00:00+00:00"


@pytest.fixture
def store(tmp_path: Path) -> BudgetStore:
    engine = create_engine(f"sqlite:///{tmp_path / 'ledger.db'}")
    metadata.create_all(engine)
    return BudgetStore(engine)


def _client(tmp_path: Path, store) -> TestClient:
    app = FastAPI()
    add_cost_pages(app, private_root=tmp_path / "private", config_dir=REPO_ROOT / "config",
                   store_factory=lambda: store, today=lambda: date(2026, 12, 21), authorize=False)
    return TestClient(app)


def _frozen(store: BudgetStore) -> None:
    reason = freeze_reason("digits-ocr", "2026-12", 25_010.0, 25_000.0)
    store.record("digits-ocr", "2026-12", budget_usd=25_000, spend_usd=25_010, frozen=True, reason=reason, at=AT)
    store.notify_once("digits-ocr", "2026-12", 0.8, spend_usd=20_100, budget_usd=25_000, send=lambda: None, at=AT)
    store.notify_once("digits-ocr", "2026-12", 1.0, spend_usd=25_010, budget_usd=25_000, send=lambda: None, at=AT)


def test_costs_page_shows_each_projects_budget_state_and_how_to_lift_a_freeze(tmp_path, store):
    _frozen(store)
    html = _client(tmp_path, store).get("/costs").text
    assert "Budgets for 2026-12" in html
    assert "<tr class='frozen'><td>digits-ocr</td><td>perception</td><td>25,000.00</td><td>25,010.00</td>" in html
    assert "100.0%" in html and "80%, 100%" in html and "<td>frozen</td>" in html
    assert "raise projects.digits-ocr.months.&quot;2026-12&quot;" in html
    # ranking has a budget but has not been evaluated this month.
    assert "<td>ranking</td><td>search</td><td>8,000.00</td>" in html and "not evaluated yet" in html
    assert "No allocation report yet" in html
    body = _client(tmp_path, store).get("/api/costs/budgets").json()
    frozen = {p["project"]: p["frozen"] for p in body["projects"]}
    assert frozen == {"digits-ocr": True, "ranking": False}


def test_costs_page_embeds_the_latest_allocation_report(tmp_path, store):
    reports = tmp_path / "private" / "reports" / "allocation"
    for day in ("2026-12-18", "2026-12-19"):
        (reports / day).mkdir(parents=True)
        (reports / day / "report.html").write_text(f"<h1>GPU cost {day}</h1>")
    client = _client(tmp_path, store)
    html = client.get("/costs").text
    assert "<iframe src='/hybridflow/costs/report/2026-12-19'" in html
    assert client.get("/costs/report/2026-12-19").text == "<h1>GPU cost 2026-12-19</h1>"
    assert client.get("/costs/report/2026-12-01").status_code == 404
    assert client.get("/costs/report/..%2F..%2Frecords").status_code == 404


def test_without_a_ledger_the_page_says_budgets_are_not_evaluated_yet(tmp_path):
    html = _client(tmp_path, None).get("/costs").text
    assert "No ledger yet" in html and "<td>digits-ocr</td>" in html


def test_run_cost_tab_shows_the_runs_cost_and_its_projects_budget(tmp_path, store):
    _frozen(store)
    identity = RunIdentity("hybrid_training", RUN_ID)
    write_record(tmp_path / "private", {
        "run_key": identity.run_key, "dag_id": "hybrid_training", "run_id": RUN_ID, "project": "digits-ocr",
        "team": "perception", "priority": "critical", "budget_override": "INC-42 hotfix", "cluster": "onprem-a",
        "pricing_class": "onprem", "gpu_hours": 2.0, "price_per_gpu_hour": 1.25,
        "recorded_at": "2026-12-19T10:30:00+00:00",
    })
    client = _client(tmp_path, store)
    html = client.get(f"/costs/runs/hybrid_training/{RUN_ID}").text
    assert "<td>2.5</td>" in html and "INC-42 hotfix" in html
    assert "Budget of digits-ocr for 2026-12" in html and "<td>frozen</td>" in html
    missing = client.get("/costs/runs/hybrid_training/<b>nope</b>").text
    assert "No run record yet" in missing and "<b>nope" not in missing
    assert "Not allocated yet" in html


def test_run_cost_tab_shows_what_the_nightly_allocation_charged_each_attempt(tmp_path, store):
    from hybridflow.ledger.allocation import REPORTS, AttemptCost, write_files
    from hybridflow.storage.objectstore import LocalObjectStore

    identity = RunIdentity("hybrid_training", RUN_ID)
    attempt = {"try_number": 1, "attempt": "t1-a1", "cluster": "onprem-a", "workers": 2,
               "started_at": "2026-12-18T23:30:00+00:00", "seconds": 3600.0, "outcome": "succeeded"}
    write_record(tmp_path / "private", {
        "run_key": identity.run_key, "dag_id": "hybrid_training", "run_id": RUN_ID, "project": "digits-ocr",
        "team": "perception", "cluster": "onprem-a", "pricing_class": "onprem", "gpu_hours": 2.0,
        "price_per_gpu_hour": 1.25, "train_attempts": [attempt], "recorded_at": "2026-12-19T00:40:00+00:00",
    })

    def cost(day: str, run_key: str, hours: float, util: float | None) -> dict:
        return dict(vars(AttemptCost(
            day=day, run_key=run_key, dag_id="hybrid_training", run_id=RUN_ID, try_number=1, attempt="t1-a1",
            outcome="succeeded", project="digits-ocr", team="perception", cluster="onprem-a", gpu_model="A100-80GB",
            pricing_class="onprem", gpus=2, gpu_hours=hours, usd_per_gpu_hour=1.25, cost_usd=hours * 1.25,
            mean_util_pct=util, effective_gpu_hours=None if util is None else hours * util / 100, waste=False,
            preempted_gpu_hours=0.0)))

    store_ = LocalObjectStore(tmp_path / "private")
    # The run held its GPUs over midnight: half an hour on each day; another run shares the second day.
    write_files(store_, f"{REPORTS.as_posix()}/2026-12-18", [], [], [cost("2026-12-18", identity.run_key, 1.0, None)])
    write_files(store_, f"{REPORTS.as_posix()}/2026-12-19", [], [],
                [cost("2026-12-19", identity.run_key, 1.0, 42.0), cost("2026-12-19", "another-run", 8.0, 90.0)])
    html = _client(tmp_path, store).get(f"/costs/runs/hybrid_training/{RUN_ID}").text
    assert "<td>2026-12-18</td><td>t1-a1</td><td>onprem-a / onprem</td>" in html
    assert "<td>2026-12-19</td>" in html and "<td>42</td><td>0.42</td>" in html
    assert "allocated in all</th><th>2.5000</th>" in html and "10.0000" not in html and "Not allocated yet" not in html


@pytest.mark.parametrize("dag_id", ["gpu_budgets", "gpu_cost_nightly", "cluster_fence", "resource_reaper"])
def test_the_cost_tab_of_a_run_of_another_dag_is_refused_and_shows_no_projects_figures(tmp_path, store, dag_id):
    _frozen(store)
    reports = tmp_path / "private" / "reports" / "allocation" / "2026-12-19"
    reports.mkdir(parents=True)
    (reports / "report.html").write_text("<h1>GPU cost 2026-12-19</h1>")
    # The other DAG's run shares the run id of a training run with a record: nothing of it shows either.
    identity = RunIdentity("hybrid_training", RUN_ID)
    write_record(tmp_path / "private", {
        "run_key": identity.run_key, "dag_id": "hybrid_training", "run_id": RUN_ID, "project": "digits-ocr",
        "team": "perception", "cluster": "onprem-a", "gpu_hours": 2.0, "price_per_gpu_hour": 1.25,
        "recorded_at": "2026-12-19T10:30:00+00:00",
    })
    response = _client(tmp_path, store).get(f"/costs/runs/{dag_id}/{RUN_ID}")
    assert response.status_code == 404
    for figure in ("digits-ocr", "ranking", "perception", "25,0", "8,000", "report/2026-12-19", "2.5"):
        assert figure not in response.text, f"the {dag_id} run's cost tab shows {figure!r}"
    assert "only hybrid_training runs have a cost" in response.text


def test_a_record_that_is_not_the_runs_own_is_refused(tmp_path, store):
    """A record filed under the run's key but naming another DAG or run is not that run's cost."""
    identity = RunIdentity("hybrid_training", RUN_ID)
    write_record(tmp_path / "private", {
        "run_key": identity.run_key, "dag_id": "ranking_training", "run_id": "manual__other", "project": "ranking",
        "team": "search", "cluster": "cloud-east", "gpu_hours": 40.0, "price_per_gpu_hour": 3.0,
        "recorded_at": "2026-12-19T10:30:00+00:00",
    })
    response = _client(tmp_path, store).get(f"/costs/runs/hybrid_training/{RUN_ID}")
    assert response.status_code == 404
    assert "ranking" not in response.text and "120" not in response.text and "search" not in response.text


@pytest.mark.airflow
def test_cost_pages_are_in_the_plugin_and_need_a_signed_in_user():
    from airflow import plugins_manager
    from airflow.api_fastapi.app import create_app as create_api_server

    plugins, _ = plugins_manager._get_plugins()
    ours = next(p for p in plugins if p.name == "hybridflow_ui")
    views = {v["url_route"]: v for v in ours.external_views}
    assert views["hybridflow-costs"]["destination"] == "nav"
    assert views["hybridflow-run-cost"] == {
        "name": "Cost & budget", "href": "/hybridflow/costs/runs/{DAG_ID}/{RUN_ID}",
        "destination": "dag_run", "url_route": "hybridflow-run-cost",
    }
    api = TestClient(create_api_server(apps="core"))
    assert api.get("/hybridflow/costs").status_code == 401
    assert api.get(f"/hybridflow/costs/runs/hybrid_training/{RUN_ID}").status_code == 401


@pytest.fixture(scope="module")
def airflow_db():
    """The session's Airflow metadata database, migrated (tests/conftest.py points Airflow at it)."""
    import os
    import subprocess
    import sys

    airflow = Path(sys.executable).with_name("airflow")
    subprocess.run([str(airflow), "db", "migrate"], env=dict(os.environ), check=True, timeout=300, capture_output=True)


@pytest.mark.airflow
def test_the_api_server_shows_the_budgets_only_to_who_may_read_the_gpu_budgets_dag(airflow_db, tmp_path, monkeypatch):
    """Through the api-server and its auth manager: read access to a DAG's runs is per DAG, as a
    deployment's auth manager grants it (the FAB auth manager's DAG-level permissions)."""
    from airflow.api_fastapi import app as api_app
    from airflow.api_fastapi.app import create_app as create_api_server
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    reads = {"trainer": {"hybrid_training"}, "nightly": {"gpu_cost_nightly"}, "finance": {"gpu_budgets"}}

    class DagReaders(SimpleAuthManager):
        def is_authorized_dag(self, *, method, user, access_entity=None, details=None) -> bool:
            return method == "GET" and details is not None and details.id in reads.get(user.username, set())

    manager = DagReaders()
    monkeypatch.setattr(api_app._AuthManagerState, "instance", manager)
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path))
    monkeypatch.delenv("HYBRIDFLOW_LEDGER_URL", raising=False)
    write_record(tmp_path / "private", {
        "run_key": RunIdentity("hybrid_training", RUN_ID).run_key, "dag_id": "hybrid_training", "run_id": RUN_ID,
        "project": "digits-ocr", "team": "perception", "cluster": "onprem-a", "gpu_hours": 2.0,
        "price_per_gpu_hour": 1.25, "recorded_at": "2026-12-19T10:30:00+00:00",
    })
    api = TestClient(create_api_server(apps="core"))

    def get(user: str, path: str):
        token = manager.generate_jwt(SimpleAuthManagerUser(username=user, role="viewer"))
        return api.get(f"/hybridflow{path}", headers={"Authorization": f"Bearer {token}"})

    for user in ("trainer", "nightly"):
        for path in ("/costs", "/api/costs/budgets", "/costs/report/2026-12-19"):
            assert get(user, path).status_code == 403, (user, path)
    nightly_tab = get("nightly", "/costs/runs/gpu_cost_nightly/scheduled__2026-12-20T00:00:00")
    assert nightly_tab.status_code == 404 and "digits-ocr" not in nightly_tab.text and "ranking" not in nightly_tab.text
    assert get("trainer", "/costs/runs/gpu_cost_nightly/scheduled__2026-12-20T00:00:00").status_code == 403
    own = get("trainer", f"/costs/runs/hybrid_training/{RUN_ID}")
    assert own.status_code == 200 and "Budget of digits-ocr" in own.text and "ranking" not in own.text
    finance = get("finance", "/api/costs/budgets")
    assert finance.status_code == 200 and {p["project"] for p in finance.json()["projects"]} == {"digits-ocr", "ranking"}
