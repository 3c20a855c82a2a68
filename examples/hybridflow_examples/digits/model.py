"""A small MLP over the 64 pixels of a digit, trained data-parallel through hybridflow's contract.

``build(hparams)`` makes the module (the model server and evaluation call it too); ``train(ctx)`` runs
in every rank of the gang. The whole training state is checkpointed from rank 0 (DDP keeps every
rank's replica identical), and batches are a pure function of (seed, step), so a resumed run sees
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
    from torch.nn.parallel import DistributedDataParallel

    hp = ctx.hparams
    frame = ctx.dataset.split("train").frame()
    x = torch.tensor(frame[FEATURES].to_numpy(dtype=np.float32))
    y = torch.tensor(frame[LABEL].to_numpy(dtype=np.int64))

    model = build(hp)
    optimizer = torch.optim.SGD(model.parameters(), lr=hp["learning_rate"], momentum=hp["momentum"])
    start = 0
    restored = ctx.checkpoint.restore()
    if restored is not None:
        model.load_state_dict(restored.state["model"])
        optimizer.load_state_dict(restored.state["optimizer"])
        start = restored.step

    def state() -> dict:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    ddp = DistributedDataParallel(model)
    sampler = ctx.sampler(len(x), hp["batch_size"], seed=hp["seed"])
    loss_fn = nn.CrossEntropyLoss()
    step = start
    for step in range(start + 1, hp["steps"] + 1):
        rows = sampler.indices(step)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x[rows]), y[rows])
        loss.backward()  # DDP averages the gradients across the gang here
        optimizer.step()
        ctx.log(step, loss=loss.item())
        if ctx.should_stop():  # preempted: leave the loop, the final checkpoint follows
            break
        if ctx.checkpoint.due(step):
            ctx.checkpoint.save(step, state)  # snapshot now, written in the background
    ctx.checkpoint.save(step, state)  # the resume point (or, when done, what makes a rerun a no-op)
    ctx.save_model(model)
