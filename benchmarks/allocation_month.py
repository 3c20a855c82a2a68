"""Nightly cost allocation over a month of samples: 30 days x 1,000 GPUs x 1-minute samples (43.2 M rows).

Writes one Parquet file per day to /dev/shm (or --dir) and a SQLite ledger holding the month's runs and
training attempts (a run per 8 GPUs per day; every tenth run preempted once and resumed; every 25th run
nearly idle), then, each in a fresh process so peak RSS is its own:
* product: the allocation of every day of the month as a backfill does it
  (hybridflow.ledger.allocation.allocate_days, the code the nightly DAG runs for one day), reading the
  Parquet files in place: use per day and run in one DuckDB pass, every attempt priced, waste,
  preemption, idle owned capacity by guaranteed share, each day's ledger rows replaced, its CSV and
  Parquet files written; one day's HTML report is timed apart;
* bare: one DuckDB SQL doing the same sample aggregation on the same files;
and checks both found the same mean utilisation for every run.

    .venv/bin/python benchmarks/allocation_month.py [--days 30] [--gpus 1000] [--keep]

Targets: product <= 60 s wall, <= 4 GiB peak RSS, <= 2x the bare SQL's time.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

GPUS_PER_RUN = 8
PREEMPT_EVERY = 10  # every tenth run is preempted once (06:00) and resumes (06:30)
WASTE_EVERY = 25  # every 25th run holds its GPUs at ~2.5 % use
START = datetime(2026, 11, 1)
CLUSTERS_YAML = """clusters:
  dc-1:
    location: private
    region: dc-1
    backend: local
    node_pools:
      - {name: h100, gpu_model: H100-80GB, gpu_memory_gib: 80, gpus: %d, rdma: true, spot: false}
    prices: {onprem: 2.10}
"""
PROJECTS_YAML = """gpu_types:
  H100-80GB: {memory_gib: 80}
teams:
  vision: {gpu_cap: 100000, guaranteed_share: 0.5}
  search: {gpu_cap: 100000, guaranteed_share: 0.3}
projects:
  ocr: {team: vision, max_workers: 8}
  detect: {team: vision, max_workers: 8}
  ranking: {team: search, max_workers: 8}
"""
PROJECTS = [("ocr", "vision"), ("detect", "vision"), ("ranking", "search")]
BARE_SQL = """
SELECT run_key, AVG(util_pct), AVG(mem_used_mib), AVG(power_w), COUNT(*)
FROM read_parquet('{glob}') WHERE run_key IS NOT NULL GROUP BY CAST(ts AS DATE), run_key
"""


def generate(out: Path, days: int, gpus: int) -> int:
    """A file per day: every GPU every minute; a run per 8 GPUs per day, a tenth of the GPUs idle (no run)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hybridflow.ledger.usage import EXPORT_COLUMNS

    rng = np.random.default_rng(0)
    out.mkdir(parents=True, exist_ok=True)
    minutes = 24 * 60
    uuids = pa.array([f"GPU-{i:05d}" for i in range(gpus)])
    gpu_idx = np.tile(np.arange(gpus, dtype=np.int32), minutes)
    start = START
    rows = 0
    for d in range(days):
        n = gpus * minutes
        t0 = np.datetime64(start + timedelta(days=d), "us")
        ts = t0 + np.repeat(np.arange(minutes, dtype="int64") * 60_000_000, gpus).astype("timedelta64[us]")
        run_names = pa.array([f"run-{d:02d}-{j:04d}" for j in range(gpus // GPUS_PER_RUN + 1)])
        run_idx = (gpu_idx // GPUS_PER_RUN).astype(np.int32)
        idle = (np.arange(gpus) % 10 == 9)[gpu_idx]
        run_key = pa.DictionaryArray.from_arrays(pa.array(run_idx, mask=idle), run_names)
        util = rng.uniform(0, 100, n)
        util = np.where(run_idx % WASTE_EVERY == 0, util * 0.05, util).round(1)  # nearly idle runs
        table = pa.table({
            "ts": pa.array(ts), "cluster": pa.DictionaryArray.from_arrays(np.zeros(n, np.int32), pa.array(["c1"])),
            "node": pa.DictionaryArray.from_arrays((gpu_idx // 8).astype(np.int32),
                                                   pa.array([f"node-{i}" for i in range(gpus // 8 + 1)])),
            "gpu_uuid": pa.DictionaryArray.from_arrays(gpu_idx, uuids),
            "mig_key": pa.DictionaryArray.from_arrays(np.zeros(n, np.int32), pa.array([""])),
            "gpu_model": pa.DictionaryArray.from_arrays(np.zeros(n, np.int32), pa.array(["H100-80GB"])),
            "run_key": run_key, "util_pct": util, "mem_used_mib": rng.uniform(0, 81920, n).round(0),
            "power_w": (60 + util * 3.4).round(1),
        })
        assert table.column_names == EXPORT_COLUMNS
        pq.write_table(table, out / f"{(start + timedelta(days=d)).date()}.parquet")
        rows += n
    return rows


def setup_ledger(root: Path, days: int, gpus: int) -> None:
    """The estate (one private cluster of ``gpus`` H100s, two teams with guaranteed shares) and a SQLite
    ledger with the month's runs and attempts, written in bulk: this set-up is not timed."""
    from sqlalchemy import create_engine, insert

    from hybridflow.ledger import upgrade
    from hybridflow.ledger.models import Attempt, Run

    config = root / "config"
    config.mkdir(parents=True)
    (config / "clusters.yaml").write_text(CLUSTERS_YAML % gpus)
    (config / "projects.yaml").write_text(PROJECTS_YAML)
    (config / "pipeline.yaml").write_text("")
    engine = create_engine(f"sqlite:///{root / 'ledger.db'}")
    upgrade(engine)
    runs, attempts = [], []
    for d in range(days):
        day = START + timedelta(days=d)
        for j in range(gpus // GPUS_PER_RUN):
            key = f"run-{d:02d}-{j:04d}"
            project, team = PROJECTS[j % len(PROJECTS)]
            runs.append({"run_key": key, "project": project, "team": team, "cluster": "dc-1",
                         "gpu_model": "H100-80GB", "pricing_class": "onprem", "price_per_gpu_hour": 2.10,
                         "workers": GPUS_PER_RUN, "priority": "normal", "dag_id": "hybrid_training",
                         "run_id": f"scheduled__{day.date()}-{j}"})
            base = {"run_key": key, "cluster": "dc-1", "gpus": GPUS_PER_RUN, "try_number": 1}
            if j % PREEMPT_EVERY == 3:
                attempts.append({**base, "seq": 0, "label": "a1", "started_at": day, "outcome": "preempted",
                                 "ended_at": day + timedelta(hours=6), "start_step": 0, "last_step": 600,
                                 "steps_lost": 100})
                attempts.append({**base, "seq": 1, "label": "a2", "started_at": day + timedelta(hours=6, minutes=30),
                                 "ended_at": day + timedelta(hours=20), "outcome": "succeeded", "start_step": 500,
                                 "last_step": 2000})
            else:
                attempts.append({**base, "seq": 0, "label": "a1", "started_at": day, "outcome": "succeeded",
                                 "ended_at": day + timedelta(hours=20), "start_step": 0, "last_step": 2000})
    with engine.begin() as conn:
        conn.execute(insert(Run), runs)
        conn.execute(insert(Attempt), attempts)
    engine.dispose()


def measure(which: str, out: Path, root: Path) -> None:
    """Child process: one side, printed as JSON with its wall time, peak RSS and what it found."""
    import duckdb

    if which == "product":
        import os

        os.environ["HYBRIDFLOW_CONFIG_DIR"] = str(root / "config")
        # Imports before the clock, as on the bare side (pyarrow's from_pylist loads pandas on first use).
        import matplotlib.pyplot  # noqa: F401
        import pyarrow as pa
        from sqlalchemy import create_engine

        from hybridflow.config import load_estate
        from hybridflow.ledger.allocation import allocate_day, allocate_days

        pa.Table.from_pylist([{"warm": 1}])

        engine = create_engine(f"sqlite:///{root / 'ledger.db'}")
        estate = load_estate(root / "config")
        files = sorted(out.glob("*.parquet"))
        t = time.perf_counter()  # imports done: both sides time the work alone
        summaries = allocate_days([datetime.fromisoformat(f.stem).date() for f in files], engine=engine,
                                  estate=estate, private_root=root / "private", as_of=START.date(), report=False,
                                  samples=files)
        wall = time.perf_counter() - t
        t = time.perf_counter()
        allocate_day(datetime.fromisoformat(files[-1].stem).date(), engine=engine, estate=estate,
                     private_root=root / "private", as_of=START.date(), samples=[files[-1]])
        report_s = time.perf_counter() - t - wall / len(files)  # the last day again, less one day's allocation
        with duckdb.connect() as con:  # what it found, read back from its own per-attempt files
            found = con.execute(
                "SELECT run_key, ANY_VALUE(mean_util_pct) FROM read_parquet(?) WHERE mean_util_pct IS NOT NULL "
                "GROUP BY run_key", [[str(root / "private" / "reports" / "allocation" / f.stem / "attempts.parquet")
                                      for f in files]]).fetchall()
        extra = {"report_s": report_s, "cost_usd": sum(s["cost_usd"] for s in summaries),
                 "idle_cost_usd": sum(s["idle_cost_usd"] for s in summaries),
                 "max_conservation_error": max(s["conservation_error"] for s in summaries),
                 "waste_attempts": sum(s["waste_attempts"] for s in summaries)}
    else:
        t = time.perf_counter()
        with duckdb.connect() as con:
            found = [r[:2] for r in con.execute(BARE_SQL.format(glob=out / "*.parquet")).fetchall()]
        wall = time.perf_counter() - t
        extra = {}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    checksum = [len(found), round(sum(v for _, v in found), 6)]
    print(json.dumps({"which": which, "wall_s": wall, "peak_rss_bytes": peak, "checksum": checksum, **extra}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--gpus", type=int, default=1000)
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm/hybridflow-allocation-month"))
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    parser.add_argument("--measure", choices=["product", "bare"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    samples, root = args.dir / "samples", args.dir / "work"
    if args.measure:
        measure(args.measure, samples, root)
        return 0
    shutil.rmtree(args.dir, ignore_errors=True)
    t = time.perf_counter()
    rows = generate(samples, args.days, args.gpus)
    size = sum(p.stat().st_size for p in samples.glob("*.parquet"))
    print(f"generated {rows:,} samples in {args.days} files ({size / 2**20:.0f} MiB) in {time.perf_counter() - t:.1f} s")
    setup_ledger(root, args.days, args.gpus)
    results = {}
    try:
        for which in ("bare", "product"):
            out = subprocess.run([sys.executable, __file__, "--measure", which, "--dir", str(args.dir)],
                                 capture_output=True, text=True)
            if out.returncode:
                sys.stderr.write(out.stderr)
                return out.returncode
            results[which] = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    product, bare = results["product"], results["bare"]
    ratio = product["wall_s"] / bare["wall_s"]
    for r in (bare, product):
        print(f"{r['which']:>8}: {r['wall_s']:.2f} s wall, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB")
    print(f"  report: {product['report_s']:.2f} s for one day's HTML page (charts), apart from the above")
    print(f"   month: ${product['cost_usd']:,.2f} allocated, ${product['idle_cost_usd']:,.2f} idle, "
          f"{product['waste_attempts']} waste attempts, conservation error <= {product['max_conservation_error']:.1e}")
    agree = product["checksum"] == bare["checksum"]
    print(f"   ratio: {ratio:.2f}x (product / bare DuckDB SQL); same use per run found: {agree}")
    ok = product["wall_s"] <= 60 and product["peak_rss_bytes"] <= 4 * 2**30 and ratio <= 2.0 and agree
    print("targets (<= 60 s, <= 4 GiB, <= 2x):", "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
