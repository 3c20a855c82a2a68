"""The nightly allocation of a day: every attempt priced, utilisation-weighted, waste and preemption
flagged, idle owned capacity billed to teams, conservation, and a re-run that changes nothing."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import pytest
from sqlalchemy import text
from tests.support.ledger_db import ledger_engine  # noqa: F401 (fixture)
from tests.unit.test_ledger_runs import make_record

from hybridflow.budgets.spend import allocated_spend
from hybridflow.config import load_estate
from hybridflow.ledger import ingest_run_record, store_samples
from hybridflow.ledger.allocation import PLATFORM, AllocationError, allocate_day, sync_prices
from hybridflow.metering.records import GpuSample
from hybridflow.settings import get_settings

DAY = date(2026, 11, 3)


def samples(run_key: str, util: float, start: datetime, minutes: int, gpus: int = 4) -> list[GpuSample]:
    return [GpuSample(ts=start + timedelta(minutes=m), cluster="onprem-a", node="n1", gpu_uuid=f"GPU-{run_key}-{g}",
                      gpu_index=g, gpu_model="A100-80GB", mig_profile=None, mig_instance=None, namespace=None,
                      pod=None, container=None, util_pct=util, mem_used_mib=1.0, mem_free_mib=1.0, power_w=100.0,
                      temp_c=None, energy_mj=None, xid=None, ecc_sbe=None, ecc_dbe=None)
            for m in range(minutes) for g in range(gpus)]


@pytest.fixture
def ledger(ledger_engine, tmp_path):  # noqa: F811
    engine = ledger_engine
    estate = load_estate(get_settings().config_dir)
    ingest_run_record(make_record(), engine=engine)  # r1: spot tries on cloud-east, then onprem-a
    idle_run = make_record(
        [{"try_number": 1, "attempt": "a1", "cluster": "onprem-a", "workers": 4, "outcome": "failed",
          "started_at": "2026-11-03T10:00:00+00:00", "seconds": 7200.0, "start_step": 0, "last_step": 10}],
        run_key="r2-idle", project="ranking", team="search")
    ingest_run_record(idle_run, engine=engine)
    at = datetime(2026, 11, 3, tzinfo=UTC)
    batch = samples("hybrid-training-r1-abc", 60.0, at + timedelta(hours=2), 30) + samples("r2-idle", 5.0,
                                                                                          at + timedelta(hours=10), 30)
    store_samples(batch, {s.key(): ("r2-idle" if "r2" in s.gpu_uuid else "hybrid-training-r1-abc") for s in batch},
                  engine=engine)
    return engine, estate, tmp_path / "private"


def _rows(engine):
    with engine.connect() as conn:
        alloc = conn.execute(text(
            "SELECT day, project, team, cluster, gpu_model, pricing_class, gpu_hours, effective_gpu_hours, cost_usd, "
            "waste, preempted_gpu_hours FROM allocation ORDER BY project, cluster, pricing_class")).all()
        idle = conn.execute(text("SELECT day, team, cluster, gpu_hours, cost_usd FROM idle_allocation ORDER BY team")).all()
    return [tuple(r) for r in alloc], [tuple(r) for r in idle]


def test_a_day_is_allocated_per_attempt_with_prices_use_waste_and_idle(ledger):
    engine, estate, private = ledger
    summary = allocate_day(DAY, engine=engine, estate=estate, private_root=private, as_of=DAY)
    alloc, idle = _rows(engine)
    by = {(r[1], r[3], r[5]): r for r in alloc}
    # r1's first try: 00:00-00:30 of this day (it began the day before), 4 GPUs on spot, 100 of its 900 steps redone.
    # Its second try (killed) held 4 GPUs 00:40-02:00; both billed at cloud-east's spot price.
    spot = by[("digits-ocr", "cloud-east", "spot")]
    assert spot[6] == pytest.approx(2.0 + 4 * 80 / 60)
    assert spot[8] == pytest.approx(spot[6] * 1.45)
    assert spot[10] == pytest.approx(2.0 * 100 / 900)
    onprem = by[("digits-ocr", "onprem-a", "onprem")]
    assert (onprem[6], onprem[8]) == (pytest.approx(4.0), pytest.approx(4.8))
    assert onprem[7] == pytest.approx(4.0 * 0.60)  # effective: used 60 %
    assert not onprem[9]
    wasted = by[("ranking", "onprem-a", "onprem")]
    assert wasted[6] == pytest.approx(8.0) and wasted[9] and wasted[7] == pytest.approx(0.4)
    # Idle owned capacity: 4 A100 x 24 h - 12 GPU-h held, at 1.20, split 0.5 / 0.25 / rest to the platform.
    idle_h = 96.0 - 12.0
    assert [(r[1], r[3], r[4]) for r in idle] == [
        (PLATFORM, pytest.approx(idle_h * 0.25), pytest.approx(idle_h * 0.25 * 1.2)),
        ("perception", pytest.approx(idle_h * 0.5), pytest.approx(idle_h * 0.5 * 1.2)),
        ("search", pytest.approx(idle_h * 0.25), pytest.approx(idle_h * 0.25 * 1.2)),
    ]
    private_cost = onprem[8] + wasted[8]
    assert abs(private_cost + sum(r[4] for r in idle) - 96 * 1.2) <= 1e-9 * 96 * 1.2
    assert summary["conservation_error"] <= 1e-9 and summary["waste_attempts"] == 1
    # What budgets read: the project's spend in the month.
    assert allocated_spend(engine, "digits-ocr", "2026-11") == pytest.approx(spot[8] + onprem[8])
    out = private / "reports" / "allocation" / DAY.isoformat()
    page = (out / "report.html").read_text()
    assert page.count("<svg") == 2 and "r2-idle" in page and "Top waste" in page
    assert {p.name for p in out.iterdir()} >= {"allocation.csv", "allocation.parquet", "idle.csv", "attempts.parquet"}


def test_re_running_a_day_replaces_it_with_identical_results(ledger):
    engine, estate, private = ledger
    allocate_day(DAY, engine=engine, estate=estate, private_root=private, as_of=DAY, report=False)
    first = _rows(engine)
    csv = (private / "reports" / "allocation" / DAY.isoformat() / "allocation.csv").read_bytes()
    allocate_day(DAY, engine=engine, estate=estate, private_root=private, as_of=DAY, report=False)
    assert _rows(engine) == first
    assert (private / "reports" / "allocation" / DAY.isoformat() / "allocation.csv").read_bytes() == csv
    # Another day does not touch this one; the day before holds r1's first half hour... and more.
    allocate_day(DAY - timedelta(days=1), engine=engine, estate=estate, private_root=private, as_of=DAY, report=False)
    alloc, _ = _rows(engine)
    assert [r for r in alloc if r[0] == DAY.isoformat()] == first[0]
    assert [r[6] for r in alloc if r[0] != DAY.isoformat()] == [pytest.approx(4 * 1.0)]


def test_a_price_change_applies_from_its_day_on(ledger):
    engine, estate, private = ledger
    sync_prices(engine, estate, DAY)
    cheaper = estate.clusters["onprem-a"].model_copy(update={"prices": {"onprem": 0.60}})
    cheaper._name = "onprem-a"
    changed = type(estate)(**{**estate.__dict__, "clusters": {**estate.clusters, "onprem-a": cheaper}})
    assert sync_prices(engine, changed, DAY + timedelta(days=1)) == 1
    assert sync_prices(engine, changed, DAY + timedelta(days=1)) == 0
    allocate_day(DAY, engine=engine, estate=changed, private_root=private, as_of=DAY + timedelta(days=1),
                 report=False)
    alloc, _ = _rows(engine)
    assert [r[8] for r in alloc if r[1] == "ranking"] == [pytest.approx(8.0 * 1.20)]  # the day keeps its price


def test_attempts_holding_more_than_the_capacity_stop_the_allocation(ledger):
    engine, estate, private = ledger
    overlapping = make_record(
        [{"try_number": 1, "attempt": "x", "cluster": "onprem-a", "workers": 4, "outcome": "succeeded",
          "started_at": "2026-11-03T00:00:00+00:00", "seconds": 86400.0}], run_key="r3-all-day")
    ingest_run_record(overlapping, engine=engine)
    with pytest.raises(AllocationError, match="more than its 96 GPU-hours of capacity"):
        allocate_day(DAY, engine=engine, estate=estate, private_root=private, as_of=DAY, report=False)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM allocation")).scalar_one() == 0


def test_the_day_of_a_dag_run():
    from hybridflow.ledger.nightly import day_to_allocate

    run_after = datetime(2026, 11, 4, 0, 5, tzinfo=UTC)
    assert day_to_allocate("", datetime(2026, 11, 3, tzinfo=UTC), None, run_after) == DAY  # scheduled/backfill
    assert day_to_allocate("2026-10-01", datetime(2026, 11, 3, tzinfo=UTC), None, run_after) == date(2026, 10, 1)
    assert day_to_allocate(None, None, None, run_after) == DAY  # manual run: yesterday
    with pytest.raises(ValueError, match="Param day: '2026-13-01' is not a date"):
        day_to_allocate("2026-13-01", None, None, run_after)


def test_files_go_to_the_given_object_store_and_samples_are_read_in_place(ledger, tmp_path):
    import shutil

    from hybridflow.storage.objectstore import LocalObjectStore

    engine, estate, private = ledger
    allocate_day(DAY, engine=engine, estate=estate, private_root=private, as_of=DAY, report=False)
    first = _rows(engine)
    elsewhere = tmp_path / "parquet" / "day.parquet"  # e.g. a day already exported, or written by another tool
    elsewhere.parent.mkdir()
    shutil.copy(private / "ledger" / "samples" / f"{DAY}.parquet", elsewhere)
    bucket = LocalObjectStore(tmp_path / "bucket")
    summary = allocate_day(DAY, engine=engine, estate=estate, private_root=private, as_of=DAY,
                           samples=[elsewhere], store=bucket)
    assert _rows(engine) == first  # the same use from the same samples
    prefix = f"reports/allocation/{DAY}/"
    assert {o.key.removeprefix(prefix) for o in bucket.list(prefix)} == {
        f"{n}.{ext}" for n in ("allocation", "idle", "attempts", "inference") for ext in ("csv", "parquet")} | {
        "report.html"}
    assert summary["files"] == f"{bucket.uri}/{prefix}".rstrip("/")
    page = bucket.get_bytes(prefix + "report.html").decode()
    assert not any(tag in page for tag in ("<script", "<link", "<img", "src=", "@import"))  # nothing fetched
    allocate_day(DAY, engine=engine, estate=estate, private_root=private, as_of=DAY, samples=[elsewhere], store=bucket)
    assert bucket.get_bytes(prefix + "report.html").decode() == page  # a re-run writes the same page


def test_a_range_of_days_in_one_pass_gives_what_the_nightly_gives_day_by_day(ledger):
    from hybridflow.ledger.allocation import allocate_days

    engine, estate, private = ledger
    days = [DAY - timedelta(days=1), DAY]
    for day in days:
        allocate_day(day, engine=engine, estate=estate, private_root=private, as_of=DAY, report=False)
    nightly = _rows(engine)
    summaries = allocate_days(days, engine=engine, estate=estate, private_root=private, as_of=DAY, report=False)
    assert _rows(engine) == nightly and [s["day"] for s in summaries] == ["2026-11-02", "2026-11-03"]
    assert [s["samples"] for s in summaries] == [0, 240]
