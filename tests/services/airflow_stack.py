"""Real Airflow 3 services for the tests: api-server, scheduler, dag-processor and triggerer (and a
Celery worker under the CeleryExecutor) against their own PostgreSQL database, in a temporary
AIRFLOW_HOME, on loopback ports, with the embedded default's object stores (DevStack).

Every process is started here, in its own process group, and stopped by :meth:`AirflowStack.stop`
(SIGTERM to the group, SIGKILL after a grace period); the database is dropped at the end.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests
from tests.support.deploy_settings import quick_serving

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PG = {"host": "127.0.0.1", "port": 5432, "user": "postgres"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def config_copy(root: Path) -> Path:
    """The shipped config under ``root``, with a free serving port (the endpoint binds it) and the quick
    gate and canary of tests.support.deploy_settings."""
    import yaml

    config = root / "config"
    shutil.copytree(REPO / "config", config)
    pipeline = yaml.safe_load((config / "pipeline.yaml").read_text())
    pipeline["serving"]["port"] = free_port()
    quick_serving(pipeline)  # short gate and canary windows: each deploy measures for seconds
    (config / "pipeline.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    return config


def _pg_admin(sql: str) -> None:
    import psycopg2

    conn = psycopg2.connect(dbname="postgres", **PG)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(sql)
    finally:
        conn.close()


def wait_for(what: str, check: Callable[[], Any], timeout: float, interval: float = 1.0,
             diagnose: Callable[[], str] | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}"
                                 + (f"\n{diagnose()}" if diagnose else ""))
        time.sleep(interval)


class AirflowStack:
    def __init__(self, root: Path, *, executor: str = "LocalExecutor", config_dir: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.root = root
        self.executor = executor
        self.home = root / "hf-home"
        self.config_dir = config_dir or REPO / "config"
        self.airflow_home = root / "airflow"
        self.logs = root / "service-logs"
        self.db = f"hf_services_{secrets.token_hex(4)}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.password = secrets.token_urlsafe(12)
        self.extra_env = dict(env or {})
        self.procs: dict[str, subprocess.Popen] = {}
        self.env: dict[str, str] = {}
        self._token: str | None = None
        self._db_created = False
        self._devstack = None

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self, timeout: float = 240) -> AirflowStack:
        from hybridflow.devenv.stack import DevStack
        from hybridflow.settings import Settings

        self.logs.mkdir(parents=True, exist_ok=True)
        self.airflow_home.mkdir(parents=True, exist_ok=True)
        _pg_admin(f'CREATE DATABASE "{self.db}"')
        self._db_created = True
        sql = f"postgresql+psycopg2://{PG['user']}@{PG['host']}:{PG['port']}/{self.db}"
        self._devstack = DevStack(Settings(home=self.home, config_dir=self.config_dir))
        passwords = self.airflow_home / "passwords.json"
        passwords.write_text(json.dumps({"admin": self.password}))
        # The embedded default's rclone caches and AIRFLOW_CONN_*, as `hybridflow dev up` makes them.
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "HYBRIDFLOW"))},
                    **self._devstack.up()}
        self.env.update({
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": sql,
            "AIRFLOW__CORE__EXECUTOR": self.executor,
            "AIRFLOW__CORE__PARALLELISM": "4",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__BASE_URL": self.url,
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            # One secret for every process: the api-server must accept the tokens workers get.
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(32),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "0.5",
            "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(self.airflow_home / "logs"),
            "PYTHONUNBUFFERED": "1",
        })
        if self.executor == "CeleryExecutor":
            db = 1 + int(self.db[-4:], 16) % 15  # its own Redis database: queues of other runs stay apart
            self.env.update({
                "AIRFLOW__CELERY__BROKER_URL": f"redis://127.0.0.1:6379/{db}",
                "AIRFLOW__CELERY__RESULT_BACKEND": f"db+postgresql+psycopg2://{PG['user']}@{PG['host']}:{PG['port']}/{self.db}",
                "AIRFLOW__CELERY__WORKER_CONCURRENCY": "4",
            })
        self.env.update(self.extra_env)
        self._run(["db", "migrate"], "db-migrate", timeout=300)
        self._spawn("api-server", ["api-server", "--host", "127.0.0.1", "--port", str(self.port)])
        for name in ("scheduler", "dag-processor", "triggerer"):
            self._spawn(name, [name])
        if self.executor == "CeleryExecutor":
            self._spawn("celery-worker", ["celery", "worker", "--concurrency", "4"])
        wait_for("the api-server's health endpoint", self._healthy, timeout, diagnose=self.tail_logs)
        return self

    def _run(self, args: list[str], name: str, timeout: float) -> None:
        with open(self.logs / f"{name}.log", "wb") as log:
            done = subprocess.run([str(BIN / "airflow"), *args], env=self.env, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=timeout)
        if done.returncode != 0:
            raise AssertionError(f"airflow {' '.join(args)} failed:\n{self.tail_logs(name)}")

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it
        self.procs[name] = subprocess.Popen([str(BIN / "airflow"), *args], env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def _healthy(self) -> bool:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"airflow {name} exited with {proc.returncode}:\n{self.tail_logs(name)}")
        try:
            return requests.get(f"{self.url}/api/v2/monitor/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 30
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:  # what is left of the group (task processes, gunicorn/uvicorn workers)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        if self._devstack is not None:
            self._devstack.down()
        if self._db_created:
            _pg_admin(f'DROP DATABASE IF EXISTS "{self.db}" WITH (FORCE)')

    def __enter__(self) -> AirflowStack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def tail_logs(self, *names: str, lines: int = 40) -> str:
        out = []
        for path in sorted(self.logs.glob("*.log")):
            if names and path.stem not in names:
                continue
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"== {path.name}\n" + "\n".join(text))
        return "\n".join(out)

    # --- REST API ---------------------------------------------------------------------------------

    def token(self) -> str:
        if self._token is None:
            r = requests.post(f"{self.url}/auth/token", json={"username": "admin", "password": self.password},
                              timeout=30)
            r.raise_for_status()
            self._token = r.json()["access_token"]
        return self._token

    def api(self, method: str, path: str, **kw) -> Any:
        r = requests.request(method, f"{self.url}/api/v2{path}", headers={"Authorization": f"Bearer {self.token()}"},
                             timeout=60, **kw)
        if r.status_code >= 400:
            raise AssertionError(f"{method} {path} -> {r.status_code}: {r.text[:2000]}")
        return r.json() if r.content else None

    def wait_for_dag(self, dag_id: str, timeout: float = 180) -> dict:
        def parsed():
            r = requests.get(f"{self.url}/api/v2/dags/{dag_id}", headers={"Authorization": f"Bearer {self.token()}"},
                             timeout=30)
            return r.json() if r.status_code == 200 else None

        return wait_for(f"DAG {dag_id} to be parsed", parsed, timeout, diagnose=lambda: self.tail_logs("dag-processor"))

    def unpause(self, dag_id: str) -> None:
        self.api("PATCH", f"/dags/{dag_id}", json={"is_paused": False})

    def trigger(self, dag_id: str, conf: dict | None = None, logical_date: str | None = None,
                run_id: str | None = None) -> str:
        body: dict[str, Any] = {"logical_date": logical_date, "conf": conf or {}}
        if run_id:
            body["dag_run_id"] = run_id
        return self.api("POST", f"/dags/{dag_id}/dagRuns", json=body)["dag_run_id"]

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str | None]:
        got = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances", params={"limit": 100})
        return {ti["task_id"] + (f"[{ti['map_index']}]" if ti.get("map_index", -1) >= 0 else ""): ti["state"]
                for ti in got["task_instances"]}

    def wait_for_run(self, dag_id: str, run_id: str, states: tuple[str, ...] = ("success", "failed"),
                     timeout: float = 900) -> str:
        def finished():
            state = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"]
            return state if state in states else None

        return wait_for(f"run {dag_id}/{run_id} to reach {states}", finished, timeout, interval=3,
                        diagnose=lambda: f"tasks: {self.task_states(dag_id, run_id)}\n{self.tail_logs()}")

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1) -> str:
        """The task try's log as text (the API serves structured log lines)."""
        got = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}",
                       params={"full_content": "true"})
        content = got.get("content") or []
        if isinstance(content, str):
            return content
        out = []
        for line in content:
            if not isinstance(line, dict):
                out.append(str(line))
                continue
            out.append(line.get("event", ""))
            out += [f"{e.get('exc_type')}: {e.get('exc_value')}" for e in line.get("error_detail") or []]
        return "\n".join(out)

    def clear(self, dag_id: str, run_id: str, task_ids: list[str]) -> list[dict]:
        got = self.api("POST", f"/dags/{dag_id}/clearTaskInstances", json={
            "dry_run": False, "dag_run_id": run_id, "task_ids": task_ids, "only_failed": False,
            "reset_dag_runs": True, "include_downstream": True})
        return got.get("task_instances", [])


def services_available(*, redis: bool = False) -> str | None:
    """Why the service tests cannot run here (PostgreSQL, and Redis for Celery), or None."""
    try:
        import psycopg2

        psycopg2.connect(dbname="postgres", connect_timeout=3, **PG).close()
    except Exception as exc:  # noqa: BLE001
        return f"PostgreSQL on 127.0.0.1:5432 is not reachable: {exc}"
    if redis:
        try:
            socket.create_connection(("127.0.0.1", 6379), timeout=3).close()
        except OSError as exc:
            return f"Redis on 127.0.0.1:6379 is not reachable: {exc}"
    if shutil.which("airflow", path=str(BIN)) is None:
        return "the airflow command is not installed next to this Python"
    return None
