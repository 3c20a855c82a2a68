"""The train task fails over: a gang its cluster does not admit in time trains on the next candidate."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from tests.support.train_task import seed_examples, train_task

from hybridflow.backends.local import LocalSlotPool
from hybridflow.settings import REPO_ROOT


@pytest.fixture
def two_private(tmp_path, monkeypatch):
    """Shipped config plus onprem-b, a cheaper twin of onprem-a; a 1 s gang admission timeout."""
    home, config = tmp_path / "home", tmp_path / "config"
    shutil.copytree(REPO_ROOT / "config", config)
    clusters = yaml.safe_load((config / "clusters.yaml").read_text())
    twin = json.loads(json.dumps(clusters["clusters"]["onprem-a"]))
    twin["prices"]["onprem"] = 0.90
    twin["scratch_dir"] = "scratch/onprem-b"
    clusters["clusters"]["onprem-b"] = twin
    (config / "clusters.yaml").write_text(yaml.safe_dump(clusters, sort_keys=False))
    pipeline = yaml.safe_load((config / "pipeline.yaml").read_text())
    pipeline["training"].update(gang_admission_timeout_s=1, preemption_grace_s=5)
    pipeline["placement"]["spill_threshold"] = 0.9
    (config / "pipeline.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(home))
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(config))
    seed_examples(home)
    return home


def _train_task(name: str, params: dict):
    run, placement, staged, op, context = train_task(name, {"cluster_preference": "private", **params})
    return run, placement, staged, op, context


def test_gang_not_admitted_fails_over_to_the_next_candidate(two_private: Path) -> None:
    home = two_private
    run, placement, staged, op, context = _train_task("failover", {"hyperparameters": {"steps": 40}, "checkpoint_every_steps": 20})
    assert placement["cluster"] == "onprem-b"  # the cheaper twin wins the first placement
    blocker = LocalSlotPool(home / "state", "onprem-b", 4)
    assert blocker.try_acquire("someone-else", 4)
    try:
        result = op.execute(context)
    finally:
        blocker.release("someone-else")
    assert result["cluster"] == "onprem-a" and result["final_step"] == 40
    run_folder = home / "private" / "runs" / run["run_key"]
    recorded = json.loads((run_folder / "placement.json").read_text())
    assert recorded["cluster"] == "onprem-a"
    assert recorded["failovers"] == [{"cluster": "onprem-b", "reason": "gang not admitted within 1 s"}]
    excluded = next(c for c in recorded["candidates"] if c["cluster"] == "onprem-b")
    assert excluded["rules"]["excluded"] == "excluded: gang not admitted within 1 s"
    attempts = json.loads((run_folder / "train-attempts.json").read_text())
    assert [(a["cluster"], a["outcome"]) for a in attempts] == [("onprem-b", "not_admitted"), ("onprem-a", "succeeded")]

    # A retried train task gets the placement step's XCom again (onprem-b) and no copy of the move:
    # the run's newest checkpoint, committed on onprem-a, takes it back there, resuming at step 40.
    (run_folder / "placement.json").unlink()
    retry, context = _retry(run, placement, staged, "manual__failover", try_number=2)
    again = retry.execute(context)
    assert again["cluster"] == "onprem-a" and again["final_step"] == 40
    attempts = json.loads((run_folder / "train-attempts.json").read_text())
    assert (attempts[-1]["cluster"], attempts[-1]["attempt"]) == ("onprem-a", "try-2")
    shown = json.loads((run_folder / "placement.json").read_text())  # the run's page shows the move
    assert shown["cluster"] == "onprem-a" and shown["failovers"][0]["cluster"] == "onprem-b"
    assert "newest checkpoint (step 40" in shown["failovers"][0]["reason"]


def test_a_placement_decided_after_the_newest_checkpoint_wins_over_it(two_private: Path) -> None:
    """Clearing choose_cluster places the run afresh: a retry then trains where that decision says,
    even though the run's newest checkpoint was made elsewhere."""
    from hybridflow.config import load_estate
    from hybridflow.settings import get_settings
    from hybridflow.training.failover import newest_checkpoint, resume_placement

    run, placement, staged, op, context = train_task("replaced", {"cluster_preference": "private", "hyperparameters": {"steps": 20},
                                                                  "checkpoint_every_steps": 10})
    assert op.execute(context)["cluster"] == "onprem-b"
    settings, estate = get_settings(), load_estate(get_settings().config_dir)
    newest = newest_checkpoint(run, estate, settings)
    assert (newest.cluster, newest.step) == ("onprem-b", 20)
    moved = {**placement, "cluster": "onprem-a", "decided_at": newest.committed_at + 1}  # decided afterwards
    assert resume_placement(run, moved, staged, estate, settings)[0]["cluster"] == "onprem-a"
    before = {**moved, "decided_at": newest.committed_at - 1}  # decided before onprem-b's checkpoint
    assert resume_placement(run, before, staged, estate, settings)[0]["cluster"] == "onprem-b"


def _retry(run, placement, staged, run_id: str, try_number: int):
    from types import SimpleNamespace

    from hybridflow.operators.train import GangTrainOperator

    op = GangTrainOperator(task_id="train", run=run, placement=placement, staged=staged)
    context = {"dag": SimpleNamespace(dag_id="hybrid_training"), "run_id": run_id,
               "ti": SimpleNamespace(try_number=try_number), "dag_run": SimpleNamespace(triggering_user_name="test")}
    return op, context


def test_with_no_other_cluster_free_the_gang_keeps_its_place_instead_of_failing(two_private: Path) -> None:
    from airflow.sdk.exceptions import TaskDeferred

    from hybridflow.queueing import QueueWaitTrigger

    home = two_private
    run, placement, _, op, context = _train_task("nowhere", {"hyperparameters": {"steps": 40}, "checkpoint_every_steps": 20})
    pools = [LocalSlotPool(home / "state", name, 4) for name in ("onprem-a", "onprem-b")]
    for pool in pools:
        assert pool.try_acquire("someone-else", 4)
    try:
        with pytest.raises(TaskDeferred) as deferred:
            op.execute(context)
    finally:
        for pool in pools:
            pool.release("someone-else")
    trigger = deferred.value.trigger
    # Placement chose onprem-b; onprem-a has no room either, so the run waits on onprem-b, no retry spent.
    assert isinstance(trigger, QueueWaitTrigger) and trigger.cluster == "onprem-b"
    assert trigger.recheck_s == 1 and trigger.max_wait_s == 86_400
    recorded = json.loads((home / "private" / "runs" / run["run_key"] / "placement.json").read_text())
    assert recorded["cluster"] == "onprem-b" and not recorded.get("failovers")
