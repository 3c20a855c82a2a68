"""The ledger schema and GPU samples in it: migrations, idempotent upsert on the sample key, attribution."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from sqlalchemy import create_engine, inspect, select, text
from tests.support.ledger_db import ledger_engine  # noqa: F401 (fixture)

from hybridflow.ledger import store_samples, upgrade
from hybridflow.ledger.models import GpuSampleRow
from hybridflow.metering.records import GpuSample

T0 = datetime(2026, 11, 2, 10, 0, tzinfo=UTC)


def sample(i: int = 0, *, mig: str | None = None, util: float = 50.0, ts: datetime = T0) -> GpuSample:
    return GpuSample(
        ts=ts, cluster="onprem-a", node="node-1", gpu_uuid=f"GPU-{i}", gpu_index=i, gpu_model="A100-80GB",
        mig_profile="1g.10gb" if mig else None, mig_instance=mig, namespace="vision", pod=f"train-r{i}-0",
        container="rank-0", util_pct=util, mem_used_mib=1000.0, mem_free_mib=80000.0, power_w=250.0,
        temp_c=None, energy_mj=12.5, xid=None, ecc_sbe=0, ecc_dbe=0,
    )


def test_upgrade_creates_the_tables_and_is_idempotent(tmp_path):
    url = f"sqlite:///{tmp_path / 'sub' / 'ledger.db'}"
    upgrade(url)
    upgrade(url)
    tables = set(inspect(create_engine(url)).get_table_names())
    assert {"gpu_sample", "run", "attempt", "price", "allocation", "idle_allocation"} <= tables
    assert {"budget_state", "budget_notification"} <= tables  # migration 0002


def test_cli_upgrade_uses_the_ledger_url(tmp_path):
    db = tmp_path / "cli.db"
    env = {"HYBRIDFLOW_LEDGER_URL": f"sqlite:///{db}", "HYBRIDFLOW_HOME": str(tmp_path / "home"), "PATH": "/usr/bin"}
    out = subprocess.run([sys.executable, "-m", "hybridflow.cli", "ledger", "upgrade"], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    assert "latest schema" in out.stdout
    assert "allocation" in inspect(create_engine(f"sqlite:///{db}")).get_table_names()


def test_samples_upsert_on_their_key(ledger_engine):  # noqa: F811
    batch = [sample(0), sample(1), sample(1, mig="3"), sample(0, ts=T0 + timedelta(minutes=1))]
    owners = {batch[0].key(): "r0"}
    assert store_samples(batch, owners, engine=ledger_engine) == 4
    # The same scrape again (a cleared task), now attributed and with a changed reading: no duplicates.
    again = [replace(batch[0], util_pct=75.0), batch[1]]
    assert store_samples(again, {batch[1].key(): "r1"}, engine=ledger_engine) == 2
    with ledger_engine.connect() as conn:
        rows = conn.execute(select(GpuSampleRow).order_by(GpuSampleRow.gpu_uuid, GpuSampleRow.mig_key,
                                                          GpuSampleRow.ts)).all()
        assert conn.execute(text("SELECT COUNT(*) FROM gpu_sample")).scalar_one() == 4
    by_key = {(r.gpu_uuid, r.mig_key, r.ts): r for r in rows}
    first = by_key[("GPU-0", "", T0.replace(tzinfo=None))]
    assert (first.util_pct, first.run_key) == (75.0, "r0")  # re-read unattributed: keeps its run
    assert by_key[("GPU-1", "", T0.replace(tzinfo=None))].run_key == "r1"
    assert by_key[("GPU-1", "3", T0.replace(tzinfo=None))].mig_instance == "3"
    assert first.temp_c is None and first.energy_mj == 12.5


def test_a_reading_repeated_in_one_batch_is_stored_once(ledger_engine):  # noqa: F811
    assert store_samples([sample(0, util=1.0), sample(0, util=2.0)], {}, engine=ledger_engine) == 1
    with ledger_engine.connect() as conn:
        assert conn.execute(text("SELECT util_pct FROM gpu_sample")).scalars().all() == [2.0]


def test_store_samples_uses_the_default_ledger(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_LEDGER_URL", f"sqlite:///{tmp_path / 'default.db'}")
    assert store_samples([sample(0)], {}) == 1
    assert store_samples([], {}) == 0
    with create_engine(f"sqlite:///{tmp_path / 'default.db'}").connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM gpu_sample")).scalar_one() == 1
