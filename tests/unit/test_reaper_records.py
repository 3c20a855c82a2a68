"""The reaper's sweeps in the ledger: migration 0004 adds (and removes) their tables, a sweep recorded
again under its key replaces itself, and the newest sweep reads back with its counts and GPU-hours."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import create_engine, inspect, text
from tests.support.ledger_db import postgres_engine

from hybridflow.ledger import upgrade
from hybridflow.reaper.base import Leftover, Owner, Release, Sweep
from hybridflow.reaper.records import last_sweep, record_sweep

T0 = datetime(2027, 3, 1, 10, 0, tzinfo=UTC)
REAPER_TABLES = {"reaper_sweep", "reaper_release"}


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request, tmp_path):
    if request.param == "sqlite":
        eng = create_engine(f"sqlite:///{tmp_path / 'ledger.db'}")
    else:
        eng = postgres_engine("hybridflow_reaper_records_test")
    yield eng
    eng.dispose()


def _sweep(started: datetime, *, dry_run: bool, fail: bool = False) -> Sweep:
    gang = Leftover("onprem-a", "local-gang", "hf-train-run-1-abc", Owner("hybrid_training", "manual__1", "train", 2),
                    gpus=4, since=started - timedelta(hours=3))
    upload = Leftover("cloud-east", "multipart-upload", "datasets/x/blobs/ab/abc#up-1", reason="unfinished for 30 h")
    releases = [
        Release(gang, dry_run=dry_run, released=not dry_run and not fail, gpu_hours=6.0,
                error="permission denied" if fail else ""),
        Release(upload, dry_run=dry_run, released=not dry_run),
    ]
    return Sweep(started=started, finished=started + timedelta(seconds=12), releases=releases, kept=3,
                 errors={"cloud-west": "cannot reach the cluster"})


def test_0004_adds_the_reaper_tables_to_a_0003_ledger_and_goes_back_down(engine):
    from alembic import command

    from hybridflow.ledger.migrate import _config

    upgrade(engine, "0003")
    assert not set(inspect(engine).get_table_names()) & REAPER_TABLES
    upgrade(engine)
    assert REAPER_TABLES <= set(inspect(engine).get_table_names())
    uniques = [u["column_names"] for u in inspect(engine).get_unique_constraints("reaper_release")]
    assert uniques == [["sweep_key", "place", "kind", "name"]]
    record_sweep(_sweep(T0, dry_run=True), key="2027-03-01T09:00", engine=engine)

    with engine.begin() as conn:
        command.downgrade(_config(conn), "0003")
    assert not set(inspect(engine).get_table_names()) & REAPER_TABLES
    with engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM hybridflow_ledger_version")).scalars().all() == ["0003"]


def test_no_sweep_yet_reads_as_none(engine):
    upgrade(engine)
    assert last_sweep(engine) is None


def test_the_newest_sweep_reads_back_with_counts_gpu_hours_and_each_row(engine):
    upgrade(engine)
    record_sweep(_sweep(T0 - timedelta(hours=1), dry_run=True), key="older", engine=engine)
    record_sweep(_sweep(T0, dry_run=False, fail=True), key="newer", engine=engine)

    last = last_sweep(engine)
    assert last["key"] == "newer" and last["started"] == T0 and last["finished"] == T0 + timedelta(seconds=12)
    assert (last["released"], last["failed"], last["listed"], last["kept"]) == (1, 1, 0, 3)
    assert last["gpu_hours_stopped"] == 0.0  # the only GPU holder failed to be released
    assert last["errors"] == {"cloud-west": "cannot reach the cluster"}
    gang = next(r for r in last["rows"] if r["kind"] == "local-gang")
    assert gang["owner"] == {"dag_id": "hybrid_training", "run_id": "manual__1", "task_id": "train", "try_number": 2}
    assert gang["error"] == "permission denied" and gang["gpus"] == 4 and gang["since"] == T0 - timedelta(hours=3)
    assert last["places"]["cloud-east"] == {"dry_run": False, "released": 1, "listed": 0, "failed": 0}


def test_recording_a_sweep_again_under_its_key_replaces_it(engine):
    upgrade(engine)
    record_sweep(_sweep(T0, dry_run=True), key="2027-03-01T10:00", engine=engine)
    record_sweep(_sweep(T0, dry_run=False), key="2027-03-01T10:00", engine=engine)  # the same sweep, run again

    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM reaper_sweep")).scalar() == 1
        assert conn.execute(text("SELECT count(*) FROM reaper_release")).scalar() == 2
    last = last_sweep(engine)
    assert last["released"] == 2 and last["listed"] == 0 and last["gpu_hours_stopped"] == 6.0
    assert all(not p["dry_run"] for p in last["places"].values())


def test_a_dry_run_sweep_counts_what_it_would_stop():
    engine = create_engine("sqlite://")
    upgrade(engine)
    record_sweep(_sweep(T0, dry_run=True), key="k", engine=engine)
    last = last_sweep(engine)
    assert last["released"] == 0 and last["listed"] == 2
    assert last["gpu_hours_stopped"] == 0.0 and last["gpu_hours_would_stop"] == 6.0
    assert last["places"]["onprem-a"]["dry_run"] is True
