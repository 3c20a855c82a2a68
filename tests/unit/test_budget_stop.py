"""A frozen project's running interruptible gang checkpoints and stops for good (no relaunch);
gangs of other projects, non-interruptible and critical gangs keep running."""

from __future__ import annotations

import threading
import time

from tests.support.jobs import job_spec

from hybridflow.backends.local import GangJob, GangPreempted, GangStopped, LocalGangBackend
from hybridflow.budgets.enforce import stop_interruptible_gangs
from hybridflow.config import load_estate
from hybridflow.settings import REPO_ROOT
from hybridflow.storage.objectstore import LocalObjectStore
from hybridflow.training.checkpoint import CheckpointStore

CLUSTER = "onprem-a"


def test_frozen_projects_interruptible_gang_checkpoints_and_stops(tmp_path, digits_dataset):
    estate = load_estate(REPO_ROOT / "config")
    state_dir = tmp_path / "state"
    cluster = estate.clusters[CLUSTER]
    backend = LocalGangBackend(state_dir, CLUSTER, cluster.total_gpus, grace_s=30)
    ckpt_root = tmp_path / "ckpt"
    checkpoints = CheckpointStore(LocalObjectStore(ckpt_root))
    spec = job_spec(digits_dataset, ckpt_root, hparams={"steps": 100_000}, run_key="frozen-run",
                    checkpoint_every_steps=25, keep=2, log_every_steps=1000)
    labels = {"project": "digits-ocr", "priority": "batch", "interruptible": "true"}
    job = GangJob(name="train-frozen-run", workers=1, spec=spec, labels=labels)
    outcome: dict = {}

    def launch() -> None:
        try:
            backend.run(job, admission_timeout_s=10, log=lambda line: None)
        except Exception as exc:  # handed to the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=launch)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while not checkpoints.committed_steps():
            assert thread.is_alive() and time.monotonic() < deadline, outcome
            time.sleep(0.05)
        assert [g["name"] for g in backend.running_gangs()] == ["train-frozen-run"]

        # Another project's freeze leaves this gang alone.
        assert stop_interruptible_gangs("ranking", "ranking is frozen", estate, state_dir) == []
        assert thread.is_alive()

        reason = "project 'digits-ocr' has spent 25,010.00 USD of its 25,000.00 USD budget for 2026-12"
        assert stop_interruptible_gangs("digits-ocr", reason, estate, state_dir) == ["train-frozen-run"]
        thread.join(60)
    finally:
        backend.cancel("train-frozen-run")
        thread.join(60)

    err = outcome.get("error")
    assert isinstance(err, GangStopped) and not isinstance(err, GangPreempted)  # the train task must not relaunch it
    assert err.exit_code == 75 and err.reason == reason
    assert checkpoints.latest() is not None and checkpoints.latest().step > 0  # resumable once lifted
    assert backend.pool.usage() == 0 and backend.running_gangs() == []
    assert not (backend.job_dir("train-frozen-run") / "stop.json").exists()  # a later clear runs normally


def test_only_interruptible_non_critical_gangs_of_the_project_are_chosen(tmp_path, monkeypatch):
    estate = load_estate(REPO_ROOT / "config")
    gangs = [
        {"name": "a", "attempt": "1", "labels": {"project": "digits-ocr", "priority": "normal", "interruptible": "true"}},
        {"name": "b", "attempt": "1", "labels": {"project": "digits-ocr", "priority": "normal", "interruptible": "false"}},
        {"name": "c", "attempt": "1", "labels": {"project": "digits-ocr", "priority": "critical", "interruptible": "true"}},
        {"name": "d", "attempt": "1", "labels": {"project": "ranking", "priority": "batch", "interruptible": "true"}},
    ]
    asked: list[str] = []
    monkeypatch.setattr(LocalGangBackend, "running_gangs", lambda self: gangs if self.cluster == CLUSTER else [])
    monkeypatch.setattr(LocalGangBackend, "stop", lambda self, name, reason: asked.append(name) or True)
    assert stop_interruptible_gangs("digits-ocr", "frozen", estate, tmp_path) == ["a"]
    assert asked == ["a"]
