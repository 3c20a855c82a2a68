"""Test-wide setup. Airflow reads its configuration when first imported, so the isolated
AIRFLOW_HOME and metadata database are set here, before any test module imports Airflow."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="hf-airflow-home-"))
os.environ["AIRFLOW_HOME"] = str(_AIRFLOW_HOME)
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(REPO / "dags")
os.environ["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(REPO / "plugins")
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__CORE__UNIT_TEST_MODE"] = "False"
os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = os.environ.get(
    "HYBRIDFLOW_TEST_SQL_CONN", f"sqlite:///{_AIRFLOW_HOME / 'airflow.db'}"
)
os.environ.setdefault("HYBRIDFLOW_CONFIG_DIR", str(REPO / "config"))


@pytest.fixture(scope="session")
def rclone_s3(tmp_path_factory):
    """A real S3 endpoint for the whole session: ``rclone serve s3`` on loopback.

    Yields (endpoint_url, access_key, secret_key, data_dir); buckets are folders of data_dir.
    """
    from hybridflow.devenv.rclone import RcloneS3Server

    data_dir = tmp_path_factory.mktemp("rclone-s3-data")
    access, secret = "hf-test-access-key", "hf-test-secret-key-0123"
    server = RcloneS3Server(data_dir, access, secret, log_path=data_dir.parent / "rclone-s3.log")
    with server:
        yield server.endpoint_url, access, secret, data_dir


@pytest.fixture(scope="session")
def seeded_private(tmp_path_factory) -> Path:
    """Private storage holding the catalogue's example datasets, seeded once per test session.
    Read it in place, or copy it (``copy_seeded``) where a test writes."""
    from hybridflow.config import load_estate
    from hybridflow.datasets import seed

    root = tmp_path_factory.mktemp("seeded") / "private"
    for entry in load_estate(REPO / "config").datasets.datasets.values():
        seed(entry, root)
    return root


def copy_seeded(seeded: Path, private_root: Path) -> Path:
    import shutil

    shutil.copytree(seeded, private_root, dirs_exist_ok=True)
    return private_root
