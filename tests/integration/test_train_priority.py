"""A critical run preempts a batch run on the local backend through the train task: the batch gang
checkpoints, is relaunched by its task, waits behind the critical gang and resumes where it stopped."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from hybridflow.datasets import seed_digits
from hybridflow.settings import REPO_ROOT


@pytest.fixture
def small_private(tmp_path, monkeypatch):
    """onprem-a with 2 GPUs: one gang of 2 fills it."""
    home, config = tmp_path / "home", tmp_path / "config"
    shutil.copytree(REPO_ROOT / "config", config)
    clusters = yaml.safe_load((config / "clusters.yaml").read_text())
    clusters["clusters"]["onprem-a"]["node_pools"][0]["gpus"] = 2
    (config / "clusters.yaml").write_text(yaml.safe_dump(clusters, sort_keys=False))
    pipeline = yaml.safe_load((config / "pipeline.yaml").read_text())
    pipeline["training"].update(preemption_grace_s=10)
    (config / "pipeline.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(home))
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(config))
    seed_digits(home / "private")
    return home


class _Task:
    def __init__(self, name: str, params: dict) -> None:
        from hybridflow import pipeline
        from hybridflow.operators.train import GangTrainOperator
        from hybridflow.runs import RunIdentity

        identity = RunIdentity("hybrid_training", f"manual__{name}", 1)
        self.run = pipeline.admit({"cluster_preference": "private", **params}, identity)
        placement = pipeline.choose_cluster(self.run)
        staged = pipeline.stage_data(self.run, placement)
        self.op = GangTrainOperator(task_id="train", run=self.run, placement=placement, staged=staged)
        self.context = {
            "dag": SimpleNamespace(dag_id=identity.dag_id),
            "run_id": identity.run_id,
            "ti": SimpleNamespace(try_number=1),
            "dag_run": SimpleNamespace(triggering_user_name="test"),
        }
        self.result: dict | None = None
        self.error: BaseException | None = None
        self.finished: float | None = None
        self.thread = threading.Thread(target=self._execute, daemon=True)

    def _execute(self) -> None:
        try:
            self.result = self.op.execute(self.context)
        except BaseException as exc:  # handed to the test thread
            self.error = exc
        self.finished = time.monotonic()

    def start(self) -> _Task:
        self.thread.start()
        return self


def test_critical_run_preempts_a_batch_run_which_resumes_after_it(small_private: Path) -> None:
    from hybridflow.storage.objectstore import LocalObjectStore
    from hybridflow.training.checkpoint import CheckpointStore

    home = small_private
    batch = _Task("batch", {"priority": "batch", "interruptible": True, "train_steps": 120,
                            "checkpoint_every_steps": 20}).start()
    place = CheckpointStore(LocalObjectStore(home / "private" / "checkpoints" / batch.run["run_key"]))
    deadline = time.monotonic() + 120
    while not place.committed_steps():
        assert batch.thread.is_alive() and time.monotonic() < deadline, batch.error
        time.sleep(0.1)
    critical = _Task("critical", {"priority": "critical", "train_steps": 20, "checkpoint_every_steps": 10}).start()
    critical.thread.join(240)
    batch.thread.join(240)
    assert critical.error is None and batch.error is None, (critical.error, batch.error)
    assert critical.result["final_step"] == 20 and critical.result["preemptions"] == 0
    first, second = batch.result["attempts"]
    assert (first["outcome"], second["outcome"]) == ("preempted", "succeeded")
    assert second["start_step"] == first["last_committed_step"] > 0  # resumed, nothing lost
    assert batch.result["final_step"] == 120
    # The critical gang ran in between: it finished before the batch gang's relaunch did.
    assert critical.finished < batch.finished
    attempts = json.loads((home / "private" / "runs" / critical.run["run_key"] / "train-attempts.json").read_text())
    assert [a["outcome"] for a in attempts] == ["succeeded"]
