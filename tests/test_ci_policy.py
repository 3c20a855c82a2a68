"""In CI a skip is a failure: a missing service or binary cannot make the run green."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    probe = tmp_path / "test_probe.py"
    probe.write_text("import pytest\n\ndef test_needs_redis():\n    pytest.skip('redis is not answering')\n\n"
                     "def test_fine():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           "--rootdir", str(tmp_path), str(probe)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_skip_fails_the_run_in_ci_and_names_the_reason(tmp_path: Path) -> None:
    out = _run(tmp_path, "true")
    assert out.returncode == 1, out.stdout
    assert "skips are failures in CI" in out.stdout and "redis is not answering" in out.stdout


def test_outside_ci_a_skip_is_only_reported(tmp_path: Path) -> None:
    out = _run(tmp_path, None)
    assert out.returncode == 0 and "1 skipped" in out.stdout, out.stdout
