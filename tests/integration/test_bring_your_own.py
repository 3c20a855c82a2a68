"""A team's own model and data through the pipeline's tasks: sovereignty taken from the catalogue,
regions kept, and a training function that fails spending an Airflow retry, not a preemption."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from tests.support.train_task import seed_examples, train_task

from hybridflow import pipeline
from hybridflow.errors import SovereigntyError
from hybridflow.runs import RunIdentity
from hybridflow.settings import REPO_ROOT

TRAINING_FNS = Path(__file__).resolve().parents[1] / "support" / "training_fns"


def _estate(tmp_path: Path, monkeypatch, edit=None) -> Path:
    home, config = tmp_path / "home", tmp_path / "config"
    shutil.copytree(REPO_ROOT / "config", config)
    if edit:
        edit(config)
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(home))
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(config))
    seed_examples(home)
    return home


def _edit_yaml(path: Path, change) -> None:
    body = yaml.safe_load(path.read_text())
    change(body)
    path.write_text(yaml.safe_dump(body, sort_keys=False))


def test_a_restricted_dataset_with_default_params_is_placed_and_staged_privately(tmp_path, monkeypatch):
    home = _estate(tmp_path, monkeypatch)
    # The private pool is busy enough that a run of internal data would spill to the public cloud.
    from hybridflow.backends.local import LocalSlotPool

    busy = LocalSlotPool(home / "state", "onprem-a", 4)
    assert busy.try_acquire("someone-else", 3)
    try:
        internal = pipeline.admit({"interruptible": True, "spot_allowed": True},
                                  RunIdentity("hybrid_training", "manual__internal"))
        assert pipeline.choose_cluster(internal)["cluster"] == "cloud-east"
        run = pipeline.admit({"model": "breast-cancer", "interruptible": True, "spot_allowed": True},
                             RunIdentity("hybrid_training", "manual__restricted"))
        assert run["classification"] == "restricted"  # from datasets.yaml, not from the form
        pipeline.validate_data(run)
        placement = pipeline.choose_cluster(run)
        staged = pipeline.stage_data(run, placement)
    finally:
        busy.release("someone-else")
    assert placement["cluster"] == "onprem-a" and placement["location"] == "private"
    east = next(c for c in placement["candidates"] if c["cluster"] == "cloud-east")
    assert east["rules"]["sovereignty"] == ("dataset breast-cancer is restricted: restricted data never leaves "
                                            "private clusters")
    assert staged["staged"] is False and staged["source"]["kind"] == "local"
    assert not list((home / "clouds").rglob("breast-cancer*"))


def test_staging_refuses_what_the_catalogue_forbids_even_when_placement_is_forged(tmp_path, monkeypatch, rclone_s3):
    """An EU-only dataset never reaches a US cache: the staging guard reads the catalogue itself."""
    from hybridflow.devenv.rclone import airflow_conn_uri

    endpoint, access, secret, data_dir = rclone_s3
    (data_dir / "hf-us-cache").mkdir()
    monkeypatch.setenv("AIRFLOW_CONN_HYBRIDFLOW_CACHE_CLOUD_EAST", airflow_conn_uri(access, secret, endpoint))

    def eu_only(config: Path) -> None:
        _edit_yaml(config / "clusters.yaml",
                   lambda b: b["clusters"]["cloud-east"]["cache"].update(bucket="hf-us-cache"))
        _edit_yaml(config / "datasets.yaml", lambda b: b["datasets"]["digits"].update(regions=["eu"]))

    _estate(tmp_path, monkeypatch, eu_only)
    run = pipeline.admit({"interruptible": True, "spot_allowed": True}, RunIdentity("hybrid_training", "manual__eu"))
    assert run["regions"] == ["eu"]
    pipeline.validate_data(run)
    placement = pipeline.choose_cluster(run)
    assert placement["cluster"] == "onprem-a"  # the only cluster in the EU
    forged = {**placement, "cluster": "cloud-east", "location": "public"}
    with pytest.raises(SovereigntyError, match="may only be processed in eu"):
        pipeline.stage_data(run, forged)
    assert not [p for p in (data_dir / "hf-us-cache").rglob("*") if p.is_file()], "data reached the US cache"
    # A run that raised the classification is refused by the same guard, from the same reading.
    raised = pipeline.admit({"classification": "restricted"}, RunIdentity("hybrid_training", "manual__raised"))
    pipeline.validate_data(raised)
    with pytest.raises(SovereigntyError, match="is restricted"):
        pipeline.stage_data(raised, forged)


def test_a_training_function_that_raises_fails_the_try_with_its_traceback(tmp_path, monkeypatch):
    """An application error is not a preemption: one attempt, outcome failed, the traceback in the
    exception the task log shows, no relaunch; Airflow's own retries take it from there."""
    from hybridflow.backends.local import GangFailed

    def failing_model(config: Path) -> None:
        def register(body: dict) -> None:
            body["models"]["team-model"] = {**body["models"]["digits-mlp"],
                                           "entrypoint": "contract_fns:raises_bad_column"}
            body["models"]["team-model"].pop("serving")
        _edit_yaml(config / "models.yaml", register)

    _estate(tmp_path, monkeypatch, failing_model)
    monkeypatch.syspath_prepend(str(TRAINING_FNS))  # importable here (admission) ...
    monkeypatch.setenv("PYTHONPATH", str(TRAINING_FNS))  # ... and in the gang's workers
    run, _, _, op, context = train_task("fails", {"model": "team-model", "cluster_preference": "private"})
    with pytest.raises(GangFailed) as failed:
        op.execute(context)
    message = str(failed.value)
    assert "exited with code 1" in message and "Traceback (most recent call last)" in message
    assert "raises_bad_column" in message and "ValueError: bad column" in message
    attempts = json.loads((Path(tmp_path / "home" / "private" / "runs" / run["run_key"]) /
                           "train-attempts.json").read_text())
    assert [a["outcome"] for a in attempts] == ["failed"]  # no preemption relaunch was spent


def test_a_dataset_in_a_private_bucket_is_validated_and_trained_on_where_it_lives(tmp_path, monkeypatch, rclone_s3):
    """A catalogue entry at s3://<bucket>/<prefix> on a private endpoint: admission reads its header and
    suites through the Connection, validate_data pins the objects, and the gang on the private cluster
    reads them in place, each checked against the pinned version."""
    from hybridflow.devenv.rclone import airflow_conn_uri
    from hybridflow.storage.s3 import S3ObjectStore

    endpoint, access, secret, data_dir = rclone_s3
    monkeypatch.setenv("AIRFLOW_CONN_TEAM_DATA", airflow_conn_uri(access, secret, endpoint))

    def in_a_bucket(config: Path) -> None:
        def add(body: dict) -> None:
            entry = dict(body["datasets"]["digits"], location="s3://team-data/datasets/digits", conn_id="team_data")
            entry.pop("seed")
            body["datasets"]["digits-s3"] = entry
        _edit_yaml(config / "datasets.yaml", add)

    home = _estate(tmp_path, monkeypatch, in_a_bucket)
    bucket = S3ObjectStore("team-data", endpoint_url=endpoint, access_key=access, secret_key=secret)
    bucket.ensure_bucket()
    local = home / "private" / "datasets" / "digits"
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        bucket.put_bytes(f"datasets/digits/{path.relative_to(local).as_posix()}", path.read_bytes())

    run, placement, staged, op, context = train_task(
        "bucket", {"dataset": "digits-s3", "cluster_preference": "private", "hyperparameters": {"steps": 30},
                   "checkpoint_every_steps": 10})
    assert run["dataset_location"] == "s3://team-data/datasets/digits"
    assert placement["cluster"] == "onprem-a"
    assert staged["source"]["kind"] == "store" and staged["source"]["store"]["bucket"] == "team-data"
    assert "access_key" not in json.dumps(staged)  # credentials reach the workers through their environment only
    result = op.execute(context)
    assert result["final_step"] == 30
    version = json.loads((home / "private" / "runs" / run["run_key"] / "dataset-version.json").read_text())
    assert sorted(e["key"] for e in version["manifest"]["entries"]) == [
        "datasets/digits/test.csv", "datasets/digits/train.csv"]
    # An object replaced after validation is refused by the next read, naming it.
    bucket.put_bytes("datasets/digits/test.csv", b"pixel_0,label\n1,2\n")
    with pytest.raises(Exception, match="digits-s3/test.csv is not the file validate_data checked"):
        pipeline.evaluate(run, result)
