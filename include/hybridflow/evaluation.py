"""Evaluate a trained model bundle on a held-out split with the metric its registration names.

The module is rebuilt from the bundle (the registered builder, weights loaded with
``weights_only=True``), fed the signature's input columns in order, and its raw outputs turned into
predictions the way the model server does (:mod:`hybridflow.scoring`), so the figure evaluate
reports is the figure the serving smoke test checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow import scoring
from hybridflow.bundle import Predictor, inputs_and_target
from hybridflow.config.registry import MetricSpec

if TYPE_CHECKING:
    import pandas as pd


def score_predictor(predictor: Predictor, frame: pd.DataFrame) -> dict[str, Any]:
    """The card's metric of ``predictor`` on ``frame`` (which holds the inputs and the target)."""
    card = predictor.card
    missing = [c for c in [*card.input_names, card.target] if c not in frame.columns]
    if missing:
        raise ValueError(f"the held-out split has no column {', '.join(missing[:5])}; the model's signature and "
                         "target must be columns of its dataset")
    x, y = inputs_and_target(frame, card)
    predicted = predictor.predict(x)
    spec = MetricSpec.model_validate(card.metric)
    value = scoring.metric_value(spec.name, y, predicted, card.output)
    report: dict[str, Any] = {
        "model": card.model,
        "variant": card.variant,
        "n": int(len(y)),
        "metric": {"name": spec.name, "value": value, "direction": spec.better, "gate": spec.gate,
                   "passed": spec.passes(value)},
    }
    if card.output["type"] == "class":
        report.update(scoring.class_report(y, predicted, int(card.output["classes"])))
    return report


def evaluate_bundle(bundle: Path, frame: pd.DataFrame) -> dict[str, Any]:
    """Score the bundle (fp32 after training) on a held-out frame."""
    report = score_predictor(Predictor.load(Path(bundle)), frame)
    report["bundle"] = str(bundle)
    return report
