"""Compress a trained model bundle and refuse variants that lose too much of its metric.

Variants (:func:`hybridflow.bundle.convert`):

- ``fp32``: the trained model, the baseline every figure is compared against;
- ``int8``: dynamic quantization of the ``Linear`` layers (int8 weights, activations quantized per batch);
- ``fp16``: the whole model in half precision.

Each variant is scored with the model's registered metric on the held-out split; one that is worse
than the baseline by more than the metric's ``max_drop`` (models.yaml) is refused and gets no
bundle. Accepted variants are bundles of their own (``<out>/<variant>/``), loadable like the trained one.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hybridflow.bundle import (
    ModelCard,
    Predictor,
    convert,
    inputs_and_target,
    load_module,
    quiet_torch,
    serialise_state,
    write_atomic,
    write_bundle,
)
from hybridflow.config.registry import MetricSpec
from hybridflow.errors import CompressionRefused
from hybridflow.evaluation import score_predictor

if TYPE_CHECKING:
    import pandas as pd

VARIANTS = ("fp32", "int8", "fp16")
COMPRESSED = ("int8", "fp16")
MODES = ("int8", "fp16", "best")
REPORT_NAME = "compression-report.json"
LATENCY_BATCH = 256
WARMUP_RUNS = 5
TIMED_RUNS = 30


def _latency_ms(predict: Callable[[np.ndarray], np.ndarray], batch: np.ndarray) -> float:
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # thread scheduling noise would swamp the differences between variants
    try:
        for _ in range(WARMUP_RUNS):
            predict(batch)
        times = []
        for _ in range(TIMED_RUNS):
            start = time.perf_counter()
            predict(batch)
            times.append((time.perf_counter() - start) * 1000.0)
    finally:
        torch.set_num_threads(previous)
    return round(statistics.median(times), 4)


def _fixed_batch(x: np.ndarray) -> np.ndarray:
    reps = math.ceil(LATENCY_BATCH / len(x))
    return np.ascontiguousarray(np.tile(x, (reps, 1))[:LATENCY_BATCH])


def _figures(rows: dict[str, dict[str, Any]], metric: str) -> str:
    return "; ".join(
        f"{name}: {metric} {row['metric']:.4f} (worse by {row['metric_drop']:+.4f}), {row['size_bytes']} bytes"
        for name, row in rows.items()
    )


def compress_bundle(
    bundle: Path,
    frame: pd.DataFrame,
    out_dir: Path,
    *,
    mode: str = "best",
) -> dict[str, Any]:
    """Measure every variant of ``bundle`` against its fp32 baseline on ``frame`` and select one.

    ``mode`` is ``int8``, ``fp16`` or ``best`` (the smallest compressed variant within the allowed
    drop; the fp32 baseline is the reference, not a candidate). The report is written in every
    case, so a refusal leaves its figures behind; :class:`CompressionRefused` is raised when nothing
    selectable is left.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; use one of {', '.join(MODES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fp32, card = load_module(Path(bundle))
    spec = MetricSpec.model_validate(card.metric)
    x, _ = inputs_and_target(frame, card)
    batch = _fixed_batch(x)

    rows, weights = _measure(fp32, card, frame, batch)
    baseline = rows["fp32"]["metric"]
    _judge(rows, weights, baseline, spec, card, bundle, out_dir)

    candidates = COMPRESSED if mode == "best" else (mode,)
    accepted = [rows[v] for v in candidates if rows[v]["status"] == "accepted"]
    selected = min(accepted, key=lambda r: r["size_bytes"]) if accepted else None
    report_path = out_dir / "compression-report.json"
    report: dict[str, Any] = {
        "status": "ok" if selected else "refused",
        "mode": mode,
        "model": card.model,
        "metric": spec.name,
        "max_drop": spec.max_drop,
        "baseline_metric": baseline,
        "n": int(len(frame)),
        "latency_batch_size": LATENCY_BATCH,
        "selected": selected["variant"] if selected else None,
        "bundle": selected["bundle"] if selected else None,
        "variants": rows,
        "report_path": str(report_path),
    }
    write_atomic(report_path, json.dumps(report, indent=2).encode())
    if selected is None:
        refused = CompressionRefused(
            f"compression mode={mode!r} of {card.model} refused: every candidate ({', '.join(candidates)}) is worse "
            f"than the fp32 model by more than its max_drop {spec.max_drop} ({spec.name}); figures: "
            f"{_figures(rows, spec.name)}. Raise models.{card.model}.metric.max_drop, pick another compression "
            f"mode, or train a more robust model (report: {report_path})"
        )
        refused.report = report  # the figures, for callers that record them
        raise refused
    return report


def _measure(
    fp32: Any, card: ModelCard, frame: pd.DataFrame, batch: np.ndarray
) -> tuple[dict[str, dict[str, Any]], dict[str, bytes]]:
    """Every variant's size, latency and metric, and its serialised weights."""
    rows: dict[str, dict[str, Any]] = {}
    weights: dict[str, bytes] = {}
    for variant in VARIANTS:
        module = convert(fp32, variant)
        weights[variant] = serialise_state(module)
        predictor = Predictor(module, card.with_variant(variant))
        with quiet_torch():
            scored = score_predictor(predictor, frame)
        rows[variant] = {
            "variant": variant,
            "size_bytes": len(weights[variant]),
            "latency_ms_per_batch": _latency_ms(predictor.predict, batch),
            "metric": scored["metric"]["value"],
        }
    return rows, weights


def _judge(
    rows: dict[str, dict[str, Any]],
    weights: dict[str, bytes],
    baseline: float,
    spec: MetricSpec,
    card: ModelCard,
    bundle: Path,
    out_dir: Path,
) -> None:
    """Accept (write its bundle) or refuse (remove a stale one) each compressed variant, in ``rows``."""
    for variant, row in rows.items():
        # Rounded so float noise in the subtraction cannot flip a decision at the boundary.
        row["metric_drop"] = spec.drop(baseline, row["metric"])
        if variant == "fp32":
            row.update(status="baseline", bundle=str(bundle))
            continue
        target = out_dir / variant
        if row["metric_drop"] <= spec.max_drop:
            row["status"] = "accepted"
            write_bundle(target, weights[variant], card.with_variant(variant))
            row["bundle"] = str(target)
        else:
            row["status"] = "refused"
            # A stale bundle from an earlier run must not be deployable.
            (target / "model.json").unlink(missing_ok=True)
            row["bundle"] = None
            row["reason"] = f"{spec.name} worse by {row['metric_drop']:.4f}, more than max_drop {spec.max_drop}"
