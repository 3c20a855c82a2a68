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
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.errors import DataValidationError

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)

# Enough failure lines to act on in a task log; the JSON reports have all of them.
MAX_FAILURE_LINES = 15
MAX_EXAMPLES = 3
# Example values and row indices kept per failed expectation in the JSON report (GX's default).
REPORT_EXAMPLES = 20
# GX's column metrics on pandas drop the column's null rows with df[df[column].notnull()], which
# copies every column of the frame, once per metric, whenever the column holds a null (1.2 GB and
# ~0.5 s a time on 5M rows x 31 columns). From this size on, the expectations on columns that hold
# nulls run against a frame of just those columns; below it one more GX batch costs more than copies.
NARROW_MIN_BYTES = 64 * 2**20

# The expectation types GX 1.24.1 registers (its ``expect_*`` names), so that admission can refuse
# a misspelt type without the 5 s GX import; a unit test keeps this list equal to GX's registry.
# GX also registers ``unexpected_rows_expectation``, left out: it runs a SQL query, which a pandas
# frame cannot answer.
EXPECTATION_TYPES: frozenset[str] = frozenset({
    "expect_column_distinct_values_to_be_in_set",
    "expect_column_distinct_values_to_contain_set",
    "expect_column_distinct_values_to_equal_set",
    "expect_column_kl_divergence_to_be_less_than",
    "expect_column_max_to_be_between",
    "expect_column_mean_to_be_between",
    "expect_column_median_to_be_between",
    "expect_column_min_to_be_between",
    "expect_column_most_common_value_to_be_in_set",
    "expect_column_pair_values_a_to_be_greater_than_b",
    "expect_column_pair_values_to_be_equal",
    "expect_column_pair_values_to_be_in_set",
    "expect_column_proportion_of_non_null_values_to_be_between",
    "expect_column_proportion_of_unique_values_to_be_between",
    "expect_column_quantile_values_to_be_between",
    "expect_column_stdev_to_be_between",
    "expect_column_sum_to_be_between",
    "expect_column_to_exist",
    "expect_column_type_to_be",
    "expect_column_unique_value_count_to_be_between",
    "expect_column_value_lengths_to_be_between",
    "expect_column_value_lengths_to_equal",
    "expect_column_value_z_scores_to_be_less_than",
    "expect_column_values_to_be_between",
    "expect_column_values_to_be_dateutil_parseable",
    "expect_column_values_to_be_decreasing",
    "expect_column_values_to_be_in_set",
    "expect_column_values_to_be_in_type_list",
    "expect_column_values_to_be_increasing",
    "expect_column_values_to_be_json_parseable",
    "expect_column_values_to_be_null",
    "expect_column_values_to_be_of_type",
    "expect_column_values_to_be_unique",
    "expect_column_values_to_match_json_schema",
    "expect_column_values_to_match_like_pattern",
    "expect_column_values_to_match_like_pattern_list",
    "expect_column_values_to_match_regex",
    "expect_column_values_to_match_regex_list",
    "expect_column_values_to_match_strftime_format",
    "expect_column_values_to_not_be_in_set",
    "expect_column_values_to_not_be_null",
    "expect_column_values_to_not_be_outliers",
    "expect_column_values_to_not_match_like_pattern",
    "expect_column_values_to_not_match_like_pattern_list",
    "expect_column_values_to_not_match_regex",
    "expect_column_values_to_not_match_regex_list",
    "expect_compound_columns_to_be_unique",
    "expect_multicolumn_sum_to_equal",
    "expect_multicolumn_values_to_be_equal",
    "expect_query_results_to_match_comparison",
    "expect_select_column_values_to_be_unique_within_record",
    "expect_table_column_count_to_be_between",
    "expect_table_column_count_to_equal",
    "expect_table_columns_to_match_ordered_list",
    "expect_table_columns_to_match_set",
    "expect_table_row_count_to_be_between",
    "expect_table_row_count_to_equal",
    "expect_table_row_count_to_equal_other_table",
})
# Keys GX 1.x accepts in a suite file and in one of its expectations (``gx.ExpectationSuite(**json)``).
SUITE_KEYS = frozenset({"name", "expectations", "suite_parameters", "meta", "notes", "id"})
EXPECTATION_KEYS = frozenset({
    "type", "kwargs", "meta", "notes", "description", "severity", "id", "rendered_content",
    "success_on_last_run", "expectation_context",
})
# Expectations whose failure is about the values of a numeric column: when they cannot run, the
# usual cause is text in the column, and the failure line points at those cells.
_NUMERIC = frozenset({
    "expect_column_values_to_be_between", "expect_column_mean_to_be_between",
    "expect_column_median_to_be_between", "expect_column_min_to_be_between",
    "expect_column_max_to_be_between", "expect_column_sum_to_be_between",
    "expect_column_stdev_to_be_between", "expect_column_quantile_values_to_be_between",
    "expect_column_value_z_scores_to_be_less_than",
})


class SuiteError(ValueError):
    """An expectation suite file that is not a valid GX 1.x suite; the message names the file."""


# -- suite files ----------------------------------------------------------------------------------
def check_suite(raw: bytes, where: str) -> dict:
    """Parse a suite file and check its structure without importing GX; return the parsed suite.

    Checks: a JSON object with a non-empty string ``name`` and a non-empty ``expectations`` list of
    ``{"type": "expect_...", "kwargs": {...}}`` objects whose types GX 1.24.1 knows, and no keys GX
    would refuse. Each expectation's kwargs are checked by GX itself when the suite runs.
    """
    try:
        text = raw.decode("utf-8-sig")  # json.loads(bytes) would also guess UTF-16/32; suites are UTF-8
    except UnicodeDecodeError as exc:
        raise SuiteError(f"{where} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        suite = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SuiteError(f"{where} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    _check_structure(suite, where)
    return suite


def _check_structure(suite: Any, where: str) -> None:
    if not isinstance(suite, dict):
        raise SuiteError(f"{where}: a suite is a JSON object {{\"name\": ..., \"expectations\": [...]}}, "
                         f"not a JSON {_json_kind(suite)}")
    if "expectation_suite_name" in suite or "ge_cloud_id" in suite:
        raise SuiteError(f"{where} is a Great Expectations 0.x suite (expectation_suite_name); GX 1.x suites "
                         "have \"name\" and expectations with \"type\" instead of \"expectation_type\"")
    unknown = sorted(set(suite) - SUITE_KEYS)
    if unknown:
        raise SuiteError(f"{where}: unknown key {', '.join(map(repr, unknown))}; a GX 1.x suite has "
                         f"{', '.join(sorted(SUITE_KEYS))}")
    name = suite.get("name")
    if not isinstance(name, str) or not name.strip():
        raise SuiteError(f"{where}: \"name\" must be a non-empty string")
    expectations = suite.get("expectations")
    if not isinstance(expectations, list) or not expectations:
        raise SuiteError(f"{where}: \"expectations\" must be a non-empty list of "
                         "{\"type\": \"expect_...\", \"kwargs\": {...}}")
    for i, item in enumerate(expectations):
        at = f"{where}: expectations[{i}]"
        if not isinstance(item, dict):
            raise SuiteError(f"{at} is a JSON {_json_kind(item)}, not an object {{\"type\": ..., \"kwargs\": ...}}")
        if "expectation_type" in item:
            raise SuiteError(f"{at} uses the GX 0.x key \"expectation_type\"; GX 1.x calls it \"type\"")
        kind = item.get("type")
        if not isinstance(kind, str) or not kind:
            raise SuiteError(f"{at} has no \"type\"")
        if kind not in EXPECTATION_TYPES:
            raise SuiteError(f"{at}: unknown expectation type {kind!r}"
                             f"{_did_you_mean(kind)}; Great Expectations 1.24.1 has no such expectation")
        if not isinstance(item.get("kwargs"), dict):
            raise SuiteError(f"{at} ({kind}): \"kwargs\" must be an object")
        extra = sorted(set(item) - EXPECTATION_KEYS)
        if extra:
            raise SuiteError(f"{at} ({kind}): unknown key {', '.join(map(repr, extra))}")


def _json_kind(value: Any) -> str:
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _did_you_mean(kind: str) -> str:
    import difflib

    close = difflib.get_close_matches(kind, sorted(EXPECTATION_TYPES), n=1, cutoff=0.8)
    return f" (did you mean {close[0]!r}?)" if close else ""


# -- validation -----------------------------------------------------------------------------------
@dataclass
class ValidationSummary:
    dataset: str
    passed: bool
    splits: dict[str, dict[str, int]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    reports: dict[str, Path] = field(default_factory=dict)
    elapsed_s: float = 0.0

    def to_xcom(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "passed": self.passed,
            "splits": {s: dict(v) for s, v in self.splits.items()},
            "failures": list(self.failures),
            "reports": {k: str(p) for k, p in self.reports.items()},
            "elapsed_s": round(self.elapsed_s, 3),
        }

    def render(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        lines = [f"Data validation {verdict} for {self.dataset} ({self.elapsed_s:.1f} s)"]
        for split, stats in self.splits.items():
            lines.append(
                f"  {split}: {stats['rows']} rows, {stats['expectations']} expectations, {stats['failed']} failed"
            )
        if self.failures:
            shown = self.failures[:MAX_FAILURE_LINES]
            lines.append(f"Failures ({len(self.failures)}):")
            lines.extend(f"  - {line}" for line in shown)
            if len(self.failures) > len(shown):
                lines.append(f"  ... and {len(self.failures) - len(shown)} more")
        if self.reports:
            lines.append("Full reports:")
            lines.extend(f"  {name}: {path}" for name, path in self.reports.items())
        return "\n".join(lines)


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


def _import_gx():
    # GX logs hundreds of INFO/DEBUG lines while it imports (its public-API registry, its data
    # source registry); an Airflow task logs at INFO, so quieten GX unless someone set its level.
    gx_log = logging.getLogger("great_expectations")
    if gx_log.level == logging.NOTSET:
        gx_log.setLevel(logging.WARNING)
    import great_expectations as gx

    return gx


def _ephemeral_context(gx):
    from great_expectations.data_context.types.base import (
        DataContextConfig,
        InMemoryStoreBackendDefaults,
        ProgressBarsConfig,
    )

    # In memory: no files, no docs site, no usage statistics leaving the (private) network, and no
    # progress bars in the task log.
    return gx.get_context(
        mode="ephemeral",
        project_config=DataContextConfig(
            store_backend_defaults=InMemoryStoreBackendDefaults(init_temp_docs_sites=False),
            analytics_enabled=False,
            progress_bars=ProgressBarsConfig(globally=False),
        ),
    )


def _build_suite(gx, raw: dict, where: str):
    """The GX suite for a parsed suite file; SuiteError names the expectation GX refuses.

    Expectations are built one by one because ``gx.ExpectationSuite`` drops an invalid one with
    only a log line, and handed to the constructor at once (``add_expectation`` compares each new
    expectation with all before it: O(n^2)).
    """
    from great_expectations.expectations.expectation_configuration import ExpectationConfiguration

    _check_structure(raw, f"suite {raw.get('name')!r} for {where}" if isinstance(raw, dict) else where)
    expectations = []
    for i, item in enumerate(raw["expectations"]):
        try:
            expectations.append(ExpectationConfiguration(**item).to_domain_obj())
        except Exception as exc:  # noqa: BLE001 - pydantic and GX raise several kinds; all mean "invalid"
            raise SuiteError(
                f"suite {raw['name']!r} for {where}: expectations[{i}] ({item['type']}) is not valid: {_first_line(exc)}"
            ) from None
    return gx.ExpectationSuite(
        name=raw["name"], expectations=expectations, meta=dict(raw.get("meta") or {}), notes=raw.get("notes")
    )


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


def _nbytes(frame: pd.DataFrame) -> int:
    return int(frame.memory_usage(index=False, deep=False).sum())


def _columns_with_nulls(frame: pd.DataFrame, suite) -> list[str]:
    """Columns that column expectations look at and that hold a null, in the frame's order."""
    import numpy as np

    if not frame.columns.is_unique:
        return []  # frame[name] would be a frame; GX reports the duplicate columns anyway
    wanted = {getattr(e, "column", None) for e in suite.expectations}
    found = []
    for name in frame.columns:
        if name not in wanted:
            continue
        series = frame[name]
        dtype = series.dtype
        if isinstance(dtype, np.dtype) and dtype.kind in "iub":
            continue  # numpy integers and booleans cannot hold a null
        if isinstance(dtype, np.dtype) and dtype.kind == "f":
            # One reduction instead of an isna() mask per column: a NaN anywhere makes the sum NaN
            # (so do +inf and -inf together, which only sends the column apart needlessly).
            has_null = bool(np.isnan(series.to_numpy().sum()))
        else:
            has_null = bool(series.hasnans)
        if has_null:
            found.append(name)
    return found


def _validate(gx, source, asset: str, frame: pd.DataFrame, suite):
    """BOOLEAN_ONLY over the whole suite, then SUMMARY for the failed expectations that can say more."""
    # V1 Validator is what ValidationDefinition.run and Batch.validate build for each run; holding
    # one per batch keeps one batch (GX fingerprints each batch it builds) and its metric cache for
    # both passes, without storing suites and results in the context as ValidationDefinition does.
    from great_expectations.validator.v1_validator import Validator

    batch_definition = source.add_dataframe_asset(name=asset).add_batch_definition_whole_dataframe(name=asset)
    validator = Validator(
        batch_definition=batch_definition, batch_parameters={"dataframe": frame}, result_format="BOOLEAN_ONLY"
    )
    result = validator.validate_expectation_suite(suite)
    columns = set(frame.columns)
    # A missing column or an exception says all there is to say: SUMMARY would only raise again.
    again = [
        r.expectation_config
        for r in result.results
        if not r.success
        and r.expectation_config.kwargs.get("column") in columns | {None}
        and _exception_message(r.exception_info or {}) is None
    ]
    if again:
        validator.result_format = {"result_format": "SUMMARY", "partial_unexpected_count": REPORT_EXAMPLES}
        detail = validator.validate_expectation_suite(
            gx.ExpectationSuite(name=suite.name, expectations=[_fresh(cfg) for cfg in again])
        )
        by_key = {_key(r.expectation_config): r for r in detail.results}
        result.results = [by_key.get(_key(r.expectation_config), r) for r in result.results]
    return result


def _fresh(cfg) -> dict:
    # A configuration that went through a suite carries that suite's expectation id.
    return {"type": cfg.type, "kwargs": dict(cfg.kwargs)}


def _key(cfg) -> str:
    return json.dumps([cfg.type, cfg.kwargs], sort_keys=True, default=str)


# -- failure lines --------------------------------------------------------------------------------
def _describe_failures(failed: list[Any], frame: pd.DataFrame, line_offset: int | None) -> list[str]:
    """One readable line per failed expectation, table-level first.

    Column expectations on a column that is not in the data cannot run; they are folded into one
    line per column since the column-list failure already names the cause.
    """
    rows = _RowPointer(frame, line_offset)
    table_lines: list[str] = []
    column_lines: list[tuple[int, str]] = []  # (column position, line): the file's column order
    unrunnable: dict[str, list[str]] = {}
    position = {name: i for i, name in enumerate(frame.columns)}
    for res in failed:
        kind = res.expectation_config.type
        kwargs = res.expectation_config.kwargs
        column = kwargs.get("column")
        if column is None:
            table_lines.append(_describe_one(kind, kwargs, res.result or {}, res.exception_info or {}, frame, rows))
        elif column not in position:
            unrunnable.setdefault(column, []).append(kind)
        else:
            line = _describe_one(kind, kwargs, res.result or {}, res.exception_info or {}, frame, rows)
            column_lines.append((position[column], line))
    column_lines.sort(key=lambda item: item[0])
    lines = table_lines + [line for _, line in column_lines]
    for column, kinds in unrunnable.items():
        count = f"{len(kinds)} expectations" if len(kinds) > 1 else "1 expectation"
        lines.append(f"{column}: {count} not evaluated, the column is not in the data")
    return lines


def _describe_one(
    kind: str,
    kwargs: dict[str, Any],
    result: dict[str, Any],
    exc_info: dict[str, Any],
    frame: pd.DataFrame,
    rows: _RowPointer,
) -> str:
    column = kwargs.get("column")
    prefix = f"{column}: {kind}" if column is not None else kind
    error = _exception_message(exc_info)

    if error:
        text = _non_numeric_cells(frame[column], rows) if column is not None and kind in _NUMERIC else ""
        return f"{prefix}: {text or f'could not be evaluated ({error})'}"
    if kind == "expect_table_columns_to_match_ordered_list":
        expected, observed = list(kwargs["column_list"]), [str(c) for c in frame.columns]
        missing = [c for c in expected if c not in observed]
        extra = [c for c in observed if c not in expected]
        parts = []
        if missing:
            parts.append(f"missing {_clip(missing)}")
        if extra:
            parts.append(f"unexpected {_clip(extra)}")
        if not parts:
            parts.append("same columns in a different order")
        return f"{prefix}: {'; '.join(parts)}"
    if kind == "expect_table_row_count_to_be_between":
        return f"{prefix}: {result.get('observed_value')} rows, expected {_range(kwargs)}"
    if kind == "expect_column_distinct_values_to_contain_set":
        absent = result.get("partial_missing_list")
        if absent is None:
            observed = set(result.get("observed_value") or [])
            absent = [v for v in kwargs.get("value_set") or [] if v not in observed]
        return f"{prefix}: no rows for {_clip([_fmt(v) for v in absent])} (expected all of {_value_set(kwargs.get('value_set') or [])})"
    if "unexpected_count" in result:
        return f"{prefix}: {_unexpected(kind, kwargs, result, rows)}"
    observed = result.get("observed_value")
    if "min_value" in kwargs or "max_value" in kwargs:
        return f"{prefix}: observed {_fmt(observed)}, expected {_range(kwargs)}"
    return f"{prefix}: observed {_fmt(observed)}"


def _unexpected(kind: str, kwargs: dict[str, Any], result: dict[str, Any], rows: _RowPointer) -> str:
    what = {
        "expect_column_values_to_not_be_null": "null",
        "expect_column_values_to_be_between": f"outside {_range(kwargs)}",
        "expect_column_values_to_be_in_set": f"not in {_value_set(kwargs.get('value_set') or [])}",
    }.get(kind, "unexpected")
    text = f"{result['unexpected_count']} of {result.get('element_count')} rows {what}"
    values = (result.get("partial_unexpected_list") or [])[:MAX_EXAMPLES]
    indices = (result.get("partial_unexpected_index_list") or [])[:MAX_EXAMPLES]
    if values:
        if len(indices) == len(values):
            shown = [f"{_fmt(v)} ({rows.at(i)})" for v, i in zip(values, indices, strict=True)]
        else:
            shown = [_fmt(v) for v in values]
        text += f", e.g. {', '.join(shown)}"
    return text


class _RowPointer:
    """'row i' (0-based position in the split) plus the file line where the caller gave an offset."""

    def __init__(self, frame: pd.DataFrame, line_offset: int | None) -> None:
        import pandas as pd

        self._index = frame.index
        index = frame.index
        self._positional = isinstance(index, pd.RangeIndex) and index.start == 0 and index.step == 1
        self._offset = line_offset

    def position(self, label: Any) -> int | None:
        if self._positional:
            return int(label)
        if self._index.is_unique:
            pos = self._index.get_indexer([label])[0]
            return int(pos) if pos >= 0 else None
        return None

    def at(self, label: Any) -> str:
        pos = self.position(label)
        if pos is None:
            return f"index {label!r}"
        if self._offset is None:
            return f"row {pos}"
        return f"row {pos}, CSV line {pos + self._offset}"


def _non_numeric_cells(series: pd.Series, rows: _RowPointer) -> str:
    """Point at the cells that keep a column from being numeric (text in a number column)."""
    import pandas as pd

    if series.dtype.kind in "iufb":
        return ""
    bad = series[pd.to_numeric(series, errors="coerce").isna() & series.notna()]
    if bad.empty:
        return ""
    shown = [f"{_fmt(v)} ({rows.at(i)})" for i, v in bad.head(MAX_EXAMPLES).items()]
    cells = "1 cell is not a number" if len(bad) == 1 else f"{len(bad)} cells are not numbers"
    return f"the column holds text (dtype {series.dtype}): {cells}, e.g. {', '.join(shown)}"


def _exception_message(exc_info: dict[str, Any]) -> str | None:
    # GX 1.x stores either one flat record or a dict of records keyed by metric id.
    records = [exc_info] if "raised_exception" in exc_info else list(exc_info.values())
    for record in records:
        if isinstance(record, dict) and (record.get("exception_message") or record.get("raised_exception")):
            message = str(record.get("exception_message") or "unknown error").strip().splitlines()
            return message[-1][:200] if message else "unknown error"
    return None


def _value_set(values: list[Any]) -> str:
    """{0..9} for a run of consecutive integers, else the values (clipped)."""
    ints = sorted(v for v in values if isinstance(v, int) and not isinstance(v, bool))
    if len(ints) == len(values) > 2 and ints == list(range(ints[0], ints[-1] + 1)):
        return f"{{{ints[0]}..{ints[-1]}}}"
    return f"{{{_clip([_fmt(v) for v in values])}}}"


def _range(kwargs: dict[str, Any]) -> str:
    low, high = kwargs.get("min_value"), kwargs.get("max_value")
    return f"{'' if low is None else _fmt(low)}..{'' if high is None else _fmt(high)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _fmt(value: Any) -> str:
    if hasattr(value, "item"):  # numpy scalar -> plain Python, so repr reads 99 not np.int64(99)
        value = value.item()
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "null"
    if isinstance(value, float):
        return format(value, ".12g")  # 99 not 99.0, 13993.246269 not 13993.246269000001
    return repr(value)


def _clip(items: list[Any], limit: int = 8) -> str:
    shown = ", ".join(str(i) for i in items[:limit])
    return shown + (f" (+{len(items) - limit} more)" if len(items) > limit else "")
