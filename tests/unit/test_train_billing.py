"""The train task notes every attempt in the ledger as it starts and ends, so GPU time of a run
that fails (and never reaches its record step) is still billed; the run record replaces the rows."""

from __future__ import annotations

import logging

from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from hybridflow.ledger import ingest_run_record
from hybridflow.ledger.models import Attempt, Run
from hybridflow.request import AdmittedRun, RunRequest
from hybridflow.runs import RunIdentity
from hybridflow.training.attempts import note_in_ledger

PLACEMENT = {"cluster": "cloud-east", "pricing_class": "spot", "price_per_gpu_hour": 1.45}


def _admitted() -> AdmittedRun:
    req = RunRequest(project="digits-ocr", workers=2)
    return AdmittedRun(**req.model_dump(), team="perception", dataset_location="file:///data/digits")


def _attempts(*outcomes: str) -> list[dict]:
    return [
        {"try_number": i + 1, "attempt": f"try-{i + 1}", "cluster": "cloud-east", "workers": 2,
         "started_at": f"2026-12-01T0{i}:00:00+00:00", "seconds": None if o == "running" else 1800.0,
         "outcome": o, "_t0": 0.0}
        for i, o in enumerate(outcomes)
    ]


def _rows(url: str):
    engine = create_engine(url)
    with Session(engine) as s:
        run = s.scalars(select(Run)).all()
        attempts = s.scalars(select(Attempt).order_by(Attempt.seq)).all()
        out = run, [(a.try_number, a.outcome, a.gpus, a.cluster, a.ended_at is not None) for a in attempts]
    engine.dispose()
    return out


def test_a_failed_try_is_in_the_ledger_before_any_run_record(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    monkeypatch.setenv("HYBRIDFLOW_LEDGER_URL", url)
    bill = {"run_key": "r-1", "admitted": _admitted(), "identity": RunIdentity("hybrid_training", "manual__1", 2),
            "placement": PLACEMENT, "log": logging.getLogger("t")}

    note_in_ledger(_attempts("running"), **bill)  # the gang just started
    runs, attempts = _rows(url)
    assert [(r.project, r.team, r.pricing_class) for r in runs] == [("digits-ocr", "perception", "spot")]
    assert attempts == [(1, "running", 2, "cloud-east", True)]  # open-ended: billed up to now

    note_in_ledger(_attempts("failed", "running"), **bill)  # try 1 failed, try 2 started
    _, attempts = _rows(url)
    assert [a[:3] for a in attempts] == [(1, "failed", 2), (2, "running", 2)]  # replaced, not added

    # The run record, when it comes, replaces the provisional rows.
    ingest_run_record({"run_key": "r-1", "project": "digits-ocr", "team": "perception", "cluster": "cloud-east",
                       "workers": 2, "recorded_at": "2026-12-01T03:00:00+00:00",
                       "train_attempts": [{k: v for k, v in a.items() if k != "_t0"}
                                          for a in _attempts("failed", "succeeded")]})
    _, attempts = _rows(url)
    assert [a[:2] for a in attempts] == [(1, "failed"), (2, "succeeded")]


def test_an_unreachable_ledger_never_stops_training(monkeypatch, caplog):
    monkeypatch.setenv("HYBRIDFLOW_LEDGER_URL", "postgresql+psycopg2://nobody@127.0.0.1:1/none")
    bill = {"run_key": "r-2", "admitted": _admitted(), "identity": RunIdentity("d", "r"),
            "placement": PLACEMENT, "log": logging.getLogger("t")}
    with caplog.at_level(logging.WARNING):
        note_in_ledger(_attempts("running"), **bill)
    assert "could not note the training attempts in the ledger" in caplog.text
