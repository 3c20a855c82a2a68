"""The GPU memory check: the bytes per parameter of each part of the training state, what sharding
saves, and admission refusing a gang that cannot hold its model with a count or sharding that can."""

from __future__ import annotations

import pytest

from hybridflow.admission import admit
from hybridflow.config import load_estate
from hybridflow.errors import AdmissionError
from hybridflow.gpumem import GB, estimate
from hybridflow.settings import REPO_ROOT


def test_the_8b_adamw_example_needs_sharding_over_several_gpus():
    est = estimate(8_000_000_000, precision="bf16", optimizer="adamw", sharding="none", workers=8,
                   gpu_memory_gib=80)
    assert (est.weights / GB, est.gradients / GB, est.optimizer_state / GB) == (16.0, 16.0, 96.0)
    assert est.total / GB == 128.0 and not est.fits
    assert est.min_workers() is None  # unsharded, every GPU holds all 128 GB however many there are
    zero1 = estimate(8_000_000_000, precision="bf16", optimizer="adamw", sharding="zero1", workers=8,
                     gpu_memory_gib=80)
    assert zero1.per_gpu / GB == 16 + 16 + 12 and zero1.fits
    assert zero1.min_workers() == 3  # 32 + 96/n <= 80 GiB * 0.8
    assert zero1.min_workers("zero3") == 2
    assert "8B parameters in bf16 with adamw" in zero1.explain() and "44.0 GB on each" in zero1.explain()


@pytest.mark.parametrize(
    ("precision", "optimizer", "per_param"),
    [("fp32", "sgd", 8), ("fp32", "sgd_momentum", 12), ("fp32", "adamw", 16), ("bf16", "adamw", 16),
     ("fp16", "sgd", 8), ("bf16", "sgd_momentum", 12)],
)
def test_bytes_per_parameter(precision, optimizer, per_param):
    est = estimate(1_000_000, precision=precision, optimizer=optimizer, sharding="none", workers=1,
                   gpu_memory_gib=24)
    assert est.total == per_param * 1_000_000


def test_zero_stages_shard_progressively_more():
    kw = dict(precision="bf16", optimizer="adamw", workers=4, gpu_memory_gib=80)
    per = [estimate(10**9, sharding=s, **kw).per_gpu / GB for s in ("none", "zero1", "zero2", "zero3")]
    assert per == [16.0, 2 + 2 + 3, 2 + 14 / 4, 16 / 4]


@pytest.fixture(scope="module")
def estate():
    return load_estate(REPO_ROOT / "config", use_cache=False)


@pytest.fixture
def private_root(seeded_private):
    return seeded_private  # admission only reads it


def test_admission_suggests_a_gang_size_that_fits(estate, private_root):
    big = {"model_params_b": 8, "precision": "bf16", "optimizer": "adamw", "sharding": "zero1", "workers": 2}
    with pytest.raises(AdmissionError) as info:
        admit(big, estate, private_root)
    assert info.value.field == "workers"
    assert "workers=3" in str(info.value) and "sharding=zero3" in str(info.value)
    assert admit({**big, "workers": 3}, estate, private_root).workers == 3
    assert admit({**big, "sharding": "zero3"}, estate, private_root).sharding == "zero3"


def test_admission_refuses_a_model_no_sharding_can_fit_within_the_quota(estate, private_root):
    with pytest.raises(AdmissionError) as info:
        admit({"model_params_b": 70, "precision": "bf16", "optimizer": "adamw", "workers": 4}, estate, private_root)
    assert info.value.field == "model_params_b"
    assert "quota of 4" in str(info.value) and "1120.0 GB" in str(info.value)


def test_unsharded_model_that_fits_one_gpu_is_admitted(estate, private_root):
    run = admit({"model_params_b": 1.5, "precision": "bf16", "optimizer": "adamw"}, estate, private_root)
    assert run.model_params_b == 1.5  # 1.5B * 16 B = 24 GB < 64 GB usable
    assert admit({}, estate, private_root).model_params_b == 0.0  # the registered model's own parameter count
