"""Training functions that break the training contract, for the worker's failure tests.

Registered nowhere: a test names one as its job's entrypoint (``contract_fns:<function>``) and puts
this folder on the workers' PYTHONPATH through the GangJob's env.
"""

from __future__ import annotations


def raises_bad_column(ctx) -> None:
    """Reads its data, then fails the way a bug in a training function does."""
    frame = ctx.dataset.split("train").frame()
    ctx.log(1, loss=float(len(frame.columns)))
    raise ValueError("bad column")


def forgets_the_model(ctx) -> None:
    """Trains (logs) a few steps and returns without ctx.save_model: nothing to evaluate or serve."""
    rows = len(ctx.dataset.split("train").frame())
    for step in range(1, 4):
        ctx.log(step, loss=1.0 / (step + rows))
        if ctx.should_stop():
            break


def paced(ctx) -> None:
    """A tiny model trained one step every ``pace_ms`` (hyperparameter, default 20): slow enough for a
    test to find its gang running, move it and see it resume from its checkpoint elsewhere."""
    import time

    import torch
    from torch import nn

    model = ctx.wrap(nn.Linear(4, 2))
    optimizer = ctx.optimizer(model, lr=0.01, momentum=0.0)
    step = start = ctx.restore(model, optimizer)
    for step in range(start + 1, ctx.hparams["steps"] + 1):
        loss = model(torch.ones(1, 4, device=ctx.device)).sum()
        ctx.backward(loss)
        ctx.step(optimizer)
        ctx.log(step, loss=loss.item())
        if ctx.should_stop():
            break
        if ctx.checkpoint.due(step):
            ctx.save_checkpoint(step, model, optimizer)
        time.sleep(ctx.hparams.get("pace_ms", 20) / 1000)
    ctx.save_checkpoint(step, model, optimizer)
    ctx.save_model(model)
