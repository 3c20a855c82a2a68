"""validate_frames and check_suite against the example datasets, their suites and broken copies.

GX costs ~5 s to import and a fraction of a second per split, so breakages in different columns
are combined into a few runs (each failure still asserted on its own line) and each run happens
once per module.
"""

from __future__ import annotations

import io
import json
import logging
import time
from pathlib import Path

import pandas as pd
import pytest

from hybridflow.errors import DataValidationError
from hybridflow.validation import (
    EXPECTATION_TYPES,
    SuiteError,
    ValidationSummary,
    check_suite,
    validate_frames,
)

SPLITS = ("train", "test")
CSV_HEADER_LINES = {"train": 2, "test": 2}  # row 0 is on line 2, under the header


@pytest.fixture(scope="module")
def gx():
    """GX imported once up front, so the timings below are validation only."""
    from hybridflow.validation import _import_gx

    return _import_gx()


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    from hybridflow_examples.digits.data import seed

    return seed(tmp_path_factory.mktemp("digits"))


@pytest.fixture(scope="module")
def breast_cancer(tmp_path_factory) -> Path:
    from hybridflow_examples.breast_cancer.data import seed

    return seed(tmp_path_factory.mktemp("breast-cancer"))


def _suites(folder: Path) -> dict[str, dict]:
    return {
        split: check_suite((folder / "expectations" / f"{split}.json").read_bytes(), f"{split}.json")
        for split in SPLITS
    }


def _as_read(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame pandas reads back from a CSV of ``frame``: the dtypes a caller would get."""
    return pd.read_csv(io.StringIO(frame.to_csv(index=False)))


def _digits(folder: Path, split: str) -> pd.DataFrame:
    # object dtype so a test can drop any value (None, a word) into any cell
    return pd.read_csv(folder / f"{split}.csv").astype(object)


def _failing(frames, suites, report_dir: Path, **kwargs) -> str:
    with pytest.raises(DataValidationError) as info:
        validate_frames("digits", frames, suites, report_dir=report_dir, **kwargs)
    return str(info.value)


# -- passing runs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["digits", "breast_cancer"])
def test_example_suites_pass_and_write_reports(name, gx, request, tmp_path, caplog):
    folder = request.getfixturevalue(name)
    reader = pd.read_csv if name == "digits" else pd.read_parquet
    suffix = "csv" if name == "digits" else "parquet"
    frames = {split: reader(folder / f"{split}.{suffix}") for split in SPLITS}
    suites = _suites(folder)

    caplog.set_level(logging.INFO)
    started = time.perf_counter()
    summary = validate_frames(name, frames, suites, report_dir=tmp_path)
    print(f"validate_frames on {name}: {time.perf_counter() - started:.2f} s")  # -s shows it; no GX import
    assert not [r for r in caplog.records if r.name.startswith("great_expectations")], "GX logs into the task log"

    assert isinstance(summary, ValidationSummary)
    assert summary.passed and summary.failures == []
    for split in SPLITS:
        assert summary.splits[split] == {
            "rows": len(frames[split]),
            "expectations": len(suites[split]["expectations"]),
            "failed": 0,
        }
        report = json.loads((tmp_path / f"validation-{split}.json").read_text())
        assert report["success"] is True
        assert report["statistics"]["evaluated_expectations"] == len(suites[split]["expectations"])
    assert "passed" in (tmp_path / "validation-summary.txt").read_text()

    xcom = summary.to_xcom()
    assert json.loads(json.dumps(xcom)) == xcom
    assert xcom["reports"]["train"] == str(tmp_path / "validation-train.json")


def test_digits_suites_hold_every_rule(digits):
    train, test = (_suites(digits)[s]["expectations"] for s in SPLITS)
    kinds = {e["type"] for e in train}
    assert kinds == {
        "expect_table_columns_to_match_ordered_list",
        "expect_table_row_count_to_be_between",
        "expect_column_values_to_not_be_null",
        "expect_column_values_to_be_between",
        "expect_column_values_to_be_in_set",
        "expect_column_distinct_values_to_contain_set",
    }
    columns = next(e for e in train if e["type"] == "expect_table_columns_to_match_ordered_list")["kwargs"]
    assert columns["column_list"] == [f"pixel_{i}" for i in range(64)] + ["label"]
    not_null = {e["kwargs"]["column"] for e in train if e["type"] == "expect_column_values_to_not_be_null"}
    ranges = {e["kwargs"]["column"] for e in train if e["type"] == "expect_column_values_to_be_between"}
    assert not_null == set(columns["column_list"]) and ranges == set(columns["column_list"]) - {"label"}
    rows = next(e for e in test if e["type"] == "expect_table_row_count_to_be_between")["kwargs"]
    assert rows["min_value"] == 1  # the held-out split only has to be non-empty
    # A class missing from train cannot be learned; test may legitimately be too small to hold all.
    assert "expect_column_distinct_values_to_contain_set" not in {e["type"] for e in test}


def test_splits_can_share_a_suite(breast_cancer, gx, tmp_path):
    suite = _suites(breast_cancer)["test"]
    frame = pd.read_parquet(breast_cancer / "test.parquet")
    summary = validate_frames("bc", {"test": frame, "again": frame}, {"test": suite, "again": suite}, report_dir=tmp_path)
    assert summary.passed and set(summary.splits) == {"test", "again"}
    assert (tmp_path / "validation-again.json").is_file()


# -- failures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cell_errors(digits, gx, tmp_path_factory):
    """train: a null pixel, a pixel of 99, a word in a pixel column, a label 12; test: a missing column."""
    train = _digits(digits, "train")
    train.loc[2, "pixel_5"] = None
    train.loc[4, "pixel_7"] = 99
    train.loc[6, "pixel_20"] = "abc"
    train.loc[8, "label"] = 12
    frames = {"train": _as_read(train), "test": _as_read(_digits(digits, "test").drop(columns=["pixel_2"]))}
    report_dir = tmp_path_factory.mktemp("cell-errors")
    return _failing(frames, _suites(digits), report_dir, line_offset=CSV_HEADER_LINES), report_dir


@pytest.fixture(scope="module")
def shape_errors(digits, gx, tmp_path_factory):
    """train: an extra column, too few rows and no digit 3; test: header only (zero rows)."""
    train = _digits(digits, "train")
    train = train[train["label"] != 3].head(40).copy()
    train["extra"] = 1
    frames = {"train": _as_read(train), "test": _as_read(_digits(digits, "test").head(0))}
    report_dir = tmp_path_factory.mktemp("shape-errors")
    return _failing(frames, _suites(digits), report_dir), report_dir


@pytest.mark.parametrize(
    "expected",
    [
        pytest.param("train: pixel_5: expect_column_values_to_not_be_null: 1 of 1437 rows null, "
                     "e.g. null (row 2, CSV line 4)", id="null"),
        pytest.param("train: pixel_7: expect_column_values_to_be_between: 1 of 1437 rows outside 0..16, "
                     "e.g. 99 (row 4, CSV line 6)", id="out-of-range"),
        pytest.param("train: label: expect_column_values_to_be_in_set: 1 of 1437 rows not in {0..9}, "
                     "e.g. 12 (row 8, CSV line 10)", id="label-not-a-class"),
        pytest.param("train: pixel_20: expect_column_values_to_be_between: the column holds text (dtype str): "
                     "1 cell is not a number, e.g. 'abc' (row 6, CSV line 8)", id="wrong-type"),
        pytest.param("test: expect_table_columns_to_match_ordered_list: missing pixel_2", id="missing-column"),
        pytest.param("test: pixel_2: 2 expectations not evaluated, the column is not in the data",
                     id="missing-column-folded"),
    ],
)
def test_cell_errors_named(cell_errors, expected):
    message, _ = cell_errors
    assert expected in message, message


def test_cell_errors_counted(cell_errors):
    message, _ = cell_errors
    assert "train: 1437 rows, 133 expectations, 4 failed" in message
    assert "test: 360 rows, 132 expectations, 3 failed" in message


@pytest.mark.parametrize(
    "expected",
    [
        "train: expect_table_columns_to_match_ordered_list: unexpected extra",
        "train: expect_table_row_count_to_be_between: 40 rows, expected 100..10000000",
        "train: label: expect_column_distinct_values_to_contain_set: no rows for 3 (expected all of {0..9})",
        "test: expect_table_row_count_to_be_between: 0 rows, expected 1..10000000",
    ],
    ids=["extra-column", "too-few-rows", "class-missing-from-train", "empty-test-split"],
)
def test_shape_errors_named(shape_errors, expected):
    message, _ = shape_errors
    assert expected in message, message


@pytest.mark.parametrize("fixture", ["cell_errors", "shape_errors"])
def test_failure_reports_written(fixture, request):
    message, report_dir = request.getfixturevalue(fixture)
    assert message.startswith("Data validation FAILED")
    assert str(report_dir / "validation-train.json") in message  # the log says where to look
    for split in SPLITS:
        report = json.loads((report_dir / f"validation-{split}.json").read_text())
        assert report["success"] is False and report["results"], "full GX result expected"
    assert (report_dir / "validation-summary.txt").read_text().strip() == message


def test_failed_expectations_detailed_in_report(cell_errors):
    _, report_dir = cell_errors
    report = json.loads((report_dir / "validation-train.json").read_text())
    failed = {r["expectation_config"]["kwargs"].get("column"): r for r in report["results"] if not r["success"]}
    # only the failed expectations were run again for details; passing ones keep BOOLEAN_ONLY's verdict
    assert failed["pixel_7"]["result"]["partial_unexpected_index_list"] == [4]
    assert failed["label"]["result"]["unexpected_count"] == 1
    passing = next(r for r in report["results"] if r["success"])
    assert passing["result"] == {}


def test_parquet_failures_point_at_rows(breast_cancer, gx, tmp_path):
    """No line offset (Parquet): the row alone; an aggregate failure says what it observed."""
    suites = _suites(breast_cancer)
    train = pd.read_parquet(breast_cancer / "train.parquet")
    train.loc[3, "mean_radius"] = -1.5
    test = pd.read_parquet(breast_cancer / "test.parquet")
    test["malignant"] = 1
    with pytest.raises(DataValidationError) as info:
        validate_frames("breast-cancer", {"train": train, "test": test}, suites, report_dir=tmp_path)
    message = str(info.value)
    assert "train: mean_radius: expect_column_values_to_be_between: 1 of 455 rows outside 0..10000, e.g. -1.5 (row 3)" in message
    assert "test: malignant: expect_column_mean_to_be_between: observed 1, expected 0.2..0.6" in message
    assert "CSV line" not in message


def test_columns_with_nulls_validated_apart_in_large_frames(breast_cancer, gx, tmp_path, monkeypatch):
    """A large frame's columns that hold nulls run in a batch of their own; the result reads the same."""
    monkeypatch.setattr("hybridflow.validation.NARROW_MIN_BYTES", 0)  # the examples are small
    suites = _suites(breast_cancer)
    train = pd.read_parquet(breast_cancer / "train.parquet")
    train.loc[[3, 9], "mean_area"] = float("nan")
    train.loc[5, "worst_symmetry"] = 99_999.0
    test = pd.read_parquet(breast_cancer / "test.parquet")
    with pytest.raises(DataValidationError) as info:
        validate_frames("breast-cancer", {"train": train, "test": test}, suites, report_dir=tmp_path)
    message = str(info.value)
    assert "train: mean_area: expect_column_values_to_not_be_null: 2 of 455 rows null, e.g. null (row 3), null (row 9)" in message
    assert "train: worst_symmetry: expect_column_values_to_be_between: 1 of 455 rows outside 0..10000" in message
    assert "train: 455 rows, 66 expectations, 2 failed" in message

    report = json.loads((tmp_path / "validation-train.json").read_text())
    assert report["meta"]["columns_validated_apart"]["columns"] == ["mean_area"]
    assert report["statistics"]["evaluated_expectations"] == len(report["results"]) == 66
    assert report["statistics"]["unsuccessful_expectations"] == 2 and report["success"] is False
    assert "columns_validated_apart" not in json.loads((tmp_path / "validation-test.json").read_text())["meta"]


def test_suite_gx_refuses_is_named(breast_cancer, gx, tmp_path):
    suite = _suites(breast_cancer)["test"]
    broken = {**suite, "expectations": [*suite["expectations"], {"type": "expect_column_values_to_be_between",
                                                                   "kwargs": {"min_value": 0}}]}
    frame = pd.read_parquet(breast_cancer / "test.parquet")
    with pytest.raises(SuiteError, match=r"expectations\[66\] \(expect_column_values_to_be_between\) is not valid"):
        validate_frames("bc", {"test": frame}, {"test": broken}, report_dir=tmp_path)
    with pytest.raises(SuiteError, match="no expectation suite for split test"):
        validate_frames("bc", {"test": frame}, {}, report_dir=tmp_path)


# -- suite files ----------------------------------------------------------------------------------
def _suite_bytes(**overrides) -> bytes:
    suite = {"name": "s", "expectations": [{"type": "expect_table_row_count_to_be_between",
                                            "kwargs": {"min_value": 1}}], **overrides}
    return json.dumps(suite).encode()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param(b"{not json", "data/train.json is not valid JSON: ", id="not-json"),
        pytest.param(b"\xff\xfe", "data/train.json is not UTF-8 text", id="not-text"),
        pytest.param(b"[1, 2]", "not a JSON array", id="array"),
        pytest.param(json.dumps({"name": "s"}).encode(), '"expectations" must be a non-empty list', id="no-expectations"),
        pytest.param(_suite_bytes(expectations=[]), '"expectations" must be a non-empty list', id="empty-expectations"),
        pytest.param(_suite_bytes(name=""), '"name" must be a non-empty string', id="no-name"),
        pytest.param(
            _suite_bytes(expectations=[{"type": "expect_column_values_to_be_betwen", "kwargs": {"column": "a"}}]),
            "data/train.json: expectations[0]: unknown expectation type 'expect_column_values_to_be_betwen' "
            "(did you mean 'expect_column_values_to_be_between'?)",
            id="unknown-type",
        ),
        pytest.param(_suite_bytes(expectations=[{"type": "expect_column_to_exist", "kwargs": ["a"]}]),
                     '(expect_column_to_exist): "kwargs" must be an object', id="kwargs-not-object"),
        pytest.param(_suite_bytes(expectation="x"), "unknown key 'expectation'", id="unknown-key"),
        pytest.param(
            json.dumps({"expectation_suite_name": "s", "expectations": [
                {"expectation_type": "expect_column_to_exist", "kwargs": {"column": "a"}}]}).encode(),
            "is a Great Expectations 0.x suite", id="gx-0.x",
        ),
    ],
)
def test_check_suite_refuses(raw, expected):
    with pytest.raises(SuiteError) as info:
        check_suite(raw, "data/train.json")
    assert expected in str(info.value)
    assert "data/train.json" in str(info.value)


@pytest.mark.parametrize("path", sorted(Path(__file__).parents[2].glob("examples/*/*/expectations/*.json")),
                         ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_check_suite_accepts_example_suites(path, gx):
    suite = check_suite(path.read_bytes(), str(path))
    assert suite["name"] and suite["expectations"]
    # ...and GX builds every one of its expectations from the same JSON
    assert len(gx.ExpectationSuite(**suite).expectations) == len(suite["expectations"])


def test_expectation_types_match_gx_registry(gx):
    from great_expectations.expectations.registry import list_registered_expectation_implementations

    registered = {name for name in list_registered_expectation_implementations() if name.startswith("expect_")}
    assert set(EXPECTATION_TYPES) == registered
