"""The run's precision, optimizer and sharding Params, applied by the training contract's helpers:
what admission estimates GPU memory with is what the gang trains with, and each setting trains the
digits example (real 2-rank gloo gangs on CPU: FSDP and ZeroRedundancyOptimizer run there too)."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.distributed as dist
from tests.support.jobs import held_out_metric, job_spec

from hybridflow import admission
from hybridflow.backends.local import GangJob, LocalGangBackend
from hybridflow.gpumem import TrainSetting
from hybridflow.storage.objectstore import LocalObjectStore
from hybridflow.training.checkpoint import CheckpointStore
from hybridflow.training.context import FINAL_MODEL_KEY, RESULT_KEY
from hybridflow.training.parallel import Parallel
from hybridflow.training.worker import JobSpec


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_admission_estimates_with_the_setting_the_gang_trains_with(monkeypatch, tmp_path, seeded_private):
    from tests.support.jobs import REPO

    from hybridflow.config import load_estate

    estimated = []
    real = admission.estimate_for
    monkeypatch.setattr(admission, "estimate_for", lambda params, setting, **kw: estimated.append(setting)
                        or real(params, setting, **kw))
    run = admission.admit({"precision": "bf16", "optimizer": "adamw", "sharding": "zero3"},
                          load_estate(REPO / "config"), seeded_private)
    setting = run.request.train_setting
    assert estimated == [setting] == [TrainSetting("bf16", "adamw", "zero3")]
    # The job spec carries it to every rank as "training"; the worker reads it back unchanged.
    spec = JobSpec.from_dict({"run_key": "r", "model": {"name": "m", "entrypoint": "p:f"}, "dataset": {}, "data": {},
                              "checkpoint_store": {}, "checkpoint_every_steps": 1, "training": setting.to_dict()})
    assert spec.setting == setting


@pytest.mark.parametrize("body, field", [({"precision": "fp8"}, "precision='fp8'"),
                                         ({"sharding": "fsdp"}, "sharding='fsdp'"),
                                         ({"optimiser": "adamw"}, "unknown keys ['optimiser']")])
def test_a_setting_training_cannot_apply_is_refused_before_the_gang_starts(body, field):
    with pytest.raises(ValueError, match="training setting .*" + re.escape(field)):
        JobSpec.from_dict({"run_key": "r", "model": {"name": "m", "entrypoint": "p:f"}, "dataset": {}, "data": {},
                           "checkpoint_store": {}, "checkpoint_every_steps": 1, "training": body})


@pytest.mark.parametrize("sharding, wrapper, optimizer, precision, dtype", [
    ("none", "DistributedDataParallel", "sgd_momentum", "fp32", torch.float32),
    ("zero1", "DistributedDataParallel", "adamw", "bf16", torch.bfloat16),
    ("zero2", "FSDPSequential", "sgd", "fp16", torch.float16),
    ("zero3", "FSDPSequential", "adamw", "bf16", torch.bfloat16),
])
def test_each_setting_wraps_optimizes_and_casts_as_named(one_rank, sharding, wrapper, optimizer, precision, dtype):
    par = Parallel(TrainSetting(precision, optimizer, sharding), "cpu", 0, 1)
    model = par.wrap(torch.nn.Sequential(torch.nn.Linear(4, 3)))
    opt = par.optimizer(model, lr=0.1, momentum=0.5)
    assert type(model).__name__ == wrapper
    inner = opt.optim if sharding == "zero1" else opt  # ZeroRedundancyOptimizer holds this rank's share
    assert type(opt).__name__ == ("ZeroRedundancyOptimizer" if sharding == "zero1" else type(inner).__name__)
    assert type(inner).__name__ == ("AdamW" if optimizer == "adamw" else "SGD")
    if optimizer != "adamw":
        assert inner.param_groups[0]["momentum"] == (0.5 if optimizer == "sgd_momentum" else 0.0)
    with par.autocast():
        out = model(torch.ones(2, 4))
    assert out.dtype == dtype
    assert (par.scaler is not None) == (precision == "fp16")  # a GradScaler only for fp16
    par.backward(out.float().sum())
    par.step(opt)
    assert all(p.grad is None for p in model.parameters())
    state = par.state(model, opt)
    assert set(state) == {"model", "optimizer"} | ({"scaler"} if precision == "fp16" else set())
    # The trained model is saved with the builder's keys, whatever wraps it.
    assert set(par.model_state(model)) == {"0.weight", "0.bias"}


@pytest.mark.parametrize("setting, kind", [
    ({"precision": "bf16", "optimizer": "adamw", "sharding": "zero1"}, "full"),
    ({"precision": "fp16", "optimizer": "sgd_momentum", "sharding": "zero3"}, "sharded"),
])
def test_a_gang_trains_resumes_and_beats_the_gate_with_its_setting(tmp_path, digits_dataset, setting, kind):
    ckpt_root = tmp_path / "ckpt"
    store, checkpoints = LocalObjectStore(ckpt_root), CheckpointStore(LocalObjectStore(ckpt_root))
    backend = LocalGangBackend(tmp_path / "state", "onprem-a", capacity=2)
    hp = {"steps": 120}
    spec = job_spec(digits_dataset, ckpt_root, hparams=hp, checkpoint_every_steps=40, keep=3, training=setting)
    lines: list[str] = []
    backend.run(GangJob(name="par", workers=2, spec=spec, attempt="1"), admission_timeout_s=10, log=lines.append)

    first = json.loads(store.get_bytes(RESULT_KEY))
    assert first["training"] == setting and first["checkpoint_kind"] == kind
    assert any(f"precision {setting['precision']}, optimizer {setting['optimizer']}, sharding "
               f"{setting['sharding']}" in line for line in lines), lines
    assert held_out_metric(digits_dataset, store.get_bytes(FINAL_MODEL_KEY)) > digits_dataset.model.metric.gate

    # Resumed from the newest checkpoint with the same setting: model, optimizer (and scaler) state
    # come back, and training goes on to the new end.
    longer = job_spec(digits_dataset, ckpt_root, hparams={"steps": 160}, checkpoint_every_steps=40, keep=3,
                      training=setting)
    backend.run(GangJob(name="par", workers=2, spec=longer, attempt="2"), admission_timeout_s=10, log=lines.append)
    second = json.loads(store.get_bytes(RESULT_KEY))
    assert (second["start_step"], second["final_step"]) == (120, 160)
    assert checkpoints.latest().step == 160
