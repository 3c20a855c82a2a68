"""Real 2-worker DDP gangs of the example models through the local backend, built as the train task
builds them (a registered model's train(ctx), its pinned dataset version), and the training
contract's failure modes. A few seconds of training each; most of the time is the workers importing
torch."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tests.support.jobs import held_out_metric, job_spec, seed_example, staged_source

from hybridflow.backends.local import GangFailed, GangJob, GangPreempted, LocalGangBackend, pid_alive
from hybridflow.storage.objectstore import LocalObjectStore
from hybridflow.training.checkpoint import MANIFEST_NAME, CheckpointStore, step_prefix
from hybridflow.training.context import FINAL_MODEL_KEY, RESULT_KEY, attempt_status_key

CLUSTER = "onprem-a"
# Training functions that break the contract; the workers import them from here (contract_fns.py).
TRAINING_FNS = Path(__file__).resolve().parents[1] / "support" / "training_fns"
LOG_LINE = re.compile(r"step (\d+) loss \d+\.\d{4} [\d.]+ steps/s")


@pytest.fixture(scope="module")
def digits(digits_dataset):
    return digits_dataset


@pytest.fixture(scope="module")
def cancer(tmp_path_factory):
    return seed_example(tmp_path_factory.mktemp("private-bc"), "breast-cancer")


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


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["result"] = fn()
        except Exception as exc:  # handed to the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    return thread, outcome


def _wait_for_commits(checkpoints: CheckpointStore, thread: threading.Thread, outcome: dict, n: int = 1) -> None:
    deadline = time.monotonic() + 120
    while len(checkpoints.committed_steps()) < n:
        assert thread.is_alive() and time.monotonic() < deadline, outcome
        time.sleep(0.05)


def _weights(store: LocalObjectStore) -> dict:
    import torch

    return torch.load(io.BytesIO(store.get_bytes(FINAL_MODEL_KEY)), weights_only=True)


def test_two_worker_gang_trains_digits(tmp_path, digits):
    ckpt_root = tmp_path / "ckpt"
    backend = LocalGangBackend(tmp_path / "state", CLUSTER, capacity=4)
    lines: list[str] = []
    job = GangJob(name="digits-train", workers=2, spec=job_spec(digits, ckpt_root))

    result = backend.run(job, admission_timeout_s=10, log=lines.append)

    assert result.exit_codes == [0, 0]
    assert all(p.is_file() for p in result.log_paths)
    store = LocalObjectStore(ckpt_root)
    summary = json.loads(store.get_bytes(RESULT_KEY))
    assert digits.model.defaults()["steps"] == 300
    assert summary["final_step"] == 300 and summary["start_step"] == 0
    assert summary["world_size"] == 2 and summary["model"] == "digits-mlp"
    assert summary["hyperparameters"] == digits.model.defaults()
    assert summary["checkpoint_kind"] == "full"
    assert summary["checkpoints_written"] == 3
    assert summary["final_loss"] < 0.5
    # No GPU asked for by the local backend's default: CPU and gloo, said in the record and the log.
    assert (summary["device"], summary["backend"], summary["device_name"]) == ("cpu", "gloo", "cpu")
    assert CheckpointStore(store).committed_steps() == [200, 300]  # keep=2
    accuracy = held_out_metric(digits, store.get_bytes(FINAL_MODEL_KEY))
    assert accuracy > digits.model.metric.gate == 0.85
    assert 300 in [int(m.group(1)) for m in map(LOG_LINE.search, lines) if m]  # rank 0 streamed
    report = json.loads(store.get_bytes(attempt_status_key("1")))
    assert (report["outcome"], report["start_step"], report["last_step"], report["last_committed_step"]) == (
        "succeeded", 0, 300, 300)
    assert (report["device"], report["backend"]) == ("cpu", "gloo")
    assert any("device cpu (cpu), backend gloo" in line for line in lines)
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


def test_killed_launcher_leaves_no_workers_and_rerun_resumes(tmp_path, digits):
    ckpt_root, state_dir = tmp_path / "ckpt", tmp_path / "state"
    checkpoints = CheckpointStore(LocalObjectStore(ckpt_root))
    data = staged_source(digits, tmp_path / "staged")  # read from the cache, as a staged run does
    # Long enough that it is still training when killed; checkpoints on a timer, not by step count.
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(job_spec(digits, ckpt_root, data=data, hparams={"steps": 100_000},
                                             checkpoint_every_steps=10**9, checkpoint_every_seconds=0.2)))
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
    rerun_spec = job_spec(digits, ckpt_root, data=data, hparams={"steps": resume_from + 40},
                          checkpoint_every_steps=20)
    lines: list[str] = []
    backend.run(
        GangJob(name="resumable", workers=2, spec=rerun_spec, attempt="2"),
        admission_timeout_s=10,
        log=lines.append,
    )

    summary = json.loads(LocalObjectStore(ckpt_root).get_bytes(RESULT_KEY))
    assert summary["start_step"] == resume_from > 0
    assert summary["final_step"] == resume_from + 40
    assert any(f"resuming from checkpoint step {resume_from} (" in line for line in lines)
    assert backend.pool.usage() == 0


def test_gang_with_bad_data_fails_as_a_whole_and_releases_slots(tmp_path, digits):
    backend = LocalGangBackend(tmp_path / "state", CLUSTER, capacity=2)
    missing = {"kind": "local", "path": str(tmp_path / "no-such-dataset"), "version": str(digits.version_path)}
    job = GangJob(name="bad-data", workers=2, spec=job_spec(digits, tmp_path / "ckpt", data=missing))
    with pytest.raises(GangFailed, match=r"rank \d exited with code 1") as err:
        backend.run(job, admission_timeout_s=10, log=lambda line: None)
    assert "No such file or directory" in err.value.log_tail
    assert "no-such-dataset/train.csv" in err.value.log_tail
    assert err.value.exit_code == 1
    assert backend.pool.usage() == 0
    assert not (tmp_path / "ckpt" / RESULT_KEY).exists()


def test_one_crashing_worker_stops_the_gang(tmp_path, digits):
    backend = LocalGangBackend(tmp_path / "state", CLUSTER, capacity=2, grace_s=10)
    spec = job_spec(digits, tmp_path / "ckpt", inject_failure={"rank": 1, "step": 5})
    job = GangJob(name="crashy", workers=2, spec=spec)
    started = time.monotonic()
    with pytest.raises(GangFailed) as err:
        backend.run(job, admission_timeout_s=10, log=lambda line: None)
    assert err.value.rank == 1 and err.value.exit_code == 1
    assert "injected failure on rank 1 at step 5" in err.value.log_tail
    assert time.monotonic() - started < 60
    # Rank 0 reports the attempt failed. The drill fires in rank 1's ctx.log(5), after the step's
    # gradients were averaged across the gang and applied: step 5 is the last step every rank trained.
    report = json.loads(LocalObjectStore(tmp_path / "ckpt").get_bytes(attempt_status_key("1")))
    assert (report["outcome"], report["start_step"], report["last_step"]) == ("failed", 0, 5)
    assert backend.pool.usage() == 0
    assert not _worker_pids_for(tmp_path / "state" / "jobs" / "crashy")


def test_cancel_preempts_the_gang_after_a_checkpoint(tmp_path, digits):
    ckpt_root = tmp_path / "ckpt"
    checkpoints = CheckpointStore(LocalObjectStore(ckpt_root))
    backend = LocalGangBackend(tmp_path / "state", CLUSTER, capacity=2)
    spec = job_spec(digits, ckpt_root, hparams={"steps": 100_000}, checkpoint_every_steps=25)
    job = GangJob(name="cancel-me", workers=2, spec=spec)
    thread, outcome = _in_thread(lambda: backend.run(job, admission_timeout_s=10, log=lambda line: None))
    _wait_for_commits(checkpoints, thread, outcome)

    assert backend.cancel("cancel-me") is True  # what an operator's on_kill calls
    thread.join(60)

    assert isinstance(outcome.get("error"), GangPreempted)
    assert outcome["error"].exit_code == 75
    # The SIGTERM-time checkpoint is at the last step the gang finished, not the last periodic one.
    report = json.loads(LocalObjectStore(ckpt_root).get_bytes(attempt_status_key("1")))
    final = checkpoints.latest()
    assert report["outcome"] == "preempted"
    assert final is not None and final.step == report["last_step"] == report["last_committed_step"] > 0
    assert not (ckpt_root / RESULT_KEY).exists()
    assert backend.pool.usage() == 0


def test_job_spec_rejects_unknown_keys(tmp_path, digits):
    from hybridflow.training.worker import JobSpec

    spec = job_spec(digits, tmp_path)
    assert JobSpec.from_dict(spec).model["hyperparameters"]["steps"] == 300
    with pytest.raises(ValueError, match="unknown keys \\['trian_steps'\\]"):
        JobSpec.from_dict({**spec, "trian_steps": 5})
    # Training settings are the model's hyper-parameters now, not keys of the spec.
    with pytest.raises(ValueError, match="unknown keys \\['batch_size', 'train_steps'\\]"):
        JobSpec.from_dict({**spec, "train_steps": 5, "batch_size": 8})
    with pytest.raises(ValueError, match="needs name and entrypoint"):
        JobSpec.from_dict({**spec, "model": {"name": "digits-mlp"}})
    with pytest.raises(ValueError, match=r"lacks \['dataset'\]"):
        JobSpec.from_dict({k: v for k, v in spec.items() if k != "dataset"})


def test_job_spec_accepts_source_as_the_data_key(tmp_path, digits):
    from hybridflow.training.worker import JobSpec

    spec = job_spec(digits, tmp_path)
    spec["source"] = spec.pop("data")
    assert JobSpec.from_dict(spec).data == digits.local_source
    with pytest.raises(ValueError, match="twice"):
        JobSpec.from_dict({**spec, "data": spec["source"]})


# -- the training contract --------------------------------------------------------------------------
def test_sharded_gang_beats_the_gate_and_resumes_exactly_from_its_newest_checkpoint(tmp_path, cancer):
    ckpt_root = tmp_path / "ckpt"
    store = LocalObjectStore(ckpt_root)
    checkpoints = CheckpointStore(store)
    backend = LocalGangBackend(tmp_path / "state", CLUSTER, capacity=2)
    # FSDP (sharding zero3) with AdamW, as the run's Params ask: every rank checkpoints its part.
    spec = job_spec(cancer, ckpt_root, hparams={"steps": 60}, checkpoint_every_steps=15, keep=4,
                    training={"sharding": "zero3", "optimizer": "adamw"})

    backend.run(GangJob(name="bc", workers=2, spec=spec, attempt="1"), admission_timeout_s=10, log=lambda _: None)

    first = json.loads(store.get_bytes(RESULT_KEY))
    assert (first["start_step"], first["final_step"], first["world_size"]) == (0, 60, 2)
    assert first["checkpoint_kind"] == "sharded" and first["checkpoints_written"] == 4
    assert first["training"] == {"precision": "fp32", "optimizer": "adamw", "sharding": "zero3"}
    assert checkpoints.committed_steps() == [15, 30, 45, 60]
    assert checkpoints.latest().meta["kind"] == "sharded" and checkpoints.latest().meta["world_size"] == 2
    uninterrupted = _weights(store)
    assert cancer.model.metric.name == "roc_auc"
    auc = held_out_metric(cancer, store.get_bytes(FINAL_MODEL_KEY))
    assert auc > cancer.model.metric.gate, auc

    # The newest checkpoint is lost and the one before it is partial (no manifest, as when a gang
    # dies before committing): the rerun must take step 30, the newest committed one.
    for info in list(store.list(f"{step_prefix(60)}/")):
        store.delete(info.key)
    store.delete(f"{step_prefix(45)}/{MANIFEST_NAME}")
    store.delete(RESULT_KEY)
    store.delete(FINAL_MODEL_KEY)
    lines: list[str] = []
    backend.run(GangJob(name="bc", workers=2, spec=spec, attempt="2"), admission_timeout_s=10, log=lines.append)

    second = json.loads(store.get_bytes(RESULT_KEY))
    assert (second["start_step"], second["final_step"], second["checkpoint_kind"]) == (30, 60, "sharded")
    assert any(re.search(r"resuming from checkpoint step 30 \(.*, sharded\)", line) for line in lines), lines
    # Every rank loaded its part of model and optimizer state: the run ends where the uninterrupted one did.
    assert second["final_loss"] == first["final_loss"]
    resumed = _weights(store)
    assert resumed.keys() == uninterrupted.keys()
    assert all(resumed[k].equal(uninterrupted[k]) for k in uninterrupted)
    assert checkpoints.committed_steps() == [15, 30, 45, 60]


def test_a_killed_rank_fails_the_gang_and_the_rerun_resumes_from_the_newest_sharded_checkpoint(tmp_path, cancer):
    ckpt_root = tmp_path / "ckpt"
    checkpoints = CheckpointStore(LocalObjectStore(ckpt_root))
    # A short grace: rank 0 may be waiting for the dead rank's part of a checkpoint when it is stopped.
    backend = LocalGangBackend(tmp_path / "state", CLUSTER, capacity=2, grace_s=5)
    spec = job_spec(cancer, ckpt_root, hparams={"steps": 1_000_000}, checkpoint_every_steps=200,
                    checkpoint_every_seconds=0.3, training={"sharding": "zero2"})
    job = GangJob(name="bc-kill", workers=2, spec=spec, attempt="1")
    thread, outcome = _in_thread(lambda: backend.run(job, admission_timeout_s=10, log=lambda _: None))
    _wait_for_commits(checkpoints, thread, outcome, n=2)
    record = json.loads((backend.job_dir("bc-kill") / "running.json").read_text())
    victim = next(w["pid"] for w in record["workers"] if w["rank"] == 1)
    os.kill(victim, signal.SIGKILL)
    thread.join(90)

    assert not thread.is_alive()
    err = outcome.get("error")
    assert isinstance(err, GangFailed) and not isinstance(err, GangPreempted), outcome
    killed = f"rank 1 exited with code {-signal.SIGKILL}" in str(err) or f"rank 1: {-signal.SIGKILL}" in str(err)
    assert killed, str(err)
    assert backend.pool.usage() == 0 and not _worker_pids_for(backend.job_dir("bc-kill"))
    newest = checkpoints.latest()
    assert newest is not None and newest.step > 0 and newest.meta["kind"] == "sharded"

    rerun = job_spec(cancer, ckpt_root, hparams={"steps": newest.step + 20}, checkpoint_every_steps=10,
                     training={"sharding": "zero2"})
    lines: list[str] = []
    result = backend.run(GangJob(name="bc-kill", workers=2, spec=rerun, attempt="2"), admission_timeout_s=10,
                         log=lines.append)

    assert result.exit_codes == [0, 0]
    summary = json.loads(LocalObjectStore(ckpt_root).get_bytes(RESULT_KEY))
    assert (summary["start_step"], summary["final_step"]) == (newest.step, newest.step + 20)
    assert any(f"resuming from checkpoint step {newest.step} (" in line for line in lines), lines
    assert checkpoints.latest().step == newest.step + 20


def _contract_fn(name: str) -> dict:
    return {"name": "contract-test", "entrypoint": f"contract_fns:{name}", "hyperparameters": {}}


def test_an_error_in_the_training_function_fails_the_gang_with_its_traceback(tmp_path, digits):
    ckpt_root = tmp_path / "ckpt"
    backend = LocalGangBackend(tmp_path / "state", CLUSTER, capacity=2)
    spec = job_spec(digits, ckpt_root, model=_contract_fn("raises_bad_column"))
    job = GangJob(name="bad-fn", workers=2, spec=spec, env={"PYTHONPATH": str(TRAINING_FNS)})

    with pytest.raises(GangFailed) as err:
        backend.run(job, admission_timeout_s=10, log=lambda _: None)

    # An application error, not a preemption: exit 1, and the traceback reaches the task log whole.
    assert err.value.exit_code == 1 and not isinstance(err.value, GangPreempted)
    message = str(err.value)
    assert "Traceback (most recent call last)" in message
    assert re.search(r'contract_fns\.py", line \d+, in raises_bad_column', message), message
    assert "ValueError: bad column" in message
    report = json.loads(LocalObjectStore(ckpt_root).get_bytes(attempt_status_key("1")))
    assert (report["outcome"], report["error"], report["last_step"]) == ("failed", "ValueError: bad column", 1)
    assert not (ckpt_root / RESULT_KEY).exists() and not (ckpt_root / FINAL_MODEL_KEY).exists()
    assert backend.pool.usage() == 0


def test_a_training_function_that_saves_no_model_fails_saying_so(tmp_path, digits):
    ckpt_root = tmp_path / "ckpt"
    backend = LocalGangBackend(tmp_path / "state", CLUSTER, capacity=2)
    spec = job_spec(digits, ckpt_root, model=_contract_fn("forgets_the_model"))
    job = GangJob(name="no-model", workers=2, spec=spec, env={"PYTHONPATH": str(TRAINING_FNS)})

    with pytest.raises(GangFailed) as err:
        backend.run(job, admission_timeout_s=10, log=lambda _: None)

    assert err.value.exit_code == 1
    assert "contract_fns:forgets_the_model returned without ctx.save_model(model)" in str(err.value)
    report = json.loads(LocalObjectStore(ckpt_root).get_bytes(attempt_status_key("1")))
    assert report["outcome"] == "failed" and "without ctx.save_model" in report["error"]
    assert report["last_step"] == 3
    assert not (ckpt_root / RESULT_KEY).exists() and not (ckpt_root / FINAL_MODEL_KEY).exists()


def test_data_changed_after_it_was_pinned_is_refused_naming_the_file(tmp_path, digits):
    folder = tmp_path / "digits"
    shutil.copytree(digits.folder, folder)
    train = folder / "train.csv"
    raw = train.read_bytes()
    # One pixel value changed, the size kept: only the pinned SHA-256 can tell.
    at = raw.index(b"\n0,") + 1
    train.write_bytes(raw[:at] + b"1" + raw[at + 1:])
    assert train.stat().st_size == len(raw)
    changed = {"kind": "local", "path": str(folder), "version": str(digits.version_path)}
    backend = LocalGangBackend(tmp_path / "state", CLUSTER, capacity=1)
    job = GangJob(name="changed-data", workers=1, spec=job_spec(digits, tmp_path / "ckpt", data=changed))

    with pytest.raises(GangFailed) as err:
        backend.run(job, admission_timeout_s=10, log=lambda _: None)

    assert err.value.exit_code == 1
    assert "DataValidationError: digits/train.csv is not the file validate_data checked" in str(err.value)
    assert not (tmp_path / "ckpt" / FINAL_MODEL_KEY).exists()
