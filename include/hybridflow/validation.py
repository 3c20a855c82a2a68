"""Data validation with Great Expectations 1.x before anything trains on a dataset.

Each split CSV is read with pandas where it lives (private storage; nothing is copied) and checked
against an expectation suite. The full GX result goes to ``validation-<split>.json`` and a short
report to ``validation-summary.txt``; on failure :class:`DataValidationError` carries the readable
summary so the Airflow task log says what is wrong without opening the JSON.

GX takes seconds to import, so it is only imported inside the functions that need it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.datasets import DIGITS_FEATURES, LABEL, SPLITS, DatasetRef
from hybridflow.errors import DataValidationError

if TYPE_CHECKING:
    import pandas as pd
    from great_expectations import ExpectationSuite

log = logging.getLogger(__name__)

PIXEL_MIN = 0
PIXEL_MAX = 16
DIGIT_CLASSES = list(range(10))
# Integer dtypes pandas may infer for a clean column; a null turns the column into float64 and a
# stray word into str/object, so a dtype check catches both without scanning values twice.
INTEGER_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
# Enough failure lines to act on in a task log; the JSON report has all of them.
MAX_FAILURE_LINES = 15
MAX_EXAMPLES = 3

SuiteBuilder = Callable[..., "ExpectationSuite"]


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


def digits_suite(split: str, *, min_rows: int, max_rows: int) -> ExpectationSuite:
    """The expectation suite for one split of the digits set (64 pixel columns + label)."""
    import great_expectations as gx
    import great_expectations.expectations as gxe

    columns = [*DIGITS_FEATURES, LABEL]
    # Only train is held to min_rows; a small held-out split is legitimate but must not be empty.
    lower = min_rows if split == "train" else 1
    expectations = [
        gxe.ExpectTableColumnsToMatchOrderedList(column_list=columns),
        gxe.ExpectTableRowCountToBeBetween(min_value=lower, max_value=max_rows),
    ]
    for column in columns:
        expectations.append(gxe.ExpectColumnValuesToNotBeNull(column=column))
        expectations.append(gxe.ExpectColumnValuesToBeInTypeList(column=column, type_list=INTEGER_DTYPES))
    expectations += [
        gxe.ExpectColumnValuesToBeBetween(column=column, min_value=PIXEL_MIN, max_value=PIXEL_MAX)
        for column in DIGITS_FEATURES
    ]
    expectations.append(gxe.ExpectColumnValuesToBeInSet(column=LABEL, value_set=DIGIT_CLASSES))
    if split == "train":
        # A class missing from train cannot be learned; test may legitimately be too small to hold all.
        expectations.append(gxe.ExpectColumnDistinctValuesToContainSet(column=LABEL, value_set=DIGIT_CLASSES))
    # Passed to the constructor: add_expectation() compares each new one with all before it (O(n^2),
    # seconds for ~200 expectations).
    return gx.ExpectationSuite(name=f"digits-{split}", expectations=expectations)


def validate_dataset(
    dataset: DatasetRef,
    *,
    min_rows: int,
    max_rows: int,
    report_dir: Path,
    suite_builder: SuiteBuilder = digits_suite,
) -> ValidationSummary:
    """Validate every split of ``dataset``; write reports; raise DataValidationError on any failure."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import (
        DataContextConfig,
        InMemoryStoreBackendDefaults,
        ProgressBarsConfig,
    )

    started = time.monotonic()
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    summary = ValidationSummary(dataset=dataset.uri, passed=True)

    # In-memory context: no files, no docs site, no usage statistics leaving the (private) network,
    # and no progress bars cluttering the Airflow task log.
    context = gx.get_context(
        mode="ephemeral",
        project_config=DataContextConfig(
            store_backend_defaults=InMemoryStoreBackendDefaults(init_temp_docs_sites=False),
            analytics_enabled=False,
            progress_bars=ProgressBarsConfig(globally=False),
        ),
    )
    source = context.data_sources.add_pandas(name=dataset.name)

    for split in SPLITS:
        path = dataset.split_path(split)
        report_path = report_dir / f"validation-{split}.json"
        report_path.unlink(missing_ok=True)  # never leave a stale report from an earlier run
        try:
            frame = _read_split(path)
        except DataValidationError as exc:
            summary.passed = False
            summary.splits[split] = {"rows": 0, "expectations": 0, "failed": 1}
            summary.failures.append(f"{split}: {exc}")
            continue

        suite = context.suites.add(suite_builder(split, min_rows=min_rows, max_rows=max_rows))
        batch_definition = source.add_dataframe_asset(name=split).add_batch_definition_whole_dataframe(
            name=f"{split}-whole"
        )
        definition = context.validation_definitions.add(
            gx.ValidationDefinition(name=f"{dataset.name}-{split}", data=batch_definition, suite=suite)
        )
        # SUMMARY keeps unexpected counts plus up to 20 example values and row indices per expectation.
        result = definition.run(batch_parameters={"dataframe": frame}, result_format="SUMMARY")
        report_path.write_text(json.dumps(result.to_json_dict(), indent=2, default=str))
        summary.reports[split] = report_path

        failed = [r for r in result.results if not r.success]
        summary.splits[split] = {
            "rows": len(frame),
            "expectations": len(result.results),
            "failed": len(failed),
        }
        if failed:
            summary.passed = False
            summary.failures.extend(f"{split}: {line}" for line in _describe_failures(failed, frame))

    summary.elapsed_s = time.monotonic() - started
    summary_path = report_dir / "validation-summary.txt"
    summary.reports["summary"] = summary_path
    text = summary.render()
    summary_path.write_text(text + "\n")
    if not summary.passed:
        raise DataValidationError(text)
    log.info("%s", text)
    return summary


def _read_split(path: Path) -> pd.DataFrame:
    import pandas as pd

    try:
        return pd.read_csv(path)
    except FileNotFoundError:
        raise DataValidationError(f"{path} does not exist") from None
    except pd.errors.EmptyDataError:
        raise DataValidationError(
            f"{path} is empty (no header, no rows); expected a CSV with a header"
        ) from None
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataValidationError(f"{path} is not a readable CSV: {first}") from None


def _describe_failures(failed: list[Any], frame: pd.DataFrame) -> list[str]:
    """One readable line per failed expectation, table-level first.

    Column expectations on a column that is not in the file cannot run; they are folded into one
    line per column since the column-list failure already names the cause.
    """
    table_lines: list[str] = []
    column_lines: list[str] = []
    unrunnable: dict[str, list[str]] = {}
    for res in failed:
        kind = res.expectation_config.type
        kwargs = res.expectation_config.kwargs
        column = kwargs.get("column")
        if column is not None and column not in frame.columns:
            unrunnable.setdefault(column, []).append(kind)
            continue
        line = _describe_one(kind, kwargs, res.result or {}, res.exception_info or {}, frame)
        (column_lines if column is not None else table_lines).append(line)
    for column, kinds in unrunnable.items():
        column_lines.append(f"{column}: {len(kinds)} expectations not evaluated, column is not in the file")
    return table_lines + column_lines


def _describe_one(
    kind: str, kwargs: dict[str, Any], result: dict[str, Any], exc_info: dict[str, Any], frame: pd.DataFrame
) -> str:
    column = kwargs.get("column")
    prefix = f"{column}: {kind}" if column is not None else kind
    error = _exception_message(exc_info)

    if kind == "expect_table_columns_to_match_ordered_list":
        expected, observed = list(kwargs["column_list"]), list(result.get("observed_value") or [])
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
        return (
            f"{prefix}: {result.get('observed_value')} rows, expected "
            f"{kwargs.get('min_value')}..{kwargs.get('max_value')}"
        )
    if kind == "expect_column_values_to_be_in_type_list":
        dtype = result.get("observed_value")
        line = f"{prefix}: column type is {dtype}, expected integers"
        return line + _non_integer_examples(frame[column])
    if kind == "expect_column_distinct_values_to_contain_set":
        return f"{prefix}: no rows for {_clip(result.get('partial_missing_list') or [])}"
    if error:
        return f"{prefix}: could not be evaluated ({error})"
    if "unexpected_count" in result:
        return f"{prefix}: {_unexpected(result)}"
    return f"{prefix}: observed {result.get('observed_value')!r}"


def _unexpected(result: dict[str, Any]) -> str:
    text = f"{result['unexpected_count']} of {result.get('element_count')} rows unexpected"
    values = [_fmt(v) for v in (result.get("partial_unexpected_list") or [])[:MAX_EXAMPLES]]
    # Row index i (0-based, default RangeIndex) is CSV line i + 2 because of the header line.
    lines = [str(i + 2) for i in (result.get("partial_unexpected_index_list") or [])[:MAX_EXAMPLES]]
    if values:
        text += f", e.g. {', '.join(values)}"
        if len(lines) == len(values):
            text += f" (CSV line{'s' if len(lines) > 1 else ''} {', '.join(lines)})"
    return text


def _non_integer_examples(series: pd.Series) -> str:
    """Point at the cells that made a column non-integer (nulls, words, fractions)."""
    import pandas as pd

    numeric = pd.to_numeric(series, errors="coerce")
    bad = series[numeric.isna() | (numeric.notna() & (numeric % 1 != 0))]
    if bad.empty:
        return ""
    shown = [f"{_fmt(v)} (CSV line {i + 2})" for i, v in bad.head(MAX_EXAMPLES).items()]
    return f"; {len(bad)} non-integer cells, e.g. {', '.join(shown)}"


def _exception_message(exc_info: dict[str, Any]) -> str | None:
    # GX 1.x stores either one flat record or a dict of records keyed by metric id.
    records = [exc_info] if "raised_exception" in exc_info else list(exc_info.values())
    for record in records:
        if isinstance(record, dict) and (record.get("exception_message") or record.get("raised_exception")):
            message = str(record.get("exception_message") or "unknown error").strip().splitlines()
            return message[-1][:200] if message else "unknown error"
    return None


def _fmt(value: Any) -> str:
    if hasattr(value, "item"):  # numpy scalar -> plain Python, so repr reads 99 not np.int64(99)
        value = value.item()
    if value is None or (isinstance(value, float) and value != value):
        return "null"
    return repr(value)


def _clip(items: list[Any], limit: int = 8) -> str:
    shown = ", ".join(str(i) for i in items[:limit])
    return shown + (f" (+{len(items) - limit} more)" if len(items) > limit else "")
