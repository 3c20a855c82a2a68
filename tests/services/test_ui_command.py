"""``hybridflow ui`` as the README has a user start it: from a shell where the virtualenv is neither
activated nor on PATH. It must bring up Airflow standalone (api-server, scheduler, dag-processor,
triggerer) on the embedded default, so every component reports healthy on the api-server's health
endpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import requests
from tests.services.airflow_stack import BIN, REPO, free_port, wait_for

pytestmark = [pytest.mark.services]

COMPONENTS = ("metadatabase", "scheduler", "dag_processor", "triggerer")
# A component that cannot be started leaves its traceback in the output: stop waiting at once.
FAILED_START = ("FileNotFoundError", "Traceback (most recent call last)")


def _health(url: str) -> dict | None:
    try:
        r = requests.get(f"{url}/api/v2/monitor/health", timeout=5)
    except requests.RequestException:
        return None
    return r.json() if r.status_code == 200 else None


def _stop_group(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM to the process group the command leads, SIGKILL to what is left after ``grace``."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:  # children that outlived the leader (uvicorn workers, executor processes)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=grace)


def test_ui_starts_every_component_without_the_virtualenv_on_path(tmp_path: Path) -> None:
    from hybridflow.devenv.stack import DevStack
    from hybridflow.settings import Settings

    home, port = tmp_path / "hf-home", free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        "PATH": "/usr/bin:/bin",  # no virtualenv: what a new shell has
        "HOME": str(tmp_path),
        "LANG": "C.UTF-8",
        "HYBRIDFLOW_HOME": str(home),  # AIRFLOW_HOME and the SQLite metadata go under it
        "HYBRIDFLOW_CONFIG_DIR": str(REPO / "config"),
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__WORKERS": "1",
    }
    log_path = tmp_path / "hybridflow-ui.log"
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(BIN / "hybridflow"), "ui"], env=env, cwd=tmp_path, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def output() -> str:
        return log_path.read_text(errors="replace")

    def all_healthy() -> dict | None:
        if proc.poll() is not None:
            raise AssertionError(f"hybridflow ui exited with {proc.returncode}:\n{output()[-4000:]}")
        text = output()
        if any(marker in text for marker in FAILED_START):
            raise AssertionError(f"an Airflow component failed to start:\n{text[-4000:]}")
        health = _health(url)
        if health and all((health.get(c) or {}).get("status") == "healthy" for c in COMPONENTS):
            return health
        return None

    try:
        wait_for(f"every component healthy on {url}", all_healthy, timeout=240, interval=1.0,
                 diagnose=lambda: f"health: {_health(url)}\n{output()[-4000:]}")
        print(f"\nhybridflow ui healthy after {time.monotonic() - started:.1f} s")
        assert f"Airflow UI on {url}" in output()
    finally:
        _stop_group(proc)
        DevStack(Settings(home=home, config_dir=REPO / "config")).down()  # its object stores, by recorded pid
