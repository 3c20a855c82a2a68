"""Requests/s and p50/p99 of the model server under load, against the threaded server it replaced.

Trains the digits model briefly (as the tests do), writes it as a bundle, then starts on 127.0.0.1:

- the model server, ``python -m hybridflow.serving.server`` in its own environment
  (``hybridflow.serving.runtime.serve_python()``) with the ``serving.server`` settings of
  ``config/pipeline.yaml`` as flags (dynamic batching: ``max_batch_size``, ``max_batch_wait_ms``);
- the old one, ``benchmarks/threaded_server.py`` (a thread per connection, one forward pass per
  request) with this interpreter;

and loads each in turn with the same load generator (``hybridflow.serving.loadtest.load_test``:
locust, single-row requests back to back) at each concurrency, printing a table and the ratios.

    .venv/bin/python benchmarks/serving.py [--concurrency 1 8 64] [--duration 10]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "include")]

ENDPOINT = "digits"


def _machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return f"{os.cpu_count()} CPUs ({cpu}), {platform.system()} {platform.release()}, Python {platform.python_version()}"


def _bundle(root: Path) -> tuple[Path, list[list[int]]]:
    """The digits model trained briefly, as a bundle, and held-out rows to send (whole pixel values)."""
    from tests.support import bundles
    from tests.support.serving import INT_DIGITS

    data = bundles.seed("digits-mlp", root / "data")
    module = bundles.train("digits-mlp", data)
    folder = bundles.make_bundle(root / "bundle", "digits-mlp", module, version="bench", signature=INT_DIGITS)
    x, _ = data.xy("test", 256)
    return folder, x.astype(int).tolist()


def _start(cmd: list[str], ready: Path, log: Path, timeout_s: float = 120) -> tuple[subprocess.Popen, int]:
    from hybridflow.serving.processes import stop_child

    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready.exists():
            return proc, json.loads(ready.read_text())["port"]
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    stop_child(proc)
    raise SystemExit(f"{cmd[0]} {' '.join(cmd[1:4])} did not become ready; its log:\n{log.read_text()[-3000:]}")


def _servers(bundle: Path, tmp: Path) -> dict[str, list[str]]:
    from hybridflow.config import load_estate
    from hybridflow.serving.runtime import serve_python, server_args

    settings = load_estate(REPO / "config").pipeline.serving.server
    common = ["--bundle", str(bundle), "--endpoint", ENDPOINT, "--port", "0"]
    return {
        "new": [serve_python(), "-m", "hybridflow.serving.server", *common, "--version", "new",
                "--ready-file", str(tmp / "new.ready"), *server_args(settings)],
        "old": [sys.executable, str(REPO / "benchmarks" / "threaded_server.py"), *common, "--version", "old",
                "--ready-file", str(tmp / "old.ready")],
    }


def _row(users: int, name: str, figs) -> str:
    return (f"{users:>6} {name:<5}{figs.requests:>9}{figs.rps:>10.1f}{figs.p50_ms:>9.2f}{figs.p99_ms:>9.2f}"
            f"{figs.error_rate * 100:>8.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64], help="locust users")
    parser.add_argument("--duration", type=float, default=10, help="seconds of load per server and concurrency")
    args = parser.parse_args()

    from hybridflow.serving.loadtest import load_test
    from hybridflow.serving.processes import stop_child

    with tempfile.TemporaryDirectory(prefix="hf-bench-serving-") as tmp_name:
        tmp = Path(tmp_name)
        bundle, rows = _bundle(tmp)
        procs = {}
        try:
            ports = {}
            for name, cmd in _servers(bundle, tmp).items():
                procs[name], ports[name] = _start(cmd, tmp / f"{name}.ready", tmp / f"{name}.log")
            print(f"machine: {_machine()}")
            print(f"load: locust, single-row requests back to back, {args.duration:g} s per server and concurrency")
            print(f"{'users':>6} {'server':<5}{'requests':>9}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'err %':>8}")
            ratios = []
            for users in args.concurrency:
                figs = {}
                for name in ("old", "new"):
                    result = load_test(f"http://127.0.0.1:{ports[name]}", ENDPOINT, rows, concurrency=users,
                                       duration_s=args.duration)
                    figs[name] = result["all"]
                    print(_row(users, name, figs[name]), flush=True)
                old, new = figs["old"], figs["new"]
                ratios.append((users, new.rps / old.rps if old.rps else float("inf"),
                               new.p99_ms / old.p99_ms if old.p99_ms else float("inf")))
            print(f"{'users':>6}  new/old req/s   new/old p99")
            for users, rps, p99 in ratios:
                print(f"{users:>6}{rps:>15.2f}x{p99:>13.2f}x")
        finally:
            for proc in procs.values():
                stop_child(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
