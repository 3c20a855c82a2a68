"""The deploy on the run's page: the gate's load test (new beside serving version, the bars), each
canary step's figures and verdict, and the reason of a rollback, from the record or, when the deploy
failed before the record step, from the run folder's deploy.json."""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from hybridflow import pipeline
from hybridflow.records import build_record, write_record
from hybridflow.runs import RunIdentity, run_dir
from hybridflow.settings import REPO_ROOT, Settings
from hybridflow.ui.runs import create_app

RUN_ID = "manual__2026-12-04T09:00:00+00:00"
BARS = {"p99_ms": 250.0, "min_rps": 50.0, "max_error_rate": 0.0, "max_p99_regression": 0.5, "concurrency": 8,
        "duration_s": 5.0}


def figs(requests, rps, p50, p99, failures=0):
    return {"requests": requests, "failures": failures, "error_rate": failures / requests, "rps": rps,
            "p50_ms": p50, "p99_ms": p99}


def outcome(**changes) -> dict:
    base = {
        "endpoint": "digits", "version": "run-b", "previous_version": "run-a", "model": "digits-mlp",
        "variant": "int8", "target": "local",
        "smoke_metric": {"name": "accuracy", "value": 0.9611, "gate": 0.9},
        "gate": {"new": figs(2100, 412.3, 7.25, 31.4), "serving": figs(1500, 298.7, 11.5, 48.25), "bars": BARS,
                 "passed": True, "reasons": []},
        "canary": [
            {"percent": 10, "canary": figs(61, 20.1, 8.0, 22.5), "stable": figs(540, 179.6, 9.1, 30.0),
             "passed": True, "reasons": []},
            {"percent": 50, "canary": figs(300, 99.9, 8.2, 25.0), "stable": figs(301, 100.2, 9.0, 29.0),
             "passed": True, "reasons": []},
            {"percent": 100, "canary": figs(610, 203.0, 8.1, 24.0), "stable": None, "passed": True, "reasons": []},
        ],
        "rolled_back": None, "status": "deployed",
    }
    return {**base, **changes}


@pytest.fixture
def settings(tmp_path: Path, seeded_private: Path) -> Settings:
    from tests.conftest import copy_seeded

    copy_seeded(seeded_private, tmp_path / "private")
    return Settings(home=tmp_path, config_dir=REPO_ROOT / "config")


@pytest.fixture
def client(settings: Settings) -> TestClient:
    return TestClient(create_app(settings.private_root, authorize=False))


def _admitted_run(settings: Settings) -> dict:
    return pipeline.admit({}, RunIdentity("hybrid_training", RUN_ID), settings)


def _run_folder(settings: Settings) -> Path:
    """The run's folder as the steps before deploy leave it (the deploy writes deploy.json there)."""
    folder = run_dir(settings.private_root, RunIdentity("hybrid_training", RUN_ID).run_key)
    folder.mkdir(parents=True)
    return folder


def test_the_record_keeps_the_deploy_figures_and_the_page_shows_them_side_by_side(settings, client):
    run = _admitted_run(settings)
    identity = RunIdentity("hybrid_training", RUN_ID)
    rec = build_record(pipeline._admitted(run), identity,
                       {"deploy": {**outcome(), "deployed": True, "endpoint_url": "http://127.0.0.1:8790/v1/models/digits",
                                   "seconds": 21.0}})
    assert rec["deploy"]["gate"]["new"]["p99_ms"] == 31.4 and len(rec["deploy"]["canary"]) == 3
    assert rec["model_version"] == "run-b"
    write_record(settings.private_root, rec)
    html = client.get(f"/runs/hybrid_training/{RUN_ID}").text
    assert "<h2>Deploy</h2>" in html and "accuracy 0.9611 (gate 0.9)" in html
    assert "Gate: <b>passed</b> (8 users for 5 s each)" in html
    assert "<th>new run-b</th><th>serving run-a</th><th>bar</th>" in html
    # Each figure of the new version beside the serving version's, and its bar.
    assert "<tr><th>requests/s</th><td>412.3</td><td>298.7</td><td>≥ 50</td></tr>" in html
    assert "<tr><th>p99 ms</th><td>31.40</td><td>48.25</td><td>≤ 250; ≤ serving × 1.5</td></tr>" in html
    assert "<tr><th>error rate</th><td>0.00%</td><td>0.00%</td><td>≤ 0.00%</td></tr>" in html
    assert "<td rowspan='2'>10 %</td><td>canary</td><td>61</td><td>20.1</td>" in html
    assert "<td>stable</td><td>540</td><td>179.6</td>" in html
    assert html.count("<b>passed</b>") == 4 and "Rolled back" not in html
    assert client.get(f"/api/runs/hybrid_training/{RUN_ID}").json()["record"]["deploy"]["status"] == "deployed"


def test_a_failed_deploy_shows_the_failed_step_and_the_rollback_reason_from_the_run_folder(settings, client):
    folder = _run_folder(settings)
    reason = "the canary's p99 412.0 ms is above the gate's 250 ms (serving.gate.p99_ms)"
    failed = outcome(
        canary=[outcome()["canary"][0], {"percent": 50, "canary": figs(290, 96.0, 180.0, 412.0),
                                         "stable": figs(310, 103.0, 9.0, 29.0), "passed": False, "reasons": [reason]}],
        rolled_back={"step": 50, "reason": reason, "serving": "run-a"}, status="rolled_back",
    )
    (folder / "deploy.json").write_text(json.dumps(failed))
    html = client.get(f"/runs/hybrid_training/{RUN_ID}").text
    assert "The record step has not run yet" in html
    assert f"<b>Rolled back</b> at the 50 % traffic step: {escape(reason)}; run-a serves." in html
    assert "<b class='failed'>failed</b>" in html and "<td>412.00</td>" in html


def test_a_gate_that_failed_shows_its_reasons_and_a_redeploy_of_the_serving_version_says_nothing_changed(
        settings, client):
    folder = _run_folder(settings)
    reason = "throughput 31.5 requests/s is below the gate's 50 requests/s (serving.gate.min_rps)"
    gate = {**outcome()["gate"], "new": figs(160, 31.5, 120.0, 240.0), "passed": False, "reasons": [reason]}
    (folder / "deploy.json").write_text(json.dumps(outcome(gate=gate, canary=[], status="rolled_back",
                                                          rolled_back={"step": "gate", "reason": reason,
                                                                       "serving": "run-a"})))
    html = client.get(f"/runs/hybrid_training/{RUN_ID}").text
    assert "Gate: <b class='failed'>failed</b>" in html and f"<li>{escape(reason)}</li>" in html
    assert "Rolled back</b> at the gate step" in html and "Canary steps" not in html
    (folder / "deploy.json").write_text(json.dumps(outcome(previous_version="run-b", gate=None, canary=[],
                                                          status="kept")))
    assert "This version was already serving: nothing changed." in client.get(f"/runs/hybrid_training/{RUN_ID}").text
