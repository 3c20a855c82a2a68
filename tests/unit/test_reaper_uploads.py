"""Abandoned multipart uploads, against a real S3 endpoint (``rclone serve s3`` on loopback, which
lists unfinished uploads by prefix with their start time, and aborts them): only the product's
prefixes, only uploads older than the set age, and aborting frees them for good."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from hybridflow.reaper.uploads import MultipartUploadsFinder
from hybridflow.storage.objectstore import StoreSpec
from hybridflow.storage.s3 import S3ObjectStore

DAY = timedelta(hours=24)


@pytest.fixture
def bucket(rclone_s3) -> S3ObjectStore:
    endpoint, access, secret, _ = rclone_s3
    store = S3ObjectStore(f"hf-{uuid.uuid4().hex[:12]}", endpoint_url=endpoint, access_key=access, secret_key=secret)
    store.ensure_bucket()
    return store


def _open_keys(store: S3ObjectStore) -> set[str]:
    return {up["key"] for up in store.multipart_uploads("")}


def test_old_uploads_under_the_product_s_prefixes_are_found_and_aborted(bucket):
    blob = "datasets/digits/blobs/ab/ab12"
    bucket.start_multipart(blob)
    bucket.start_multipart("checkpoints/run-1-0123456789/step-000000100/model.pt")
    bucket.start_multipart("someone-else/big.tar")  # not ours: never listed, never aborted
    finder = MultipartUploadsFinder("cloud-east", bucket, DAY)

    later = datetime.now(UTC) + DAY + timedelta(hours=2)
    found = finder.find(later)
    assert [lo.detail["key"] for lo in found] == ["checkpoints/run-1-0123456789/step-000000100/model.pt", blob]
    first = found[1]
    assert first.place == "cloud-east" and first.kind == "multipart-upload" and first.gpus == 0
    assert first.name.startswith(f"s3://{bucket.bucket}/{blob}#") and "unfinished for 26" in first.reason

    for leftover in found:
        finder.release(leftover)
    finder.release(found[0])  # already gone: not an error
    assert _open_keys(bucket) == {"someone-else/big.tar"}
    assert finder.find(later) == []


def test_an_upload_younger_than_the_age_is_kept(bucket):
    bucket.start_multipart("datasets/digits/blobs/cd/cd34")
    finder = MultipartUploadsFinder("cloud-east", bucket, DAY)
    assert finder.find(datetime.now(UTC) + timedelta(hours=23)) == []
    assert _open_keys(bucket) == {"datasets/digits/blobs/cd/cd34"}


def test_a_store_spec_under_a_prefix_is_opened_and_keys_are_relative_to_it(rclone_s3, bucket):
    endpoint, access, secret, _ = rclone_s3
    scoped = S3ObjectStore(bucket.bucket, prefix="team/cache", endpoint_url=endpoint, access_key=access,
                           secret_key=secret)
    scoped.start_multipart("datasets/x/blobs/ef/ef56")
    bucket.start_multipart("datasets/x/blobs/ef/outside-the-prefix")
    spec = StoreSpec(kind="s3", bucket=bucket.bucket, prefix="team/cache", endpoint_url=endpoint,
                     access_key=access, secret_key=secret)
    found = MultipartUploadsFinder("private-s3", spec, DAY).find(datetime.now(UTC) + 2 * DAY)
    assert [lo.detail["key"] for lo in found] == ["datasets/x/blobs/ef/ef56"]


def test_a_folder_store_has_no_uploads_and_a_whole_store_prefix_is_refused(tmp_path):
    folder = StoreSpec(kind="local", root=str(tmp_path))
    assert MultipartUploadsFinder("onprem-a", folder, DAY).find(datetime.now(UTC)) == []
    with pytest.raises(ValueError, match="own key prefixes"):
        MultipartUploadsFinder("onprem-a", folder, DAY, prefixes=["", "datasets/"])
