"""Bandwidth caps: hybridflow's stage_dataset under a cap against `rclone copy --bwlimit` at the same
rate, a checkpoint commit in the middle of the capped stage, and the cost of the metering when no cap
binds, all against one `rclone serve s3` endpoint on 127.0.0.1 in the same run.

Rates are read at the endpoint: the bytes its bucket folder holds, polled every 0.25 s (single
PutObjects, which rclone writes as they arrive), so both tools are measured the same way. For every
window of --window-s seconds (sliding by 1 s, from the first byte to the last) the endpoint's rate is
compared with the cap; the target is every window within 5 % of it.

The checkpoint is a CheckpointStore commit of --checkpoint-mib from another process (as a gang's
rank 0 commits), under the same cap with checkpoint priority: --checkpoints times on the idle
endpoint, then as often spread over the capped stage; the target is a median at most 1.2x the idle
median.

Without a cap no body is wrapped; a cap far above the endpoint's speed shows what the metering costs
when it is set but does not bind (target: within 5 % of no cap), and s5cmd is the reference tool.

    .venv/bin/python benchmarks/bandwidth.py [--cap-mb 100] [--gib 8] [--file-mib 256] [--uncapped-gib 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from s3bench import ACCESS, REPO, SECRET, Bench, MiB, measure_here
from staging_catalogue import PUBLIC_CACHE, write_catalogue

from hybridflow.staging import StagingSettings, stage_dataset
from hybridflow.storage.bandwidth import Cap, endpoint_key
from hybridflow.storage.objectstore import StoreSpec, open_store
from hybridflow.storage.sources import LocalFolderSource

_CHECKPOINT_CHILD = """
import json, os, sys, time
from hybridflow.storage.objectstore import StoreSpec, open_store
from hybridflow.training.checkpoint import CheckpointStore, prepare
store = open_store(StoreSpec.from_dict(json.loads(sys.argv[1])))
store.exists("warm")  # a gang's store is open long before it commits
shard = os.urandom(int(sys.argv[2]))
print("ready", flush=True)
for step, _ in enumerate(sys.stdin, start=1):
    t0 = time.perf_counter()
    prepared = prepare(step, {"model.pt": shard})  # hashing: the worker's CPU, not the link
    t1 = time.perf_counter()
    CheckpointStore(store).commit(prepared)
    t2 = time.perf_counter()
    print(t2 - t0, t1 - t0, flush=True)
"""


def write_dataset(folder: Path, count: int, size: int) -> int:
    """``count`` distinct files of ``size`` bytes: a random head each (distinct content, so nothing
    is deduplicated) over one shared random body (fast to write)."""
    folder.mkdir(parents=True, exist_ok=True)
    body = os.urandom(size - MiB)
    for i in range(count):
        with open(folder / f"shard-{i:05d}.bin", "wb") as fh:
            fh.write(os.urandom(MiB))
            fh.write(body)
    old = time.time() - 120
    for p in folder.iterdir():
        os.utime(p, (old, old))
    return count * size


def folder_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass  # renamed away between listing and stat
    return total


class Poller:
    """The bytes under a folder of the endpoint, every 0.25 s, in a thread."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.samples = folder, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), folder_bytes(self.folder)))
            self._stop.wait(0.25)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.perf_counter(), folder_bytes(self.folder)))


def window_rates(samples: list[tuple[float, int]], window_s: float) -> list[float]:
    """Bytes/s over every window of ``window_s`` (sliding by 1 s) from the first byte to the last."""
    moving = [(t, b) for t, b in samples if 0 < b < samples[-1][1]]
    if not moving:
        return []
    start, end = moving[0][0], moving[-1][0]
    rates, t = [], start
    while t + window_s <= end + 1e-9:
        a = _bytes_at(samples, t)
        b = _bytes_at(samples, t + window_s)
        rates.append((b - a) / window_s)
        t += 1.0
    return rates


def _bytes_at(samples: list[tuple[float, int]], when: float) -> float:
    for (t0, b0), (t1, b1) in zip(samples, samples[1:], strict=False):
        if t0 <= when <= t1:
            return b0 + (b1 - b0) * (when - t0) / max(t1 - t0, 1e-9)
    return samples[-1][1] if when > samples[-1][0] else samples[0][1]


def report_windows(label: str, samples, cap: float, window_s: float) -> tuple[float, float]:
    rates = window_rates(samples, window_s)
    if not rates:
        print(f"{label}: shorter than one {window_s:g} s window; raise --gib")
        return 0.0, 0.0
    low, high = min(rates) / cap, max(rates) / cap
    print(f"{label}: {len(rates)} windows of {window_s:g} s, rate {min(rates) / 1e6:.1f}-{max(rates) / 1e6:.1f} MB/s "
          f"= {low:.3f}-{high:.3f} of the cap (target: every window within 0.95-1.05)")
    return low, high


def _stage(src: Path, store, catalogue: Path, run_key: str):
    return stage_dataset(LocalFolderSource(src), store, destination=PUBLIC_CACHE, catalogue=catalogue, run_key=run_key,
                         settings=StagingSettings(pack="never"))


def uncapped(bench: Bench, src: Path, catalogue: Path, base: StoreSpec, key: str, repeat: int) -> dict[str, float]:
    """MiB/s of s5cmd, of stage_dataset without a cap, and with a cap that never binds (best of ``repeat``)."""
    files = sorted(src.iterdir())
    total = sum(p.stat().st_size for p in files)
    part = str(max(5, files[0].stat().st_size // MiB + 1))
    best: dict[str, float] = {}

    def keep(label: str, seconds: float) -> None:
        best[label] = max(best.get(label, 0.0), total / MiB / seconds)

    for rep in range(repeat):
        b = bench.bucket("s5")
        keep("s5cmd cp -p (whole objects)", bench.run_tool("s5", bench.s5cmd("cp", "-p", part, f"{src}/*", f"s3://{b}/w/"),
                                                           len(files), total).seconds)
        bench.drop(b)
        for label, caps in (("hybridflow, no cap", ()), ("hybridflow, cap 100 GB/s (never binds)", (Cap(key, 1e11),))):
            b = bench.bucket("hf")
            store = open_store(dataclasses.replace(base, bucket=b, caps=caps))
            m, result = measure_here(label, lambda s=store, r=rep: _stage(src, s, catalogue, f"free-{r}"), len(files), total)
            assert result.bytes_copied == total
            keep(label, m.seconds)
            bench.drop(b)
    ref = best["s5cmd cp -p (whole objects)"]
    print(f"\nno cap binding: {len(files)} x {files[0].stat().st_size // MiB} MiB, best of {repeat}")
    for label, rate in best.items():
        print(f"  {label:<42} {rate:>8.1f} MiB/s  {rate / ref:>5.2f}x s5cmd")
    free, unbound = best["hybridflow, no cap"], best["hybridflow, cap 100 GB/s (never binds)"]
    print(f"  a cap that never binds / no cap: {unbound / free:.3f} (target >= 0.95)")
    return best


def checkpoint_child(spec: StoreSpec, size: int) -> subprocess.Popen:
    env = {**os.environ, **dataclasses.replace(spec, access_key=ACCESS, secret_key=SECRET).credential_env()}
    child = subprocess.Popen([sys.executable, "-c", _CHECKPOINT_CHILD, json.dumps(spec.to_dict()), str(size)],
                             cwd=REPO, env={**env, "PYTHONPATH": str(REPO / "include")}, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    if child.stdout.readline().strip() != "ready":
        raise RuntimeError("the checkpoint process did not start")
    return child


def commit_checkpoint(child: subprocess.Popen) -> tuple[float, float]:
    """Seconds the commit took, and how many of them hashing the shard (before any byte is sent)."""
    child.stdin.write("go\n")
    child.stdin.flush()
    total, hashing = child.stdout.readline().split()
    return float(total), float(hashing)


def capped(bench: Bench, src: Path, catalogue: Path, base: StoreSpec, key: str, cap: float, args) -> dict[str, float]:
    total = sum(p.stat().st_size for p in src.iterdir())
    out: dict[str, float] = {}
    b = bench.bucket("capped")
    caps = (Cap(key, cap),)
    child = checkpoint_child(dataclasses.replace(base, bucket=b, prefix="checkpoints/run-1", caps=caps,
                                                 priority="checkpoint"), args.checkpoint_mib * MiB)
    try:
        idle = sorted(commit_checkpoint(child) for _ in range(args.checkpoints))
        store = open_store(dataclasses.replace(base, bucket=b, prefix="cache", caps=caps))
        busy = []
        with Poller(bench.data / b) as poll:
            started = time.perf_counter()
            stage = threading.Thread(target=_stage, args=(src, store, catalogue, "capped"))
            stage.start()
            every = total / cap / (args.checkpoints + 1)
            for i in range(args.checkpoints):  # spread over the stage, as a gang's timer would
                time.sleep(max(0.0, started + every * (i + 1) - time.perf_counter()))
                busy.append(commit_checkpoint(child))
            stage.join()
            out["stage s"] = time.perf_counter() - started
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    sent = total + args.checkpoints * args.checkpoint_mib * MiB
    print(f"\ncap {cap / 1e6:g} MB/s, {total / 2**30:.1f} GiB staged in {out['stage s']:.1f} s "
          f"({sent / out['stage s'] / 1e6:.1f} MB/s with the checkpoints)")
    out["ours low"], out["ours high"] = report_windows("  hybridflow stage_dataset", poll.samples, cap, args.window_s)
    out["checkpoint idle s"] = statistics.median(t for t, _ in idle)
    out["checkpoint during stage s"] = statistics.median(t for t, _ in busy)
    ratio = out["checkpoint during stage s"] / out["checkpoint idle s"]
    print(f"  checkpoint of {args.checkpoint_mib} MiB, median of {args.checkpoints}: {out['checkpoint idle s']:.2f} s "
          f"on the idle endpoint, {out['checkpoint during stage s']:.2f} s during the stage = {ratio:.2f}x "
          "(target <= 1.2)")
    print("    each (total / hashing): idle " + ", ".join(f"{t:.2f}/{h:.2f}" for t, h in idle)
          + "; during " + ", ".join(f"{t:.2f}/{h:.2f}" for t, h in busy))
    bench.drop(b)
    b = bench.bucket("rclone")
    cmd = bench.rclone("copy", str(src), f"bench:{b}/w", "--bwlimit", f"{cap / 1024:.0f}K", "--transfers", "8",
                       "--s3-upload-cutoff", "5G", "--checkers", "8")
    with Poller(bench.data / b) as poll:
        out["rclone s"] = bench.run_tool("rclone", cmd, 0, total).seconds
    out["rclone low"], out["rclone high"] = report_windows(f"  rclone copy --bwlimit {cap / 1024:.0f}K (reference)",
                                                           poll.samples, cap, args.window_s)
    bench.drop(b)
    return out


def run(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--cap-mb", type=float, default=100.0, help="the cap, in MB/s (10^6 bytes)")
    parser.add_argument("--gib", type=float, default=8.0, help="the capped stage's size")
    parser.add_argument("--file-mib", type=int, default=256)
    parser.add_argument("--uncapped-gib", type=float, default=2.0, help="0: skip the runs without a binding cap")
    parser.add_argument("--checkpoint-mib", type=int, default=64)
    parser.add_argument("--checkpoints", type=int, default=5, help="commits on the idle endpoint, and during the stage")
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args(argv)
    with Bench(in_memory=False) as bench:
        os.environ["HYBRIDFLOW_HOME"] = str(bench.root / "home")  # where the caps' shared state lives
        src = bench.root / "src" / "weights"
        count = max(1, round(args.gib * 1024 / args.file_mib))
        total = write_dataset(src, count, args.file_mib * MiB)
        catalogue = write_catalogue(bench.root / "config", src.name)
        print(f"{count} x {args.file_mib} MiB = {total / 2**30:.2f} GiB on {bench.endpoint} (loopback, disk)")
        subset = bench.root / "src" / "subset" / "weights"
        subset.mkdir(parents=True)
        for p in sorted(src.iterdir())[: max(1, round(args.uncapped_gib * 1024 / args.file_mib))]:
            os.link(p, subset / p.name)
        write_catalogue(bench.root / "config", "weights")
        bench.warm_up(subset)
        base = StoreSpec(kind="s3", bucket="unset", endpoint_url=bench.endpoint, access_key=ACCESS, secret_key=SECRET)
        key = endpoint_key(bench.endpoint, base.region)
        figures = {}
        if args.uncapped_gib > 0:
            figures = {f"uncapped {k}": v for k, v in uncapped(bench, subset, catalogue, base, key, args.repeat).items()}
        figures.update(capped(bench, src, catalogue, base, key, args.cap_mb * 1e6, args))
        shutil.rmtree(bench.root / "src", ignore_errors=True)
    return figures


if __name__ == "__main__":
    run()
