"""Evaluation of any model bundle with its registered metric, and bundles that load safely or not at all."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.support.bundles import card, make_bundle, seed, train

from hybridflow.bundle import Predictor, serialise_state, write_bundle
from hybridflow.evaluation import evaluate_bundle
from hybridflow.scoring import class_report, metric_value, predictions


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    return {m: seed(m, root / m) for m in ("digits-mlp", "breast-cancer")}


def test_a_class_model_reports_accuracy_per_class_and_confusion(data, tmp_path):
    frame = data["digits-mlp"].test
    report = evaluate_bundle(make_bundle(tmp_path, "digits-mlp", train("digits-mlp", data["digits-mlp"])), frame)
    metric = report["metric"]
    assert metric["name"] == "accuracy" and metric["direction"] == "higher" and metric["gate"] == 0.85
    assert metric["value"] > 0.9 and metric["passed"]
    assert report["n"] == len(frame)
    confusion = np.array(report["confusion_matrix"])
    assert confusion.shape == (10, 10) and confusion.sum() == len(frame)
    assert np.trace(confusion) / len(frame) == pytest.approx(metric["value"])
    assert set(report["per_class_accuracy"]) == {str(c) for c in range(10)}


def test_a_probability_model_is_scored_with_roc_auc(data, tmp_path):
    frame = data["breast-cancer"].test
    report = evaluate_bundle(make_bundle(tmp_path, "breast-cancer", train("breast-cancer", data["breast-cancer"])),
                             frame)
    assert report["metric"]["name"] == "roc_auc" and report["metric"]["value"] >= 0.95 and report["metric"]["passed"]
    assert "confusion_matrix" not in report  # a confusion matrix belongs to class outputs


def test_an_untrained_model_misses_its_gate(data, tmp_path):
    report = evaluate_bundle(make_bundle(tmp_path, "breast-cancer", train("breast-cancer", data["breast-cancer"], steps=0)),
                             data["breast-cancer"].test)
    assert not report["metric"]["passed"] and report["metric"]["value"] < 0.95


def test_a_frame_without_the_signature_columns_is_refused(data, tmp_path):
    bundle = make_bundle(tmp_path, "digits-mlp", train("digits-mlp", data["digits-mlp"], steps=0))
    with pytest.raises(ValueError, match="no column pixel_0"):
        evaluate_bundle(bundle, data["digits-mlp"].test.drop(columns=["pixel_0"]))


def test_scoring_outputs_and_metrics():
    assert predictions(np.array([[0.1, 2.0], [3.0, -1.0]]), {"type": "class", "classes": 2}).tolist() == [1, 0]
    assert predictions(np.array([[0.0], [100.0]]), {"type": "probability"}) == pytest.approx([0.5, 1.0])
    assert predictions(np.array([[0.0, 0.0]]), {"type": "probability"}) == pytest.approx([0.5])
    with pytest.raises(ValueError, match=r"\[n, 3\]"):
        predictions(np.zeros((2, 2)), {"type": "class", "classes": 3})
    with pytest.raises(ValueError, match="one value per row"):
        predictions(np.zeros((2, 3)), {"type": "value"})
    out = {"type": "probability"}
    assert metric_value("roc_auc", np.array([0, 1, 1]), np.array([0.1, 0.8, 0.9]), out) == 1.0
    assert metric_value("accuracy", np.array([0, 1]), np.array([0.4, 0.4]), out) == 0.5
    with pytest.raises(ValueError, match="both classes"):
        metric_value("roc_auc", np.array([1, 1]), np.array([0.3, 0.9]), out)
    with pytest.raises(ValueError, match="equal, non-empty"):
        metric_value("accuracy", np.array([1, 2]), np.array([1]), {"type": "class", "classes": 3})
    report = class_report(np.array([0, 0, 2]), np.array([0, 1, 2]), 4)
    assert report["per_class_accuracy"] == {"0": 0.5, "1": None, "2": 1.0, "3": None}


def test_garbage_weights_are_refused(tmp_path):
    write_bundle(tmp_path, b"not a torch file", card("digits-mlp"))
    with pytest.raises(ValueError, match="not a saved state dict"):
        Predictor.load(tmp_path)


def test_weights_never_unpickle_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("unpickled!",))

    import io

    buf = io.BytesIO()
    torch.save({"x": Evil()}, buf)
    write_bundle(tmp_path, buf.getvalue(), card("digits-mlp"))
    with pytest.raises(ValueError, match="not a saved state dict"):
        Predictor.load(tmp_path)


def test_weights_of_another_shape_are_refused(data, tmp_path):
    module = train("breast-cancer", data["breast-cancer"], steps=0)
    write_bundle(tmp_path, serialise_state(module), card("digits-mlp"))
    with pytest.raises(ValueError, match="do not fit hybridflow_examples.digits.model:build"):
        Predictor.load(tmp_path)


def test_a_folder_without_a_card_is_not_a_bundle(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a model bundle"):
        Predictor.load(tmp_path)
