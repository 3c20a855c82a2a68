"""Run records written before (or missed by) the ledger are synced in; the ledger's location comes from
the environment, the hybridflow_ledger Connection, or a SQLite file."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from tests.support.ledger_db import PG_SCHEMA, PG_URL, ledger_engine, postgres_engine  # noqa: F401 (fixture)
from tests.unit.test_ledger_runs import ATTEMPTS, make_record

from hybridflow.errors import ConfigError
from hybridflow.ledger import ingest_run_record
from hybridflow.ledger.engine import ledger_url
from hybridflow.ledger.sync import sync_run_records
from hybridflow.records import write_record


def _counts(engine) -> tuple[int, int]:
    with engine.connect() as conn:
        return (conn.execute(text("SELECT COUNT(*) FROM run")).scalar_one(),
                conn.execute(text("SELECT COUNT(*) FROM attempt")).scalar_one())


def test_records_written_before_are_synced_once_and_a_bad_one_is_named(ledger_engine, tmp_path):  # noqa: F811
    private = tmp_path / "private"
    write_record(private, make_record())
    write_record(private, make_record(ATTEMPTS[:1], run_key="r-old", project="ranking", team="search"))
    bad = private / "records" / "ranking" / "r-bad.json"
    bad.write_text(json.dumps(make_record([{**ATTEMPTS[0], "workers": -1}], run_key="r-bad", project="ranking")))
    (private / "records" / "ranking" / "torn.json").write_text('{"run_key": ')

    first = sync_run_records(private, engine=ledger_engine)
    assert sorted(first.ingested) == ["hybrid-training-r1-abc", "r-old"]
    assert set(first.errors) == {str(bad), str(private / "records" / "ranking" / "torn.json")}
    assert "train_attempts[0].workers" in first.errors[str(bad)]
    assert _counts(ledger_engine) == (2, 4)
    # Again: the same rows, nothing twice.
    assert sorted(sync_run_records(private, engine=ledger_engine).ingested) == sorted(first.ingested)
    assert _counts(ledger_engine) == (2, 4)
    assert sync_run_records(private, engine=ledger_engine, project="digits-ocr").ingested == ["hybrid-training-r1-abc"]


def test_a_later_note_from_the_train_task_is_not_replaced_by_an_older_record(ledger_engine, tmp_path):  # noqa: F811
    private = tmp_path / "private"
    write_record(private, make_record())  # recorded 03:05
    # The run was cleared and its train task noted a new attempt at 05:00, before its record step ran.
    rerun = [*ATTEMPTS, {**ATTEMPTS[2], "try_number": 3, "attempt": "t3-a1", "started_at": "2026-11-03T05:00:00"}]
    ingest_run_record(make_record(rerun, recorded_at="2026-11-03T05:00:00+00:00"), engine=ledger_engine)
    result = sync_run_records(private, engine=ledger_engine)
    assert (result.ingested, result.kept_newer) == ([], ["hybrid-training-r1-abc"])
    assert _counts(ledger_engine) == (1, 4)


def test_cli_sync_prints_what_it_did_and_fails_on_a_bad_record(tmp_path):
    home, db = tmp_path / "home", tmp_path / "cli.db"
    write_record(home / "private", make_record())
    env = {"HYBRIDFLOW_LEDGER_URL": f"sqlite:///{db}", "HYBRIDFLOW_HOME": str(home), "PATH": "/usr/bin"}
    cmd = [sys.executable, "-m", "hybridflow.cli", "ledger", "sync"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ingested"] == 1
    (home / "private" / "records" / "digits-ocr" / "x.json").write_text("[]")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "not a JSON object" in out.stdout
    assert _counts(create_engine(f"sqlite:///{db}")) == (1, 3)


def test_the_ledger_url_comes_from_the_environment_the_connection_or_sqlite(tmp_path, monkeypatch):
    monkeypatch.delenv("HYBRIDFLOW_LEDGER_URL", raising=False)
    monkeypatch.delenv("AIRFLOW_CONN_HYBRIDFLOW_LEDGER", raising=False)
    assert ledger_url(tmp_path) == f"sqlite:///{tmp_path / 'ledger' / 'ledger.db'}"
    monkeypatch.setenv("AIRFLOW_CONN_HYBRIDFLOW_LEDGER", json.dumps({
        "conn_type": "postgres", "host": "127.0.0.1", "port": 5432, "login": "postgres", "password": "s3cr@t",
        "schema": "test", "extra": {"options": f"-csearch_path={PG_SCHEMA}"}}))
    url = ledger_url(tmp_path)
    assert url.password == "s3cr@t" and "s3cr@t" not in str(url)  # rendered without the password
    assert make_url(url).render_as_string(hide_password=True) == (
        f"postgresql+psycopg2://postgres:***@127.0.0.1:5432/test?options=-csearch_path%3D{PG_SCHEMA}")
    monkeypatch.setenv("HYBRIDFLOW_LEDGER_URL", "sqlite:///elsewhere.db")
    assert ledger_url(tmp_path) == "sqlite:///elsewhere.db"
    monkeypatch.delenv("HYBRIDFLOW_LEDGER_URL")
    monkeypatch.setenv("AIRFLOW_CONN_HYBRIDFLOW_LEDGER", "mysql://u:p@h/db")
    with pytest.raises(ConfigError, match="'hybridflow_ledger' has type 'mysql'.*'postgres'"):
        ledger_url(tmp_path)


def test_the_connection_reaches_postgresql_in_its_own_schema(tmp_path, monkeypatch):
    from hybridflow.ledger import upgrade

    postgres_engine().dispose()  # a fresh schema, or skip when the server is not there
    pg = make_url(PG_URL)
    monkeypatch.delenv("HYBRIDFLOW_LEDGER_URL", raising=False)
    monkeypatch.setenv("AIRFLOW_CONN_HYBRIDFLOW_LEDGER", json.dumps({
        "conn_type": "postgres", "host": pg.host, "port": pg.port, "login": pg.username, "schema": pg.database,
        "extra": {"options": f"-csearch_path={PG_SCHEMA}"}}))
    upgrade(ledger_url(tmp_path))
    with create_engine(pg).connect() as conn:
        tables = conn.execute(text("SELECT table_name FROM information_schema.tables WHERE table_schema = :s"),
                              {"s": PG_SCHEMA}).scalars().all()
    assert {"run", "attempt", "allocation", "hybridflow_ledger_version"} <= set(tables)
