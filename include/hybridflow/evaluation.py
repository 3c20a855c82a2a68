"""Evaluate a trained fp32 model artefact on a test split.

A model artefact is ``torch.save(model.state_dict())`` of :func:`hybridflow.training.model.build_model`.
It is always read with ``weights_only=True`` so that a model file can never run code on load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hybridflow.datasets import parse_split
from hybridflow.training.model import N_CLASSES


def _reason(exc: Exception) -> str:
    """The specific line of torch's multi-paragraph weights-only error, not its boilerplate."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and lines[-1].startswith("Check the documentation"):
        lines.pop()
    return f"{type(exc).__name__}: {lines[-1][:300] if lines else ''}"


def read_state_dict(model_path: Path) -> dict[str, Any]:
    """Load a state dict without unpickling arbitrary objects; a clear error for anything else."""
    import torch

    model_path = Path(model_path)
    if not model_path.is_file():
        raise FileNotFoundError(f"model artefact {model_path} does not exist")
    try:
        state = torch.load(model_path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several unrelated types for a corrupt file
        raise ValueError(
            f"{model_path} is not a model artefact (expected torch.save(state_dict) of build_model()): "
            f"{_reason(exc)}"
        ) from exc
    if not isinstance(state, dict):
        raise ValueError(f"{model_path} holds a {type(state).__name__}, not a state dict")
    return state


def hidden_size(state: dict[str, Any]) -> int:
    """The MLP width, read from the first layer so non-default widths load too."""
    if "0.weight" in state:
        return int(state["0.weight"].shape[0])
    packed = state.get("0._packed_params._packed_params")  # int8 dynamic-quantized layout
    if packed is not None:
        return int(packed[0].shape[0])
    raise ValueError("state dict has no first Linear layer ('0.weight'); it is not a build_model() artefact")


def load_fp32(model_path: Path):
    """The fp32 model in eval mode."""
    from hybridflow.training.model import build_model

    state = read_state_dict(model_path)
    model = build_model(hidden=hidden_size(state))
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise ValueError(f"{model_path} does not match build_model(): {exc}") from exc
    return model.eval()


def predict_fp32(model, x: np.ndarray) -> np.ndarray:
    import torch

    with torch.inference_mode():
        return model(torch.from_numpy(np.require(x, np.float32, ["C", "W"]))).argmax(dim=1).numpy()


def score(y_true: np.ndarray, y_pred: np.ndarray, n_classes: int = N_CLASSES) -> dict[str, Any]:
    """Accuracy, per-class accuracy (recall) and confusion matrix (rows: true, columns: predicted)."""
    y_true = np.asarray(y_true, dtype=np.int64)
    y_pred = np.asarray(y_pred, dtype=np.int64)
    if y_true.shape != y_pred.shape or y_true.size == 0:
        raise ValueError(f"need equal, non-empty label arrays; got {y_true.shape} and {y_pred.shape}")
    confusion = np.zeros((n_classes, n_classes), dtype=np.int64)
    np.add.at(confusion, (y_true, y_pred), 1)
    support = confusion.sum(axis=1)
    per_class = {
        str(c): (float(confusion[c, c] / support[c]) if support[c] else None) for c in range(n_classes)
    }
    return {
        "accuracy": float(np.mean(y_true == y_pred)),
        "n": int(y_true.size),
        "per_class_accuracy": per_class,
        "support": {str(c): int(support[c]) for c in range(n_classes)},
        "confusion_matrix": confusion.tolist(),
    }


def evaluate_model(model_path: Path, test_csv: Path) -> dict[str, Any]:
    """Score the fp32 model on ``test_csv`` (features scaled 0..1 as in training)."""
    x, y = parse_split(Path(test_csv).read_bytes())
    result = score(y, predict_fp32(load_fp32(model_path), x))
    result["model_path"] = str(model_path)
    return result
