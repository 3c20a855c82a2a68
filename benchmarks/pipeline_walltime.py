"""Wall time of the training pipeline end to end and of each task, on the embedded default.

Runs ``hybridflow demo`` in a fresh home (its own object stores, endpoint port and SQLite
metadata), then reads every task's start and end from Airflow's metadata and each step's own work
time from the run record, and prints both with their ratio: the time Airflow adds around a step.

    .venv/bin/python benchmarks/pipeline_walltime.py [--conf '{"model": "breast-cancer"}']
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--conf", default="{}", help="trigger Params as JSON")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="hf-bench-"))
    config = home / "config"
    shutil.copytree(REPO / "config", config)
    pipeline = yaml.safe_load((config / "pipeline.yaml").read_text())
    pipeline["serving"]["port"] = _free_port()
    (config / "pipeline.yaml").write_text(yaml.safe_dump(pipeline))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(HYBRIDFLOW_HOME=str(home / "var"), HYBRIDFLOW_CONFIG_DIR=str(config))
    try:
        started = time.monotonic()
        demo = subprocess.run(
            [BIN / "hybridflow", "demo", "--quiet", "--conf", args.conf], env=env, capture_output=True, text=True
        )
        wall = time.monotonic() - started
        if demo.returncode != 0:
            print(demo.stdout[-3000:], demo.stderr[-3000:], file=sys.stderr)
            return 1
        record = json.loads(next((home / "var" / "private" / "records").glob("*/*.json")).read_text())
        airflow_env = dict(env)
        for line in (home / "var" / "dev" / "airflow.env").read_text().splitlines():
            key, _, value = line.removeprefix("export ").partition("=")
            airflow_env[key] = shlex.split(value)[0]
        states = subprocess.run(
            [BIN / "airflow", "tasks", "states-for-dag-run", "hybrid_training", record["run_id"], "-o", "json"],
            env=airflow_env, capture_output=True, text=True, check=True,
        )
        tasks = json.loads(states.stdout[states.stdout.index("[") :])
        print(f"hybrid_training on the embedded default, Params {args.conf}")
        metric = record["metric"]
        print(f"model {record['model']}, placement {record['cluster']}, {record['workers']} workers, "
              f"held-out {metric['name']} {metric['value']:.4f}")
        print(f"{'task':<16}{'task wall s':>12}{'step work s':>13}{'wall/work':>11}")
        total_tasks = 0.0
        for ti in tasks:
            t0 = datetime.fromisoformat(ti["start_date"])
            t1 = datetime.fromisoformat(ti["end_date"])
            task_wall = (t1 - t0).total_seconds()
            total_tasks += task_wall
            work = record["durations_s"].get(ti["task_id"])
            ratio = f"{task_wall / work:>10.2f}x" if work else f"{'-':>11}"
            print(f"{ti['task_id']:<16}{task_wall:>12.2f}{(work if work is not None else float('nan')):>13.2f}{ratio}")
        print(f"{'sum of tasks':<16}{total_tasks:>12.2f}")
        print(f"end to end (hybridflow demo, incl. setup and `airflow dags test` start): {wall:.1f} s")
        return 0
    finally:
        subprocess.run([BIN / "hybridflow", "dev", "down"], env=env, capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
