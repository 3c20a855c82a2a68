"""Where the platform keeps its files on this machine.

Everything is derived from two environment variables so that DAGs, worker processes and tests agree
without sharing Python state:

- ``HYBRIDFLOW_HOME``: the data root (private storage, local cluster state, serving state).
- ``HYBRIDFLOW_CONFIG_DIR``: the estate description (``clusters.yaml``, ``projects.yaml``, ...).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Settings:
    home: Path
    config_dir: Path

    @property
    def private_root(self) -> Path:
        """Private (on-prem) storage: an NFS-style folder that sensitive data never leaves."""
        return self.home / "private"

    @property
    def state_dir(self) -> Path:
        """Local cluster backend and serving state (slot pools, job records, endpoints)."""
        return self.home / "state"

    @property
    def clouds_dir(self) -> Path:
        """Folders served as S3 by the embedded object stores, one per endpoint."""
        return self.home / "clouds"


def get_settings() -> Settings:
    home = Path(os.environ.get("HYBRIDFLOW_HOME", REPO_ROOT / "var")).resolve()
    config_dir = Path(os.environ.get("HYBRIDFLOW_CONFIG_DIR", REPO_ROOT / "config")).resolve()
    return Settings(home=home, config_dir=config_dir)
