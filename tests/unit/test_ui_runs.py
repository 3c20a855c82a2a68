"""The runs pages in the Airflow UI: what an operator sees for a run, and that Airflow guards them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from hybridflow import pipeline
from hybridflow.records import write_record
from hybridflow.runs import RunIdentity, run_dir
from hybridflow.settings import REPO_ROOT, Settings
from hybridflow.ui.runs import create_app

RUN_ID = "manual__2026-12-03T10:00:00+00:00"


@pytest.fixture
def settings(tmp_path: Path, seeded_private: Path) -> Settings:
    from tests.conftest import copy_seeded

    copy_seeded(seeded_private, tmp_path / "private")
    return Settings(home=tmp_path, config_dir=REPO_ROOT / "config")


@pytest.fixture
def client(settings: Settings) -> TestClient:
    return TestClient(create_app(settings.private_root, authorize=False))


def _placed_run(settings: Settings, params: dict) -> dict:
    identity = RunIdentity("hybrid_training", RUN_ID)
    run = pipeline.admit(params, identity, settings)
    return pipeline.choose_cluster(run, settings)


def test_run_page_shows_the_winner_and_why_each_other_cluster_lost(settings, client):
    placement = _placed_run(settings, {"gpu_type": "H100-80GB"})
    assert placement["cluster"] == "cloud-east"
    page = client.get(f"/runs/hybrid_training/{RUN_ID}")
    assert page.status_code == 200
    html = page.text
    assert "<b>cloud-east</b> / h100-on-demand" in html
    assert "class='won'><td>cloud-east" in html
    # The private cluster lost for a reason the operator can read.
    assert "class='lost'><td>onprem-a" in html and "offers no H100-80GB GPUs" in html
    assert "The train task has not started." in html and "The record step has not run yet" in html


def test_run_page_shows_a_failover(settings, client):
    run = pipeline.admit({"gpu_type": "H100-80GB"}, RunIdentity("hybrid_training", RUN_ID), settings)
    placement = pipeline.choose_cluster(run, settings)
    placement["failovers"] = [{"cluster": "onprem-x", "reason": "gang not admitted within 120 s"}]
    folder = run_dir(settings.private_root, run["run_key"])
    (folder / "placement.json").write_text(json.dumps(placement))
    html = client.get(f"/runs/hybrid_training/{RUN_ID}").text
    assert "Failed over from:" in html and "onprem-x: gang not admitted within 120 s" in html


def test_run_page_shows_where_a_waiting_gang_stands(settings, client):
    import time

    from hybridflow.backends.base import QueueStanding
    from hybridflow.queueing import note_standing
    from hybridflow.waits import WaitEstimate

    run = pipeline.admit({"classification": "restricted"}, RunIdentity("hybrid_training", RUN_ID), settings)
    pipeline.choose_cluster(run, settings)
    note_standing(settings.private_root, run["run_key"], cluster="onprem-a", state="waiting",
                  queued_since=time.time() - 600, standing=QueueStanding("onprem-a", 2, 4, 0, 4),
                  estimate=WaitEstimate("onprem-a", 900, "p80 of 7 waits of 1-4 GPU gangs on onprem-a", 7))
    html = client.get(f"/runs/hybrid_training/{RUN_ID}").text
    assert "<h2>Queue</h2>" in html and "position 2, 4 GPUs ahead" in html and "0 of 4" in html
    assert "p80 of 7 waits of 1-4 GPU gangs on onprem-a" in html and ">waiting<" in html


def test_run_page_after_the_record_shows_attempts_and_artefacts(settings, client):
    _placed_run(settings, {})
    identity = RunIdentity("hybrid_training", RUN_ID)
    folder = run_dir(settings.private_root, identity.run_key)
    attempts = [
        {"try_number": 1, "cluster": "onprem-a", "workers": 2, "started_at": "t1", "seconds": 3.5, "outcome": "failed"},
        {"try_number": 2, "cluster": "onprem-a", "workers": 2, "started_at": "t2", "seconds": 9.1, "outcome": "succeeded"},
    ]
    (folder / "train-attempts.json").write_text(json.dumps(attempts))
    write_record(
        settings.private_root,
        {
            "run_key": identity.run_key, "dag_id": "hybrid_training", "run_id": RUN_ID, "project": "digits-ocr",
            "team": "perception", "workers": 2, "gpu_type": "A100-80GB", "gpu_hours": 0.00702,
            "checkpoints": {"count": 6, "resumed_from_step": 100, "final_step": 300},
            "model": "breast-cancer", "dataset": "breast-cancer", "classification": "restricted", "regions": ["eu"],
            "dataset_version": "0123abcd",
            "metric": {"name": "roc_auc", "value": 0.9611, "direction": "higher", "gate": 0.95, "passed": True},
            "artefacts": {"model": "/p/model"}, "recorded_at": "2026-12-03T10:05:00+00:00",
        },
    )
    html = client.get(f"/runs/hybrid_training/{RUN_ID}").text
    assert "<td>failed</td>" in html and "<td>succeeded</td>" in html
    assert "6 written, resumed from step 100, final step 300" in html
    assert "/p/model" in html and "roc_auc 0.9611 (gate 0.95)" in html
    assert "breast-cancer (restricted, regions eu), version 0123abcd" in html
    listing = client.get("/runs").text
    assert f"href='runs/hybrid_training/{RUN_ID}'" in listing and "digits-ocr" in listing
    assert "roc_auc 0.9611" in listing and "breast-cancer" in listing
    body = client.get(f"/api/runs/hybrid_training/{RUN_ID}").json()
    assert body["placement"]["cluster"] == "onprem-a" and body["record"]["gpu_hours"] == 0.00702


def test_run_page_shows_a_preempted_attempt_and_the_steps_it_cost(settings, client):
    _placed_run(settings, {})
    identity = RunIdentity("hybrid_training", RUN_ID)
    attempts = [
        {"try_number": 1, "attempt": "try-1", "cluster": "onprem-a", "workers": 2, "started_at": "t1",
         "seconds": 4.0, "outcome": "preempted", "start_step": 0, "last_step": 106, "last_committed_step": 106},
        {"try_number": 1, "attempt": "try-1-relaunch-1", "cluster": "onprem-a", "workers": 2, "started_at": "t2",
         "seconds": 9.0, "outcome": "succeeded", "start_step": 106, "last_step": 300, "last_committed_step": 300},
    ]
    (run_dir(settings.private_root, identity.run_key) / "train-attempts.json").write_text(json.dumps(attempts))
    write_record(
        settings.private_root,
        {
            "run_key": identity.run_key, "dag_id": "hybrid_training", "run_id": RUN_ID, "project": "digits-ocr",
            "checkpoints": {"count": 7, "resumed_from_step": 106, "final_step": 300},
            "training": {"steps_trained": 300, "preemptions": 1, "steps_lost": 0},
        },
    )
    html = client.get(f"/runs/hybrid_training/{RUN_ID}").text
    assert "<td>try-1-relaunch-1</td>" in html and "<td>preempted</td><td>0</td><td>106</td><td>106</td>" in html
    assert "300 steps trained, 1 preemptions, 0 steps redone" in html


def test_unknown_run_says_so_and_markup_in_names_is_escaped(client):
    html = client.get("/runs/hybrid_training/<script>alert(1)</script>").text
    assert "<script>alert(1)" not in html and "&lt;script&gt;" in html
    assert "admit refused it or it has not started" in html


@pytest.mark.airflow
def test_plugin_is_loaded_by_airflow_and_its_pages_need_a_signed_in_user():
    from airflow import plugins_manager
    from airflow.api_fastapi.app import create_app as create_api_server

    plugins, _ = plugins_manager._get_plugins()
    ours = [p for p in plugins if p.name == "hybridflow_ui"]
    assert ours, "plugins/hybridflow_ui.py was not loaded"
    views = {v["url_route"]: v for v in ours[0].external_views}
    assert views["hybridflow-run"]["destination"] == "dag_run"
    assert views["hybridflow-run"]["href"] == "/hybridflow/runs/{DAG_ID}/{RUN_ID}"
    api = TestClient(create_api_server(apps="core"))
    assert api.get("/hybridflow/runs").status_code == 401
    assert api.get(f"/hybridflow/runs/hybrid_training/{RUN_ID}").status_code == 401
