"""Data validation with Great Expectations 1.x before anything trains on a dataset.

Every dataset keeps its own GX 1.x suite file next to its data (JSON:
``{"name", "expectations": [{"type", "kwargs"}, ...], "meta"}``). :func:`check_suite` checks such a
file's structure at admission without importing GX; :func:`validate_frames` runs the suites over
the splits the caller has read. The full GX result goes to ``validation-<split>.json`` and a short
report to ``validation-summary.txt``; on failure :class:`DataValidationError` carries the readable
summary so the Airflow task log says what is wrong without opening the JSON.

Where the time goes, and why the code is shaped this way:

- ``import great_expectations`` takes about 5 s, so it happens only inside :func:`validate_frames`.
- GX spends 2-3 ms of Python per expectation whatever the data size (its dependency graph is
  rebuilt from pydantic models many times per expectation), and SUMMARY results cost about twice
  BOOLEAN_ONLY ones. Every split is therefore validated with BOOLEAN_ONLY first; only the
  expectations that failed run again, with SUMMARY, for counts, example values and row indices.
- GX fingerprints (hashes) every pandas batch under 1 GB each time it builds one. One validator
  per split serves both passes, so a split is hashed once.
- Frames are handed to GX as they are: nothing is copied or converted here. In a large frame, the
  columns that hold nulls are validated apart (see NARROW_MIN_BYTES) so that GX's null filtering
  copies those columns only, not the whole frame, per metric.

The package: ``suites`` (suite files, checked without GX), ``runner`` (GX context, suites, the two
passes), ``failures`` (readable failure lines), ``summary`` (the rendered summary); this module runs
the splits and writes the reports.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.errors import DataValidationError
from hybridflow.validation.failures import (
    _NUMERIC,
    MAX_EXAMPLES,
    _clip,
    _describe_failures,
    _describe_one,
    _exception_message,
    _fmt,
    _non_numeric_cells,
    _range,
    _RowPointer,
    _unexpected,
    _value_set,
)
from hybridflow.validation.runner import (
    REPORT_EXAMPLES,
    _build_suite,
    _columns_with_nulls,
    _ephemeral_context,
    _first_line,
    _fresh,
    _import_gx,
    _key,
    _nbytes,
    _validate,
)
from hybridflow.validation.suites import (
    EXPECTATION_KEYS,
    EXPECTATION_TYPES,
    SUITE_KEYS,
    SuiteError,
    _check_structure,
    _did_you_mean,
    _json_kind,
    check_suite,
)
from hybridflow.validation.summary import MAX_FAILURE_LINES, ValidationSummary

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "EXPECTATION_KEYS",
    "EXPECTATION_TYPES",
    "MAX_EXAMPLES",
    "MAX_FAILURE_LINES",
    "NARROW_MIN_BYTES",
    "REPORT_EXAMPLES",
    "SUITE_KEYS",
    "SuiteError",
    "ValidationSummary",
    "_NUMERIC",
    "_RowPointer",
    "_build_suite",
    "_check_structure",
    "_clip",
    "_columns_with_nulls",
    "_describe_failures",
    "_describe_one",
    "_did_you_mean",
    "_ephemeral_context",
    "_exception_message",
    "_first_line",
    "_fmt",
    "_fresh",
    "_import_gx",
    "_json_kind",
    "_key",
    "_nbytes",
    "_non_numeric_cells",
    "_range",
    "_run_split",
    "_unexpected",
    "_validate",
    "_value_set",
    "check_suite",
    "validate_frames",
]

log = logging.getLogger(__name__)

# GX's column metrics on pandas drop the column's null rows with df[df[column].notnull()], which
# copies every column of the frame, once per metric, whenever the column holds a null (1.2 GB and
# ~0.5 s a time on 5M rows x 31 columns). From this size on, the expectations on columns that hold
# nulls run against a frame of just those columns; below it one more GX batch costs more than copies.
NARROW_MIN_BYTES = 64 * 2**20


def validate_frames(
    dataset: str,
    frames: Mapping[str, pd.DataFrame],
    suites: Mapping[str, dict],
    *,
    report_dir: Path,
    line_offset: Mapping[str, int] | None = None,
) -> ValidationSummary:
    """Validate each split's whole table against its suite; write reports; raise on any failure.

    ``frames`` maps split -> table, ``suites`` split -> parsed suite (splits may share one).
    ``line_offset[split]``, where given, turns row i into a file line: line = i + offset (2 for a
    CSV read from one file with a header line). Raises SuiteError for a suite GX cannot build and
    DataValidationError, carrying the rendered summary, when any expectation fails.
    """
    started = time.monotonic()
    missing = [s for s in frames if s not in suites]
    if missing:
        raise SuiteError(f"{dataset}: no expectation suite for split {', '.join(missing)}")
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    offsets = dict(line_offset or {})
    summary = ValidationSummary(dataset=dataset, passed=True)

    gx = _import_gx()
    source = _ephemeral_context(gx).data_sources.add_pandas(name="hybridflow")
    built: dict[str, Any] = {}  # suite JSON -> ExpectationSuite: splits sharing a suite build it once
    for split, frame in frames.items():
        report_path = report_dir / f"validation-{split}.json"
        report_path.unlink(missing_ok=True)  # never leave a stale report from an earlier run
        raw = suites[split]
        key = json.dumps(raw, sort_keys=True, default=str)
        if key not in built:
            built[key] = _build_suite(gx, raw, f"{dataset} split {split}")
        result = _run_split(gx, source, split, frame, built[key])

        report_path.write_text(json.dumps(result.to_json_dict(), indent=1, default=str))
        summary.reports[split] = report_path
        failed = [r for r in result.results if not r.success]
        summary.splits[split] = {"rows": len(frame), "expectations": len(result.results), "failed": len(failed)}
        if failed:
            summary.passed = False
            lines = _describe_failures(failed, frame, offsets.get(split))
            summary.failures.extend(f"{split}: {line}" for line in lines)

    summary.elapsed_s = time.monotonic() - started
    summary_path = report_dir / "validation-summary.txt"
    summary.reports["summary"] = summary_path
    text = summary.render()
    summary_path.write_text(text + "\n")
    if not summary.passed:
        raise DataValidationError(text)
    log.info("%s", text)
    return summary


def _run_split(gx, source, split: str, frame: pd.DataFrame, suite):
    """The split's suite result; columns holding nulls run apart in a large frame (NARROW_MIN_BYTES)."""
    apart = _columns_with_nulls(frame, suite) if _nbytes(frame) >= NARROW_MIN_BYTES else []
    if not apart:
        return _validate(gx, source, split, frame, suite)
    main, narrow = [], []
    for expectation in suite.expectations:
        (narrow if getattr(expectation, "column", None) in apart else main).append(_fresh(expectation.configuration))
    result = _validate(gx, source, split, frame, gx.ExpectationSuite(name=suite.name, expectations=main))
    # frame[columns] is a view (copy-on-write) with the same row labels, so row pointers still hold.
    extra = _validate(
        gx, source, f"{split}.nulls", frame[apart], gx.ExpectationSuite(name=suite.name, expectations=narrow)
    )
    result.results = [*result.results, *extra.results]
    passed = sum(1 for r in result.results if r.success)
    total = len(result.results)
    result.success = passed == total
    result.statistics.update(
        evaluated_expectations=total,
        successful_expectations=passed,
        unsuccessful_expectations=total - passed,
        success_percent=100.0 * passed / total,
    )
    result.meta["columns_validated_apart"] = {"columns": apart, "why": "they hold nulls"}
    return result
