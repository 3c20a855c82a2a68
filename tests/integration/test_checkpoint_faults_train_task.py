"""SIGTERM preemption through the train task: the gang commits its final checkpoint within the grace
period and the relaunch resumes from it; a preemption beyond the budget, or on_kill, ends the task."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from tests.support.train_task import seed_examples, train_task

from hybridflow.backends.local import pid_alive
from hybridflow.storage.objectstore import LocalObjectStore

pytestmark = [pytest.mark.s3]

GRACE_S = 20.0


@pytest.fixture
def train_home(tmp_path, monkeypatch):
    """An isolated HYBRIDFLOW_HOME and config (small preemption budget and grace) with the digits set."""
    import shutil

    import yaml

    from hybridflow.settings import REPO_ROOT

    home, config = tmp_path / "home", tmp_path / "config"
    shutil.copytree(REPO_ROOT / "config", config)
    pipeline = yaml.safe_load((config / "pipeline.yaml").read_text())
    pipeline["training"].update(preemption_grace_s=GRACE_S, preemption_retries=1)
    (config / "pipeline.yaml").write_text(yaml.safe_dump(pipeline))
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(home))
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(config))
    seed_examples(home)
    return home, config


def _set_training(config: Path, **values) -> None:
    import yaml

    pipeline = yaml.safe_load((config / "pipeline.yaml").read_text())
    pipeline["training"].update(values)
    (config / "pipeline.yaml").write_text(yaml.safe_dump(pipeline))


class _TrainTask:
    """The train task as Airflow runs it: GangTrainOperator.execute in its own thread."""

    def __init__(self, name: str, params: dict) -> None:
        import threading

        from hybridflow.runs import RunIdentity

        self.run, _, _, self.op, self.context = train_task(name, {"cluster_preference": "private", **params})
        self.identity = RunIdentity.from_context(self.context)
        self.result: dict | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._execute, daemon=True)

    def _execute(self) -> None:
        try:
            self.result = self.op.execute(self.context)
        except BaseException as exc:  # handed to the test thread
            self.error = exc

    @property
    def run_key(self) -> str:
        return self.run["run_key"]

    def start(self) -> _TrainTask:
        self.thread.start()
        return self

    def join(self, timeout: float = 300) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the train task did not finish"


def _gang_pids(job_dir: Path) -> list[int]:
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


def _wait_for_checkpoint(home: Path, task: _TrainTask, timeout: float = 120) -> None:
    from hybridflow.training.checkpoint import CheckpointStore

    place = CheckpointStore(LocalObjectStore(home / "private" / "checkpoints" / task.run_key))
    deadline = time.monotonic() + timeout
    while not place.committed_steps():
        assert task.thread.is_alive() and time.monotonic() < deadline, task.error
        time.sleep(0.05)


def _attempts(home: Path, run_key: str) -> list[dict]:
    return json.loads((home / "private" / "runs" / run_key / "train-attempts.json").read_text())


def test_sigterm_preemption_commits_within_grace_and_the_relaunch_resumes(train_home):
    from hybridflow.records import build_record
    from hybridflow.request import AdmittedRun

    home, _ = train_home
    task = _TrainTask("preempt", {"hyperparameters": {"steps": 1500}, "checkpoint_every_steps": 100,
                                  "interruptible": True})
    task.start()
    gang = home / "state" / "jobs" / f"train-{task.run_key}"
    try:
        _wait_for_checkpoint(home, task)
        victims = _gang_pids(gang / "try-1")
        assert len(victims) == 2
        # A spot reclaim: every worker of the gang gets SIGTERM at once.
        sent = time.monotonic()
        for pid in victims:
            os.kill(pid, signal.SIGTERM)
        while any(pid_alive(p) for p in victims):
            assert time.monotonic() - sent < GRACE_S + 5, "preempted workers outlived the grace period"
            time.sleep(0.02)
        exited_after = time.monotonic() - sent
        task.join()
    finally:
        for pid in _gang_pids(gang):
            os.kill(pid, signal.SIGKILL)
    assert task.error is None, task.error
    result = task.result
    assert exited_after < GRACE_S

    first, second = result["attempts"]
    assert (first["attempt"], first["outcome"]) == ("try-1", "preempted")
    assert (second["attempt"], second["outcome"]) == ("try-1-relaunch-1", "succeeded")
    # The final checkpoint is at the step the gang stopped after, committed inside the grace period,
    # and the relaunch resumed from exactly that step.
    assert first["last_step"] == first["last_committed_step"] == second["start_step"] > 0
    assert 0 < first["sigterm_to_commit_s"] < GRACE_S
    relaunch_log = (gang / "try-1-relaunch-1" / "rank-0.log").read_text()
    assert f"resuming from checkpoint step {second['start_step']}" in relaunch_log
    assert result["preemptions"] == 1 and result["final_step"] == 1500
    assert result["start_step"] == second["start_step"]

    record = build_record(AdmittedRun.from_xcom(task.run), task.identity, {"train": result})
    training = record["training"]
    assert training["preemptions"] == 1 and training["attempts"] == 2
    assert training["steps_trained"] == record["checkpoints"]["final_step"] == 1500
    assert training["steps_run"] == 1500 and training["steps_lost"] == 0  # nothing trained twice
    assert [a["outcome"] for a in record["train_attempts"]] == ["preempted", "succeeded"]


def test_preemptions_beyond_the_budget_fail_the_task_clearly(train_home):
    from airflow.sdk.exceptions import AirflowFailException

    home, config = train_home
    _set_training(config, preemption_retries=0)
    task = _TrainTask("budget", {"hyperparameters": {"steps": 5000}, "checkpoint_every_steps": 100})
    task.start()
    gang = home / "state" / "jobs" / f"train-{task.run_key}"
    try:
        _wait_for_checkpoint(home, task)
        for pid in _gang_pids(gang / "try-1"):
            os.kill(pid, signal.SIGTERM)
        task.join()
    finally:
        for pid in _gang_pids(gang):
            os.kill(pid, signal.SIGKILL)
    assert isinstance(task.error, AirflowFailException), task.error
    message = str(task.error)
    assert "preempted 1 times" in message and "training.preemption_retries = 0" in message
    assert "clear the train task" in message
    assert [a["outcome"] for a in _attempts(home, task.run_key)] == ["preempted"]
    assert not (gang / "try-1-relaunch-1").exists()


def test_on_kill_stops_the_gang_and_is_not_relaunched_as_a_preemption(train_home):
    home, _ = train_home
    task = _TrainTask("on-kill", {"hyperparameters": {"steps": 5000}, "checkpoint_every_steps": 100})
    task.start()
    gang = home / "state" / "jobs" / f"train-{task.run_key}"
    try:
        _wait_for_checkpoint(home, task)
        task.op.on_kill()  # what Airflow calls when the task is stopped (marked failed, timeout)
        task.join(60)
    finally:
        for pid in _gang_pids(gang):
            os.kill(pid, signal.SIGKILL)
    assert task.error is not None  # the task ends; it does not train on in a relaunched gang
    assert not _gang_pids(gang)
    attempts = _attempts(home, task.run_key)
    assert [a["outcome"] for a in attempts] == ["interrupted"]
    assert attempts[0]["last_committed_step"] > 0
    assert not (gang / "try-1-relaunch-1").exists()
