"""Compress a trained model and refuse variants that lose too much accuracy.

Variants:

- ``fp32``: the trained model, the baseline every figure is compared against.
- ``int8``: dynamic quantization of the ``Linear`` layers (int8 weights, activations quantized per batch).
- ``fp16``: the whole model in half precision.

Artefact format: ``torch.save(state_dict)`` of the converted model. Loading rebuilds the structure
(``build_model`` -> same conversion) and then loads the state dict with ``torch.load(weights_only=True)``,
which accepts the quantized packed params, so no artefact can execute code when it is loaded.
"""

from __future__ import annotations

import io
import json
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from hybridflow.datasets import parse_split
from hybridflow.errors import CompressionRefused
from hybridflow.evaluation import hidden_size, load_fp32, read_state_dict, score

VARIANTS = ("fp32", "int8", "fp16")
COMPRESSED = ("int8", "fp16")
MODES = ("int8", "fp16", "best")
REPORT_NAME = "compression-report.json"
LATENCY_BATCH = 256
WARMUP_RUNS = 5
TIMED_RUNS = 30


@contextmanager
def _quiet_torch():
    """torch.ao.quantization warns that it is deprecated, and saving quantized tensors warns about
    TypedStorage; both are noise for callers (the API still works in the pinned torch)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch(\..*)?$")
        yield


def artifact_name(variant: str) -> str:
    return f"model-{variant}.pt"


def convert(fp32_model, variant: str):
    """fp32 model -> the variant's model (a new module; the input is left as it is)."""
    import copy

    import torch

    if variant == "fp32":
        return fp32_model
    if variant == "int8":
        with _quiet_torch():
            return torch.ao.quantization.quantize_dynamic(
                copy.deepcopy(fp32_model), {torch.nn.Linear}, dtype=torch.qint8
            ).eval()
    if variant == "fp16":
        return copy.deepcopy(fp32_model).half().eval()
    raise ValueError(f"unknown variant {variant!r}; use one of {', '.join(VARIANTS)}")


def _predictor(model, variant: str) -> Callable[[np.ndarray], np.ndarray]:
    import torch

    dtype = torch.float16 if variant == "fp16" else torch.float32

    def predict(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != 64:
            raise ValueError(f"expected features of shape [n, 64], got {list(x.shape)}")
        with torch.inference_mode():
            return (
                model(torch.from_numpy(np.require(x, np.float32, ["C", "W"])).to(dtype)).argmax(dim=1).numpy()
            )

    return predict


def _serialise(model) -> bytes:
    buf = io.BytesIO()
    import torch

    with _quiet_torch():
        torch.save(model.state_dict(), buf)
    return buf.getvalue()


def load_compressed(path: Path, variant: str) -> Callable[[np.ndarray], np.ndarray]:
    """A ``predict(x float32 [n, 64] scaled 0..1) -> labels`` for an artefact of ``variant``."""
    from hybridflow.training.model import build_model

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; use one of {', '.join(VARIANTS)}")
    with _quiet_torch():
        state = read_state_dict(Path(path))
    # Rebuild the same structure the artefact was saved from, then load only tensors into it.
    model = convert(build_model(hidden=hidden_size(state)).eval(), variant)
    try:
        with _quiet_torch():
            model.load_state_dict(state)
    except (RuntimeError, KeyError) as exc:
        raise ValueError(f"{path} is not a {variant} artefact of build_model(): {exc}") from exc
    return _predictor(model.eval(), variant)


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


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.part")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)


def _figures(rows: dict[str, dict[str, Any]]) -> str:
    return "; ".join(
        f"{name}: accuracy {row['accuracy']:.4f} (drop {row['accuracy_drop']:+.4f}), {row['size_bytes']} bytes"
        for name, row in rows.items()
    )


def compress_model(
    model_path: Path,
    test_csv: Path,
    out_dir: Path,
    *,
    mode: str = "best",
    max_accuracy_drop: float = 0.02,
) -> dict[str, Any]:
    """Measure every variant against the fp32 baseline and select one.

    ``mode`` is ``int8``, ``fp16`` or ``best`` (the smallest compressed variant within the allowed
    drop; the fp32 baseline is the reference, not a candidate). A variant whose accuracy drop exceeds
    ``max_accuracy_drop`` is refused and gets no artefact. The report is written in every case, so a
    refusal leaves its figures behind; :class:`CompressionRefused` is raised when nothing selectable
    is left.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; use one of {', '.join(MODES)}")
    if not isinstance(max_accuracy_drop, int | float) or math.isnan(max_accuracy_drop):
        raise ValueError(f"max_accuracy_drop={max_accuracy_drop!r}; use a number such as 0.02")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    x, y = parse_split(Path(test_csv).read_bytes())
    batch = _fixed_batch(x)
    fp32 = load_fp32(model_path)

    rows: dict[str, dict[str, Any]] = {}
    blobs: dict[str, bytes] = {}
    for variant in VARIANTS:
        model = convert(fp32, variant)
        blobs[variant] = _serialise(model)
        predict = _predictor(model, variant)
        rows[variant] = {
            "variant": variant,
            "size_bytes": len(blobs[variant]),
            "latency_ms_per_batch": _latency_ms(predict, batch),
            "accuracy": score(y, predict(x))["accuracy"],
        }
    baseline = rows["fp32"]["accuracy"]
    for variant, row in rows.items():
        # Round so float noise in the subtraction cannot flip a decision at the boundary.
        row["accuracy_drop"] = round(baseline - row["accuracy"], 10)
        if variant == "fp32":
            row.update(status="baseline", path=str(model_path))
            continue
        accepted = row["accuracy_drop"] <= max_accuracy_drop
        row["status"] = "accepted" if accepted else "refused"
        target = out_dir / artifact_name(variant)
        if accepted:
            _write_atomic(target, blobs[variant])
            row["path"] = str(target)
        else:
            target.unlink(missing_ok=True)  # a stale artefact from an earlier run must not be deployable
            row["path"] = None
            row["reason"] = (
                f"accuracy drop {row['accuracy_drop']:.4f} exceeds max_accuracy_drop {max_accuracy_drop}"
            )

    candidates = COMPRESSED if mode == "best" else (mode,)
    accepted_rows = [rows[v] for v in candidates if rows[v]["status"] == "accepted"]
    selected = min(accepted_rows, key=lambda r: r["size_bytes"]) if accepted_rows else None
    report_path = out_dir / REPORT_NAME
    report: dict[str, Any] = {
        "status": "ok" if selected else "refused",
        "mode": mode,
        "max_accuracy_drop": max_accuracy_drop,
        "baseline_accuracy": baseline,
        "n": int(len(y)),
        "latency_batch_size": LATENCY_BATCH,
        "selected": selected["variant"] if selected else None,
        "artifact": selected["path"] if selected else None,
        "variants": rows,
        "report_path": str(report_path),
    }
    _write_atomic(report_path, json.dumps(report, indent=2).encode())
    if selected is None:
        refused = CompressionRefused(
            f"compression mode={mode!r} refused: every candidate ({', '.join(candidates)}) loses more than "
            f"max_accuracy_drop={max_accuracy_drop}; figures: {_figures(rows)}. Raise max_accuracy_drop, "
            f"pick another mode, or train a more robust model (report: {report_path})"
        )
        refused.report = report  # the figures, for callers that record them
        raise refused
    return report
