"""Run records into the ledger: the run, every attempt (failed and preempted ones too), re-ingest is a no-op."""

from __future__ import annotations

from datetime import datetime

import pytest
from sqlalchemy import select, text
from tests.support.ledger_db import ledger_engine  # noqa: F401 (fixture)

from hybridflow.ledger import ingest_run_record
from hybridflow.ledger.models import Attempt, Run
from hybridflow.ledger.runs import RunRecordError
from hybridflow.records import training_summary

ATTEMPTS = [
    {"try_number": 1, "attempt": "t1-a1", "cluster": "cloud-east", "workers": 4,
     "started_at": "2026-11-02T23:00:00+00:00", "seconds": 5400.0, "outcome": "preempted",
     "start_step": 0, "last_step": 900, "last_committed_step": 800},
    {"try_number": 1, "attempt": "t1-a2", "cluster": "cloud-east", "workers": 4,
     "started_at": "2026-11-03T00:40:00+00:00", "seconds": None, "outcome": "interrupted",
     "start_step": 800, "last_step": None},
    {"try_number": 2, "attempt": "t2-a1", "cluster": "onprem-a", "workers": 4,
     "started_at": "2026-11-03T02:00:00+00:00", "seconds": 3600.0, "outcome": "succeeded",
     "start_step": 800, "last_step": 2000},
]


def make_record(attempts=ATTEMPTS, **extra) -> dict:
    return {
        "format": "hybridflow.run-record/v1", "run_key": "hybrid-training-r1-abc", "dag_id": "hybrid_training",
        "run_id": "manual__r1", "project": "digits-ocr", "team": "vision", "cluster": "onprem-a",
        "pricing_class": "onprem", "price_per_gpu_hour": 1.2, "gpu_type": "A100-80GB", "workers": 4,
        "priority": "normal", "gpu_hours": 10.0, "train_attempts": attempts,
        "training": training_summary(attempts, 2000), "recorded_at": "2026-11-03T03:05:00+00:00", **extra,
    }


def test_a_record_stores_its_run_and_every_attempt(ledger_engine):  # noqa: F811
    assert ingest_run_record(make_record(), engine=ledger_engine) == 3
    with ledger_engine.connect() as conn:
        run = conn.execute(select(Run)).one()
        attempts = conn.execute(select(Attempt).order_by(Attempt.seq)).all()
    assert (run.project, run.team, run.gpu_model, run.pricing_class, run.dag_id, run.run_id) == (
        "digits-ocr", "vision", "A100-80GB", "onprem", "hybrid_training", "manual__r1")
    assert [a.outcome for a in attempts] == ["preempted", "interrupted", "succeeded"]
    assert attempts[0].ended_at == datetime(2026, 11, 3, 0, 30)
    # The killed try ran (at most) until the next one started.
    assert attempts[1].ended_at == datetime(2026, 11, 3, 2, 0)
    assert [a.steps_lost for a in attempts] == [100, None, None]
    assert [a.cluster for a in attempts] == ["cloud-east", "cloud-east", "onprem-a"]


def test_ingesting_again_replaces_the_runs_rows(ledger_engine):  # noqa: F811
    ingest_run_record(make_record(), engine=ledger_engine)
    ingest_run_record(make_record(), engine=ledger_engine)
    # A cleared run that now has one more attempt: still one run, the attempts as recorded now.
    more = [*ATTEMPTS, {**ATTEMPTS[2], "try_number": 3, "attempt": "t3-a1", "started_at": "2026-11-03T04:00:00"}]
    assert ingest_run_record(make_record(more), engine=ledger_engine) == 4
    with ledger_engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM run")).scalar_one() == 1
        assert conn.execute(text("SELECT COUNT(*) FROM attempt")).scalar_one() == 4


def test_a_bad_attempt_names_the_field_and_writes_nothing(ledger_engine):  # noqa: F811
    bad = [ATTEMPTS[0], {**ATTEMPTS[1], "started_at": "yesterday"}]
    with pytest.raises(RunRecordError, match=r"train_attempts\[1\]\.started_at: 'yesterday'"):
        ingest_run_record(make_record(bad), engine=ledger_engine)
    with pytest.raises(RunRecordError, match=r"train_attempts\[0\]\.workers"):
        ingest_run_record(make_record([{**ATTEMPTS[0], "workers": "four"}]), engine=ledger_engine)
    with ledger_engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM run")).scalar_one() == 0


def test_the_pipelines_record_step_ingests_the_run(tmp_path, monkeypatch, seeded_private):
    from tests.conftest import copy_seeded

    from hybridflow import pipeline
    from hybridflow.runs import RunIdentity
    from hybridflow.settings import Settings, get_settings

    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HYBRIDFLOW_LEDGER_URL", f"sqlite:///{tmp_path / 'ledger.db'}")
    settings = Settings(home=tmp_path / "home", config_dir=get_settings().config_dir)
    copy_seeded(seeded_private, settings.private_root)  # admission reads the dataset's header and suites
    identity = RunIdentity(dag_id="hybrid_training", run_id="manual__ledger")
    run = pipeline.admit({"project": "digits-ocr", "workers": 2}, identity, settings)
    steps = {"choose_cluster": {"cluster": "onprem-a", "pricing_class": "onprem", "price_per_gpu_hour": 1.2},
             "train": {"attempts": ATTEMPTS[2:], "final_step": 2000, "gpu_seconds": 14400.0}}
    for _ in range(2):  # the record task cleared and run again
        pipeline.record(run, identity, steps, settings)
    from sqlalchemy import create_engine

    with create_engine(f"sqlite:///{tmp_path / 'ledger.db'}").connect() as conn:
        assert conn.execute(text("SELECT run_key, project, cluster FROM run")).one() == (
            identity.run_key, "digits-ocr", "onprem-a")
        assert conn.execute(text("SELECT COUNT(*), MIN(outcome) FROM attempt")).one() == (1, "succeeded")
