"""One readable line per failed expectation: what failed, example values and the rows (file lines)
they are on."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

# Example values shown per failure line in the task log.
MAX_EXAMPLES = 3
# Expectations whose failure is about the values of a numeric column: when they cannot run, the
# usual cause is text in the column, and the failure line points at those cells.
_NUMERIC = frozenset({
    "expect_column_values_to_be_between", "expect_column_mean_to_be_between",
    "expect_column_median_to_be_between", "expect_column_min_to_be_between",
    "expect_column_max_to_be_between", "expect_column_sum_to_be_between",
    "expect_column_stdev_to_be_between", "expect_column_quantile_values_to_be_between",
    "expect_column_value_z_scores_to_be_less_than",
})


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
