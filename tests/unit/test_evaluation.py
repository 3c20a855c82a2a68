"""Evaluation of a trained fp32 artefact: figures, and refusal of files that are not state dicts."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridflow.evaluation import evaluate_model, load_fp32, score


def test_evaluate_model_reports_accuracy_per_class_and_confusion(trained):
    model_path, test_csv = trained
    result = evaluate_model(model_path, test_csv)

    assert result["n"] == 360
    assert result["accuracy"] > 0.9
    confusion = np.asarray(result["confusion_matrix"])
    assert confusion.shape == (10, 10)
    assert confusion.sum() == result["n"]
    assert np.trace(confusion) / result["n"] == pytest.approx(result["accuracy"])
    assert set(result["per_class_accuracy"]) == {str(c) for c in range(10)}
    for c in range(10):
        row = confusion[c]
        assert result["per_class_accuracy"][str(c)] == pytest.approx(row[c] / row.sum())


def test_score_handles_absent_class_and_rejects_mismatch():
    result = score(np.array([0, 0, 1]), np.array([0, 1, 1]))
    assert result["accuracy"] == pytest.approx(2 / 3)
    assert result["per_class_accuracy"]["0"] == 0.5
    assert result["per_class_accuracy"]["9"] is None  # no support, not 0
    with pytest.raises(ValueError):
        score(np.array([0, 1]), np.array([0]))


def test_load_fp32_rejects_garbage(tmp_path):
    bad = tmp_path / "garbage.pt"
    bad.write_bytes(os.urandom(512))
    with pytest.raises(ValueError, match="not a model artefact"):
        load_fp32(bad)
    with pytest.raises(FileNotFoundError):
        load_fp32(tmp_path / "missing.pt")


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_load_fp32_never_unpickles_code(tmp_path):
    marker = tmp_path / "executed"
    evil = tmp_path / "evil.pt"
    torch.save({"0.weight": _Payload(marker)}, evil)
    with pytest.raises(ValueError):
        load_fp32(evil)
    assert not marker.exists()


def test_load_fp32_rejects_other_architecture(tmp_path):
    other = tmp_path / "other.pt"
    torch.save(torch.nn.Sequential(torch.nn.Linear(64, 10)).state_dict(), other)
    with pytest.raises(ValueError, match="does not match build_model"):
        load_fp32(other)
