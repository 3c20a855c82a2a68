"""What the local deploy target's processes inherit: a model server or the gateway gets the allow-list of
:func:`hybridflow.serving.processes.child_env`, never the secrets of the Airflow task that starts it."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from tests.support.serving import stop_process

import hybridflow
from hybridflow.serving.processes import child_env, spawn

# What an Airflow task's environment holds and a process answering HTTP must not.
SECRETS = {
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql+psycopg2://airflow:hunter2@db:5432/airflow",
    "AIRFLOW__CORE__FERNET_KEY": "c2VjcmV0LWZlcm5ldC1rZXktZm9yLXRoZS10ZXN0cy0=",
    "AIRFLOW__API_AUTH__JWT_SECRET": "jwt-secret-of-the-api-server",
    "AIRFLOW_CONN_S3_PRIVATE": "aws://AKIAEXAMPLE:secret@/?region_name=eu-west-1",
    "AWS_SECRET_ACCESS_KEY": "aws-secret",
    "HYBRIDFLOW_WEBHOOK_TOKEN": "token",
}
# What a model server needs from it: where programs and libraries are, the locale, GPUs and threads.
NEEDED = {"PATH": os.environ["PATH"], "LC_ALL": "C.UTF-8", "CUDA_VISIBLE_DEVICES": "0", "OMP_NUM_THREADS": "2",
          "PYTHONPATH": "/opt/models"}


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.decode().split("=", 1) for item in raw.split(b"\0") if b"=" in item)


def test_child_env_passes_the_allow_list_and_none_of_the_task_secrets(monkeypatch):
    for name, value in {**SECRETS, **NEEDED}.items():
        monkeypatch.setenv(name, value)
    env = child_env()
    assert not SECRETS.keys() & env.keys(), sorted(SECRETS.keys() & env.keys())
    assert not [name for name in env if name.startswith(("AIRFLOW", "AWS_"))]
    assert {k: env[k] for k in ("PATH", "LC_ALL", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")} == \
        {k: NEEDED[k] for k in ("PATH", "LC_ALL", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")}
    # This package first, then the caller's own path (where a model's code may live).
    package_root = str(Path(hybridflow.__file__).resolve().parents[1])
    assert env["PYTHONPATH"] == f"{package_root}{os.pathsep}/opt/models" and env["PYTHONUNBUFFERED"] == "1"


def test_a_started_gateway_holds_none_of_the_task_secrets(tmp_path, monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = spawn(["hybridflow.serving.router", "--state-root", str(tmp_path), "--port", str(port)],
                 tmp_path / "router.log", tmp_path)
    try:
        deadline = time.monotonic() + 10
        while str(tmp_path).encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():  # until it has exec'd
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)
        environ = _environ(proc.pid)
    finally:
        stop_process(proc)
    assert not SECRETS.keys() & environ.keys(), sorted(SECRETS.keys() & environ.keys())
    assert environ["PATH"] == os.environ["PATH"]
