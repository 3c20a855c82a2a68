"""Model bundles of the example models for tests: seed the dataset, train the registered builder's
module briefly in-process (plain single-process torch loop), write the bundle.

    data = seed("digits-mlp", tmp)                       # the model's dataset, seeded into tmp
    module = train("digits-mlp", data)                    # ~a second; untrained with steps=0
    make_bundle(tmp / "b", "digits-mlp", module, variant="int8", version="v1")
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hybridflow.settings import REPO_ROOT

CONFIG = REPO_ROOT / "config"

# Steps that reach the registered gate on the held-out split with this loop.
STEPS = {"digits-mlp": 300, "breast-cancer": 300}


def entry(model: str):
    from hybridflow.config import load_estate

    return load_estate(CONFIG).models.get(model)


@dataclass(frozen=True)
class Data:
    """A seeded dataset's train and held-out frames, and the model entry they belong to."""

    model: str
    folder: Path
    train: Any  # pandas.DataFrame
    test: Any

    def xy(self, split: str = "test", rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(signature inputs float32 [n, d] as a client sends them, targets [n])."""
        e = entry(self.model)
        frame = getattr(self, split)[:rows]
        return frame[e.signature.input_names].to_numpy(dtype=np.float32), frame[e.target].to_numpy()


def seed(model: str, folder: Path) -> Data:
    """Seed ``model``'s dataset into ``folder`` with the catalogue's seeder and read its splits."""
    import pandas as pd

    from hybridflow.config import load_estate
    from hybridflow.config.registry import resolve

    estate = load_estate(CONFIG)
    dataset = estate.datasets.get(estate.models.get(model).dataset)
    resolve(dataset.seed, argument="folder")(Path(folder))
    read = pd.read_csv if dataset.format == "csv" else pd.read_parquet
    frames = {split: read(Path(folder) / spec.files[0]) for split, spec in dataset.splits.items()}
    return Data(model, Path(folder), frames["train"], frames[dataset.holdout])


def train(model: str, data: Data, steps: int | None = None, seed: int = 0):
    """The builder's module (registered default hyper-parameters) after ``steps`` of SGD on the train split."""
    import torch
    import torch.nn.functional as F

    from hybridflow.config.registry import resolve

    e = entry(model)
    module = resolve(e.build, argument="hparams")(e.defaults())
    x, y = data.xy("train")
    xs = torch.tensor(x)
    first = next(iter(module.children()), None)
    if hasattr(first, "fit"):  # input standardisation the training function fits on the train split
        first.fit(xs)
    kind = e.signature.output.type
    ys = torch.from_numpy(y.astype(np.int64 if kind == "class" else np.float32))
    opt = torch.optim.Adam(module.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only fight the other test processes
    try:
        module.train()
        for _ in range(STEPS[model] if steps is None else steps):
            idx = torch.randint(0, len(xs), (64,), generator=gen)
            out = module(xs[idx])
            if kind == "class":
                loss = F.cross_entropy(out, ys[idx])
            elif kind == "probability":
                loss = F.binary_cross_entropy_with_logits(out.reshape(-1), ys[idx])
            else:
                loss = F.mse_loss(out.reshape(-1), ys[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return module.eval()


def card(model: str, *, version: str = "v1", variant: str = "fp32", signature: dict | None = None):
    """The registry's card for ``model`` (default hyper-parameters), optionally with another signature."""
    from hybridflow.bundle import ModelCard

    e = entry(model)
    body = e.card()
    if signature is not None:
        body["signature"] = signature
    return ModelCard(**body, hyperparameters=e.defaults(), variant=variant, version=version)


def make_bundle(folder: Path, model: str, module, *, variant: str = "fp32", version: str = "v1",
                signature: dict | None = None) -> Path:
    """Write ``module`` (fp32, converted to ``variant``) as a bundle of ``model`` into ``folder``."""
    from hybridflow import bundle

    converted = bundle.convert(module, variant)
    return bundle.write_bundle(folder, bundle.serialise_state(converted),
                               card(model, version=version, variant=variant, signature=signature))
