"""benchmarks/gpu_check.py on a machine without GPUs: it says there is nothing to check and exits 0
(the GPU run itself needs two CUDA devices)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def test_without_two_gpus_it_says_so_and_exits_0():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no device visible, even where there are some
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "0 CUDA device(s) visible here, 2 needed: nothing to check on this machine" in done.stdout
