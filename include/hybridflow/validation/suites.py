"""Expectation suite files: their GX 1.x structure, checked at admission without importing GX."""

from __future__ import annotations

import json
from typing import Any

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


class SuiteError(ValueError):
    """An expectation suite file that is not a valid GX 1.x suite; the message names the file."""


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
