"""The model trained by the pipeline: a small MLP classifier over 8x8 digit images."""

from __future__ import annotations

import torch
from torch import nn

N_FEATURES = 64
N_CLASSES = 10


def build_model(hidden: int = 128) -> nn.Module:
    torch.manual_seed(0)  # identical initial weights on every rank and every retry
    return nn.Sequential(
        nn.Linear(N_FEATURES, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden // 2),
        nn.ReLU(),
        nn.Linear(hidden // 2, N_CLASSES),
    )
