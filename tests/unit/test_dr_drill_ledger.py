"""Drills in the ledger: a judged drill's figures, targets and verdict as a row, recorded again
without counting twice, the history newest first, and migration 0006 up and down."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, inspect

from hybridflow.dr.drills.ledger import drill_history, record_drill
from hybridflow.dr.drills.report import Targets
from hybridflow.ledger import upgrade


@pytest.fixture
def ledger(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'ledger.db'}")
    upgrade(engine)
    yield engine
    engine.dispose()


def _report(drill: str, declared_at: str, inference: float, missed: list[str]) -> dict:
    return {"drill": drill, "declared_at": declared_at, "primary": "onprem-a", "dr_cluster": "dr-west",
            "run_key": "train-run-0007", "inference": {"endpoint": "e"}, "checkpoint_interval_steps": 10,
            "targets": Targets().to_dict(), "verdict": "missed" if missed else "met", "missed": missed,
            "figures": {"inference_rto_s": inference, "training_rto_s": 9.5, "rpo_steps_lost": 10,
                        "rpo_dataset_age_s": 60.0}}


def test_a_judged_drill_is_one_row_recorded_again_without_counting_twice(ledger) -> None:
    record_drill(_report("q1", "2027-01-01T06:00:00+00:00", 8.0, []), engine=ledger)
    record_drill(_report("q2", "2027-04-01T06:00:00+00:00", 75.0, ["inference: took 75.0 s"]), engine=ledger)
    record_drill(_report("q1", "2027-01-01T06:00:00+00:00", 7.5, []), engine=ledger)  # judge cleared, run again
    history = drill_history(ledger)
    assert [(r["drill"], r["figures"]["inference_rto_s"], r["verdict"]) for r in history] == [
        ("q2", 75.0, "missed"), ("q1", 7.5, "met")]
    with ledger.connect() as conn:
        row = conn.exec_driver_sql("SELECT target_inference_rto_s, target_rpo_steps, rpo_steps_lost, missed "
                                   "FROM dr_drill WHERE drill = 'q2'").one()
    assert tuple(row) == (60.0, 10, 10, '["inference: took 75.0 s"]')


def test_migration_0006_adds_the_drills_table_and_goes_back_down(tmp_path) -> None:
    from alembic import command

    from hybridflow.ledger.migrate import _config

    engine = create_engine(f"sqlite:///{tmp_path / 'ledger.db'}")
    upgrade(engine)
    assert "dr_drill" in inspect(engine).get_table_names()
    with engine.begin() as conn:
        command.downgrade(_config(conn), "0005")
    assert "dr_drill" not in inspect(engine).get_table_names()
    upgrade(engine)
    assert "dr_drill" in inspect(engine).get_table_names()
    engine.dispose()
