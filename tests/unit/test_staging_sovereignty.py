"""stage_dataset's sovereignty guard: data goes only where its classification (as raised by the run)
and its regions allow, checked before any request to the target store."""

from __future__ import annotations

import json
import uuid

import pytest
from tests.support.staging import (  # noqa: F401 (fixtures)
    Requests,
    bucket_is_empty,
    catalogue,
    dataset_folder,
    digits,
    new_store,
    small_files,
    stage,
    store,
)
from tests.unit.test_sovereignty import PRIVATE_EU, PUBLIC_EU, PUBLIC_US

from hybridflow.errors import ConfigError, SovereigntyError, StagingError
from hybridflow.sovereignty import Destination
from hybridflow.staging import read_manifest, stage_dataset
from hybridflow.storage.manifest import fetch_verified
from hybridflow.storage.objectstore import LocalObjectStore
from hybridflow.storage.s3 import S3ObjectStore
from hybridflow.storage.sources import S3DatasetSource

pytestmark = pytest.mark.s3


def test_data_a_run_raises_to_restricted_never_goes_to_a_public_store(stage, digits, store, rclone_s3):  # noqa: F811
    log = Requests(store)
    with pytest.raises(SovereigntyError, match="restricted data never leaves private storage"):
        stage(digits, store, raised="restricted")
    assert log.calls == []  # not even a listing
    bucket_is_empty(rclone_s3, store)


def test_restricted_data_never_goes_to_a_public_store(stage, store, rclone_s3, tmp_path):  # noqa: F811
    ds = dataset_folder(tmp_path, "records", small_files(30, 2000, seed=9))
    log = Requests(store)
    with pytest.raises(SovereigntyError, match="'records' is restricted .* run it on a private cluster"):
        stage(ds, store, destination=PUBLIC_EU)
    assert log.calls == []
    bucket_is_empty(rclone_s3, store)


def test_restricted_data_may_go_to_a_private_store(stage, tmp_path):  # noqa: F811
    files = small_files(10, 1000, seed=10)
    target = LocalObjectStore(tmp_path / "private-cache")
    result = stage(dataset_folder(tmp_path, "records", files), target, destination=PRIVATE_EU)
    assert result.objects_copied == 10
    manifest = read_manifest(target, result.manifest_key)
    assert manifest.sensitivity == "restricted"
    assert {e.path: fetch_verified(target, e) for e in manifest.entries} == files


def test_eu_only_data_never_reaches_a_us_cache_and_stages_into_an_eu_one(stage, rclone_s3, tmp_path):  # noqa: F811
    files = small_files(25, 1500, seed=11)
    ds = dataset_folder(tmp_path, "eu-claims", files)
    us_cache = new_store(rclone_s3, "us")
    log = Requests(us_cache)
    with pytest.raises(SovereigntyError, match="'eu-claims' may only be processed in eu .*cloud-east"):
        stage(ds, us_cache, destination=PUBLIC_US)
    assert log.calls == []
    bucket_is_empty(rclone_s3, us_cache)

    eu_cache = new_store(rclone_s3, "eu")
    result = stage(ds, eu_cache, destination=PUBLIC_EU)
    assert result.objects_copied == 25
    manifest = read_manifest(eu_cache, result.manifest_key)
    assert manifest.sensitivity == "internal"
    assert {e.path: fetch_verified(eu_cache, e) for e in manifest.entries} == files
    bucket_is_empty(rclone_s3, us_cache)  # the EU stage wrote nothing to the US bucket either


@pytest.mark.parametrize(("dataset", "raised", "destination", "recorded"), [
    ("open-data", None, PUBLIC_US, "public"),
    ("open-data", "internal", PUBLIC_US, "internal"),
    ("digits", None, PUBLIC_US, "internal"),
    ("digits", "public", PUBLIC_US, "internal"),  # a run may not lower the data's classification
    ("digits", "restricted", PRIVATE_EU, "restricted"),
    ("records", "internal", PRIVATE_EU, "restricted"),
])
def test_the_manifest_records_the_classification_the_data_was_handled_as(
    stage, store, tmp_path, dataset, raised, destination, recorded  # noqa: F811
):
    # A private destination here stands for a private cluster's own on-prem bucket.
    result = stage(dataset_folder(tmp_path, dataset, small_files(3, 100, seed=12)), store, destination=destination,
                   raised=raised)
    assert read_manifest(store, result.manifest_key).sensitivity == recorded
    assert json.loads(store.get_bytes(result.manifest_key))["sensitivity"] == recorded


def test_a_source_is_checked_under_the_catalogue_name_it_is_staged_as(stage, store, rclone_s3, tmp_path):  # noqa: F811
    export = dataset_folder(tmp_path, "export-2024", {"a.csv": b"x\n"})
    # By its folder's name it is not in the catalogue, so it is handled as restricted ...
    with pytest.raises(SovereigntyError, match="'export-2024' is not in datasets.yaml"):
        stage(export, store)
    # ... and it cannot be judged under another entry's name: its objects would be stored under its own.
    with pytest.raises(StagingError, match="named 'export-2024' but the catalogue entry checked is 'records'"):
        stage(export, store, dataset="records")
    bucket_is_empty(rclone_s3, store)


def test_unknown_target_location_is_refused_before_any_write(stage, digits, store):  # noqa: F811
    log = Requests(store)
    with pytest.raises(StagingError, match="target location 'cloud' is unknown"):
        stage(digits, store, destination=Destination("cloud", ("us-east-1",), "cloud-east"))
    assert log.calls == []


def test_a_catalogue_that_cannot_be_read_stops_the_stage_before_any_request(digits, store, tmp_path):  # noqa: F811
    log = Requests(store)
    with pytest.raises(ConfigError, match="file not found"):
        stage_dataset(digits, store, destination=PUBLIC_US, catalogue=tmp_path / "datasets.yaml", run_key="r")
    assert log.calls == []


def test_restricted_data_from_an_s3_source_never_reaches_a_public_store(stage, store, rclone_s3):  # noqa: F811
    endpoint, access, secret, _ = rclone_s3
    private = S3ObjectStore(f"hf-private-{uuid.uuid4().hex[:8]}", endpoint_url=endpoint, access_key=access,
                            secret_key=secret)
    private.ensure_bucket()
    private.put_bytes("datasets/patients/a.csv", b"x,y\n")
    log = Requests(store)
    with pytest.raises(SovereigntyError, match="'patients' is restricted"):
        stage(S3DatasetSource(private, "datasets/patients"), store)
    assert log.calls == []
    bucket_is_empty(rclone_s3, store)
