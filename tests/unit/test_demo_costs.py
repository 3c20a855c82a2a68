"""The demo's metering and cost allocation: the gpu_metering, gpu_cost_nightly and gpu_budgets task
units in the demo's own process, on the demo's home and ledger, safe to run again."""

from __future__ import annotations

import time
from datetime import UTC, date, datetime, timedelta

import pytest
from sqlalchemy import create_engine, text
from tests.unit.test_ledger_allocation import samples
from tests.unit.test_ledger_runs import make_record

from hybridflow.config import load_estate
from hybridflow.devenv.demo_costs import DemoMeter, allocate_demo_days, days_between, meterable_clusters
from hybridflow.ledger import store_samples
from hybridflow.records import write_record
from hybridflow.settings import get_settings

DAY = date(2026, 11, 3)
RUN = "hybrid-training-r1-abc"


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A demo home with its own SQLite ledger; returns (home, engine on that ledger)."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HYBRIDFLOW_LEDGER_URL", url)
    engine = create_engine(url)
    yield tmp_path / "home", engine
    engine.dispose()


def _table(engine, sql: str) -> list[tuple]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(sql))]


def test_the_demo_days_are_synced_allocated_and_budgeted_once_however_often(home) -> None:
    root, engine = home
    write_record(root / "private", make_record())  # not ingested yet: the sync step brings it in
    batch = samples(RUN, 60.0, datetime(2026, 11, 3, 2, tzinfo=UTC), 30)  # what metering stored of the run
    store_samples(batch, {s.key(): RUN for s in batch})
    rows_sql = ("SELECT day, project, cluster, pricing_class, gpu_hours, effective_gpu_hours, cost_usd, attempts "
                "FROM allocation ORDER BY cluster, pricing_class")
    first = allocate_demo_days([DAY])
    rows = _table(engine, rows_sql)
    assert first["synced"]["ingested"] == 1 and sum(r[7] for r in rows) == 3  # the record's attempts, each once
    # 0.5 h and 1 h 20 min of the spot tries and the onprem try's hour, on 4 GPUs; the run's use: 60 %
    assert first["gpu_hours"] == pytest.approx(4 * (0.5 + 4 / 3 + 1.0))
    assert first["effective_gpu_hours"] == pytest.approx(first["gpu_hours"] * 0.6)
    assert first["cost_usd"] == pytest.approx(sum(r[6] for r in rows)) and first["idle_cost_usd"] > 0
    again = allocate_demo_days([DAY])
    assert (again["gpu_hours"], again["cost_usd"]) == (first["gpu_hours"], first["cost_usd"])
    assert _table(engine, rows_sql) == rows
    [(spend,)] = _table(engine, "SELECT spend_usd FROM budget_state WHERE project = 'digits-ocr' "
                                "AND period = '2026-11'")
    assert spend == pytest.approx(again["cost_usd"])
    assert [p["period"] for p in again["budgets"]] == ["2026-11"]
    assert (root / "private" / "reports" / "allocation" / DAY.isoformat() / "report.html").is_file()


def test_a_metering_pass_reads_the_local_slots_and_names_what_failed(home) -> None:
    _, engine = home
    meter = DemoMeter(["onprem-a", "no-such-cluster"])
    now = datetime.now(UTC)
    meter.meter_once(now)
    meter.meter_once(now + timedelta(seconds=3))
    gpus = sum(p.gpus for p in load_estate(get_settings().config_dir).clusters["onprem-a"].node_pools)
    assert (meter.totals.passes, meter.totals.samples, meter.totals.attributed) == (2, 2 * gpus, 0)
    assert len(meter.totals.errors) == 2 and "no-such-cluster" in meter.totals.errors[0]
    assert _table(engine, "SELECT count(DISTINCT ts), count(*) FROM gpu_sample") == [(2, 2 * gpus)]


def test_the_meter_passes_until_stopped(home) -> None:
    meter = DemoMeter(["onprem-a"], every_s=0.05).start()
    deadline = time.monotonic() + 30
    while meter.totals.passes < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    totals = meter.stop()
    assert totals.passes >= 2 and not totals.errors
    assert meter.totals.passes == totals.passes and not meter._thread.is_alive()


def test_metered_clusters_and_allocated_days() -> None:
    estate = load_estate(get_settings().config_dir)
    local = sorted(n for n, c in estate.clusters.items() if c.backend == "local")
    assert meterable_clusters(estate) == local
    late, early = datetime(2026, 11, 30, 23, 59, tzinfo=UTC), datetime(2026, 12, 1, 0, 2, tzinfo=UTC)
    assert days_between(late, early) == [date(2026, 11, 30), date(2026, 12, 1)]
    assert days_between(early, early) == [date(2026, 12, 1)]
