"""stage_dataset against a real S3 endpoint (``rclone serve s3``) and a local folder store: what a first
stage and a rerun copy, what a reader gets back, damaged or missing blobs recopied, and a manifest
written only once every blob is there. The guard, the engine and versions: test_staging_*.py."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
from tests.support.staging import Requests, blob_file, catalogue, digits, settle, stage, store  # noqa: F401 (fixtures)
from tests.unit.test_sovereignty import PRIVATE_EU

from hybridflow.errors import StagingError
from hybridflow.staging import StagingSettings, read_manifest
from hybridflow.storage.manifest import fetch_verified
from hybridflow.storage.objectstore import LocalObjectStore, StoreSpec, open_store
from hybridflow.storage.transfer import TransferSettings

pytestmark = pytest.mark.s3

DIGITS_FILES = ["expectations/test.json", "expectations/train.json", "test.csv", "train.csv"]


def _contents(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_first_stage_copies_everything_and_a_rerun_uploads_nothing(stage, digits, store):  # noqa: F811
    files = _contents(digits.path)
    assert sorted(files) == DIGITS_FILES
    log = Requests(store)
    first = stage(digits, store)
    assert (first.objects_total, first.objects_copied) == (4, 4)
    assert first.bytes_copied == sum(len(data) for data in files.values())
    assert log.bytes_sent >= first.bytes_copied
    assert first.manifest_key == f"datasets/digits/versions/{first.version}.json"
    assert first.store_uri == store.uri
    xcom = first.to_xcom()
    assert json.loads(json.dumps(xcom)) == xcom and xcom["objects_copied"] == 4

    log.calls.clear()
    second = stage(digits, store, run_key="run-2")
    assert (second.version, second.objects_copied, second.bytes_copied) == (first.version, 0, 0)
    assert log.writes == [] and log.bytes_sent == 0
    # One listing for all blobs; no per-blob HEADs or downloads (the MD5 ETags vouch for them).
    assert sum(1 for op, _, _ in log.calls if op == "ListObjectsV2") == 1
    assert sum(1 for op, _, _ in log.calls if op == "GetObject") == 1  # the existing manifest only
    # The committed manifest is untouched: still the first run's.
    assert read_manifest(store, first.manifest_key).created_by == "run-1"


def test_reader_gets_identical_bytes(stage, digits, store, rclone_s3):  # noqa: F811
    result = stage(digits, store)
    # A worker opens the store from the serialisable spec plus credentials in its environment.
    spec = store.spec
    reader = open_store(StoreSpec.from_dict(spec.to_dict(), environ=spec.credential_env()))
    manifest = read_manifest(reader, result.manifest_key)
    assert manifest.dataset == "digits" and manifest.version == result.version
    assert manifest.source_uri == digits.uri and manifest.sensitivity == "internal"
    assert sorted(e.path for e in manifest.entries) == DIGITS_FILES
    for entry in manifest.entries:
        assert fetch_verified(reader, entry) == (digits.path / entry.path).read_bytes()
        assert reader.metadata(entry.key) == {"sha256": entry.sha256}


def test_deleted_blob_is_recopied(stage, digits, store, rclone_s3):  # noqa: F811
    first = stage(digits, store)
    entry = read_manifest(store, first.manifest_key).entry("train.csv")
    blob_file(rclone_s3, store, entry.key).unlink()
    settle()
    log = Requests(store)
    again = stage(digits, store)
    assert (again.objects_copied, again.bytes_copied) == (1, entry.size)
    assert sum(1 for op, _, _ in log.writes if op == "PutObject") == 1  # the blob; the manifest exists
    assert fetch_verified(store, entry) == (digits.path / "train.csv").read_bytes()


@pytest.mark.parametrize("same_size", [True, False], ids=["same-size", "truncated"])
def test_corrupted_blob_is_detected_and_recopied(stage, digits, store, rclone_s3, same_size):  # noqa: F811
    first = stage(digits, store)
    entry = read_manifest(store, first.manifest_key).entry("test.csv")
    path = blob_file(rclone_s3, store, entry.key)
    path.write_bytes(
        b"\x00garbage" * (entry.size // 8) + b"!" * (entry.size % 8) if same_size else b"garbage"
    )
    assert path.stat().st_size == (entry.size if same_size else 7)
    settle()
    with pytest.raises(StagingError, match="corrupt"):
        fetch_verified(store, entry)
    again = stage(digits, store)
    assert (again.objects_copied, again.bytes_copied) == (1, entry.size)
    assert fetch_verified(store, entry) == (digits.path / "test.csv").read_bytes()


@pytest.mark.parametrize("crt", [False, True], ids=["botocore", "crt"])
def test_manifest_appears_only_after_every_blob(stage, digits, store, monkeypatch, crt):  # noqa: F811
    settings = StagingSettings(transfer=TransferSettings(crt=crt, workers=1, crt_window_per_worker=1))
    method = "put_file_nowait" if crt else "put_verified"
    real_put = getattr(store, method)
    uploads = []
    failing = [True]
    lock = threading.Lock()

    def flaky_put(key, *args, **kwargs):
        with lock:
            uploads.append(key)
            fail = failing[0] and len(uploads) == 2
        if not fail:
            return real_put(key, *args, **kwargs)
        if not crt:
            raise ConnectionError("network went away")
        kwargs["done"](None, ConnectionError("network went away"))  # as the CRT reports it
        return True

    monkeypatch.setattr(store, method, flaky_put)
    with pytest.raises(StagingError, match="no manifest was written"):
        stage(digits, store, settings=settings)
    failed = uploads[1]
    assert len(set(uploads)) == len(uploads)  # nothing sent twice, the failed blob not retried
    if crt:
        assert len(uploads) == 2  # no request starts after the failure (one in flight at a time)
    else:
        # the pool cancels what is queued; at most the one blob its worker had already taken goes on
        assert 2 <= len(uploads) <= 3
    assert [o.key for o in store.list("datasets/digits/versions/")] == []
    present = {o.key for o in store.list("datasets/digits/blobs/")}
    assert present == set(uploads) - {failed}

    failing[0] = False
    uploads.clear()
    resumed = stage(digits, store, settings=settings)
    blobs = {e.key for e in read_manifest(store, resumed.manifest_key).entries}
    assert len(blobs) == 4 and failed in blobs
    # only the blobs the failed run did not copy
    assert sorted(k for k in uploads if "/blobs/" in k) == sorted(blobs - present)
    assert resumed.objects_copied == len(blobs - present)
    assert [o.key for o in store.list("datasets/digits/versions/")] == [resumed.manifest_key]


def test_unreadable_existing_manifest_is_reported(stage, digits, store):  # noqa: F811
    first = stage(digits, store)
    store.put_bytes(first.manifest_key, b"{not json")
    with pytest.raises(StagingError, match="unreadable"):
        stage(digits, store)


def test_read_manifest_of_a_missing_version(store):  # noqa: F811
    with pytest.raises(StagingError, match="run stage_data"):
        read_manifest(store, "datasets/digits/versions/nope.json")


def test_local_folder_store_is_verified_by_content(stage, digits, tmp_path, caplog):  # noqa: F811
    target = LocalObjectStore(tmp_path / "cache")
    first = stage(digits, target, destination=PRIVATE_EU)
    assert first.objects_copied == len(DIGITS_FILES)
    assert stage(digits, target, destination=PRIVATE_EU).bytes_copied == 0
    entry = read_manifest(target, first.manifest_key).entry("train.csv")
    blob = tmp_path / "cache" / entry.key
    data = bytearray(blob.read_bytes())
    data[100] ^= 0xFF  # one flipped byte, same size: only the SHA-256 can tell
    blob.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="hybridflow.staging"):
        again = stage(digits, target, destination=PRIVATE_EU)
    assert (again.objects_copied, again.bytes_copied) == (1, entry.size)
    assert "re-copying" in caplog.text
    assert fetch_verified(target, entry) == (digits.path / "train.csv").read_bytes()
