"""A small MLP over the 64 pixels of a digit, trained data-parallel through hybridflow's contract.

``build(hparams)`` makes the module (the model server and evaluation call it too); ``train(ctx)`` runs
in every rank of the gang, with the run's precision, optimizer and sharding (``ctx.wrap``,
``ctx.optimizer``, ``ctx.autocast``), and batches are a pure function of (seed, step), so a resumed run sees
exactly the data an uninterrupted one would have.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridflow_examples.digits.data import FEATURES, LABEL

PIXEL_MAX = 16.0
CLASSES = 10


class Scale(nn.Module):
    """Raw pixel values 0..16 in, 0..1 out: requests carry what the dataset holds."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def build(hparams: Mapping[str, Any]) -> nn.Module:
    hidden = int(hparams["hidden"])
    torch.manual_seed(int(hparams["seed"]))  # identical initial weights on every rank and every retry
    return nn.Sequential(
        Scale(1.0 / PIXEL_MAX),
        nn.Linear(len(FEATURES), hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden // 2),
        nn.ReLU(),
        nn.Linear(hidden // 2, CLASSES),
    )


def train(ctx) -> None:
    import numpy as np

    hp = ctx.hparams
    frame = ctx.dataset.split("train").frame()
    # The whole table fits on the rank's device ("cuda:<local rank>" or "cpu"): batches are slices of it.
    x = torch.tensor(frame[FEATURES].to_numpy(dtype=np.float32), device=ctx.device)
    y = torch.tensor(frame[LABEL].to_numpy(dtype=np.int64), device=ctx.device)

    # The run's sharding, optimizer and precision Params decide what these do (DDP or FSDP, SGD or
    # AdamW, fp32 or autocast): the same code for every setting.
    model = ctx.wrap(build(hp))
    optimizer = ctx.optimizer(model, lr=hp["learning_rate"], momentum=hp["momentum"])
    start = ctx.restore(model, optimizer)  # the newest committed checkpoint's step, or 0
    sampler = ctx.sampler(len(x), hp["batch_size"], seed=hp["seed"])
    loss_fn = nn.CrossEntropyLoss()
    step = start
    for step in range(start + 1, hp["steps"] + 1):
        rows = sampler.indices(step)
        with ctx.autocast():
            loss = loss_fn(model(x[rows]), y[rows])
        ctx.backward(loss)  # gradients averaged (or reduce-scattered) across the gang here
        ctx.step(optimizer)
        ctx.log(step, loss=loss.item())
        if ctx.should_stop():  # preempted: leave the loop, the final checkpoint follows
            break
        if ctx.checkpoint.due(step):
            ctx.save_checkpoint(step, model, optimizer)  # snapshot now, written in the background
    ctx.save_checkpoint(step, model, optimizer)  # the resume point (or, when done, what makes a rerun a no-op)
    ctx.save_model(model)
