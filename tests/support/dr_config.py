"""The shipped config with a local disaster-recovery cluster ``dr-west`` added (role: dr), in a test's
own folder: what the fencing, declaration and Clusters & DR page tests start from."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from hybridflow.settings import REPO_ROOT

DR_WEST = {
    "location": "private", "region": "dc-2", "jurisdiction": "eu", "backend": "local", "role": "dr",
    "dr": {"min_gpus": 2, "peacetime": ["batch"]},
    "node_pools": [{"name": "a100", "gpu_model": "A100-80GB", "gpu_memory_gib": 80, "gpus": 4}],
    "prices": {"onprem": 0.80}, "cache": {"conn_id": "hybridflow_dr_west", "bucket": "hf-dr-west"},
}


def config_with_dr(tmp_path: Path, with_dr: bool = True) -> Path:
    """``tmp_path/config``: the shipped config, plus ``dr-west`` unless ``with_dr`` is False."""
    target = tmp_path / "config"
    shutil.copytree(REPO_ROOT / "config", target)
    if with_dr:
        doc = yaml.safe_load((target / "clusters.yaml").read_text())
        doc["clusters"]["dr-west"] = dict(DR_WEST)
        (target / "clusters.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return target
