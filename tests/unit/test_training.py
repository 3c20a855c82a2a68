"""Real 2-worker DDP gangs on the digits set through the local backend (a few seconds of training each;
most of the time is the workers importing torch)."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hybridflow.backends.local import GangFailed, GangJob, GangPreempted, LocalGangBackend, pid_alive
from hybridflow.datasets import parse_split, seed_digits
from hybridflow.storage.manifest import DatasetManifest, ManifestEntry, sha256_bytes
from hybridflow.storage.objectstore import LocalObjectStore, StoreSpec
from hybridflow.training.checkpoint import CheckpointStore

CLUSTER = "onprem-a"


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return seed_digits(tmp_path_factory.mktemp("private"))


def _spec(data: dict, ckpt_root: Path, **overrides) -> dict:
    spec = {
        "run_key": "test-run",
        "data": data,
        "checkpoint_store": StoreSpec(kind="local", root=str(ckpt_root)).to_dict(),
        "train_steps": 300,
        "checkpoint_every_steps": 100,
        "batch_size": 64,
        "learning_rate": 0.05,
        "keep": 2,
        "log_every_steps": 100,
    }
    spec.update(overrides)
    return spec


def _accuracy(model_bytes: bytes, test_csv: Path) -> float:
    import torch

    from hybridflow.training.model import build_model

    model = build_model()
    model.load_state_dict(torch.load(io.BytesIO(model_bytes), weights_only=True))
    x, y = parse_split(test_csv.read_bytes())
    with torch.no_grad():
        pred = model(torch.tensor(x)).argmax(dim=1).numpy()
    return float((pred == y).mean())


def _worker_pids_for(job_dir: Path) -> list[int]:
    """Live processes whose command line names this job's folder (its workers' --spec path)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(job_dir) in cmdline and "hybridflow.training.worker" in cmdline and pid_alive(int(proc.name)):
            pids.append(int(proc.name))
    return pids


def test_two_worker_gang_trains_digits(tmp_path, digits):
    ckpt_root = tmp_path / "ckpt"
    backend = LocalGangBackend(tmp_path / "state", CLUSTER, capacity=4)
    lines: list[str] = []
    job = GangJob(
        name="digits-train", workers=2, spec=_spec({"kind": "local", "path": str(digits.path)}, ckpt_root)
    )

    result = backend.run(job, admission_timeout_s=10, log=lines.append)

    assert result.exit_codes == [0, 0]
    assert all(p.is_file() for p in result.log_paths)
    store = LocalObjectStore(ckpt_root)
    summary = json.loads(store.get_bytes("result.json"))
    assert summary["final_step"] == 300 and summary["start_step"] == 0
    assert summary["world_size"] == 2
    assert summary["checkpoints_written"] == 3
    assert summary["final_loss"] < 0.5
    assert CheckpointStore(store).committed_steps() == [200, 300]  # keep=2
    assert _accuracy(store.get_bytes("model/final.pt"), digits.split_path("test")) > 0.85
    assert any("step 300/300" in line and "steps/s" in line for line in lines)  # rank 0 streamed
    assert backend.pool.usage() == 0


_LAUNCH = """
import json, sys
from pathlib import Path
from hybridflow.backends.local import GangJob, LocalGangBackend
state_dir, spec_path = sys.argv[1], sys.argv[2]
backend = LocalGangBackend(Path(state_dir), "onprem-a", 2)
job = GangJob(name="resumable", workers=2, spec=json.loads(Path(spec_path).read_text()), attempt="1")
backend.run(job, admission_timeout_s=30, log=lambda line: print(line, flush=True))
"""


def _manifest_source(tmp_path: Path, digits) -> dict:
    """Stage train.csv content-addressed with a manifest, as stage_data does."""
    store_root = tmp_path / "staged"
    store = LocalObjectStore(store_root)
    data = digits.split_path("train").read_bytes()
    digest = sha256_bytes(data)
    entry = ManifestEntry(
        path="train.csv", key=f"datasets/digits/blobs/{digest}", size=len(data), sha256=digest
    )
    store.put_bytes(entry.key, data)
    manifest = DatasetManifest(dataset="digits", entries=(entry,))
    key = f"datasets/digits/versions/{manifest.version}.json"
    store.put_bytes(key, manifest.to_json())
    return {
        "kind": "manifest",
        "store": StoreSpec(kind="local", root=str(store_root)).to_dict(),
        "manifest_key": key,
    }


def test_killed_launcher_leaves_no_workers_and_rerun_resumes(tmp_path, digits):
    ckpt_root, state_dir = tmp_path / "ckpt", tmp_path / "state"
    checkpoints = CheckpointStore(LocalObjectStore(ckpt_root))
    data = _manifest_source(tmp_path, digits)
    # Long enough that it is still training when killed; checkpoints on a timer, not by step count.
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(
        json.dumps(
            _spec(
                data,
                ckpt_root,
                train_steps=100_000,
                checkpoint_every_steps=10**9,
                checkpoint_every_seconds=0.2,
            )
        )
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCH, str(state_dir), str(spec_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    job_dir = state_dir / "jobs" / "resumable"
    try:
        deadline = time.monotonic() + 120
        while not checkpoints.committed_steps():
            assert launcher.poll() is None, launcher.stdout.read().decode()
            assert time.monotonic() < deadline, "no checkpoint committed within 120s"
            time.sleep(0.05)
        assert len(_worker_pids_for(job_dir)) == 2
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()

    # PR_SET_PDEATHSIG delivers SIGTERM: the workers finish their step, checkpoint and exit.
    deadline = time.monotonic() + 60
    while _worker_pids_for(job_dir):
        assert time.monotonic() < deadline, f"workers outlived the launcher: {_worker_pids_for(job_dir)}"
        time.sleep(0.1)
    resume_from = checkpoints.latest().step
    assert resume_from > 0

    # Rerun the same job (its slots are still recorded for the dead launcher and must be reclaimed).
    backend = LocalGangBackend(state_dir, CLUSTER, capacity=2)
    rerun_spec = _spec(data, ckpt_root, train_steps=resume_from + 40, checkpoint_every_steps=20)
    lines: list[str] = []
    backend.run(
        GangJob(name="resumable", workers=2, spec=rerun_spec, attempt="2"),
        admission_timeout_s=10,
        log=lines.append,
    )

    summary = json.loads(LocalObjectStore(ckpt_root).get_bytes("result.json"))
    assert summary["start_step"] == resume_from > 0
    assert summary["final_step"] == resume_from + 40
    assert any(f"resuming from checkpoint step {resume_from}" in line for line in lines)
    assert backend.pool.usage() == 0


def test_gang_with_bad_data_fails_as_a_whole_and_releases_slots(tmp_path):
    backend = LocalGangBackend(tmp_path / "state", CLUSTER, capacity=2)
    job = GangJob(
        name="bad-data",
        workers=2,
        spec=_spec({"kind": "local", "path": str(tmp_path / "no-such-dataset")}, tmp_path / "ckpt"),
    )
    with pytest.raises(GangFailed, match=r"rank \d exited with code 1") as err:
        backend.run(job, admission_timeout_s=10, log=lambda line: None)
    assert "train.csv does not exist" in err.value.log_tail
    assert err.value.exit_code == 1
    assert backend.pool.usage() == 0
    assert not (tmp_path / "ckpt" / "result.json").exists()


def test_one_crashing_worker_stops_the_gang(tmp_path, digits):
    backend = LocalGangBackend(tmp_path / "state", CLUSTER, capacity=2, grace_s=10)
    spec = _spec(
        {"kind": "local", "path": str(digits.path)}, tmp_path / "ckpt", inject_failure={"rank": 1, "step": 5}
    )
    job = GangJob(name="crashy", workers=2, spec=spec)
    started = time.monotonic()
    with pytest.raises(GangFailed) as err:
        backend.run(job, admission_timeout_s=10, log=lambda line: None)
    assert err.value.rank == 1 and err.value.exit_code == 1
    assert "injected failure on rank 1 at step 5" in err.value.log_tail
    assert time.monotonic() - started < 60
    # Rank 0 reports the attempt: it failed after the last step every rank finished.
    report = json.loads(LocalObjectStore(tmp_path / "ckpt").get_bytes("attempts/1.json"))
    assert (report["outcome"], report["start_step"], report["last_step"]) == ("failed", 0, 4)
    assert backend.pool.usage() == 0
    assert not _worker_pids_for(tmp_path / "state" / "jobs" / "crashy")


def test_cancel_preempts_the_gang_after_a_checkpoint(tmp_path, digits):
    ckpt_root = tmp_path / "ckpt"
    checkpoints = CheckpointStore(LocalObjectStore(ckpt_root))
    backend = LocalGangBackend(tmp_path / "state", CLUSTER, capacity=2)
    spec = _spec(
        {"kind": "local", "path": str(digits.path)}, ckpt_root, train_steps=100_000, checkpoint_every_steps=25
    )
    job = GangJob(name="cancel-me", workers=2, spec=spec)
    outcome: dict = {}

    def launch() -> None:
        try:
            backend.run(job, admission_timeout_s=10, log=lambda line: None)
        except Exception as exc:  # handed to the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=launch)
    thread.start()
    deadline = time.monotonic() + 120
    while not checkpoints.committed_steps():
        assert thread.is_alive() and time.monotonic() < deadline, outcome
        time.sleep(0.05)

    assert backend.cancel("cancel-me") is True  # what an operator's on_kill calls
    thread.join(60)

    assert isinstance(outcome.get("error"), GangPreempted)
    assert outcome["error"].exit_code == 75
    # The SIGTERM-time checkpoint is at the last finished step, not the last periodic one.
    final = checkpoints.latest()
    assert final is not None and final.step > 0
    assert not (ckpt_root / "result.json").exists()
    assert backend.pool.usage() == 0


def test_step_sampler_is_deterministic_and_shards_disjointly():
    from hybridflow.training.worker import StepSampler

    shards = [StepSampler(1000, 32, rank, 2, seed=3) for rank in range(2)]
    for step in (1, 2, 31, 32, 500):  # 15 steps per epoch: crosses several epochs
        a, b = (s.indices(step).tolist() for s in shards)
        assert len(a) == len(b) == 32 and not set(a) & set(b)
        # A resumed run (fresh sampler jumping straight to ``step``) sees the same batch.
        assert StepSampler(1000, 32, 0, 2, seed=3).indices(step).tolist() == a
    epoch0 = [i for step in range(1, 16) for s in shards for i in s.indices(step).tolist()]
    assert len(set(epoch0)) == len(epoch0)  # no row twice within an epoch


def test_job_spec_rejects_unknown_keys(tmp_path):
    from hybridflow.training.worker import JobSpec

    spec = _spec({"kind": "local", "path": str(tmp_path)}, tmp_path)
    assert JobSpec.from_dict(spec).train_steps == 300
    with pytest.raises(ValueError, match="unknown keys \\['trian_steps'\\]"):
        JobSpec.from_dict({**spec, "trian_steps": 5})


def test_job_spec_accepts_source_as_the_data_key(tmp_path):
    from hybridflow.training.worker import JobSpec

    spec = _spec({"kind": "local", "path": str(tmp_path)}, tmp_path)
    spec["source"] = spec.pop("data")
    assert JobSpec.from_dict(spec).data == {"kind": "local", "path": str(tmp_path)}
    with pytest.raises(ValueError, match="twice"):
        JobSpec.from_dict({**spec, "data": spec["source"]})
