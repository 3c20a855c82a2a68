"""Queue waits in the ledger: one row per (run, try, cluster) replaced on re-record, the admitted
history of a window of days and of some clusters, UTC times either way in and out."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import select, text
from tests.support.ledger_db import ledger_engine  # noqa: F401 (fixture)

from hybridflow.ledger import QueueWait, queue_wait_history, record_queue_wait
from hybridflow.ledger.models import QueueWaitRow

NOW = datetime(2026, 12, 20, 12, 0, tzinfo=UTC)


def _rows(engine):
    with engine.connect() as conn:
        return conn.execute(select(QueueWaitRow).order_by(QueueWaitRow.id)).all()


def test_an_admitted_wait_is_stored_with_its_length_in_naive_utc(ledger_engine):  # noqa: F811
    cest = timezone(timedelta(hours=2))
    record_queue_wait("r1", "try-1", "onprem-a", 4, "normal", datetime(2026, 12, 20, 12, 0, tzinfo=cest),
                      datetime(2026, 12, 20, 10, 14, 30, tzinfo=UTC), "admitted", engine=ledger_engine)
    (row,) = _rows(ledger_engine)
    assert (row.run_key, row.attempt, row.cluster, row.gpus, row.priority, row.outcome) == (
        "r1", "try-1", "onprem-a", 4, "normal", "admitted")
    assert row.queued_at == datetime(2026, 12, 20, 10, 0) and row.admitted_at == datetime(2026, 12, 20, 10, 14, 30)
    assert row.wait_s == 870.0


def test_recording_again_replaces_the_row_of_its_run_try_and_cluster(ledger_engine):  # noqa: F811
    queued = NOW - timedelta(hours=1)
    record_queue_wait("r1", "try-1", "onprem-a", 4, "normal", queued, None, "waiting", engine=ledger_engine)
    record_queue_wait("r1", "try-1", "onprem-a", 4, "normal", queued, None, "waiting", engine=ledger_engine)
    assert [(r.outcome, r.wait_s) for r in _rows(ledger_engine)] == [("waiting", None)]

    # The wait ends: the same row now says admitted, with its length.
    record_queue_wait("r1", "try-1", "onprem-a", 4, "normal", queued, queued + timedelta(minutes=5), "admitted",
                      engine=ledger_engine)
    # Another cluster of the same try, and the next try, are rows of their own.
    record_queue_wait("r1", "try-1", "cloud-east", 4, "normal", queued, None, "moved", engine=ledger_engine)
    record_queue_wait("r1", "try-2", "onprem-a", 4, "normal", queued, None, "gave_up", engine=ledger_engine)
    rows = _rows(ledger_engine)
    assert [(r.attempt, r.cluster, r.outcome, r.wait_s) for r in rows] == [
        ("try-1", "onprem-a", "admitted", 300.0), ("try-1", "cloud-east", "moved", None),
        ("try-2", "onprem-a", "gave_up", None)]
    with ledger_engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM queue_waits")).scalar_one() == 3


@pytest.mark.parametrize(("args", "match"), [
    (dict(outcome="stuck"), "outcome 'stuck' is not one of admitted, moved, gave_up, waiting"),
    (dict(gpus=0), "gpus 0 is not a gang size"),
    (dict(admitted_at=None), "admitted_at is given exactly when the outcome is 'admitted'"),
    (dict(outcome="moved"), "admitted_at is given exactly when the outcome is 'admitted'"),
    (dict(admitted_at=NOW - timedelta(hours=2)), "is before queued_at"),
    (dict(cluster=""), "cluster '' must be a non-empty string"),
])
def test_a_wait_that_makes_no_sense_is_refused_and_nothing_is_written(ledger_engine, args, match):  # noqa: F811
    good = dict(run_key="r1", attempt="try-1", cluster="onprem-a", gpus=4, priority="normal",
                queued_at=NOW - timedelta(hours=1), admitted_at=NOW, outcome="admitted")
    with pytest.raises(ValueError, match=match):
        record_queue_wait(**{**good, **args}, engine=ledger_engine)
    assert _rows(ledger_engine) == []


def test_history_holds_admitted_waits_of_the_window_and_the_clusters_asked_for(ledger_engine):  # noqa: F811
    def wait(run, cluster, gpus, queued_ago, wait_s, outcome="admitted"):
        queued = NOW - queued_ago
        admitted = queued + timedelta(seconds=wait_s) if outcome == "admitted" else None
        record_queue_wait(run, "try-1", cluster, gpus, "normal", queued, admitted, outcome, engine=ledger_engine)

    wait("a", "onprem-a", 4, timedelta(days=1), 600)
    wait("b", "onprem-a", 8, timedelta(days=29, hours=23), 1200)
    wait("c", "onprem-a", 4, timedelta(days=30, minutes=1), 60)  # just outside 30 days
    wait("d", "onprem-a", 4, timedelta(hours=2), 0, outcome="gave_up")
    wait("e", "onprem-a", 4, timedelta(hours=1), 0, outcome="waiting")
    wait("f", "onprem-a", 4, -timedelta(hours=1), 30)  # after `now`: not history yet
    wait("g", "cloud-east", 2, timedelta(days=3), 90)

    history = queue_wait_history(days=30, now=NOW, engine=ledger_engine)
    assert history == [
        QueueWait("onprem-a", 8, 1200.0, NOW - timedelta(days=29, hours=23)),
        QueueWait("cloud-east", 2, 90.0, NOW - timedelta(days=3)),
        QueueWait("onprem-a", 4, 600.0, NOW - timedelta(days=1)),
    ]
    assert all(w.queued_at.tzinfo is not None for w in history)

    assert [w.cluster for w in queue_wait_history(days=30, clusters=["cloud-east"], now=NOW,
                                                  engine=ledger_engine)] == ["cloud-east"]
    assert queue_wait_history(days=30, clusters=[], now=NOW, engine=ledger_engine) == []
    # A shorter window, with `now` as naive UTC.
    short = queue_wait_history(days=2, now=NOW.replace(tzinfo=None), engine=ledger_engine)
    assert [(w.cluster, w.wait_s) for w in short] == [("onprem-a", 600.0)]
    # A longer one reaches the wait just outside 30 days.
    assert len(queue_wait_history(days=31, now=NOW, engine=ledger_engine)) == 4


def test_history_needs_a_window_of_whole_days(ledger_engine):  # noqa: F811
    with pytest.raises(ValueError, match="days 0 must be a whole number >= 1"):
        queue_wait_history(days=0, engine=ledger_engine)
