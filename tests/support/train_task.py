"""A train task as the pipeline builds it (admit, validate_data, choose_cluster, stage_data), with the
slice of an Airflow task context the operator reads, for tests that execute it directly."""

from __future__ import annotations

from types import SimpleNamespace


def train_task(name: str, params: dict, try_number: int = 1):
    """(run, placement, staged, operator, context) of run ``manual__<name>`` of hybrid_training."""
    from hybridflow import pipeline
    from hybridflow.operators.train import GangTrainOperator
    from hybridflow.runs import RunIdentity

    identity = RunIdentity("hybrid_training", f"manual__{name}", try_number)
    run = pipeline.admit(params, identity)
    pipeline.validate_data(run)  # pins the dataset version training reads
    placement = pipeline.choose_cluster(run)
    staged = pipeline.stage_data(run, placement)
    op = GangTrainOperator(task_id="train", run=run, placement=placement, staged=staged)
    context = {
        "dag": SimpleNamespace(dag_id=identity.dag_id),
        "run_id": identity.run_id,
        "ti": SimpleNamespace(try_number=try_number),
        "dag_run": SimpleNamespace(triggering_user_name="test"),
    }
    return run, placement, staged, op, context


def seed_examples(home) -> None:
    """The catalogue's example datasets in ``home``'s private storage, as ``hybridflow seed`` writes them."""
    from hybridflow.config import load_estate
    from hybridflow.datasets import seed
    from hybridflow.settings import get_settings

    for entry in load_estate(get_settings().config_dir).datasets.datasets.values():
        if entry.seed:
            seed(entry, home / "private")
