"""The resource reaper page: the last sweep as an operator reads it (dry-run or not per place, what
was released or would be, GPU-hours stopped, failures), the page before any sweep, names escaped,
an unreadable ledger said so, and that Airflow guards the page."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import create_engine
from sqlalchemy.exc import OperationalError

from hybridflow.ledger import upgrade
from hybridflow.reaper.base import Leftover, Owner, Release, Sweep
from hybridflow.reaper.records import last_sweep, record_sweep
from hybridflow.ui.reaper import add_reaper_pages

T0 = datetime(2027, 3, 1, 10, 0, tzinfo=UTC)


def _client(source) -> TestClient:
    app = FastAPI()
    add_reaper_pages(app, sweep_source=source, authorize=False)
    return TestClient(app)


@pytest.fixture
def ledger(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'ledger.db'}")
    upgrade(engine)
    yield engine
    engine.dispose()


def _record(engine) -> None:
    gang = Leftover("onprem-a", "local-gang", "gang-<script>alert(1)</script>",
                    Owner("hybrid_training", "manual__1", "train", 2), gpus=4, since=T0 - timedelta(hours=3))
    upload = Leftover("cloud-east", "multipart-upload", "s3://cache/datasets/x/blobs/ab/ab12#u1",
                      reason="unfinished for 30.0 h (more than 24.0 h)")
    secret = Leftover("private-k8s", "gang-secret", "hf-run-2-creds", Owner("hybrid_training", "manual__2"))
    sweep = Sweep(started=T0, finished=T0 + timedelta(seconds=9), kept=5,
                  errors={"cloud-west": "cannot reach the API server"},
                  releases=[Release(gang, dry_run=False, released=True, gpu_hours=12.5),
                            Release(upload, dry_run=True, released=False),
                            Release(secret, dry_run=False, released=False, error="forbidden")])
    record_sweep(sweep, key="2027-03-01T10:00:00+00:00", engine=engine)


def test_the_last_sweep_shows_each_place_s_mode_what_went_and_the_gpu_hours_stopped(ledger):
    _record(ledger)
    html = _client(lambda: last_sweep(ledger)).get("/reaper").text
    assert "<h1>Resource reaper</h1>" in html and "Last sweep: 2027-03-01T10:00:00+00:00" in html
    assert "Released 1, would release 1 (dry-run), failed 1, kept 5" in html
    assert "GPU-hours stopped: <b>12.50</b>" in html
    assert "<tr class=''><td>onprem-a</td><td>releasing</td>" in html
    assert "<td>cloud-east</td><td>dry-run</td>" in html
    assert "<tr class='failed'><td>private-k8s</td><td>releasing</td><td class='num'>0</td>" in html
    assert "<td>cloud-west</td><td><span class='muted'>–</span></td>" in html and "cannot reach the API server" in html
    assert "hybrid_training / manual__1 / train (try 2)" in html
    assert "would release (dry-run)" in html and "failed: forbidden" in html
    assert "unfinished for 30.0 h" in html


def test_names_from_the_estate_are_escaped(ledger):
    _record(ledger)
    html = _client(lambda: last_sweep(ledger)).get("/reaper").text
    assert "<script>" not in html and "gang-&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_before_the_first_sweep_the_page_says_so(ledger):
    client = _client(lambda: last_sweep(ledger))
    assert "No sweep yet: the resource_reaper DAG has not recorded one." in client.get("/reaper").text
    assert client.get("/api/reaper/last").json() == {"sweep": None, "note": ""}


def test_the_json_carries_the_same_sweep(ledger):
    _record(ledger)
    body = _client(lambda: last_sweep(ledger)).get("/api/reaper/last").json()["sweep"]
    assert body["started"] == "2027-03-01T10:00:00+00:00" and body["gpu_hours_stopped"] == 12.5
    assert {r["kind"] for r in body["rows"]} == {"local-gang", "multipart-upload", "gang-secret"}


def test_an_unreadable_ledger_is_said_not_hidden():
    def broken():
        raise OperationalError("SELECT", {}, Exception("no such table: reaper_sweep"))

    html = _client(broken).get("/reaper").text
    assert "The ledger could not be read: OperationalError" in html and "No sweep yet" not in html


@pytest.mark.airflow
def test_the_reaper_page_is_in_the_plugin_and_needs_a_signed_in_user():
    from airflow import plugins_manager
    from airflow.api_fastapi.app import create_app as create_api_server

    plugins, _ = plugins_manager._get_plugins()
    ours = next(p for p in plugins if p.name == "hybridflow_ui")
    views = {v["url_route"]: v for v in ours.external_views}
    assert views["hybridflow-reaper"] == {"name": "Resource reaper", "href": "/hybridflow/reaper",
                                          "destination": "nav", "category": "browse", "url_route": "hybridflow-reaper"}
    api = TestClient(create_api_server(apps="core"))
    assert api.get("/hybridflow/reaper").status_code == 401
    assert api.get("/hybridflow/api/reaper/last").status_code == 401
