"""The embedded default: everything the pipeline needs on one machine, no cloud, no Kubernetes.

- private storage: a folder (``$HYBRIDFLOW_HOME/private``), seeded with the catalogue's example datasets;
- each public cluster's cloud cache: ``rclone serve s3`` on 127.0.0.1 over a folder;
- Airflow: SQLite metadata in ``$HYBRIDFLOW_HOME/airflow``; connections as ``AIRFLOW_CONN_*``.

``up()`` is idempotent: servers still answering are reused, keys are made once per home and kept
in a 0600 file (the dev stand-in for a secrets backend), so a second ``up()`` changes nothing.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
from dataclasses import dataclass
from pathlib import Path

from hybridflow.settings import REPO_ROOT, Settings, get_settings


@dataclass
class DevStack:
    settings: Settings

    @classmethod
    def default(cls) -> DevStack:
        return cls(get_settings())

    @property
    def dev_dir(self) -> Path:
        return self.settings.home / "dev"

    @property
    def env_file(self) -> Path:
        return self.dev_dir / "airflow.env"

    @property
    def airflow_home(self) -> Path:
        return self.settings.home / "airflow"

    def _services_path(self) -> Path:
        return self.dev_dir / "services.json"

    def _load(self, path: Path) -> dict:
        return json.loads(path.read_text()) if path.is_file() else {}

    def _save(self, path: Path, data: dict, mode: int = 0o644) -> None:
        write_file(path, json.dumps(data, indent=2), mode)

    def _credentials(self, cluster: str) -> tuple[str, str]:
        path = self.dev_dir / "credentials.json"
        creds = self._load(path)
        if cluster not in creds:
            creds[cluster] = {"access_key": f"hf{secrets.token_hex(8)}", "secret_key": secrets.token_hex(20)}
            self._save(path, creds, mode=0o600)
        return creds[cluster]["access_key"], creds[cluster]["secret_key"]

    def up(self) -> dict[str, str]:
        from hybridflow.config import load_estate
        from hybridflow.datasets import seed
        from hybridflow.devenv.rclone import RcloneS3Server, airflow_conn_uri

        estate = load_estate(self.settings.config_dir)
        for entry in estate.datasets.datasets.values():
            if entry.seed and not entry.location.startswith("s3://"):
                seed(entry, self.settings.private_root, estate.file_roots(self.settings.home))
        services = self._load(self._services_path())
        env = self.base_env()
        for name, cluster in estate.clusters.items():
            if cluster.cache is None:
                continue
            access, secret = self._credentials(name)
            data_dir = self.settings.clouds_dir / name
            (data_dir / cluster.cache.bucket).mkdir(parents=True, exist_ok=True)
            known = services.get(name)
            if not (known and _is_our_rclone(known["pid"]) and _answers(known["port"])):
                server = RcloneS3Server(
                    data_dir, access, secret, port=known["port"] if known else None,
                    log_path=self.dev_dir / f"rclone-{name}.log",
                )
                server.start()
                known = {"pid": server.pid, "port": server.port, "data_dir": str(data_dir)}
                services[name] = known
            endpoint = f"http://127.0.0.1:{known['port']}"
            env[f"AIRFLOW_CONN_{cluster.cache.conn_id.upper()}"] = airflow_conn_uri(access, secret, endpoint)
        self._save(self._services_path(), services)
        lines = [f"export {k}={_shell_quote(v)}" for k, v in sorted(env.items())]
        write_file(self.env_file, "\n".join(lines) + "\n", 0o600)  # it holds the cache keys
        return env

    def base_env(self) -> dict[str, str]:
        return {
            "HYBRIDFLOW_HOME": str(self.settings.home),
            "HYBRIDFLOW_CONFIG_DIR": str(self.settings.config_dir),
            "AIRFLOW_HOME": str(self.airflow_home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO_ROOT / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO_ROOT / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": os.environ.get(
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", f"sqlite:///{self.airflow_home / 'airflow.db'}"
            ),
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": os.environ.get("AIRFLOW__API__PORT", "8080"),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        }

    def down(self) -> list[str]:
        """Stop what ``up()`` and deployments started here (by recorded pid, ours only)."""
        from hybridflow.serving.deploy import stop_gateway

        stopped = []
        gone = stop_gateway(self.settings.state_dir / "serving")
        stopped.append(f"model gateway and endpoints {', '.join(gone.get('endpoints', [])) or '(none)'}")
        services = self._load(self._services_path())
        for name, svc in services.items():
            if _is_our_rclone(svc["pid"]):
                os.kill(svc["pid"], signal.SIGTERM)
                stopped.append(f"rclone for {name} (pid {svc['pid']})")
        self._save(self._services_path(), {})
        return stopped


def _is_our_rclone(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return len(cmdline) > 2 and cmdline[0].endswith(b"rclone") and cmdline[1:3] == [b"serve", b"s3"]


def _answers(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _shell_quote(value: str) -> str:
    import shlex

    return shlex.quote(value)


def write_file(path: Path, text: str, mode: int) -> None:
    """Write ``text`` to ``path`` atomically, the file created with ``mode`` from the start: a
    secret is never readable by others, not even between a write and a chmod."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)  # os.open applies the umask; the file gets exactly ``mode``
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)
