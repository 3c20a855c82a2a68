"""Where checkpoints go (config/clusters.yaml, pipeline.yaml training section) and how the run record
counts training steps across preempted and failed attempts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from hybridflow.config import load_estate
from hybridflow.errors import ConfigError
from hybridflow.records import training_summary
from hybridflow.settings import REPO_ROOT, Settings

SHIPPED = REPO_ROOT / "config"


def _copy(tmp_path: Path, filename: str, mutate) -> Path:
    target = tmp_path / "config"
    shutil.copytree(SHIPPED, target)
    data = yaml.safe_load((target / filename).read_text())
    mutate(data)
    (target / filename).write_text(yaml.safe_dump(data, sort_keys=False))
    return target


def test_shipped_clusters_keep_checkpoints_in_two_places():
    estate = load_estate(SHIPPED, use_cache=False)
    assert estate.clusters["cloud-east"].checkpoint_places == ("cache", "private")
    assert estate.clusters["onprem-a"].checkpoint_places == ("private", "scratch")
    training = estate.pipeline.training
    assert training.interruptible_checkpoint_every_s == 300
    assert training.preemption_grace_s == 30 and training.preemption_retries == 3


def test_replica_defaults_to_the_other_place(tmp_path):
    def mutate(data):
        for cluster in data["clusters"].values():
            cluster.pop("checkpoint_replica", None)
            cluster.pop("scratch_dir", None)

    estate = load_estate(_copy(tmp_path, "clusters.yaml", mutate), use_cache=False)
    assert estate.clusters["cloud-east"].checkpoint_places == ("cache", "private")
    assert estate.clusters["onprem-a"].checkpoint_places == ("private", "scratch")


def _cluster(name: str, **values):
    def mutate(data):
        data["clusters"][name].update(values)

    return mutate


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (
            _cluster("onprem-a", checkpoint_replica="private"),
            ["clusters.onprem-a.checkpoint_replica", "also checkpoint_store", "two different places", "'scratch'"],
        ),
        (
            _cluster("onprem-a", checkpoint_replica="cache", cache={"conn_id": "c", "bucket": "b"}),
            ["clusters.onprem-a.checkpoint_replica", "restricted data", "never go to a cloud cache"],
        ),
        (
            _cluster("cloud-east", checkpoint_replica="cache"),
            ["clusters.cloud-east.checkpoint_replica", "also checkpoint_store"],
        ),
        (
            _cluster("cloud-east", scratch_dir="/scratch/east"),
            ["clusters.cloud-east.scratch_dir", "only used when", "checkpoint_replica: scratch"],
        ),
        (
            _cluster("onprem-a", checkpoint_replica="tape"),
            ["clusters.onprem-a.checkpoint_replica", "'private', 'cache' or 'scratch'"],
        ),
        (_cluster("onprem-a", scratch_dir=""), ["clusters.onprem-a.scratch_dir", "at least 1 character"]),
    ],
)
def test_bad_checkpoint_places_name_the_key_and_fix(tmp_path, mutate, expected):
    target = _copy(tmp_path, "clusters.yaml", mutate)
    with pytest.raises(ConfigError) as info:
        load_estate(target, use_cache=False)
    message = str(info.value)
    assert str(target / "clusters.yaml") in message
    for part in expected:
        assert part in message, f"{part!r} not in:\n{message}"


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("preemption_grace_s", 0, "training.preemption_grace_s"),
        ("preemption_retries", -1, "training.preemption_retries"),
        ("interruptible_checkpoint_every_s", 0, "training.interruptible_checkpoint_every_s"),
        ("preemption_budget", 2, "preemption_retries"),  # a typo lists the allowed keys
    ],
)
def test_bad_training_settings_name_the_key(tmp_path, key, value, expected):
    target = _copy(tmp_path, "pipeline.yaml", lambda data: data["training"].update({key: value}))
    with pytest.raises(ConfigError, match="pipeline.yaml") as info:
        load_estate(target, use_cache=False)
    assert expected in str(info.value)


def test_checkpoint_place_specs_per_cluster(tmp_path, monkeypatch):
    from hybridflow.placement import places

    estate = load_estate(SHIPPED, use_cache=False)
    settings = Settings(home=tmp_path / "home", config_dir=SHIPPED)
    onprem = estate.clusters["onprem-a"]
    primary = places.checkpoint_store_spec("run-1", onprem, settings)
    replica = places.checkpoint_replica_spec("run-1", onprem, settings)
    assert Path(primary.root) == settings.private_root / "checkpoints" / "run-1"
    assert Path(replica.root) == settings.home / "scratch" / "onprem-a" / "checkpoints" / "run-1"
    absolute = onprem.model_copy(update={"scratch_dir": str(tmp_path / "lustre")})
    absolute._name = "onprem-a"
    assert Path(places.checkpoint_replica_spec("run-1", absolute, settings).root) == (
        tmp_path / "lustre" / "checkpoints" / "run-1"
    )

    # A public cluster commits to its cache bucket (through the cache connection) and replicates
    # to private storage.
    monkeypatch.setenv(
        "AIRFLOW_CONN_HYBRIDFLOW_CACHE_CLOUD_EAST",
        "aws://access-key-123:secret-key-123@/?endpoint_url=http%3A%2F%2F127.0.0.1%3A9&region_name=us-east-1",
    )
    east = estate.clusters["cloud-east"]
    primary = places.checkpoint_store_spec("run-1", east, settings)
    replica = places.checkpoint_replica_spec("run-1", east, settings)
    assert (primary.kind, primary.bucket, primary.prefix) == ("s3", "hf-cache-cloud-east", "checkpoints/run-1")
    assert Path(replica.root) == settings.private_root / "checkpoints" / "run-1"


def _attempt(outcome, start, last, committed=None):
    return {"outcome": outcome, "start_step": start, "last_step": last, "last_committed_step": committed}


def test_training_summary_counts_each_step_once():
    # Preempted at 106 with a final checkpoint at 106, relaunched from 106: nothing is redone.
    attempts = [_attempt("preempted", 0, 106, 106), _attempt("succeeded", 106, 300, 300)]
    assert training_summary(attempts, 300) == {
        "steps_trained": 300,
        "steps_run": 300,
        "steps_lost": 0,
        "attempts": 2,
        "preemptions": 1,
        "failures": 0,
        "attempts_without_last_step": 0,
    }


def test_training_summary_counts_work_redone_after_a_failure():
    # Failed at 180 with the newest checkpoint at 150: steps 151..180 ran twice.
    attempts = [
        _attempt("failed", 0, 180, 150),
        _attempt("preempted", 150, 220, 220),
        _attempt("interrupted", 220, None, 250),  # killed outright: its last step is unknown
        _attempt("succeeded", 250, 400, 400),
    ]
    summary = training_summary(attempts, 400)
    assert summary["steps_trained"] == 400
    assert summary["steps_run"] == 180 + 70 + 150
    assert summary["steps_lost"] == 30
    assert (summary["preemptions"], summary["failures"], summary["attempts_without_last_step"]) == (1, 2, 1)


def test_training_summary_counts_the_restarts_a_kubernetes_gang_made_inside_one_attempt():
    # Evicted twice by Kueue and resumed each time: one attempt, two preemptions the cluster counted.
    attempts = [{**_attempt("succeeded", 0, 300, 300), "preemptions": 2}]
    assert training_summary(attempts, 300)["preemptions"] == 2
