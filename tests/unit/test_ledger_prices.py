"""A published price table into the versioned catalog: a public cluster's on-demand and spot pools priced
from the reference table from a day on, kept over the configured price until that changes."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import date, timedelta

import pytest
from sqlalchemy import create_engine, text
from tests.reference import PRICE_TABLE
from tests.support.ledger_db import ledger_engine  # noqa: F401 (fixture)
from tests.unit.test_ledger_runs import make_record

from hybridflow.config import load_estate
from hybridflow.errors import ConfigError
from hybridflow.ledger import ingest_run_record
from hybridflow.ledger.allocation import allocate_day, sync_prices
from hybridflow.ledger.prices import import_price_table
from hybridflow.settings import get_settings

TABLE = PRICE_TABLE
DAY = date(2026, 11, 3)
# aws us-east-1 in the table: H100 80 GB on demand 6.88 (p5.48xlarge, p5.4xlarge and a cross-check);
# A100 80 GB spot per zone 1.246675 and 1.081312.
H100_ON_DEMAND, A100_SPOT = 6.88, (1.246675 + 1.081312) / 2



def _spot_cost(engine, day: date) -> float:
    with engine.connect() as conn:
        return conn.execute(text("SELECT cost_usd / gpu_hours FROM allocation WHERE day = :d AND cluster = 'cloud-east' "
                                 "AND pricing_class = 'spot'"), {"d": day.isoformat()}).scalar_one()


def test_the_reference_table_prices_a_cloud_cluster_from_its_day_on(ledger_engine, tmp_path):  # noqa: F811
    engine, estate = ledger_engine, load_estate(get_settings().config_dir)
    ingest_run_record(make_record(), engine=engine)  # spot tries on cloud-east on the 2nd and 3rd
    sync_prices(engine, estate, DAY)
    versions = import_price_table(engine, estate, TABLE, cluster="cloud-east", provider="aws", valid_from=DAY)
    assert {(v["gpu_model"], v["pricing_class"]): v["usd_per_gpu_hour"] for v in versions} == {
        ("H100-80GB", "on_demand"): pytest.approx(H100_ON_DEMAND), ("A100-80GB", "spot"): pytest.approx(A100_SPOT)}
    assert "median of 2 aws us-east-1 rows" in next(v["source"] for v in versions if v["pricing_class"] == "spot")
    # Importing the same day again replaces it; the next syncs of clusters.yaml (unchanged) keep it in force.
    import_price_table(engine, estate, TABLE, cluster="cloud-east", provider="aws", valid_from=DAY)
    for later in (DAY, DAY + timedelta(days=5)):
        assert sync_prices(engine, estate, later) == 0
    private = tmp_path / "private"
    for day in (DAY - timedelta(days=1), DAY):
        allocate_day(day, engine=engine, estate=estate, private_root=private, as_of=DAY + timedelta(days=5),
                     report=False)
    assert _spot_cost(engine, DAY - timedelta(days=1)) == pytest.approx(1.45)  # clusters.yaml, before the import
    assert _spot_cost(engine, DAY) == pytest.approx(A100_SPOT)
    # A later change in clusters.yaml takes over from its day.
    changed = estate.clusters["cloud-east"].model_copy(update={"prices": {"on_demand": 3.90, "spot": 1.00}})
    changed._name = "cloud-east"
    estate2 = type(estate)(**{**estate.__dict__, "clusters": {**estate.clusters, "cloud-east": changed}})
    assert sync_prices(engine, estate2, DAY + timedelta(days=1)) == 1
    allocate_day(DAY, engine=engine, estate=estate2, private_root=private, as_of=DAY + timedelta(days=1), report=False)
    assert _spot_cost(engine, DAY) == pytest.approx(A100_SPOT)  # the 3rd keeps the price it had


def test_a_table_without_the_clusters_prices_is_refused_and_writes_nothing(ledger_engine, tmp_path):  # noqa: F811
    engine, estate = ledger_engine, load_estate(get_settings().config_dir)
    with pytest.raises(ConfigError, match="no aws eu-west-9 price for H100-80GB on_demand, A100-80GB spot"):
        import_price_table(engine, estate, TABLE, cluster="cloud-east", provider="aws", region="eu-west-9",
                           valid_from=DAY)
    with pytest.raises(ConfigError, match="--cluster 'nowhere' is not in clusters.yaml"):
        import_price_table(engine, estate, TABLE, cluster="nowhere", provider="aws", valid_from=DAY)
    bad = tmp_path / "bad.csv"
    bad.write_text("provider,gpu_model\naws,H100\n")
    with pytest.raises(ConfigError, match=r"columns \['gpu_memory_gb'.*missing"):
        import_price_table(engine, estate, bad, cluster="cloud-east", provider="aws", valid_from=DAY)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM price")).scalar_one() == 0


def test_cli_prices(tmp_path):
    db = tmp_path / "cli.db"
    env = {"HYBRIDFLOW_LEDGER_URL": f"sqlite:///{db}", "HYBRIDFLOW_HOME": str(tmp_path / "home"), "PATH": "/usr/bin"}
    cmd = [sys.executable, "-m", "hybridflow.cli", "ledger", "prices", "--csv", str(TABLE), "--cluster", "cloud-east",
           "--provider", "aws", "--valid-from", "2026-11-03"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)) == 2
    with create_engine(f"sqlite:///{db}").connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM price WHERE valid_from = '2026-11-03'")).scalar_one() == 2
    out = subprocess.run([*cmd[:-2], "--valid-from", "3rd"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--valid-from '3rd' is not a date" in out.stderr
