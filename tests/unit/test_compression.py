"""Compression of any model bundle: int8/fp16 variants scored with the model's own metric against
fp32, refusals past the metric's max_drop, and variant bundles that load safely."""

from __future__ import annotations

import json

import pytest
import torch
from tests.support.bundles import make_bundle, seed, train

from hybridflow.bundle import Predictor, read_card, read_weights
from hybridflow.compression import compress_bundle
from hybridflow.errors import CompressionRefused
from hybridflow.evaluation import evaluate_bundle


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """(fp32 bundle of a trained digits MLP, its held-out frame)."""
    folder = tmp_path_factory.mktemp("digits")
    data = seed("digits-mlp", folder / "data")
    return make_bundle(folder / "bundle", "digits-mlp", train("digits-mlp", data)), data.test


@pytest.fixture(scope="module")
def breast_cancer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("breast-cancer")
    data = seed("breast-cancer", folder / "data")
    return make_bundle(folder / "bundle", "breast-cancer", train("breast-cancer", data)), data.test


def test_int8_is_smaller_and_within_the_models_max_drop(digits, tmp_path):
    bundle, frame = digits
    report = compress_bundle(bundle, frame, tmp_path, mode="int8")
    rows = report["variants"]
    assert report["status"] == "ok" and report["selected"] == "int8"
    assert report["metric"] == "accuracy" and report["max_drop"] == 0.02
    assert rows["int8"]["size_bytes"] < rows["fp32"]["size_bytes"]
    assert rows["int8"]["metric_drop"] <= 0.02 and rows["fp32"]["metric"] > 0.9
    for row in rows.values():
        assert row["latency_ms_per_batch"] > 0 and {"size_bytes", "metric", "metric_drop"} <= set(row)
    assert report["bundle"] == str(tmp_path / "int8")
    assert (tmp_path / "int8" / "weights.pt").stat().st_size == rows["int8"]["size_bytes"]
    assert read_card(tmp_path / "int8").variant == "int8"
    assert json.loads((tmp_path / "compression-report.json").read_text()) == report
    # The variant's bundle alone reproduces the reported figure.
    assert evaluate_bundle(tmp_path / "int8", frame)["metric"]["value"] == pytest.approx(rows["int8"]["metric"])


def test_a_probability_model_is_judged_by_its_own_metric(breast_cancer, tmp_path):
    bundle, frame = breast_cancer
    report = compress_bundle(bundle, frame, tmp_path, mode="best")
    assert report["metric"] == "roc_auc" and report["max_drop"] == 0.01
    assert report["baseline_metric"] >= 0.95
    accepted = [v for v in ("int8", "fp16") if report["variants"][v]["status"] == "accepted"]
    assert report["selected"] == min(accepted, key=lambda v: report["variants"][v]["size_bytes"])
    selected = Predictor.load(tmp_path / report["selected"])
    assert selected.card.output["type"] == "probability"
    probabilities = selected.predict(frame[selected.input_names].to_numpy(dtype="float32"))
    assert ((probabilities >= 0) & (probabilities <= 1)).all()


def test_fp16_bundle_is_half_the_size_and_predicts(digits, tmp_path):
    bundle, frame = digits
    report = compress_bundle(bundle, frame, tmp_path, mode="fp16")
    rows = report["variants"]
    assert report["selected"] == "fp16"
    assert rows["fp16"]["size_bytes"] < 0.6 * rows["fp32"]["size_bytes"]
    assert evaluate_bundle(tmp_path / "fp16", frame)["metric"]["value"] > 0.9


def _overflowing_in_half_precision(bundle, folder):
    """The same function in fp32, but hidden activations beyond fp16's range: its fp16 variant breaks.

    ReLU layers are positively homogeneous: scaling layer 1 (and layer 2's bias) by a and the output
    layer by 1/a leaves the fp32 outputs as they were."""
    from tests.support.bundles import card

    from hybridflow import bundle as bundles

    state = read_weights(bundle / "weights.pt")
    a = 1e5
    for key in ("1.weight", "1.bias", "3.bias"):
        state[key] = state[key] * a
    state["5.weight"] = state["5.weight"] / a
    return bundles.write_bundle(folder, bundles.serialise_state_dict(state), card("digits-mlp"))


def test_a_variant_that_loses_too_much_is_refused_with_figures(digits, tmp_path):
    bundle, frame = digits
    fragile = _overflowing_in_half_precision(bundle, tmp_path / "fragile")
    # A previous successful run left an fp16 bundle; a refusal must not leave it deployable.
    out = tmp_path / "out"
    compress_bundle(bundle, frame, out, mode="fp16")
    assert (out / "fp16" / "model.json").is_file()

    with pytest.raises(CompressionRefused) as refused:
        compress_bundle(fragile, frame, out, mode="fp16")
    message = str(refused.value)
    assert "more than its max_drop 0.02 (accuracy)" in message and "fp16: accuracy" in message
    assert "models.digits-mlp.metric.max_drop" in message
    report = json.loads((out / "compression-report.json").read_text())
    assert report["status"] == "refused" and report["selected"] is None and report["bundle"] is None
    assert report["variants"]["fp16"]["status"] == "refused" and report["variants"]["fp32"]["metric"] > 0.9
    assert refused.value.report == report
    assert not (out / "fp16" / "model.json").exists()
    # int8 keeps the function, so "best" still finds a variant.
    assert compress_bundle(fragile, frame, tmp_path / "best", mode="best")["selected"] == "int8"


def test_variant_bundles_load_without_unpickling_code(digits, tmp_path):
    bundle, frame = digits
    compress_bundle(bundle, frame, tmp_path, mode="best")
    for variant in ("int8", "fp16"):
        assert isinstance(torch.load(tmp_path / variant / "weights.pt", weights_only=True), dict)
    # The int8 weights under an fp16 card do not fit: refused with a clear message, not loaded wrongly.
    card = read_card(tmp_path / "int8")
    (tmp_path / "int8" / "model.json").write_bytes(card.with_variant("fp16").to_json())
    with pytest.raises(ValueError, match="do not fit"):
        Predictor.load(tmp_path / "int8")


def test_bad_mode_is_rejected(digits, tmp_path):
    bundle, frame = digits
    with pytest.raises(ValueError, match="mode"):
        compress_bundle(bundle, frame, tmp_path, mode="int4")
