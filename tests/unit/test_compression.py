"""Compression: int8/fp16 variants measured against fp32, refusals, and safe artefact loading."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hybridflow.compression import compress_model, load_compressed
from hybridflow.datasets import parse_split
from hybridflow.errors import CompressionRefused


def test_int8_is_smaller_and_within_the_allowed_drop(trained, tmp_path):
    model_path, test_csv = trained
    report = compress_model(model_path, test_csv, tmp_path, mode="int8", max_accuracy_drop=0.02)

    rows = report["variants"]
    assert report["status"] == "ok" and report["selected"] == "int8"
    assert rows["int8"]["size_bytes"] < rows["fp32"]["size_bytes"]
    assert rows["int8"]["accuracy_drop"] <= 0.02
    assert rows["fp32"]["accuracy"] > 0.9
    for row in rows.values():
        assert row["latency_ms_per_batch"] > 0
        assert {"size_bytes", "accuracy", "accuracy_drop"} <= set(row)
    artefact = tmp_path / "model-int8.pt"
    assert report["artifact"] == str(artefact)
    assert artefact.stat().st_size == rows["int8"]["size_bytes"]
    assert (tmp_path / "model-fp16.pt").is_file()
    assert json.loads((tmp_path / "compression-report.json").read_text()) == report

    # The artefact alone reproduces the reported accuracy.
    x, y = parse_split(test_csv.read_bytes())
    predict = load_compressed(artefact, "int8")
    assert float(np.mean(predict(x) == y)) == pytest.approx(rows["int8"]["accuracy"])


def test_best_picks_the_smallest_accepted_variant(trained, tmp_path):
    model_path, test_csv = trained
    report = compress_model(model_path, test_csv, tmp_path, mode="best", max_accuracy_drop=0.02)
    rows = report["variants"]
    accepted = [v for v in ("int8", "fp16") if rows[v]["status"] == "accepted"]
    assert report["selected"] == min(accepted, key=lambda v: rows[v]["size_bytes"]) == "int8"


def test_fp16_artefact_is_half_the_size_and_predicts(trained, tmp_path):
    model_path, test_csv = trained
    report = compress_model(model_path, test_csv, tmp_path, mode="fp16", max_accuracy_drop=0.02)
    rows = report["variants"]
    assert report["selected"] == "fp16"
    assert rows["fp16"]["size_bytes"] < 0.6 * rows["fp32"]["size_bytes"]
    x, y = parse_split(test_csv.read_bytes())
    assert float(np.mean(load_compressed(tmp_path / "model-fp16.pt", "fp16")(x) == y)) > 0.9


@pytest.mark.parametrize("mode", ["int8", "best"])
def test_impossible_drop_is_refused_with_figures(trained, tmp_path, mode):
    model_path, test_csv = trained
    # A previous successful run leaves artefacts; a refusal must not leave them deployable.
    compress_model(model_path, test_csv, tmp_path, mode="best", max_accuracy_drop=0.02)

    with pytest.raises(CompressionRefused) as refused:
        compress_model(model_path, test_csv, tmp_path, mode=mode, max_accuracy_drop=-1.0)

    message = str(refused.value)
    assert "max_accuracy_drop=-1.0" in message and "int8: accuracy 0.9" in message
    report = json.loads((tmp_path / "compression-report.json").read_text())
    assert report["status"] == "refused" and report["selected"] is None and report["artifact"] is None
    assert report["variants"]["int8"]["status"] == "refused"
    assert refused.value.report == report
    assert not (tmp_path / "model-int8.pt").exists()
    assert not (tmp_path / "model-fp16.pt").exists()


def test_artefacts_load_without_unpickling_code(trained, tmp_path):
    model_path, test_csv = trained
    compress_model(model_path, test_csv, tmp_path, mode="best", max_accuracy_drop=0.02)
    for variant in ("int8", "fp16"):
        state = torch.load(tmp_path / f"model-{variant}.pt", weights_only=True)
        assert isinstance(state, dict)
    with pytest.raises(ValueError):
        load_compressed(tmp_path / "model-int8.pt", "fp16")  # wrong structure for the file
    with pytest.raises(ValueError):
        load_compressed(tmp_path / "model-int8.pt", "int4")


def test_bad_arguments_are_rejected(trained, tmp_path):
    model_path, test_csv = trained
    with pytest.raises(ValueError, match="mode"):
        compress_model(model_path, test_csv, tmp_path, mode="int4", max_accuracy_drop=0.02)
    with pytest.raises(ValueError, match="max_accuracy_drop"):
        compress_model(model_path, test_csv, tmp_path, mode="int8", max_accuracy_drop=float("nan"))
