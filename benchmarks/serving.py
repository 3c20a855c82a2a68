"""Requests/s and p50/p99 of the model server under load, against the threaded server it replaced.

Trains the digits model briefly (as the tests do), writes it as a bundle, then starts on 127.0.0.1:

- the model server, ``python -m hybridflow.serving.server`` in its own environment
  (``hybridflow.serving.runtime.serve_python()``) with the ``serving.server`` settings of
  ``config/pipeline.yaml`` as flags (dynamic batching: ``max_batch_size``, ``max_batch_wait_ms``);
- the old one, ``benchmarks/threaded_server.py`` (a thread per connection, one forward pass per
  request) with this interpreter;

and loads each in turn with the same load generator at each concurrency, printing a table and the
ratios, once per load generator:

- locust, as the deploy's gate runs it (``hybridflow.serving.loadtest.load_test``: single-row
  requests back to back);
- wrk (Debian's ``wrk``, C on epoll) with ``benchmarks/wrk_predict.lua``, the same requests. Why a
  second one: locust's Python client takes about a core at 2,000 requests/s, and on a 2-CPU machine
  that core is the server's, so at 64 users locust measures itself as much as the server; wrk takes
  a small share of a core at the same rate.

    .venv/bin/python benchmarks/serving.py [--concurrency 1 8 64] [--duration 10] [--load locust wrk]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
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


def _wrk(url: str, bodies: Path, users: int, duration_s: float):
    """One wrk run of ``users`` connections for ``duration_s`` (whole seconds), as Figures."""
    from hybridflow.serving.loadtest import Figures

    out = subprocess.run(["wrk", "-t1", f"-c{users}", f"-d{max(1, round(duration_s))}s", "--timeout", "10s",
                          "-s", str(REPO / "benchmarks" / "wrk_predict.lua"), url], capture_output=True, text=True,
                         env={**os.environ, "WRK_BODIES": str(bodies)}, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    n = got["requests"]
    return Figures(requests=n, failures=got["errors"], error_rate=got["errors"] / n if n else 1.0,
                   rps=n / (got["duration_us"] / 1e6), p50_ms=got["p50_us"] / 1000, p99_ms=got["p99_us"] / 1000)


def _row(users: int, name: str, figs) -> str:
    return (f"{users:>6} {name:<5}{figs.requests:>9}{figs.rps:>10.1f}{figs.p50_ms:>9.2f}{figs.p99_ms:>9.2f}"
            f"{figs.error_rate * 100:>8.2f}")


def _measure(load: str, ports: dict[str, int], rows: list, bodies: Path, args) -> None:
    from hybridflow.serving.loadtest import load_test

    print(f"\nload: {load}, single-row requests back to back, {args.duration:g} s per server and concurrency")
    print(f"{'users':>6} {'server':<5}{'requests':>9}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'err %':>8}")
    ratios = []
    for users in args.concurrency:
        figs = {}
        for name in ("old", "new"):
            url = f"http://127.0.0.1:{ports[name]}"
            figs[name] = (load_test(url, ENDPOINT, rows, concurrency=users, duration_s=args.duration)["all"]
                          if load == "locust" else
                          _wrk(f"{url}/v1/models/{ENDPOINT}:predict", bodies, users, args.duration))
            print(_row(users, name, figs[name]), flush=True)
        old, new = figs["old"], figs["new"]
        ratios.append((users, new.rps / old.rps if old.rps else float("inf"),
                       new.p99_ms / old.p99_ms if old.p99_ms else float("inf")))
    print(f"{'users':>6}  new/old req/s   new/old p99   ({load})")
    for users, rps, p99 in ratios:
        print(f"{users:>6}{rps:>15.2f}x{p99:>13.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64], help="concurrent clients")
    parser.add_argument("--duration", type=float, default=10, help="seconds of load per server and concurrency")
    parser.add_argument("--load", nargs="+", choices=["locust", "wrk"], default=["locust", "wrk"],
                        help="load generators, each over every server and concurrency")
    args = parser.parse_args()
    if "wrk" in args.load and not shutil.which("wrk"):
        parser.error("wrk is not installed: apt-get install wrk (or --load locust)")

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
            bodies = tmp / "bodies.jsonl"
            bodies.write_text("".join(json.dumps({"instances": [row]}) + "\n" for row in rows))
            for load in args.load:
                _measure(load, ports, rows, bodies, args)
        finally:
            for proc in procs.values():
                stop_child(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
