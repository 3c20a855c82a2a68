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
