"""Test-wide setup. Airflow reads its configuration when first imported, so the isolated
AIRFLOW_HOME and metadata database are set here, before any test module imports Airflow."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# This file may be imported twice in one process (as pytest's conftest, and as tests.conftest by a
# test that imports a helper from it): the second import must not point Airflow at another database.
_MARK = "HYBRIDFLOW_TEST_AIRFLOW_HOME"
if os.environ.get(_MARK, "").startswith(f"{os.getpid()}:"):
    _AIRFLOW_HOME = Path(os.environ[_MARK].split(":", 1)[1])
else:
    _AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="hf-airflow-home-"))
    os.environ[_MARK] = f"{os.getpid()}:{_AIRFLOW_HOME}"
os.environ["AIRFLOW_HOME"] = str(_AIRFLOW_HOME)
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(REPO / "dags")
os.environ["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(REPO / "plugins")
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__CORE__UNIT_TEST_MODE"] = "False"
os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = os.environ.get(
    "HYBRIDFLOW_TEST_SQL_CONN", f"sqlite:///{_AIRFLOW_HOME / 'airflow.db'}"
)
os.environ.setdefault("HYBRIDFLOW_CONFIG_DIR", str(REPO / "config"))

# In CI (CI=true) a skip fails the run: a missing service or binary must not make it green. A test
# that may skip there goes on this list, by node id, with a comment saying why.
SKIPS_ALLOWED_IN_CI: dict[str, str] = {}


_CI_SKIPS: list = []


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")


def pytest_runtest_logreport(report) -> None:
    if _in_ci() and report.skipped and not hasattr(report, "wasxfail") and report.nodeid not in SKIPS_ALLOWED_IN_CI:
        _CI_SKIPS.append(report)


pytest_collectreport = pytest_runtest_logreport  # a module skipped at import counts too


def pytest_sessionfinish(session, exitstatus) -> None:
    if _CI_SKIPS and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not _CI_SKIPS:
        return
    terminalreporter.section("skips are failures in CI", sep="=", red=True, bold=True)
    for report in _CI_SKIPS:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        terminalreporter.line(f"{report.nodeid or report.fspath}: {reason}")
    terminalreporter.line("install or start what they need (.ci/run does), or allow the skip in tests/conftest.py "
                          "SKIPS_ALLOWED_IN_CI with the reason")


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
