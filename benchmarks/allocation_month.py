"""Nightly cost allocation over a month of samples: 30 days x 1,000 GPUs x 1-minute samples (43.2 M rows).

Writes one Parquet file per day to /dev/shm (or --dir), then, each in a fresh process so peak RSS is its
own, runs the product's aggregation (hybridflow.ledger.usage.usage_by_run, what the nightly allocation
reads) and a bare DuckDB SQL doing the same aggregation on the same files, and checks they agree.

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
BARE_SQL = """
SELECT run_key, AVG(util_pct), AVG(mem_used_mib), AVG(power_w), COUNT(*)
FROM read_parquet('{glob}') WHERE run_key IS NOT NULL GROUP BY run_key
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
    start = datetime(2026, 11, 1)
    rows = 0
    for d in range(days):
        n = gpus * minutes
        t0 = np.datetime64(start + timedelta(days=d), "us")
        ts = t0 + np.repeat(np.arange(minutes, dtype="int64") * 60_000_000, gpus).astype("timedelta64[us]")
        run_names = pa.array([f"run-{d:02d}-{j:04d}" for j in range(gpus // GPUS_PER_RUN + 1)])
        run_idx = (gpu_idx // GPUS_PER_RUN).astype(np.int32)
        idle = (np.arange(gpus) % 10 == 9)[gpu_idx]
        run_key = pa.DictionaryArray.from_arrays(pa.array(run_idx, mask=idle), run_names)
        util = rng.uniform(0, 100, n).round(1)
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
        pq.write_table(table, out / f"2026-11-{d + 1:02d}.parquet")
        rows += n
    return rows


def measure(which: str, out: Path, threads: int) -> None:
    """Child process: one aggregation, printed as JSON with its wall time and peak RSS."""
    import duckdb

    from hybridflow.ledger.usage import usage_by_run

    files = sorted(out.glob("*.parquet"))
    t = time.perf_counter()  # imports done: both sides time the aggregation alone
    if which == "product":
        result = {k: (v["mean_util_pct"], v["samples"]) for k, v in usage_by_run(files, threads=threads).items()}
    else:
        with duckdb.connect() as con:
            con.execute(f"SET threads = {threads}")
            result = {r[0]: (r[1], r[4]) for r in con.execute(BARE_SQL.format(glob=out / "*.parquet")).fetchall()}
    wall = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    checksum = [len(result), round(sum(v[0] for v in result.values()), 6), sum(v[1] for v in result.values())]
    print(json.dumps({"which": which, "wall_s": wall, "peak_rss_bytes": peak, "checksum": checksum}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--gpus", type=int, default=1000)
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm/hybridflow-allocation-month"))
    parser.add_argument("--threads", type=int, default=2, help="DuckDB threads for both (default 2)")
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    parser.add_argument("--measure", choices=["product", "bare"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args.measure, args.dir, args.threads)
        return 0
    shutil.rmtree(args.dir, ignore_errors=True)
    t = time.perf_counter()
    rows = generate(args.dir, args.days, args.gpus)
    size = sum(p.stat().st_size for p in args.dir.glob("*.parquet"))
    print(f"generated {rows:,} samples in {args.days} files ({size / 2**20:.0f} MiB) in {time.perf_counter() - t:.1f} s")
    results = {}
    try:
        for which in ("bare", "product"):
            out = subprocess.run([sys.executable, __file__, "--measure", which, "--dir", str(args.dir),
                                  "--threads", str(args.threads)], capture_output=True, text=True, check=True)
            results[which] = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    product, bare = results["product"], results["bare"]
    ratio = product["wall_s"] / bare["wall_s"]
    for r in (bare, product):
        print(f"{r['which']:>8}: {r['wall_s']:.2f} s wall, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB")
    print(f"   ratio: {ratio:.2f}x (product / bare DuckDB SQL); results agree: {product['checksum'] == bare['checksum']}")
    ok = (product["wall_s"] <= 60 and product["peak_rss_bytes"] <= 4 * 2**30 and ratio <= 2.0
          and product["checksum"] == bare["checksum"])
    print("targets (<= 60 s, <= 4 GiB, <= 2x):", "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
