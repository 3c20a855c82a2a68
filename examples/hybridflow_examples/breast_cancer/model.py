"""A binary classifier over 30 measurements, trained data-parallel through hybridflow's contract.

The module standardises its inputs itself (means and spreads of the training split, kept as
buffers), so requests carry the raw measurements. It trains with the run's precision, optimizer and
sharding through the ``ctx`` helpers; with ``sharding`` zero2 or zero3 its weights are sharded with
FSDP and every rank saves its part with ``torch.distributed.checkpoint``, the way a model too big for
one rank's memory would be.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

N_FEATURES = 30


class Standardise(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(n))
        self.register_buffer("scale", torch.ones(n))

    def fit(self, x: torch.Tensor) -> None:
        self.mean.copy_(x.mean(dim=0))
        self.scale.copy_(x.std(dim=0).clamp_min(1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.scale


def build(hparams: Mapping[str, Any]) -> nn.Module:
    hidden = int(hparams["hidden"])
    torch.manual_seed(int(hparams["seed"]))
    return nn.Sequential(
        Standardise(N_FEATURES),
        nn.Linear(N_FEATURES, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 1),  # one logit: the model server answers with its sigmoid
    )


def train(ctx) -> None:
    import numpy as np

    from hybridflow_examples.breast_cancer.data import LABEL, feature_names

    hp = ctx.hparams
    frame = ctx.dataset.split("train").frame()
    # The whole table fits on the rank's device ("cuda:<local rank>" or "cpu"): batches are slices of it.
    x = torch.tensor(frame[feature_names()].to_numpy(dtype=np.float32), device=ctx.device)
    y = torch.tensor(frame[LABEL].to_numpy(dtype=np.float32), device=ctx.device)

    module = build(hp)
    module[0].fit(x.cpu())  # the standardiser's statistics, before the module is wrapped
    model = ctx.wrap(module)  # DDP, or FSDP with zero2/zero3 (then checkpoints are sharded: every rank its part)
    optimizer = ctx.optimizer(model, lr=hp["learning_rate"], weight_decay=hp["weight_decay"])
    start = ctx.restore(model, optimizer)
    sampler = ctx.sampler(len(x), hp["batch_size"], seed=hp["seed"])
    loss_fn = nn.BCEWithLogitsLoss()
    step = start
    for step in range(start + 1, hp["steps"] + 1):
        rows = sampler.indices(step)
        with ctx.autocast():
            loss = loss_fn(model(x[rows]).squeeze(1), y[rows])
        ctx.backward(loss)
        ctx.step(optimizer)
        ctx.log(step, loss=loss.item())
        if ctx.should_stop():
            break
        if ctx.checkpoint.due(step):
            ctx.save_checkpoint(step, model, optimizer)
    ctx.save_checkpoint(step, model, optimizer)
    ctx.save_model(model)
