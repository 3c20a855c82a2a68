"""validate_dataset against the real digits set and broken copies of it.

A GX run over ~400 expectations costs seconds, so breakages in different columns/splits are
combined into a few datasets (each still asserted on its own failure line) and every dataset is
validated once per module.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pandas as pd
import pytest

from hybridflow.datasets import DatasetRef, seed_digits
from hybridflow.errors import DataValidationError
from hybridflow.validation import ValidationSummary, digits_suite, validate_dataset

LIMITS = {"min_rows": 100, "max_rows": 10_000_000}


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> DatasetRef:
    return seed_digits(tmp_path_factory.mktemp("private"))


def _broken_copy(digits: DatasetRef, root: Path, name: str) -> DatasetRef:
    folder = root / name
    shutil.copytree(digits.path, folder)
    return DatasetRef(uri=f"file://{folder}", path=folder)


def _frame(ref: DatasetRef, split: str) -> pd.DataFrame:
    # object dtype so a test can drop any value (None, a word) into any cell
    return pd.read_csv(ref.split_path(split)).astype(object)


def _run_failing(ref: DatasetRef, report_dir: Path) -> str:
    with pytest.raises(DataValidationError) as info:
        validate_dataset(ref, report_dir=report_dir, **LIMITS)
    return str(info.value)


@pytest.fixture(scope="module")
def real_run(digits, tmp_path_factory):
    report_dir = tmp_path_factory.mktemp("reports-real")
    started = time.perf_counter()
    summary = validate_dataset(digits, report_dir=report_dir, **LIMITS)
    return summary, time.perf_counter() - started, report_dir


@pytest.fixture(scope="module")
def cell_errors(digits, tmp_path_factory):
    """train: a null pixel, a pixel of 99, a word in a pixel column, a label 12; test: a missing column."""
    root = tmp_path_factory.mktemp("cell-errors")
    ref = _broken_copy(digits, root, "data")
    train = _frame(ref, "train")
    train.loc[2, "pixel_5"] = None  # CSV line 4
    train.loc[4, "pixel_7"] = 99
    train.loc[6, "pixel_20"] = "abc"
    train.loc[8, "label"] = 12
    train.to_csv(ref.split_path("train"), index=False)
    _frame(ref, "test").drop(columns=["pixel_2"]).to_csv(ref.split_path("test"), index=False)
    return _run_failing(ref, root / "reports"), root / "reports"


@pytest.fixture(scope="module")
def shape_errors(digits, tmp_path_factory):
    """train: an extra column, too few rows and no digit 3; test: header only (zero rows)."""
    root = tmp_path_factory.mktemp("shape-errors")
    ref = _broken_copy(digits, root, "data")
    train = _frame(ref, "train")
    train = train[train["label"] != 3].head(40)
    train["extra"] = 1
    train.to_csv(ref.split_path("train"), index=False)
    _frame(ref, "test").head(0).to_csv(ref.split_path("test"), index=False)
    return _run_failing(ref, root / "reports"), root / "reports"


def test_real_digits_pass_and_write_reports(real_run):
    summary, seconds, report_dir = real_run
    print(f"validate_dataset on digits: {seconds:.1f} s")  # visible with -s; GX import not included
    assert isinstance(summary, ValidationSummary)
    assert summary.passed and summary.failures == []
    assert summary.splits["train"] == {"rows": 1437, "expectations": 198, "failed": 0}
    assert summary.splits["test"]["rows"] == 360 and summary.splits["test"]["failed"] == 0

    for split in ("train", "test"):
        report = json.loads((report_dir / f"validation-{split}.json").read_text())
        assert report["success"] is True
        assert report["statistics"]["evaluated_expectations"] == summary.splits[split]["expectations"]
    assert "passed" in (report_dir / "validation-summary.txt").read_text()

    xcom = summary.to_xcom()
    assert json.loads(json.dumps(xcom)) == xcom
    assert xcom["reports"]["train"] == str(report_dir / "validation-train.json")


def test_suite_holds_every_rule():
    train = {e.expectation_type for e in digits_suite("train", min_rows=100, max_rows=1000).expectations}
    test = digits_suite("test", min_rows=100, max_rows=1000)
    assert "expect_column_distinct_values_to_contain_set" in train
    assert {
        "expect_table_columns_to_match_ordered_list",
        "expect_table_row_count_to_be_between",
        "expect_column_values_to_not_be_null",
        "expect_column_values_to_be_in_type_list",
        "expect_column_values_to_be_between",
        "expect_column_values_to_be_in_set",
    } <= train
    row_count = next(
        e for e in test.expectations if e.expectation_type == "expect_table_row_count_to_be_between"
    )
    assert row_count.min_value == 1  # the held-out split only has to be non-empty


@pytest.mark.parametrize(
    "expected",
    [
        pytest.param(["pixel_5: expect_column_values_to_not_be_null", "null (CSV line 4)"], id="null-pixel"),
        pytest.param(["pixel_7: expect_column_values_to_be_between", "99 (CSV line 6)"], id="pixel-99"),
        pytest.param(["label: expect_column_values_to_be_in_set", "12 (CSV line 10)"], id="label-12"),
        pytest.param(
            ["pixel_20: expect_column_values_to_be_in_type_list", "'abc' (CSV line 8)"], id="text-in-pixel"
        ),
        pytest.param(
            ["test: expect_table_columns_to_match_ordered_list: missing pixel_2"], id="missing-column"
        ),
    ],
)
def test_cell_errors_named(cell_errors, expected):
    message, _ = cell_errors
    for fragment in expected:
        assert fragment in message, message


@pytest.mark.parametrize(
    "expected",
    [
        "train: expect_table_columns_to_match_ordered_list: unexpected extra",
        "train: expect_table_row_count_to_be_between: 40 rows, expected 100..10000000",
        "train: label: expect_column_distinct_values_to_contain_set: no rows for 3",
        "test: expect_table_row_count_to_be_between: 0 rows, expected 1..10000000",
    ],
    ids=["extra-column", "too-few-rows", "missing-class", "empty-test-split"],
)
def test_shape_errors_named(shape_errors, expected):
    message, _ = shape_errors
    assert expected in message, message


@pytest.mark.parametrize("fixture", ["cell_errors", "shape_errors"])
def test_failure_reports_written(fixture, request):
    message, report_dir = request.getfixturevalue(fixture)
    assert message.startswith("Data validation FAILED")
    assert str(report_dir / "validation-train.json") in message  # the log says where to look
    for split in ("train", "test"):
        report = json.loads((report_dir / f"validation-{split}.json").read_text())
        assert report["results"], "full GX result expected"
    assert (report_dir / "validation-summary.txt").read_text().strip() == message


def test_unreadable_csv_named(digits, tmp_path):
    ref = _broken_copy(digits, tmp_path, "data")
    ref.split_path("train").write_text("")
    lines = ref.split_path("test").read_text().splitlines()
    lines[3] += ",7"  # one row with a 66th field
    ref.split_path("test").write_text("\n".join(lines) + "\n")

    message = _run_failing(ref, tmp_path / "reports")
    assert f"{ref.split_path('train')} is empty" in message
    assert f"{ref.split_path('test')} is not a readable CSV" in message
    assert (tmp_path / "reports" / "validation-summary.txt").is_file()
