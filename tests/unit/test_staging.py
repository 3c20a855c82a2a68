"""stage_dataset against a real S3 endpoint (``rclone serve s3``) and a local folder store."""

from __future__ import annotations

import json
import logging
import time
import uuid

import pytest

from hybridflow.datasets import seed_digits
from hybridflow.errors import SovereigntyError, StagingError
from hybridflow.staging import read_manifest, stage_dataset
from hybridflow.storage.manifest import fetch_verified
from hybridflow.storage.objectstore import LocalObjectStore, StoreSpec, open_store
from hybridflow.storage.s3 import S3ObjectStore

pytestmark = pytest.mark.s3

PREFIX = "cache"


class Requests:
    """HTTP requests a boto3 client sends: (operation, method, Content-Length)."""

    def __init__(self, client) -> None:
        self.calls: list[tuple[str, str, int]] = []
        client.meta.events.register("before-send.s3", self._on_send)

    def _on_send(self, request, **kwargs) -> None:
        op = kwargs.get("event_name", "").rsplit(".", 1)[-1]
        self.calls.append((op, request.method, int(request.headers.get("Content-Length") or 0)))

    @property
    def writes(self) -> list[tuple[str, str, int]]:
        return [c for c in self.calls if c[1] in ("PUT", "POST", "DELETE")]

    @property
    def bytes_sent(self) -> int:
        return sum(n for _, method, n in self.calls if method in ("PUT", "POST"))


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return seed_digits(tmp_path_factory.mktemp("private"))


@pytest.fixture
def store(rclone_s3) -> S3ObjectStore:
    endpoint, access, secret, _ = rclone_s3
    s = S3ObjectStore(
        f"hf-stage-{uuid.uuid4().hex[:10]}",
        prefix=PREFIX,
        endpoint_url=endpoint,
        access_key=access,
        secret_key=secret,
    )
    s.ensure_bucket()
    return s


def _stage(dataset, target, **kw):
    args = {"sensitivity": "internal", "target_location": "public", "run_key": "run-1"} | kw
    return stage_dataset(dataset, target, **args)


def _settle() -> None:
    # The fixture's rclone lists a file deleted behind its back for up to DIR_CACHE_TIME (100ms).
    time.sleep(0.5)


def _blob_file(rclone_s3, store: S3ObjectStore, key: str):
    return rclone_s3[3] / store.bucket / PREFIX / key


def test_first_stage_copies_everything_and_a_rerun_uploads_nothing(digits, store):
    sizes = {p.name: p.stat().st_size for p in digits.path.iterdir()}
    log = Requests(store.client)
    first = _stage(digits, store)
    assert (first.objects_total, first.objects_copied) == (2, 2)
    assert first.bytes_copied == sum(sizes.values())
    assert log.bytes_sent >= first.bytes_copied
    assert first.manifest_key == f"datasets/digits/versions/{first.version}.json"
    assert first.store_uri == store.uri
    xcom = first.to_xcom()
    assert json.loads(json.dumps(xcom)) == xcom and xcom["objects_copied"] == 2

    log.calls.clear()
    second = _stage(digits, store, run_key="run-2")
    assert (second.version, second.objects_copied, second.bytes_copied) == (first.version, 0, 0)
    assert log.writes == [] and log.bytes_sent == 0
    # One listing for all blobs; no per-blob HEADs or downloads (the MD5 ETags vouch for them).
    assert sum(1 for op, _, _ in log.calls if op == "ListObjectsV2") == 1
    assert sum(1 for op, _, _ in log.calls if op == "GetObject") == 1  # the existing manifest only
    # The committed manifest is untouched: still the first run's.
    assert read_manifest(store, first.manifest_key).created_by == "run-1"


def test_reader_gets_identical_bytes(digits, store, rclone_s3):
    result = _stage(digits, store)
    # A worker opens the store from the serialisable spec plus credentials in its environment.
    spec = store.spec
    reader = open_store(StoreSpec.from_dict(spec.to_dict(), environ=spec.credential_env()))
    manifest = read_manifest(reader, result.manifest_key)
    assert manifest.dataset == "digits" and manifest.version == result.version
    assert manifest.source_uri == digits.uri and manifest.sensitivity == "internal"
    assert sorted(e.path for e in manifest.entries) == ["test.csv", "train.csv"]
    for entry in manifest.entries:
        assert fetch_verified(reader, entry) == (digits.path / entry.path).read_bytes()
        assert reader.metadata(entry.key) == {"sha256": entry.sha256}


def test_deleted_blob_is_recopied(digits, store, rclone_s3):
    first = _stage(digits, store)
    entry = read_manifest(store, first.manifest_key).entry("train.csv")
    _blob_file(rclone_s3, store, entry.key).unlink()
    _settle()
    log = Requests(store.client)
    again = _stage(digits, store)
    assert (again.objects_copied, again.bytes_copied) == (1, entry.size)
    assert sum(1 for op, _, _ in log.writes if op == "PutObject") == 1  # the blob; the manifest exists
    assert fetch_verified(store, entry) == (digits.path / "train.csv").read_bytes()


@pytest.mark.parametrize("same_size", [True, False], ids=["same-size", "truncated"])
def test_corrupted_blob_is_detected_and_recopied(digits, store, rclone_s3, same_size):
    first = _stage(digits, store)
    entry = read_manifest(store, first.manifest_key).entry("test.csv")
    path = _blob_file(rclone_s3, store, entry.key)
    path.write_bytes(
        b"\x00garbage" * (entry.size // 8) + b"!" * (entry.size % 8) if same_size else b"garbage"
    )
    assert path.stat().st_size == (entry.size if same_size else 7)
    _settle()
    with pytest.raises(StagingError, match="corrupt"):
        fetch_verified(store, entry)
    again = _stage(digits, store)
    assert (again.objects_copied, again.bytes_copied) == (1, entry.size)
    assert fetch_verified(store, entry) == (digits.path / "test.csv").read_bytes()


def test_restricted_data_never_goes_to_a_public_store(digits, store, rclone_s3):
    bucket_dir = rclone_s3[3] / store.bucket
    before = sorted(p.relative_to(bucket_dir) for p in bucket_dir.rglob("*"))
    log = Requests(store.client)
    with pytest.raises(SovereigntyError, match="restricted data never leaves private storage"):
        _stage(digits, store, sensitivity="restricted", target_location="public")
    assert log.calls == []  # not even a listing
    assert sorted(p.relative_to(bucket_dir) for p in bucket_dir.rglob("*")) == before
    assert list(store.list()) == []


def test_restricted_data_may_go_to_a_private_store(digits, tmp_path):
    result = _stage(
        digits,
        LocalObjectStore(tmp_path / "private-cache"),
        sensitivity="restricted",
        target_location="private",
    )
    assert result.objects_copied == 2


def test_unknown_target_location_is_refused_before_any_write(digits, store):
    log = Requests(store.client)
    with pytest.raises(StagingError, match="target_location"):
        _stage(digits, store, target_location="cloud")
    assert log.calls == []


def test_manifest_appears_only_after_every_blob(digits, store, monkeypatch):
    real_put_file = store.put_file
    uploads = []

    def flaky_put_file(key, path, **kwargs):
        uploads.append(key)
        if len(uploads) == 2:
            raise ConnectionError("network went away")
        return real_put_file(key, path, **kwargs)

    monkeypatch.setattr(store, "put_file", flaky_put_file)
    with pytest.raises(StagingError, match="no manifest was written"):
        _stage(digits, store)
    assert [o.key for o in store.list("datasets/digits/versions/")] == []
    assert len(list(store.list("datasets/digits/blobs/"))) == 1

    monkeypatch.setattr(store, "put_file", real_put_file)
    resumed = _stage(digits, store)
    assert resumed.objects_copied == 1  # only the blob the failed run did not copy
    assert [o.key for o in store.list("datasets/digits/versions/")] == [resumed.manifest_key]


def test_unreadable_existing_manifest_is_reported(digits, store):
    first = _stage(digits, store)
    store.put_bytes(first.manifest_key, b"{not json")
    with pytest.raises(StagingError, match="unreadable"):
        _stage(digits, store)


def test_read_manifest_of_a_missing_version(store):
    with pytest.raises(StagingError, match="run stage_data"):
        read_manifest(store, "datasets/digits/versions/nope.json")


def test_local_folder_store_is_verified_by_content(digits, tmp_path, caplog):
    target = LocalObjectStore(tmp_path / "cache")
    first = _stage(digits, target, target_location="private")
    assert first.objects_copied == 2
    assert _stage(digits, target, target_location="private").bytes_copied == 0
    entry = read_manifest(target, first.manifest_key).entry("train.csv")
    blob = tmp_path / "cache" / entry.key
    data = bytearray(blob.read_bytes())
    data[100] ^= 0xFF  # one flipped byte, same size: only the SHA-256 can tell
    blob.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="hybridflow.staging"):
        again = _stage(digits, target, target_location="private")
    assert (again.objects_copied, again.bytes_copied) == (1, entry.size)
    assert "re-copying" in caplog.text
    assert fetch_verified(target, entry) == (digits.path / "train.csv").read_bytes()
