"""Shared fixtures for unit tests: the real digits dataset and a model trained on it once."""

from __future__ import annotations

from pathlib import Path

import pytest


def train_digits_model(dataset: Path, out: Path, steps: int = 300) -> Path:
    """Plain single-process SGD: enough for >0.9 test accuracy on digits in about a second."""
    import torch
    import torch.nn.functional as F

    from hybridflow.datasets import parse_split
    from hybridflow.training.model import build_model

    x, y = parse_split((dataset / "train.csv").read_bytes())
    xs, ys = torch.tensor(x), torch.tensor(y)
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only fight the other test processes
    try:
        for _ in range(steps):
            idx = torch.randint(0, len(xs), (64,), generator=gen)
            loss = F.cross_entropy(model(xs[idx]), ys[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    torch.save(model.state_dict(), out)
    return out


@pytest.fixture(scope="session")
def digits_dataset(tmp_path_factory) -> Path:
    from hybridflow.datasets import seed_digits

    return seed_digits(tmp_path_factory.mktemp("digits-private")).path


@pytest.fixture(scope="session")
def trained(digits_dataset, tmp_path_factory) -> tuple[Path, Path]:
    """(fp32 model artefact, test.csv). Tests must not modify either."""
    model = train_digits_model(digits_dataset, tmp_path_factory.mktemp("trained") / "model.pt")
    return model, digits_dataset / "test.csv"
