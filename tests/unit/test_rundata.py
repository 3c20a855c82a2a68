"""A run's data: validated where it lives, pinned, and read back verified, for every catalogue format."""

from __future__ import annotations

import io
import json
import logging
import tarfile
from pathlib import Path

import pytest

from hybridflow import rundata
from hybridflow.config.catalogue import DatasetEntry
from hybridflow.errors import DataValidationError

LOG = logging.getLogger("test")
SHARD_SUITE = {
    "name": "images",
    "expectations": [
        {"type": "expect_table_columns_to_match_ordered_list", "kwargs": {"column_list": ["key", "extension", "size"]}},
        {"type": "expect_table_row_count_to_be_between", "kwargs": {"min_value": 2, "max_value": 1000}},
        {"type": "expect_column_values_to_be_in_set", "kwargs": {"column": "extension", "value_set": ["png", "cls"]}},
        {"type": "expect_column_values_to_be_between", "kwargs": {"column": "size", "min_value": 1, "max_value": 10_000}},
    ],
}


def _tar(path: Path, members: dict[str, bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _entry(**changes) -> DatasetEntry:
    body = {
        "location": "private://datasets/images", "format": "shards", "suite": "suite.json",
        "splits": {"train": {"files": ["train-*.tar"]}, "test": {"files": ["test-*.tar"]}},
        "classification": "internal", **changes,
    }
    entry = DatasetEntry.model_validate(body)
    entry._name = "images"
    return entry


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    """A dataset of tar shards of samples (an image and its class per sample), as teams pack them."""
    folder = tmp_path / "private" / "datasets" / "images"
    for i in range(2):
        _tar(folder / f"train-{i:03d}.tar", {f"{i}{j:03d}.png": b"\x89PNG" * (j + 1) for j in range(3)}
             | {f"{i}{j:03d}.cls": str(j % 2).encode() for j in range(3)})
    _tar(folder / "test-000.tar", {"9000.png": b"\x89PNG", "9000.cls": b"1"})
    (folder / "suite.json").write_text(json.dumps(SHARD_SUITE))
    return tmp_path / "private"


def test_a_shards_dataset_is_validated_as_a_table_of_samples_and_read_back_verified(shards: Path) -> None:
    out = rundata.validate(_entry(), "internal", "run-1", private_root=shards, file_roots=[], log=LOG)
    assert out["passed"] and out["splits"]["train"]["rows"] == 12 and out["splits"]["test"]["rows"] == 2
    version = rundata.read_version(shards, "run-1")
    assert version.splits == {"train": ["train-000.tar", "train-001.tar"], "test": ["test-000.tar"]}
    assert {e.path for e in version.manifest.entries} == {"train-000.tar", "train-001.tar", "test-000.tar"}

    dataset = rundata.open_validated(_entry(), "run-1", "internal", private_root=shards, file_roots=[])
    samples = dict(dataset.split("train").samples())
    assert samples["0000.png"] == b"\x89PNG" and samples["1002.cls"] == b"0" and len(samples) == 12
    assert list(dataset.split("test").frame()["extension"]) == ["png", "cls"]

    # A shard rewritten after validation is refused by name, not silently trained on.
    _tar(shards / "datasets" / "images" / "train-001.tar", {"1000.png": b"other"})
    with pytest.raises(DataValidationError, match="images/train-001.tar is not the file validate_data checked"):
        list(dataset.split("train").samples())


def test_samples_the_suite_does_not_allow_fail_validation_with_a_readable_report(shards: Path) -> None:
    _tar(shards / "datasets" / "images" / "train-002.tar", {"2000.exe": b"MZ"})
    with pytest.raises(DataValidationError) as failed:
        rundata.validate(_entry(), "internal", "run-2", private_root=shards, file_roots=[], log=LOG)
    assert "extension: expect_column_values_to_be_in_set" in str(failed.value) and "'exe'" in str(failed.value)
    assert (shards / "runs" / "run-2" / "validation" / "validation-summary.txt").is_file()
    assert not rundata.version_path(shards, "run-2").exists()  # nothing is pinned for data that failed


def test_a_table_that_does_not_match_its_schema_is_reported_before_any_suite_runs(tmp_path: Path) -> None:
    folder = tmp_path / "private" / "datasets" / "claims"
    folder.mkdir(parents=True)
    (folder / "train.csv").write_text("amount,label\n1.5,1\n,0\n")  # a null where the schema allows none
    (folder / "suite.json").write_text(json.dumps({"name": "c", "expectations": [
        {"type": "expect_table_row_count_to_be_between", "kwargs": {"min_value": 1, "max_value": 10}}]}))
    entry = DatasetEntry.model_validate({
        "location": "private://datasets/claims", "format": "csv", "suite": "suite.json", "holdout": "train",
        "splits": {"train": {"files": ["train.csv"]}},
        "schema": [{"name": "amount", "type": "float"}, {"name": "label", "type": "int"}],
    })
    entry._name = "claims"
    with pytest.raises(DataValidationError, match="column amount has 1 empty values; the schema does not allow nulls"):
        rundata.validate(entry, "restricted", "run-3", private_root=tmp_path / "private", file_roots=[], log=LOG)
    nullable = entry.model_copy(update={"schema_": [entry.schema_[0].model_copy(update={"nullable": True}),
                                                    entry.schema_[1]]})
    nullable._name = "claims"
    assert rundata.validate(nullable, "restricted", "run-3", private_root=tmp_path / "private", file_roots=[],
                            log=LOG)["passed"]
