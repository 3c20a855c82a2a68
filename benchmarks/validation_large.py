"""Validating a large table with its GX suite, against pandas doing the same checks in the same run.

The table: 5,000,000 rows x 30 float columns (breast-cancer-like measurements) + an int 0/1 label, one
Parquet file (zstd), generated once with a fixed seed and kept in --dir (default var/bench/validation,
ignored by git). Its suite has the kinds of checks the breast-cancer suite has: ordered column list,
row count, not-null per column, a range per column, label in {0, 1}, both labels present, label mean
between 0.2 and 0.6 (66 expectations).

Timed in one process, interleaved, best of --repeat:
* product: hybridflow.validation.validate_frames (one ephemeral GX context; BOOLEAN_ONLY over the
  suite, SUMMARY for the failed expectations only), writing its reports to a temp folder;
* pandas: the same checks written directly with pandas/numpy, reading the same suite JSON, with the
  same failure information (unexpected count per check, three example values with their rows);
each on the frame in memory and with pd.read_parquet of the file included, first on the clean table
and then with broken cells (nulls in two columns, out-of-range values in three, a label 2 in 1,000
rows), where both sides also report the failures. The GX import is timed once and kept apart.
A last row times the pipeline's whole validate step on the clean file (``hybridflow.rundata.validate``:
the file read where it lives, its SHA-256 pinned as the run's dataset version, the catalogue schema
checked, then the suite) against pandas reading the file and doing the suite's checks.
Peak extra memory is what a phase adds to the process's RSS over the frame already in memory.

    .venv/bin/python benchmarks/validation_large.py [--rows 5000000] [--repeat 3] [--dir DIR]

Target: product <= 2x pandas.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FEATURES = [f"feature_{i}" for i in range(30)]
LABEL = "label"
SEED = 7
MAX_EXAMPLES = 3
TARGET = 2.0


# -- data and suite -------------------------------------------------------------------------------
def dataset(folder: Path, rows: int) -> Path:
    """The Parquet file for ``rows`` rows, written once (same seed, same bytes)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = folder / f"table-{rows}.parquet"
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED + 2)
    # Positive measurements on different scales (radius ~10, area ~1,000, smoothness ~0.1), rounded
    # to about 4 significant digits as instruments report them (as the breast-cancer table has them).
    columns = {}
    for name, scale in zip(FEATURES, scales(), strict=True):
        values = rng.lognormal(mean=0.0, sigma=0.35, size=rows) * scale
        columns[name] = np.round(values, 3 - int(np.floor(np.log10(scale))))
    columns[LABEL] = (rng.random(rows) < 0.37).astype(np.int64)
    tmp = path.with_suffix(".part")
    pq.write_table(pa.table(columns), tmp, compression="zstd", row_group_size=1 << 20)
    tmp.replace(path)
    return path


def scales() -> list[float]:
    import numpy as np

    return (10.0 ** np.random.default_rng(SEED).uniform(-2, 3, len(FEATURES))).tolist()


def suite_for(rows: int) -> dict:
    expectations = [
        {"type": "expect_table_columns_to_match_ordered_list", "kwargs": {"column_list": [*FEATURES, LABEL]}},
        {"type": "expect_table_row_count_to_be_between", "kwargs": {"min_value": 1000, "max_value": 10 * rows}},
    ]
    expectations += [
        {"type": "expect_column_values_to_not_be_null", "kwargs": {"column": c}} for c in [*FEATURES, LABEL]
    ]
    expectations += [  # lognormal(0, 0.35) stays inside 20x its scale for every one of 150 M draws
        {"type": "expect_column_values_to_be_between",
         "kwargs": {"column": c, "min_value": 0, "max_value": round(20 * s, 6)}}
        for c, s in zip(FEATURES, scales(), strict=True)
    ]
    expectations += [
        {"type": "expect_column_values_to_be_in_set", "kwargs": {"column": LABEL, "value_set": [0, 1]}},
        {"type": "expect_column_distinct_values_to_contain_set", "kwargs": {"column": LABEL, "value_set": [0, 1]}},
        {"type": "expect_column_mean_to_be_between", "kwargs": {"column": LABEL, "min_value": 0.2, "max_value": 0.6}},
    ]
    return {"name": "large-table", "expectations": expectations, "meta": {"owner": "benchmark"}}


def break_cells(frame, suite: dict) -> None:
    """Nulls in two columns, values above the range in three, label 2 in 1,000 rows (in place)."""
    import numpy as np

    rng = np.random.default_rng(SEED + 1)
    highs = {e["kwargs"]["column"]: e["kwargs"]["max_value"] for e in suite["expectations"]
             if e["type"] == "expect_column_values_to_be_between"}
    n = len(frame)
    for column in FEATURES[:2]:
        frame.loc[rng.choice(n, 500, replace=False), column] = np.nan
    for column in FEATURES[5:8]:
        frame.loc[rng.choice(n, 200, replace=False), column] = highs[column] * 3
    frame.loc[rng.choice(n, 1000, replace=False), LABEL] = 2


# -- the reference: pandas doing the same checks --------------------------------------------------
def pandas_checks(frame, suite: dict) -> list[str]:
    """Every expectation of the suite checked with pandas/numpy; one line per failure with its
    unexpected count and a few example values with their rows, as the product reports them."""
    import numpy as np

    failures = []

    def unexpected(column: str, bad, what: str) -> None:
        count = int(np.count_nonzero(bad))
        if count:
            rows = np.flatnonzero(bad)[:MAX_EXAMPLES]
            values = frame[column].to_numpy()[rows]
            shown = ", ".join(f"{v!r} (row {r})" for v, r in zip(values.tolist(), rows.tolist(), strict=True))
            failures.append(f"{column}: {count} of {len(frame)} rows {what}, e.g. {shown}")

    for e in suite["expectations"]:
        kind, kw = e["type"], e["kwargs"]
        if kind == "expect_table_columns_to_match_ordered_list":
            if list(frame.columns) != kw["column_list"]:
                failures.append(f"columns {list(frame.columns)} != {kw['column_list']}")
        elif kind == "expect_table_row_count_to_be_between":
            if not kw["min_value"] <= len(frame) <= kw["max_value"]:
                failures.append(f"{len(frame)} rows")
        elif kind == "expect_column_values_to_not_be_null":
            unexpected(kw["column"], frame[kw["column"]].isna().to_numpy(), "null")
        elif kind == "expect_column_values_to_be_between":
            v = frame[kw["column"]].to_numpy()
            unexpected(kw["column"], (v < kw["min_value"]) | (v > kw["max_value"]), "outside range")  # NaN: neither
        elif kind == "expect_column_values_to_be_in_set":
            s = frame[kw["column"]]
            unexpected(kw["column"], (~s.isin(kw["value_set"]) & s.notna()).to_numpy(), "not in set")
        elif kind == "expect_column_distinct_values_to_contain_set":
            absent = set(kw["value_set"]) - set(frame[kw["column"]].dropna().unique().tolist())
            if absent:
                failures.append(f"{kw['column']}: no rows for {sorted(absent)}")
        elif kind == "expect_column_mean_to_be_between":
            mean = float(frame[kw["column"]].mean())
            if not kw["min_value"] <= mean <= kw["max_value"]:
                failures.append(f"{kw['column']}: mean {mean}")
        else:
            raise ValueError(f"the reference does not implement {kind}")
    return failures


# -- measuring ------------------------------------------------------------------------------------
def allocated_gib(run, frame) -> float:
    """Peak memory a run allocates through Python and numpy (tracemalloc): its copies and masks.
    RSS would not tell: glibc and Arrow keep freed pages, so a second run often adds nothing."""
    tracemalloc.start()
    try:
        run(frame)
        return tracemalloc.get_traced_memory()[1] / 2**30
    finally:
        tracemalloc.stop()


def product(frame, suite: dict, report_dir: Path) -> list[str]:
    from hybridflow.errors import DataValidationError
    from hybridflow.validation import validate_frames

    try:
        validate_frames("large-table", {"train": frame}, {"train": suite}, report_dir=report_dir)
    except DataValidationError as exc:
        return [line for line in str(exc).splitlines() if line.startswith("  - ")]
    return []


def pipeline_step(path: Path, suite: dict, work: Path):
    """A run of the pipeline's validate step on ``path`` as a catalogue dataset in private storage."""
    import logging
    import os

    from hybridflow.config.catalogue import DatasetEntry
    from hybridflow.rundata import validate

    folder = work / "private" / "datasets" / "large-table"
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "train.parquet").exists():
        os.link(path, folder / "train.parquet")  # same bytes, no copy
    (folder / "suite.json").write_text(json.dumps(suite))
    entry = DatasetEntry.model_validate({
        "location": "private://datasets/large-table", "format": "parquet", "holdout": "train",
        "splits": {"train": {"files": ["train.parquet"], "suite": "suite.json"}},
        "schema": [{"name": "feature_{0..29}", "type": "float"}, {"name": LABEL, "type": "int"}],
        "classification": "internal",
    })
    entry._name = "large-table"
    quiet = logging.getLogger("validation-bench")

    def run() -> None:
        validate(entry, "internal", "bench", private_root=work / "private", file_roots=[], log=quiet)

    return run


def _release_memory() -> None:
    """Every read starts from the same state, as in a fresh task process: without this, Arrow's pool
    keeps freed pages and later reads skip the page faults."""
    import pyarrow as pa

    gc.collect()
    pa.default_memory_pool().release_unused()


def measure_case(case: str, source: Path, frame, suite: dict, report_dir: Path, repeat: int):
    """Best-of-``repeat`` seconds of the product and pandas on one case, with and without the
    Parquet read, their memory, the read alone, and what each found."""
    import pandas as pd

    sides = {
        "product": lambda f: product(f, suite, report_dir),
        "pandas": lambda f: pandas_checks(f, suite),
    }
    best: dict[tuple[str, bool], float] = {}
    found: dict[str, list[str]] = {}
    for _ in range(repeat):
        for with_read in (False, True):
            for side, run in sides.items():
                t = time.perf_counter()
                data = pd.read_parquet(source) if with_read else frame
                found[side] = run(data)
                seconds = time.perf_counter() - t
                del data
                _release_memory()
                best[(side, with_read)] = min(seconds, best.get((side, with_read), seconds))
    memory = {side: allocated_gib(run, frame) for side, run in sides.items()}  # untimed
    read_alone = []
    for _ in range(repeat):
        t = time.perf_counter()
        table = pd.read_parquet(source)
        read_alone.append(time.perf_counter() - t)
        del table
        _release_memory()
    rows = [(case, with_read, best[("product", with_read)], best[("pandas", with_read)],
             memory["product"], memory["pandas"]) for with_read in (False, True)]
    return rows, min(read_alone), found


def measure_step(path: Path, suite: dict, repeat: int) -> tuple[float, float]:
    """The pipeline's whole validate step against pandas reading and checking the same file."""
    import pandas as pd

    step_work = Path(tempfile.mkdtemp(prefix="validation-bench-step-"))
    try:
        step = pipeline_step(path, suite, step_work)
        ours = ref = float("inf")
        for _ in range(repeat):
            t = time.perf_counter()
            step()
            ours = min(ours, time.perf_counter() - t)
            _release_memory()
            t = time.perf_counter()
            failures = pandas_checks(pd.read_parquet(path), suite)
            ref = min(ref, time.perf_counter() - t)
            assert not failures
            _release_memory()
    finally:
        shutil.rmtree(step_work, ignore_errors=True)
    return ours, ref


def print_table(rows_out: list, reads: dict[str, float], repeat: int, rows: int, suite: dict) -> float:
    """The results as a Markdown table; returns the worst ratio."""
    print(f"best of {repeat}; {rows:,} rows x {len(FEATURES)} float + 1 int columns, "
          f"{len(suite['expectations'])} expectations")
    print("| data | Parquet read | product s | pandas s | ratio | allocated during the checks GiB, product / pandas |")
    print("|---|---|---:|---:|---:|---|")
    worst = 0.0
    for case, with_read, ours, ref, ours_mem, ref_mem in rows_out:
        ratio = ours / ref
        worst = max(worst, ratio)
        memory = "(as above, plus the frame read)" if with_read else f"{ours_mem:.2f} / {ref_mem:.2f}"
        print(f"| {case} | {'included' if with_read else 'no (frame in memory)'} | {ours:.2f} | {ref:.2f} | "
              f"**{ratio:.2f}x** | {memory} |")
    print("pd.read_parquet alone: " + ", ".join(f"{case} {seconds:.2f} s" for case, seconds in reads.items()))
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rows", type=int, default=5_000_000)
    parser.add_argument("--repeat", type=int, default=3, help="best of N for every figure")
    parser.add_argument("--dir", type=Path, default=ROOT / "var" / "bench" / "validation")
    args = parser.parse_args()

    import pandas as pd

    from hybridflow.validation import _import_gx, check_suite

    started = time.perf_counter()
    path = dataset(args.dir, args.rows)
    print(f"data: {path} ({path.stat().st_size / 2**20:.0f} MiB; ready in {time.perf_counter() - started:.1f} s)")
    suite_path = args.dir / f"suite-{args.rows}.json"
    suite_path.write_text(json.dumps(suite_for(args.rows), indent=1))
    suite = check_suite(suite_path.read_bytes(), str(suite_path))  # as the pipeline loads it

    t0 = time.perf_counter()
    _import_gx()
    print(f"GX import: {time.perf_counter() - t0:.2f} s (once per task process; not in the figures below)")

    report_dir = Path(tempfile.mkdtemp(prefix="validation-bench-"))
    rows_out: list = []
    reads: dict[str, float] = {}
    try:
        frame = pd.read_parquet(path)
        print(f"frame: {len(frame):,} rows x {frame.shape[1]} columns, "
              f"{frame.memory_usage(index=False).sum() / 2**30:.2f} GiB in memory\n")
        for case in ("clean", "broken cells"):
            source = path
            if case == "broken cells":
                break_cells(frame, suite)
                source = args.dir / f"table-{args.rows}-broken.parquet"
                if not source.is_file():
                    frame.to_parquet(source, compression="zstd", row_group_size=1 << 20)
            rows, reads[case], found = measure_case(case, source, frame, suite, report_dir, args.repeat)
            rows_out += rows
            if (not found["product"]) != (not found["pandas"]):
                print(f"MISMATCH: product found {len(found['product'])} failures, pandas {len(found['pandas'])}")
                return 1
            if found["product"]:
                print(f"{case}: product reports {len(found['product'])} failures, e.g.")
                print("\n".join(f"  {line.strip()}" for line in found["product"][:3]))
                print(f"pandas: {len(found['pandas'])} failures, e.g. {found['pandas'][0]}\n")
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)

    worst = print_table(rows_out, reads, args.repeat, args.rows, suite)
    ours, ref = measure_step(path, suite, args.repeat)
    worst = max(worst, ours / ref)
    print(f"| clean, the pipeline's validate step (read, SHA-256 pin, schema, suite) | included | {ours:.2f} | "
          f"{ref:.2f} | **{ours / ref:.2f}x** | |")
    print(f"\nworst ratio {worst:.2f}x (target <= {TARGET:.0f}x)")
    return 0 if worst <= TARGET else 2


if __name__ == "__main__":
    sys.exit(main())
