"""Dataset versions in the cache: kept until pruned, pruning keeps at least three and deletes nothing
while a manifest cannot be read, and the cache command lists and prunes through a cluster's connection."""

from __future__ import annotations

import time
import uuid

import pytest
from tests.support.staging import NO_PACK, catalogue, dataset_folder, small_files, stage, store  # noqa: F401 (fixtures)

from hybridflow.cache import PruneRefused, list_versions, prune_versions
from hybridflow.staging import blob_prefix, read_manifest, versions_prefix
from hybridflow.storage.manifest import fetch_verified
from hybridflow.storage.s3 import S3ObjectStore

pytestmark = pytest.mark.s3


def test_versions_are_kept_until_pruned_and_pruning_keeps_at_least_three(stage, store, tmp_path):  # noqa: F811
    files = small_files(12, 1000, seed=6)
    ds = dataset_folder(tmp_path, "vers", files)
    results = []
    for i in range(5):
        (ds.path / "changing.txt").write_bytes(f"version {i}".encode())
        results.append(stage(ds, store, settings=NO_PACK))
        time.sleep(1.1)  # created_at has one-second resolution
    versions = list_versions(store, "vers")
    assert [v.version for v in versions] == [r.version for r in reversed(results)]
    with pytest.raises(ValueError, match="at least the last 3"):
        prune_versions(store, "vers", keep=2)
    dry = prune_versions(store, "vers", keep=3, protect_s=0, min_blob_age_s=0, dry_run=True)
    assert len(dry.versions_deleted) == 2 and dry.blobs_deleted == 2 and len(list_versions(store, "vers")) == 5
    report = prune_versions(store, "vers", keep=3, protect_s=0, min_blob_age_s=0)
    assert report.versions_deleted == [results[1].version, results[0].version]
    assert report.blobs_deleted == 2  # the two old "changing.txt" blobs; shared blobs stay
    for r in results[2:]:
        for entry in read_manifest(store, r.manifest_key).entries:
            fetch_verified(store, entry)
    # young unreferenced blobs (a stage in flight) survive a prune
    store.put_bytes(f"{blob_prefix('vers')}ff/in-flight", b"x")
    assert prune_versions(store, "vers", keep=3, protect_s=0).blobs_kept_young == 1


def test_prune_deletes_nothing_while_a_manifest_cannot_be_read(stage, store, tmp_path):  # noqa: F811
    ds = dataset_folder(tmp_path, "unread", small_files(4, 1000, seed=7))
    results = []
    for i in range(4):
        (ds.path / "changing.txt").write_bytes(f"version {i}".encode())
        results.append(stage(ds, store, settings=NO_PACK))
        time.sleep(1.1)  # created_at has one-second resolution
    # The oldest version's manifest cannot be read (a newer schema, a damaged object, a failed GET):
    # its blobs look unreferenced to every readable manifest, and are old enough to go.
    oldest = results[0]
    store.put_bytes(oldest.manifest_key, b'{"schema": 99, "not": "a manifest we know"}')
    own = {info.key for info in store.list(blob_prefix("unread"))}
    with pytest.raises(PruneRefused, match=f"cannot read manifest {oldest.manifest_key}.*nothing was pruned"):
        prune_versions(store, "unread", keep=3, protect_s=0, min_blob_age_s=0)
    assert {info.key for info in store.list(blob_prefix("unread"))} == own  # every blob survives
    assert len(list(store.list(versions_prefix("unread")))) == 4


def test_cache_command_lists_and_prunes_versions_through_the_clusters_connection(
    stage, rclone_s3, tmp_path, monkeypatch, capsys  # noqa: F811
):
    import shutil as _shutil

    import yaml

    from hybridflow.cli import main
    from hybridflow.devenv.rclone import airflow_conn_uri
    from hybridflow.settings import REPO_ROOT

    endpoint, access, secret, _ = rclone_s3
    bucket = f"hf-cli-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "config"
    _shutil.copytree(REPO_ROOT / "config", config)
    clusters = yaml.safe_load((config / "clusters.yaml").read_text())
    clusters["clusters"]["cloud-east"]["cache"] = {"conn_id": "hf_cli_cache", "bucket": bucket}
    (config / "clusters.yaml").write_text(yaml.safe_dump(clusters))
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(config))
    monkeypatch.setenv("AIRFLOW_CONN_HF_CLI_CACHE", airflow_conn_uri(access, secret, endpoint))
    store = S3ObjectStore(bucket, endpoint_url=endpoint, access_key=access, secret_key=secret)  # noqa: F811
    store.ensure_bucket()
    ds = dataset_folder(tmp_path, "clidata", {"a.txt": b"a"})
    made = []
    for i in range(4):
        (ds.path / "b.txt").write_bytes(f"b{i}".encode())
        made.append(stage(ds, store, settings=NO_PACK).version)
        time.sleep(1.1)
    assert main(["cache", "versions", "--cluster", "cloud-east", "--dataset", "clidata"]) == 0
    out = capsys.readouterr().out.splitlines()
    listed = [line.split()[0] for line in out if __import__("re").match(r"^[0-9a-f]{20}  ", line)]
    assert listed == list(reversed(made))
    with pytest.raises(SystemExit, match="--keep: keep=1"):
        main(["cache", "prune", "--cluster", "cloud-east", "--dataset", "clidata", "--keep", "1"])
    assert main(["cache", "prune", "--cluster", "cloud-east", "--dataset", "clidata", "--protect-hours", "0"]) == 0
    assert "deleted 1 versions and 1 blobs" in capsys.readouterr().out
    assert [v.version for v in list_versions(store, "clidata")] == list(reversed(made))[:3]
    with pytest.raises(SystemExit, match="has no cloud cache"):
        main(["cache", "versions", "--cluster", "onprem-a", "--dataset", "clidata"])


def _cache_cli(tmp_path, monkeypatch, rclone_s3, clusters_changes) -> None:
    """The shipped estate with ``clusters_changes`` merged into clusters.yaml, each cache through one
    connection to the S3 endpoint, and a home of the test's own (its runs folder)."""
    import shutil as _shutil

    import yaml

    from hybridflow.devenv.rclone import airflow_conn_uri
    from hybridflow.settings import REPO_ROOT

    endpoint, access, secret, _ = rclone_s3
    config = tmp_path / "config"
    _shutil.copytree(REPO_ROOT / "config", config)
    clusters = yaml.safe_load((config / "clusters.yaml").read_text())
    for name, changes in clusters_changes.items():
        clusters["clusters"][name] = {**clusters["clusters"].get(name, {}), **changes}
    (config / "clusters.yaml").write_text(yaml.safe_dump(clusters))
    monkeypatch.setenv("HYBRIDFLOW_CONFIG_DIR", str(config))
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AIRFLOW_CONN_HF_CLI_CACHE", airflow_conn_uri(access, secret, endpoint))


def _versions(stage, tmp_path, store, name: str, n: int) -> list[str]:  # noqa: F811
    """``n`` versions of dataset ``name`` staged into ``store``, oldest first."""
    ds = dataset_folder(tmp_path, name, {"a.txt": b"a"})
    made = []
    for i in range(n):
        (ds.path / "b.txt").write_bytes(f"b{i}".encode())
        made.append(stage(ds, store, settings=NO_PACK).version)
        time.sleep(1.1)
    return made


def test_prune_refuses_a_dr_cluster_and_deletes_nothing_there(stage, rclone_s3, tmp_path, monkeypatch):  # noqa: F811
    from hybridflow.cli import main

    endpoint, access, secret, _ = rclone_s3
    bucket = f"hf-dr-{uuid.uuid4().hex[:8]}"
    _cache_cli(tmp_path, monkeypatch, rclone_s3, {"dr-west": {
        "location": "private", "region": "dc-2", "jurisdiction": "eu", "backend": "local", "role": "dr",
        "dr": {"min_gpus": 1}, "prices": {"onprem": 0.5},
        "node_pools": [{"name": "a100", "gpu_model": "A100-80GB", "gpu_memory_gib": 80, "gpus": 2}],
        "cache": {"conn_id": "hf_cli_cache", "bucket": bucket}}})
    dr = S3ObjectStore(bucket, endpoint_url=endpoint, access_key=access, secret_key=secret)  # noqa: F811
    dr.ensure_bucket()
    made = _versions(stage, tmp_path, dr, "clidata", 4)  # replicas, in the layout a cache has
    with pytest.raises(SystemExit, match=r"hybridflow cache prune: --cluster dr-west has role: dr: its store holds "
                                         r"the disaster-recovery replicas.*nothing was deleted.*instead: cloud-east"):
        main(["cache", "prune", "--cluster", "dr-west", "--dataset", "clidata", "--protect-hours", "0"])
    assert sorted(v.version for v in list_versions(dr, "clidata")) == sorted(made)
    assert main(["cache", "versions", "--cluster", "dr-west", "--dataset", "clidata"]) == 0  # listing is fine


def test_prune_keeps_a_version_a_live_run_pins_whatever_its_age(stage, rclone_s3, tmp_path, monkeypatch,  # noqa: F811
                                                                 capsys):
    import json
    import os

    from hybridflow.cli import main

    endpoint, access, secret, _ = rclone_s3
    bucket = f"hf-pin-{uuid.uuid4().hex[:8]}"
    _cache_cli(tmp_path, monkeypatch, rclone_s3, {"cloud-east": {"cache": {"conn_id": "hf_cli_cache", "bucket": bucket}}})
    cache = S3ObjectStore(bucket, endpoint_url=endpoint, access_key=access, secret_key=secret)  # noqa: F811
    cache.ensure_bucket()
    made = _versions(stage, tmp_path, cache, "clidata", 5)
    # A critical run still training from the oldest version, staged for it two days ago; a run that
    # ended two days ago pinned the next one.
    runs = tmp_path / "home" / "private" / "runs"
    two_days_ago = time.time() - 2 * 86400
    for run, version, outcome in (("run-critical", made[0], "running"), ("run-ended", made[1], "failed")):
        (runs / run).mkdir(parents=True)
        (runs / run / "staging.json").write_text(json.dumps({"dataset": "clidata", "version": version}))
        (runs / run / "train-attempts.json").write_text(json.dumps([{"attempt": "a1", "outcome": outcome}]))
        for f in (runs / run).iterdir():
            os.utime(f, (two_days_ago, two_days_ago))
    assert main(["cache", "prune", "--cluster", "cloud-east", "--dataset", "clidata", "--protect-hours", "0"]) == 0
    out = capsys.readouterr().out
    assert "deleted 1 versions" in out and f"kept {made[0]}: pinned by live run run-critical" in out
    assert sorted(v.version for v in list_versions(cache, "clidata")) == sorted([made[0], *made[2:]])
    for entry in read_manifest(cache, f"{versions_prefix('clidata')}{made[0]}.json").entries:
        fetch_verified(cache, entry)  # the live run still reads every file of its version
    # A live run whose pin cannot be read may pin any version: nothing is pruned.
    (runs / "run-critical" / "staging.json").write_text("{")
    with pytest.raises(SystemExit, match=r"cannot read .*run-critical/staging.json .*the pin of run run-critical, "
                                         r"which is live.*nothing was pruned"):
        main(["cache", "prune", "--cluster", "cloud-east", "--dataset", "clidata", "--protect-hours", "0"])
    assert len(list_versions(cache, "clidata")) == 4
