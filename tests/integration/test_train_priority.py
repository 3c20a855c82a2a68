"""A critical run preempts a batch run on the local backend through the train task: the batch gang
checkpoints, is relaunched by its task, waits behind the critical gang and resumes where it stopped."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import yaml
from tests.support.train_task import seed_examples, train_task

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
    seed_examples(home)
    return home


class _Task:
    def __init__(self, name: str, params: dict) -> None:
        self.run, _, _, self.op, self.context = train_task(name, {"cluster_preference": "private", **params})
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
    # Admitted, validated and placed up front, so the critical gang asks for the GPUs as soon as the
    # batch gang has a checkpoint, while the batch gang still has most of its steps ahead.
    critical = _Task("critical", {"priority": "critical", "hyperparameters": {"steps": 20},
                                  "checkpoint_every_steps": 10})
    batch = _Task("batch", {"priority": "batch", "interruptible": True, "hyperparameters": {"steps": 400},
                            "checkpoint_every_steps": 20}).start()
    place = CheckpointStore(LocalObjectStore(home / "private" / "checkpoints" / batch.run["run_key"]))
    deadline = time.monotonic() + 120
    while not place.committed_steps():
        assert batch.thread.is_alive() and time.monotonic() < deadline, batch.error
        time.sleep(0.1)
    critical.start()
    critical.thread.join(240)
    batch.thread.join(240)
    assert critical.error is None and batch.error is None, (critical.error, batch.error)
    assert critical.result["final_step"] == 20 and critical.result["preemptions"] == 0
    first, second = batch.result["attempts"]
    assert (first["outcome"], second["outcome"]) == ("preempted", "succeeded")
    assert second["start_step"] == first["last_committed_step"] > 0  # resumed, nothing lost
    assert batch.result["final_step"] == 400
    # The critical gang ran in between: it finished before the batch gang's relaunch did.
    assert critical.finished < batch.finished
    attempts = json.loads((home / "private" / "runs" / critical.run["run_key"] / "train-attempts.json").read_text())
    assert [a["outcome"] for a in attempts] == ["succeeded"]
