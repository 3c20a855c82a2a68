"""Training throughput with background checkpoints every interval against none, on real workers.

Starts ``rclone serve s3`` on 127.0.0.1 in a temp folder and runs the training worker (world size 1,
one intra-op thread) with the registered ``digits-mlp`` example model (its training function, through
the training contract) twice per round: once without periodic checkpoints and once checkpointing
every ``--every`` steps to the S3 endpoint (primary) and a local folder (the replica), as a public
cluster does. Steps/s is measured over the training loop only (the worker's ``loop_steps`` and
``loop_seconds``, between the first and the last ``ctx.log``: no interpreter start, no data loading,
no final checkpoint). Rounds alternate the order of the two runs so drift on a shared machine hits both.

    .venv/bin/python benchmarks/checkpoint_overhead.py [--hidden 4096] [--every 100] [--intervals 20] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "include"))

from hybridflow.config import load_estate  # noqa: E402
from hybridflow.datasets import list_relative, locate, pin_version, seed, sha256_of, split_files  # noqa: E402
from hybridflow.devenv.rclone import RcloneS3Server  # noqa: E402
from hybridflow.storage.objectstore import ACCESS_KEY_ENV, SECRET_KEY_ENV, StoreSpec  # noqa: E402
from hybridflow.storage.s3 import S3ObjectStore  # noqa: E402

ACCESS, SECRET = "bench-access-key", "bench-secret-key-0123"
BUCKET = "checkpoint-bench"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_worker(work: Path, name: str, spec: dict, endpoint: str) -> dict:
    spec_path = work / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(str(REPO / d) for d in ("include", "examples")),
        "PYTHONUNBUFFERED": "1",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "GLOO_SOCKET_IFNAME": "lo",
        "HYBRIDFLOW_WORKER_THREADS": "1",
        ACCESS_KEY_ENV: ACCESS,
        SECRET_KEY_ENV: SECRET,
    }
    log_path = work / f"{name}.log"
    with open(log_path, "wb") as log:
        done = subprocess.run(
            [sys.executable, "-m", "hybridflow.training.worker", "--spec", str(spec_path)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=work,
        )
    if done.returncode != 0:
        raise SystemExit(f"{name}: worker exited {done.returncode}; see {log_path}")
    store = S3ObjectStore(
        BUCKET,
        prefix=spec["checkpoint_store"]["prefix"],
        endpoint_url=endpoint,
        access_key=ACCESS,
        secret_key=SECRET,
    )
    result = json.loads(store.get_bytes("result.json"))
    result["steps_per_s"] = result["loop_steps"] / result["loop_seconds"]
    return result


MODEL = "digits-mlp"


def seeded(work: Path) -> tuple[dict, dict, dict]:
    """The example model's dataset seeded and pinned as validate_data pins it: (model, dataset, data)."""
    from hybridflow.rundata import dataset_info

    estate = load_estate(REPO / "config")
    model = estate.models.get(MODEL)
    entry = estate.datasets.get(model.dataset)
    seed(entry, work / "private")
    location = locate(entry, work / "private")
    files = split_files(entry, list_relative(location))
    digests = {rel: sha256_of((location.path / rel).read_bytes()) for rels in files.values() for rel in rels}
    version = pin_version(entry.name, entry.effective_classification, location.uri, files, digests)
    (work / "version.json").write_bytes(version.to_json())
    data = {"kind": "local", "path": str(location.path), "version": str(work / "version.json")}
    return model, dataset_info(entry, version, entry.effective_classification), data


def run_pairs(args, work: Path, server: RcloneS3Server, base: dict, steps: int) -> dict[str, list[dict]]:
    """Runs without and with periodic checkpoints, alternating which goes first each round."""
    runs: dict[str, list[dict]] = {"without": [], "with": []}
    for r in range(args.rounds):
        order = ("without", "with") if r % 2 == 0 else ("with", "without")
        for kind in order:
            name = f"{kind}-{r}"
            spec = {
                **base,
                "run_key": name,
                "checkpoint_store": StoreSpec(
                    kind="s3", bucket=BUCKET, prefix=name, endpoint_url=server.endpoint_url
                ).to_dict(),
                # "without": only the final checkpoint after the loop, which the loop time excludes.
                "checkpoint_every_steps": args.every if kind == "with" else 10**9,
                "checkpoint_replica": StoreSpec(kind="local", root=str(work / "replica" / name)).to_dict(),
            }
            started, endpoint_cpu = time.monotonic(), cpu_seconds(server.pid)
            result = run_worker(work, name, spec, server.endpoint_url)
            result["endpoint_cpu_s"] = cpu_seconds(server.pid) - endpoint_cpu
            runs[kind].append(result)
            print(
                f"{name:10s} {result['steps_per_s']:7.2f} steps/s over {steps} steps "
                f"(loop {result['loop_seconds']:.1f}s, run {time.monotonic() - started:.1f}s, "
                f"load average {os.getloadavg()[0]:.2f})",
                flush=True,
            )
    return runs


def report(args, runs: dict[str, list[dict]], steps: int) -> None:
    """Throughput with and without checkpoints, time the training thread was blocked, background cost."""
    history = [h for res in runs["with"] for h in res["checkpoints"]["history"] if h["step"] < steps]
    blocked = [h["blocked_s"] for h in history]
    without = statistics.mean(r["steps_per_s"] for r in runs["without"])
    with_ckpt = statistics.mean(r["steps_per_s"] for r in runs["with"])
    blocked_share = sum(blocked) / sum(r["loop_seconds"] for r in runs["with"])
    size = history[-1]["bytes"]
    print()
    print(
        f"model hidden={args.hidden}: checkpoint {size / 1e6:.1f} MB in {history[-1]['shards']} shards, "
        f"every {args.every} steps, {len(history)} periodic checkpoints in {args.rounds} run(s)"
    )
    print(f"steps/s without checkpoints: {without:.2f}")
    print(f"steps/s with checkpoints:    {with_ckpt:.2f}")
    print(f"ratio with/without:          {with_ckpt / without:.3f}   (target >= 0.98)")
    print(
        f"training thread blocked per checkpoint: mean {statistics.mean(blocked) * 1000:.1f} ms, "
        f"median {statistics.median(blocked) * 1000:.1f} ms, max {max(blocked) * 1000:.1f} ms; "
        f"{blocked_share * 100:.3f} % of loop time (target <= 2 %)"
    )
    for key, label in (("serialise_s", "serialise+hash"), ("primary_s", "S3 primary"), ("replica_s", "replica")):
        print(f"background {label:14s}: mean {statistics.mean(h[key] for h in history):.2f}s per checkpoint")
    # On this machine the endpoint shares the training's cores; on a cluster it is another machine.
    endpoint_cpu = sum(r["endpoint_cpu_s"] for r in runs["with"]) / (len(history) + len(runs["with"]))
    print(
        f"CPU per checkpoint: upload thread {statistics.mean(h['cpu_s'] for h in history):.2f}s, "
        f"rclone endpoint {endpoint_cpu:.2f}s (on the same 2 cores as the training)"
    )
    print(
        f"steps trained while a checkpoint was in flight: mean {statistics.mean(h['steps_in_flight'] for h in history):.1f}, "
        f"max {max(h['steps_in_flight'] for h in history)}; offers declined while busy: "
        f"{sum(r['checkpoints'].get('declined_offers', 0) for r in runs['with'])}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096, help="MLP width: 4096 makes a 69 MB checkpoint")
    parser.add_argument("--every", type=int, default=100, help="checkpoint interval in steps (about 7 s)")
    parser.add_argument("--intervals", type=int, default=20, help="checkpoint intervals per run")
    parser.add_argument("--rounds", type=int, default=1, help="pairs of runs (order alternates)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hf-ckpt-bench-"))
    server = RcloneS3Server(work / "s3", ACCESS, SECRET, log_path=work / "rclone.log")
    try:
        server.start()
        S3ObjectStore(BUCKET, endpoint_url=server.endpoint_url, access_key=ACCESS, secret_key=SECRET).ensure_bucket()
        model, dataset, data = seeded(work)
        steps = args.every * (args.intervals + 1)  # periodic checkpoints at every, 2*every, ..., intervals*every
        base = {
            "run_key": "checkpoint-bench",
            "model": {"name": model.name, "entrypoint": model.entrypoint,
                      "hyperparameters": {**model.defaults(), "steps": steps, "hidden": args.hidden}},
            "dataset": dataset,
            "data": data,
            "keep": 2,
            "log_every_steps": args.every,
        }
        report(args, run_pairs(args, work, server, base, steps), steps)
        return 0
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
