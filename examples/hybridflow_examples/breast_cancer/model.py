"""A binary classifier over 30 measurements, trained data-parallel through hybridflow's contract.

The module standardises its inputs itself (means and spreads of the training split, kept as
buffers), so requests carry the raw measurements. Its training state is saved sharded from every
rank with ``torch.distributed.checkpoint`` (``ctx.checkpoint.save_sharded``), the way a model too big
for one rank's memory would be.
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
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel

    from hybridflow_examples.breast_cancer.data import LABEL, feature_names

    hp = ctx.hparams
    frame = ctx.dataset.split("train").frame()
    x = torch.tensor(frame[feature_names()].to_numpy(dtype=np.float32))
    y = torch.tensor(frame[LABEL].to_numpy(dtype=np.float32))

    model = build(hp)
    model[0].fit(x)
    optimizer = torch.optim.AdamW(model.parameters(), lr=hp["learning_rate"], weight_decay=hp["weight_decay"])

    def state() -> dict:
        # Fully qualified names for model and optimizer state (the optimizer's is created here if it
        # does not exist yet, so a restore has tensors to load into).
        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optimizer": optim_state}

    start = 0
    restored = state()
    step_restored = ctx.checkpoint.restore_sharded(restored)  # loads every rank's part in place
    if step_restored is not None:
        set_state_dict(model, optimizer, model_state_dict=restored["model"], optim_state_dict=restored["optimizer"])
        start = step_restored

    ddp = DistributedDataParallel(model)
    sampler = ctx.sampler(len(x), hp["batch_size"], seed=hp["seed"])
    loss_fn = nn.BCEWithLogitsLoss()
    step = start
    for step in range(start + 1, hp["steps"] + 1):
        rows = sampler.indices(step)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x[rows]).squeeze(1), y[rows])
        loss.backward()
        optimizer.step()
        ctx.log(step, loss=loss.item())
        if ctx.should_stop():
            break
        if ctx.checkpoint.due(step):
            ctx.checkpoint.save_sharded(step, state())  # every rank writes its part
    ctx.checkpoint.save_sharded(step, state())
    ctx.save_model(model)
