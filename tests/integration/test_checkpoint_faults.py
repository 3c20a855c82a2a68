"""Checkpoint fault drills with real worker processes: SIGKILL at random points of the checkpoint
write (shards to S3, manifest, replica, pruning), a lost cache bucket and SIGTERM while storage
stalls (preemption through the train task: test_checkpoint_faults_train_task.py).

What "lost progress <= one checkpoint interval" means for asynchronous checkpoints, as checked here:
a checkpoint's snapshot is taken at step s_k and committed W_k steps later (the in-flight window,
which the worker logs for every commit). The next snapshot is due K steps later
(``checkpoint_every_steps``) but waits for the write in flight, so snapshots are at most
max(K, W + 1) steps apart; a kill just before the next commit lands therefore loses at most
max(K, W + 1) + W steps, where W is the largest in-flight window of the run. Lost progress is the
last step the killed worker logged as completed minus the step the next launch resumed from.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import torch
from tests.support.jobs import job_spec, seed_example

from hybridflow.backends.local import pid_alive
from hybridflow.storage.objectstore import LocalObjectStore, StoreSpec
from hybridflow.storage.s3 import S3ObjectStore

pytestmark = [pytest.mark.s3]

INCLUDE = Path(__file__).resolve().parents[2] / "include"
HIDDEN = 1024  # digits-mlp's width: 4.8 MB of model + momentum per checkpoint, longer to write than K steps
EVERY = 25
TRIALS = 20
# Where each trial kills the worker: at a random time, or right after the log shows a phase began.
TARGETS = [
    ("random", None, 0.0),
    ("upload", re.compile(r"writing shard model\.pt .* to s3://"), 0.03),
    ("manifest", re.compile(r"writing manifest to s3://"), 0.0),
    ("replica", re.compile(r"writing shard \S+ .* to file://"), 0.005),
    ("random", None, 0.0),
]
STEP_RE = re.compile(r"INFO step (\d+) loss ")
PHASE_RE = re.compile(r"checkpoint step \d+: (serialising|writing shard|writing manifest|committed in|pruning)")
DONE_RE = re.compile(r"INFO checkpoint step (\d+) committed .* (\d+) steps trained meanwhile")
RESUME_RE = re.compile(r"resuming from checkpoint step (\d+)|starting from step 0")
STARTED_RE = re.compile(r"checkpoint step (\d+): serialising")  # the upload thread took it (debug log)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _phase(log: str) -> str:
    """The checkpoint phase the worker was in when it died: the last phase its log shows begun."""
    phase = "training"
    for line in log.splitlines():
        if DONE_RE.search(line):
            phase = "training"  # that checkpoint is complete; nothing in flight
            continue
        m = PHASE_RE.search(line)
        if not m:
            continue
        place = "primary" if "s3://" in line else "replica"
        phase = {
            "serialising": "serialise shards",
            "writing shard": "primary shard upload" if place == "primary" else "replica shard write",
            "writing manifest": f"{place} manifest write",
            "committed in": "replica start" if place == "primary" else "pruning",
            "pruning": "pruning",
        }[m.group(1)]
    return phase


def _verified_steps(store) -> tuple[list[int], list[int]]:
    """(steps whose manifest exists and whose every shard matches it, steps without a manifest),
    checked independently of the checkpoint module."""
    files: dict[int, dict[str, int]] = {}
    for info in store.list("step-"):
        step, _, name = info.key.partition("/")
        files.setdefault(int(step.removeprefix("step-")), {})[name] = info.size
    good, partial = [], []
    for step, names in files.items():
        if "MANIFEST.json" not in names:
            partial.append(step)
            continue
        manifest = json.loads(store.get_bytes(f"step-{step:09d}/MANIFEST.json"))
        shard_ok = (hashlib.sha256(store.get_bytes(f"step-{step:09d}/{s['name']}")).hexdigest() == s["sha256"]
                    for s in manifest["shards"])
        if all(shard_ok):
            good.append(step)
    return sorted(good), sorted(partial)


# Forks workers from a process that has already imported torch, pandas and boto3, so a trial costs
# about a second instead of a five-second interpreter start. Everything from worker.main() on is the
# real worker in its own process; the parent stays single-threaded and runs no torch op before fork.
_FORKSERVER = r"""
import json, os, sys
import boto3, botocore.session, pandas, torch, torch.distributed, torch.nn.parallel
import hybridflow_examples.digits.model
from hybridflow.training import checkpointer, context, data, worker
for line in sys.stdin:
    req = json.loads(line)
    if "wait" in req:
        _, status = os.waitpid(req["wait"], 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)
        continue
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ.update(req["env"])
            code = worker.main(["--spec", req["spec"]])
        finally:
            os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
"""


class _ForkServer:
    def __init__(self, env: dict) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _FORKSERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )

    def call(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the fork server died"
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


class _Worker:
    """One rank-0 worker process (world size 1) writing its log to a file."""

    def __init__(self, server: _ForkServer, spec: dict, workdir: Path, name: str) -> None:
        self.server = server
        self.log_path = workdir / f"{name}.log"
        spec_path = workdir / f"{name}.json"
        spec_path.write_text(json.dumps(spec))
        self.log_path.touch()
        self._reader = open(self.log_path, errors="replace")  # noqa: SIM115 - closed in stop()
        self.pid = server.call(
            {"spec": str(spec_path), "log": str(self.log_path), "env": {"MASTER_PORT": str(_free_port())}}
        )["pid"]
        self.returncode: int | None = None
        self.text = ""

    def alive(self) -> bool:
        return self.returncode is None and pid_alive(self.pid)

    def read(self) -> str:
        if not self._reader.closed:
            self.text += self._reader.read()
        return self.text

    def wait_for(self, pattern: re.Pattern, timeout: float, after: int = 0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pattern.search(self.read(), after):
                return True
            if not self.alive():
                return bool(pattern.search(self.read(), after))
            time.sleep(0.001)
        return False

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float = 120) -> int:
        deadline = time.monotonic() + timeout
        while pid_alive(self.pid) and time.monotonic() < deadline:  # a zombie counts as exited
            time.sleep(0.05)
        if pid_alive(self.pid):
            self.kill()
        if self.returncode is None:
            self.returncode = self.server.call({"wait": self.pid})["code"]
        return self.returncode

    def stop(self) -> None:
        if self.returncode is None:
            if pid_alive(self.pid):
                self.kill()
            self.wait()
        self.read()
        self._reader.close()


def _drill_spec(tmp_path: Path, run_key: str, primary: StoreSpec, replica: StoreSpec, **overrides) -> dict:
    """A digits-mlp job of one worker for the drills: wide enough that a checkpoint is slow to
    write, long enough that it is still training when killed, and logging every step."""
    seeded = seed_example(tmp_path / "data", "digits-mlp")
    return job_spec(seeded, tmp_path / "unused", hparams={"steps": 1_000_000, "hidden": HIDDEN}, run_key=run_key,
                    checkpoint_store=primary.to_dict(), checkpoint_replica=replica.to_dict(),
                    checkpoint_every_steps=EVERY, keep=2, log_every_steps=1, **overrides)


def _steps(spec: dict, steps: int) -> dict:
    """``spec`` training ``steps`` steps in all."""
    model = spec["model"]
    return {**spec, "model": {**model, "hyperparameters": {**model["hyperparameters"], "steps": steps}}}


@pytest.fixture
def s3_places(rclone_s3, tmp_path):
    endpoint, access, secret, _ = rclone_s3
    bucket = "checkpoint-faults"
    S3ObjectStore(bucket, endpoint_url=endpoint, access_key=access, secret_key=secret).ensure_bucket()
    primary = StoreSpec(
        kind="s3", bucket=bucket, prefix=f"kill-{uuid.uuid4().hex[:8]}", endpoint_url=endpoint
    )
    replica = StoreSpec(kind="local", root=str(tmp_path / "private" / "checkpoints"))
    env = {
        **os.environ,
        "PYTHONPATH": str(INCLUDE),
        "PYTHONUNBUFFERED": "1",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": "lo",
        "HYBRIDFLOW_STORE_ACCESS_KEY": access,
        "HYBRIDFLOW_STORE_SECRET_KEY": secret,
        "HYBRIDFLOW_DEBUG_LOGGERS": "hybridflow.training",
    }
    stores = (
        S3ObjectStore(
            bucket, prefix=primary.prefix, endpoint_url=endpoint, access_key=access, secret_key=secret
        ),
        LocalObjectStore(Path(replica.root)),
    )
    server = _ForkServer(env)
    try:
        yield primary, replica, stores, server
    finally:
        server.close()


def _kill_trial(server: _ForkServer, spec: dict, tmp_path: Path, i: int, rng: random.Random,
                expected_resume: int) -> str:
    """Trial ``i``: a worker that must resume from ``expected_resume``, SIGKILLed at the trial's
    target (a random time, or just after a write phase began). Returns its log."""
    target, pattern, max_delay = TARGETS[i % len(TARGETS)]
    worker = _Worker(server, spec, tmp_path, f"trial-{i:02d}")
    try:
        assert worker.wait_for(STEP_RE, 60), (
            f"trial {i}: no training step logged:\n{worker.read()[-3000:]}"
        )
        log = worker.read()
        resumed = RESUME_RE.search(log)
        assert resumed, log[-3000:]
        # The worker resumed from the newest checkpoint that verifies in either place.
        assert int(resumed.group(1) or 0) == expected_resume, (i, resumed.group(0), expected_resume)
        mark = len(log)
        if pattern is None:
            time.sleep(rng.uniform(0.05, 0.8))
        else:
            assert worker.wait_for(pattern, 30, after=mark), f"trial {i}: {target} never began"
            time.sleep(rng.uniform(0.0, max_delay))
        assert worker.alive(), f"trial {i}: worker exited early:\n{worker.read()[-3000:]}"
        worker.kill()
        assert worker.wait() == -signal.SIGKILL
    finally:
        worker.stop()
    return worker.read()


def _cut_window(log: str) -> list[int]:
    """The window of the write the kill cut short: taken at step s, never logged as committed, so in
    flight for at least (last step - s) steps; part of the run's W like a committed one's."""
    done = {int(s) for s, _ in DONE_RE.findall(log)}
    cut = [int(s) for s in STARTED_RE.findall(log) if int(s) not in done]
    steps = [int(s) for s in STEP_RE.findall(log)]
    return [max(steps) - max(cut)] if cut and steps else []


def _trial_record(i: int, log: str, stores: tuple, replica: StoreSpec) -> dict:
    """What killed trial ``i`` left: its phase, last step, the checkpoint the next launch must resume
    from (``resume``) and the partial checkpoints newer than that."""
    good_p, partial_p = _verified_steps(stores[0])
    good_r, partial_r = _verified_steps(stores[1])
    temp_files = [p.name for p in Path(replica.root).rglob(".*.part")]
    expected_resume = max(good_p + good_r, default=0)
    return {
        "trial": i,
        "target": TARGETS[i % len(TARGETS)][0],
        "phase": _phase(log),
        "last_step": max(int(s) for s in STEP_RE.findall(log)),
        "resume": expected_resume,
        # The checkpoint after the resume point that was being written when the worker died
        # (none: the kill came before the next one was due).
        "next_started": min((int(n) for n in STARTED_RE.findall(log) if int(n) > expected_resume),
                            default=None),
        "partial_primary": [s for s in partial_p if s > expected_resume],
        "partial_replica": [s for s in partial_r if s > expected_resume],
        "replica_temp_files": len(temp_files),
    }


def _run_to_the_end(server: _ForkServer, spec: dict, tmp_path: Path, name: str) -> _Worker:
    """A worker of ``spec`` that must finish cleanly."""
    worker = _Worker(server, spec, tmp_path, name)
    try:
        code = worker.wait()
    finally:
        worker.stop()
    assert code == 0, worker.read()[-3000:]
    return worker


def _report(trials: list[dict]) -> str:
    return "\n".join(
        f"  trial {t['trial']:2d} {t['target']:8s} killed in {t['phase']:22s} last step {t['last_step']:5d} "
        f"resume {t['resume']:5d} lost {t['last_step'] - t['resume']:3d} partial newer: "
        f"primary {t['partial_primary']} replica {t['partial_replica']} temp files {t['replica_temp_files']}"
        for t in trials
    )


def test_sigkill_at_random_points_never_loads_a_partial_checkpoint(s3_places, tmp_path):
    primary, replica, stores, server = s3_places
    spec = _drill_spec(tmp_path, "kill-drill", primary, replica)
    rng = random.Random(1234)
    trials: list[dict] = []
    windows: list[int] = []
    expected_resume = 0
    started = time.monotonic()
    for i in range(TRIALS):
        log = _kill_trial(server, spec, tmp_path, i, rng, expected_resume)
        windows += [int(w) for _, w in DONE_RE.findall(log)] + _cut_window(log)
        trials.append(_trial_record(i, log, stores, replica))
        expected_resume = trials[-1]["resume"]

    # One more launch: it must resume from the last kill's newest checkpoint and finish cleanly.
    final_steps = expected_resume + 30
    worker = _run_to_the_end(server, _steps(spec, final_steps), tmp_path, "final")
    assert f"resuming from checkpoint step {expected_resume}" in worker.read()
    result = json.loads(stores[0].get_bytes("result.json"))
    assert result["final_step"] == final_steps and result["start_step"] == expected_resume

    # Resuming is exact, so the model after 20 kills equals, bit for bit, one trained without any.
    reference = StoreSpec(kind="local", root=str(tmp_path / "reference"))
    clean = {**_steps(spec, final_steps), "checkpoint_store": reference.to_dict(), "checkpoint_replica": None}
    _run_to_the_end(server, clean, tmp_path, "reference")
    killed_model = torch.load(io.BytesIO(stores[0].get_bytes("model/final.pt")), weights_only=True)
    clean_model = torch.load(
        io.BytesIO(LocalObjectStore(Path(reference.root)).get_bytes("model/final.pt")), weights_only=True
    )
    assert killed_model.keys() == clean_model.keys()
    assert all(torch.equal(killed_model[k], clean_model[k]) for k in clean_model)

    w_max = max(windows)
    bound = max(EVERY, w_max + 1) + w_max
    lost = [t["last_step"] - t["resume"] for t in trials]
    phases = Counter(t["phase"] for t in trials)
    report = _report(trials)
    print(
        f"\n{TRIALS} SIGKILL trials in {time.monotonic() - started:.0f}s; K={EVERY} steps, largest in-flight "
        f"window W={w_max} steps, bound max(K, W+1)+W={bound}; phases hit: {dict(phases)}; max lost {max(lost)}\n"
        + report
    )
    # Training never stalls on storage, so what a kill loses is the gap to the next checkpoint (at
    # most max(K, W+1): it starts at its interval, or once the previous upload is done) plus however
    # long that one was in flight, which only storage speed bounds (a loaded machine stretches it).
    gap_bound = max(EVERY, w_max + 1)
    gaps = [(t["next_started"] if t["next_started"] is not None else t["last_step"]) - t["resume"] for t in trials]
    assert all(0 <= g <= gap_bound for g in gaps), f"gaps {gaps} over {gap_bound}:\n{report}"
    assert all(n >= 0 for n in lost), report
    assert sorted(lost)[len(lost) // 2] <= bound, f"median loss over max(K, W+1)+W = {bound}:\n{report}"
    assert any(t["resume"] > 0 for t in trials)
    # The drill reached the write phases it is about, and left partial checkpoints that were skipped.
    assert phases["primary shard upload"] >= 1 and phases["replica shard write"] >= 1, dict(phases)
    assert phases["primary manifest write"] + phases["replica manifest write"] >= 1, dict(phases)
    assert any(t["partial_primary"] or t["partial_replica"] for t in trials), report


def test_losing_the_cache_bucket_resumes_from_private_storage(s3_places, tmp_path):
    primary, replica, stores, server = s3_places
    spec = _drill_spec(tmp_path, "lost-cache", primary, replica)
    worker = _Worker(server, spec, tmp_path, "before")
    try:
        assert worker.wait_for(re.compile(r"(?s)committed in file://.*committed in file://"), 60), (
            worker.read()
        )
        os.kill(worker.pid, signal.SIGTERM)
        assert worker.wait() == 75, worker.read()[-3000:]
    finally:
        worker.stop()
    final = int(re.search(r"preempted after step (\d+)", worker.read()).group(1))
    assert final in _verified_steps(stores[0])[0] and final in _verified_steps(stores[1])[0]
    for info in list(stores[0].list("")):  # the cloud cache loses everything of this run
        stores[0].delete(info.key)

    worker = _Worker(server, _steps(spec, final + 10), tmp_path, "after")
    try:
        assert worker.wait() == 0, worker.read()[-3000:]
    finally:
        worker.stop()
    assert f"resuming from checkpoint step {final} (file://" in worker.read()
    result = json.loads(stores[0].get_bytes("result.json"))
    assert (result["start_step"], result["final_step"]) == (final, final + 10)
    assert final + 10 in _verified_steps(stores[0])[0]  # checkpoints land in the cache again


def test_preemption_with_stalled_storage_exits_within_grace_and_resumes_from_the_last_commit(tmp_path):
    """SIGTERM while the S3 endpoint hangs (SIGSTOP): the worker gives up on its final checkpoint
    before the SIGKILL is due and still exits 75; the next launch resumes from the newest committed
    checkpoint, and a SIGTERM with healthy storage commits the final checkpoint within the grace."""
    from hybridflow.devenv.rclone import RcloneS3Server

    grace = 4.0
    access, secret = "hf-stall-access-key", "hf-stall-secret-key-0123"
    server = RcloneS3Server(tmp_path / "s3", access, secret, log_path=tmp_path / "rclone.log").start()
    forks = None
    worker = None
    try:
        S3ObjectStore(
            "stall", endpoint_url=server.endpoint_url, access_key=access, secret_key=secret
        ).ensure_bucket()
        primary = StoreSpec(kind="s3", bucket="stall", prefix="run", endpoint_url=server.endpoint_url)
        replica = StoreSpec(kind="local", root=str(tmp_path / "replica"))
        forks = _ForkServer(
            {
                **os.environ,
                "PYTHONPATH": str(INCLUDE),
                "PYTHONUNBUFFERED": "1",
                "RANK": "0",
                "WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
                "GLOO_SOCKET_IFNAME": "lo",
                "HYBRIDFLOW_STORE_ACCESS_KEY": access,
                "HYBRIDFLOW_STORE_SECRET_KEY": secret,
            }
        )
        spec = _drill_spec(tmp_path, "stall-drill", primary, replica, preemption_grace_s=grace)
        worker = _Worker(forks, spec, tmp_path, "stalled")
        assert worker.wait_for(DONE_RE, 60), worker.read()[-3000:]
        os.kill(server.pid, signal.SIGSTOP)
        sent = time.monotonic()
        os.kill(worker.pid, signal.SIGTERM)
        assert worker.wait(timeout=grace + 5) == 75, worker.read()[-3000:]
        assert time.monotonic() - sent < grace
        assert f"not committed within the {grace:g}s grace period" in worker.read()
        os.kill(server.pid, signal.SIGCONT)
        worker.stop()

        stores = (
            S3ObjectStore(
                "stall", prefix="run", endpoint_url=server.endpoint_url, access_key=access, secret_key=secret
            ),
            LocalObjectStore(Path(replica.root)),
        )
        newest = max(_verified_steps(stores[0])[0] + _verified_steps(stores[1])[0])
        worker = _Worker(forks, spec, tmp_path, "resumed")
        assert worker.wait_for(STEP_RE, 60), worker.read()[-3000:]
        assert f"resuming from checkpoint step {newest}" in worker.read()
        sent = time.monotonic()
        os.kill(worker.pid, signal.SIGTERM)
        assert worker.wait(timeout=grace + 5) == 75, worker.read()[-3000:]
        assert time.monotonic() - sent < grace
        final = re.search(
            r"preempted after step (\d+); last checkpoint step (\d+) committed ([\d.]+)s after SIGTERM",
            worker.read(),
        )
        assert final and final.group(1) == final.group(2), worker.read()[-3000:]
        assert float(final.group(3)) < grace, worker.read()[-3000:]
        assert int(final.group(1)) in _verified_steps(stores[0])[0]
        assert int(final.group(1)) in _verified_steps(stores[1])[0]
    finally:
        if server.pid:
            os.kill(server.pid, signal.SIGCONT)
        if worker is not None:
            worker.stop()
        if forks is not None:
            forks.close()
        server.stop()
