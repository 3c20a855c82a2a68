"""Shared by the staging benchmarks: the datasets.yaml their synthetic datasets are staged under.

The staging guard reads the catalogue file itself and handles a dataset it does not list as
restricted, so every benchmark describes its dataset (as internal data, which may go to the public
cache the benchmarks stand for) in a catalogue of its own in the benchmark's scratch folder.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from s3bench import REPO  # noqa: F401 -- importing s3bench puts include/ on sys.path

from hybridflow.sovereignty import Destination

# The benchmarks' endpoint plays a public cluster's cache bucket.
PUBLIC_CACHE = Destination("public", ("us-east-1", "us"), "bench-cache")


def write_catalogue(folder: Path, name: str, classification: str = "internal") -> Path:
    """``folder``/datasets.yaml describing dataset ``name`` with the smallest entry the catalogue accepts."""
    entry = {
        "location": f"private://datasets/{name}",
        "format": "shards",
        "splits": {"train": {"files": ["**"]}},
        "holdout": "train",
        "suite": "expectations/train.json",
        "classification": classification,
    }
    path = Path(folder) / "datasets.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"datasets": {name: entry}}, sort_keys=False), encoding="utf-8")
    return path
