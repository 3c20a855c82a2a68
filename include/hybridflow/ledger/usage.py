"""What the GPUs did, from Parquet exports of samples: DuckDB aggregates, so a month reads as fast as a day."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import date, datetime, timedelta
from functools import lru_cache
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import Engine, select

from hybridflow.ledger.models import GpuSampleRow

# Columns of a sample export: what the allocation and its benchmark read.
EXPORT_COLUMNS = ["ts", "cluster", "node", "gpu_uuid", "mig_key", "gpu_model", "run_key", "util_pct",
                  "mem_used_mib", "power_w"]
_SCHEMA = pa.schema([
    ("ts", pa.timestamp("us")), ("cluster", pa.string()), ("node", pa.string()), ("gpu_uuid", pa.string()),
    ("mig_key", pa.string()), ("gpu_model", pa.string()), ("run_key", pa.string()), ("util_pct", pa.float64()),
    ("mem_used_mib", pa.float64()), ("power_w", pa.float64()),
])
_CHUNK = 100_000


def export_day(engine: Engine, day: date, path: Path) -> int:
    """Write the samples of ``day`` (UTC) to a Parquet file; returns the rows written."""
    start = datetime.combine(day, datetime.min.time())
    cols = [getattr(GpuSampleRow, c) for c in EXPORT_COLUMNS]
    query = select(*cols).where(GpuSampleRow.ts >= start, GpuSampleRow.ts < start + timedelta(days=1))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    rows = 0
    with engine.connect() as conn, pq.ParquetWriter(tmp, _SCHEMA) as writer:
        result = conn.execution_options(stream_results=True).execute(query.order_by(GpuSampleRow.ts))
        while chunk := result.fetchmany(_CHUNK):
            columns = list(zip(*chunk, strict=True))
            writer.write_table(pa.table(dict(zip(EXPORT_COLUMNS, columns, strict=True)), schema=_SCHEMA))
            rows += len(chunk)
    tmp.replace(path)
    return rows


# Per UTC day and run: mean utilisation, memory and power over its samples, and how many there were.
USAGE_SQL = """
SELECT CAST(ts AS DATE) AS day, run_key, AVG(util_pct) AS mean_util_pct, AVG(mem_used_mib) AS mean_mem_used_mib,
       AVG(power_w) AS mean_power_w, COUNT(*) AS samples
FROM read_parquet(?) WHERE run_key IS NOT NULL GROUP BY ALL
"""


@lru_cache(maxsize=1)
def _duckdb():
    # One in-memory DuckDB per process: opening one costs tens of milliseconds, a cursor on it nothing.
    import duckdb

    return duckdb.connect()


def usage_by_day_and_run(paths: Sequence[Path | str], *, threads: int | None = None) -> dict[tuple[date, str], dict]:
    """(day, run_key) -> {mean_util_pct, mean_mem_used_mib, mean_power_w, samples} over the Parquet files."""
    files = [str(p) for p in paths]
    if not files:
        return {}
    con = _duckdb().cursor()
    try:
        if threads:
            con.execute(f"SET threads = {int(threads)}")
        rows = con.execute(USAGE_SQL, [files]).fetchall()
    finally:
        con.close()
    return {(r[0], r[1]): {"mean_util_pct": r[2], "mean_mem_used_mib": r[3], "mean_power_w": r[4], "samples": r[5]}
            for r in rows}
