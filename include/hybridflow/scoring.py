"""From a model's raw outputs to what it predicts, and from predictions to its metric.

Shared by evaluation, compression, the model server and the deploy smoke test, so a model is
judged the same way wherever it runs. Raw outputs follow the signature's output type:

- ``class``: scores ``[n, classes]``; the prediction is the index of the highest;
- ``probability``: one logit per row (``[n]`` or ``[n, 1]``), or two class scores ``[n, 2]``; the
  prediction is the probability of the positive class;
- ``value``: one value per row.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


def predictions(raw: np.ndarray, output: Mapping[str, Any]) -> np.ndarray:
    """``raw`` model outputs -> predictions (int64 labels, float64 probabilities or values)."""
    raw = np.asarray(raw, dtype=np.float64)
    kind = output["type"]
    if kind == "class":
        classes = int(output["classes"])
        if raw.ndim != 2 or raw.shape[1] != classes:
            raise ValueError(f"a class output needs scores of shape [n, {classes}]; the model returned {list(raw.shape)}")
        return raw.argmax(axis=1).astype(np.int64)
    if kind == "probability":
        if raw.ndim == 2 and raw.shape[1] == 2:
            shifted = raw - raw.max(axis=1, keepdims=True)
            exp = np.exp(shifted)
            return exp[:, 1] / exp.sum(axis=1)
        logit = _one_per_row(raw, "probability")
        return 1.0 / (1.0 + np.exp(-logit))
    if kind == "value":
        return _one_per_row(raw, "value")
    raise ValueError(f"unknown output type {kind!r}")


def _one_per_row(raw: np.ndarray, kind: str) -> np.ndarray:
    if raw.ndim == 2 and raw.shape[1] == 1:
        return raw[:, 0]
    if raw.ndim == 1:
        return raw
    raise ValueError(f"a {kind} output needs one value per row ([n] or [n, 1]); the model returned {list(raw.shape)}")


def metric_value(name: str, y_true: np.ndarray, y_pred: np.ndarray, output: Mapping[str, Any]) -> float:
    """The metric ``name`` of predictions (as :func:`predictions` returns them) against targets."""
    from sklearn import metrics

    y_true = np.asarray(y_true)
    y_pred = np.asarray(y_pred)
    if y_true.shape != y_pred.shape or y_true.size == 0:
        raise ValueError(f"need equal, non-empty target and prediction arrays; got {y_true.shape} and {y_pred.shape}")
    labels = (y_pred >= 0.5).astype(np.int64) if output["type"] == "probability" else y_pred
    if name == "accuracy":
        return float(metrics.accuracy_score(y_true.astype(np.int64), labels))
    if name == "f1":
        average = "binary" if output["type"] == "probability" or int(output.get("classes") or 2) == 2 else "macro"
        return float(metrics.f1_score(y_true.astype(np.int64), labels, average=average))
    if name == "roc_auc":
        if len(np.unique(y_true)) < 2:
            raise ValueError("roc_auc needs both classes among the targets; the held-out split has one")
        return float(metrics.roc_auc_score(y_true.astype(np.int64), y_pred))
    if name == "log_loss":
        return float(metrics.log_loss(y_true.astype(np.int64), np.clip(y_pred, 1e-15, 1 - 1e-15), labels=[0, 1]))
    if name == "mse":
        return float(metrics.mean_squared_error(y_true, y_pred))
    if name == "rmse":
        return float(np.sqrt(metrics.mean_squared_error(y_true, y_pred)))
    if name == "mae":
        return float(metrics.mean_absolute_error(y_true, y_pred))
    if name == "r2":
        return float(metrics.r2_score(y_true, y_pred))
    raise ValueError(f"unknown metric {name!r}")


def class_report(y_true: np.ndarray, labels: np.ndarray, classes: int) -> dict[str, Any]:
    """Per-class accuracy (recall), support and the confusion matrix (rows: true, columns: predicted)."""
    y_true = np.asarray(y_true, dtype=np.int64)
    labels = np.asarray(labels, dtype=np.int64)
    confusion = np.zeros((classes, classes), dtype=np.int64)
    np.add.at(confusion, (y_true, labels), 1)
    support = confusion.sum(axis=1)
    return {
        "per_class_accuracy": {str(c): (float(confusion[c, c] / support[c]) if support[c] else None)
                               for c in range(classes)},
        "support": {str(c): int(support[c]) for c in range(classes)},
        "confusion_matrix": confusion.tolist(),
    }


def to_json(values: np.ndarray, output: Mapping[str, Any]) -> list:
    """Predictions as JSON values: ints for class outputs, floats otherwise."""
    if output["type"] == "class":
        return [int(v) for v in values]
    return [float(v) for v in values]
