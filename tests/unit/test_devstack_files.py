"""The embedded default's secrets on disk: the cache keys and the env file are private from the
moment they exist (created 0600, never written first and chmod-ed after)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from hybridflow.devenv import stack
from hybridflow.devenv.stack import DevStack, write_file
from hybridflow.settings import REPO_ROOT, Settings


def test_credentials_are_created_private_whatever_the_umask(tmp_path: Path, monkeypatch) -> None:
    created: list[tuple[str, int]] = []
    real_open = os.open

    def spy(path, flags, mode=0o777, *args, **kwargs):
        if flags & os.O_CREAT:
            created.append((str(path), mode))
        return real_open(path, flags, mode, *args, **kwargs)

    monkeypatch.setattr(stack.os, "open", spy)
    old = os.umask(0)  # the most permissive umask a shell might have
    try:
        access, secret = DevStack(Settings(home=tmp_path, config_dir=REPO_ROOT / "config"))._credentials("c1")
    finally:
        os.umask(old)
    path = next(tmp_path.rglob("credentials.json"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and secret in path.read_text()
    assert created and all(mode == 0o600 for _, mode in created)  # never a moment with other modes


def test_write_file_replaces_atomically_and_keeps_the_mode(tmp_path: Path) -> None:
    target = tmp_path / "dev" / "airflow.env"
    write_file(target, "export A=1\n", 0o600)
    write_file(target, "export A=2\n", 0o600)
    assert target.read_text() == "export A=2\n" and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert [p.name for p in target.parent.iterdir()] == ["airflow.env"]  # no temporary left behind


def test_compose_env_writes_a_private_env_file_once(tmp_path: Path) -> None:
    import subprocess

    target = tmp_path / ".env"
    env = {**os.environ, "COMPOSE_ENV_FILE": str(target)}
    subprocess.run([str(REPO_ROOT / "scripts" / "compose-env")], check=True, env=env, capture_output=True)
    first = target.read_text()
    assert stat.S_IMODE(target.stat().st_mode) == 0o600 and "POSTGRES_PASSWORD=" in first
    again = subprocess.run([str(REPO_ROOT / "scripts" / "compose-env")], check=True, env=env, capture_output=True,
                           text=True)
    assert target.read_text() == first and "keeping its secrets" in again.stderr  # never silently replaced
