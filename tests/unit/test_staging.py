"""stage_dataset against a real S3 endpoint (``rclone serve s3``) and a local folder store."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tarfile
import threading
import time
import uuid
from pathlib import Path

import pytest
from tests.unit.test_sovereignty import PRIVATE_EU, PUBLIC_EU, PUBLIC_US, write_catalogue

from hybridflow.cache import PruneRefused, list_versions, prune_versions
from hybridflow.errors import ConfigError, SovereigntyError, StagingError
from hybridflow.sovereignty import Destination
from hybridflow.staging import StagingSettings, blob_prefix, read_manifest, stage_dataset, versions_prefix
from hybridflow.storage.manifest import fetch_verified
from hybridflow.storage.objectstore import LocalObjectStore, StoreSpec, open_store
from hybridflow.storage.reader import iter_samples
from hybridflow.storage.s3 import S3ObjectStore
from hybridflow.storage.sources import LocalFolderSource, S3DatasetSource
from hybridflow.storage.transfer import TransferSettings
from hybridflow_examples.digits.data import seed as seed_digits

pytestmark = pytest.mark.s3

PREFIX = "cache"
MiB = 1024 * 1024
DIGITS_FILES = ["expectations/test.json", "expectations/train.json", "test.csv", "train.csv"]
# Every synthetic dataset staged below: the guard refuses a dataset its catalogue does not list.
INTERNAL = (
    "digits", "fan", "wide", "swap", "flip", "big", "aband", "packed", "foldered", "shardrot", "shots",
    "progress", "vers", "unread", "clidata", "whole", "parts", "small",
)


class Requests:
    """HTTP requests a store sends, through boto3 and through the CRT: (operation, method,
    Content-Length)."""

    def __init__(self, store: S3ObjectStore) -> None:
        self.calls: list[tuple[str, str, int]] = []
        store.client.meta.events.register("before-send.s3", self._on_send)
        store.crt_observers.append(lambda op, method, size: self.calls.append((op, method, size)))

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
def catalogue(tmp_path_factory) -> Path:
    """This module's datasets.yaml: internal data, except where a test is about classification."""
    return write_catalogue(tmp_path_factory.mktemp("config") / "datasets.yaml", {
        **{name: {"classification": "internal"} for name in INTERNAL},
        "open-data": {"classification": "public"},
        "patients": {"classification": "restricted"},
        "records": {"classification": "restricted"},
        "eu-claims": {"classification": "internal", "regions": ["eu"]},
    })


@pytest.fixture
def stage(catalogue):
    """stage_dataset against this module's catalogue, towards a public US cache unless told."""

    def run(source, target, *, destination: Destination = PUBLIC_US, run_key: str = "run-1", **kw):
        return stage_dataset(source, target, destination=destination, catalogue=catalogue, run_key=run_key, **kw)

    return run


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> LocalFolderSource:
    return LocalFolderSource(seed_digits(tmp_path_factory.mktemp("private") / "digits"), name="digits")


def _new_store(rclone_s3, label: str = "stage") -> S3ObjectStore:
    endpoint, access, secret, _ = rclone_s3
    s = S3ObjectStore(
        f"hf-{label}-{uuid.uuid4().hex[:10]}",
        prefix=PREFIX,
        endpoint_url=endpoint,
        access_key=access,
        secret_key=secret,
    )
    s.ensure_bucket()
    return s


@pytest.fixture
def store(rclone_s3) -> S3ObjectStore:
    return _new_store(rclone_s3)


def _settle() -> None:
    # The fixture's rclone lists a file deleted behind its back for up to DIR_CACHE_TIME (100ms).
    time.sleep(0.5)


def _blob_file(rclone_s3, store: S3ObjectStore, key: str):
    return rclone_s3[3] / store.bucket / PREFIX / key


def _contents(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _bucket_is_empty(rclone_s3, store: S3ObjectStore) -> None:
    """Nothing at all in the bucket, under any prefix: by the S3 listing and on the server's disk."""
    listed = store.client.list_objects_v2(Bucket=store.bucket)
    assert listed.get("KeyCount", 0) == 0 and "Contents" not in listed, listed.get("Contents")
    assert [p for p in (rclone_s3[3] / store.bucket).rglob("*") if p.is_file()] == []
    endpoint, access, secret, _ = rclone_s3
    whole = S3ObjectStore(store.bucket, endpoint_url=endpoint, access_key=access, secret_key=secret)
    assert whole.multipart_uploads() == []  # no upload started either


def test_first_stage_copies_everything_and_a_rerun_uploads_nothing(stage, digits, store):
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


def test_reader_gets_identical_bytes(stage, digits, store, rclone_s3):
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


def test_deleted_blob_is_recopied(stage, digits, store, rclone_s3):
    first = stage(digits, store)
    entry = read_manifest(store, first.manifest_key).entry("train.csv")
    _blob_file(rclone_s3, store, entry.key).unlink()
    _settle()
    log = Requests(store)
    again = stage(digits, store)
    assert (again.objects_copied, again.bytes_copied) == (1, entry.size)
    assert sum(1 for op, _, _ in log.writes if op == "PutObject") == 1  # the blob; the manifest exists
    assert fetch_verified(store, entry) == (digits.path / "train.csv").read_bytes()


@pytest.mark.parametrize("same_size", [True, False], ids=["same-size", "truncated"])
def test_corrupted_blob_is_detected_and_recopied(stage, digits, store, rclone_s3, same_size):
    first = stage(digits, store)
    entry = read_manifest(store, first.manifest_key).entry("test.csv")
    path = _blob_file(rclone_s3, store, entry.key)
    path.write_bytes(
        b"\x00garbage" * (entry.size // 8) + b"!" * (entry.size % 8) if same_size else b"garbage"
    )
    assert path.stat().st_size == (entry.size if same_size else 7)
    _settle()
    with pytest.raises(StagingError, match="corrupt"):
        fetch_verified(store, entry)
    again = stage(digits, store)
    assert (again.objects_copied, again.bytes_copied) == (1, entry.size)
    assert fetch_verified(store, entry) == (digits.path / "test.csv").read_bytes()


def test_data_a_run_raises_to_restricted_never_goes_to_a_public_store(stage, digits, store, rclone_s3):
    log = Requests(store)
    with pytest.raises(SovereigntyError, match="restricted data never leaves private storage"):
        stage(digits, store, raised="restricted")
    assert log.calls == []  # not even a listing
    _bucket_is_empty(rclone_s3, store)


def test_restricted_data_never_goes_to_a_public_store(stage, store, rclone_s3, tmp_path):
    ds = _folder(tmp_path, "records", _small_files(30, 2000, seed=9))
    log = Requests(store)
    with pytest.raises(SovereigntyError, match="'records' is restricted .* run it on a private cluster"):
        stage(ds, store, destination=PUBLIC_EU)
    assert log.calls == []
    _bucket_is_empty(rclone_s3, store)


def test_restricted_data_may_go_to_a_private_store(stage, tmp_path):
    files = _small_files(10, 1000, seed=10)
    target = LocalObjectStore(tmp_path / "private-cache")
    result = stage(_folder(tmp_path, "records", files), target, destination=PRIVATE_EU)
    assert result.objects_copied == 10
    manifest = read_manifest(target, result.manifest_key)
    assert manifest.sensitivity == "restricted"
    assert {e.path: fetch_verified(target, e) for e in manifest.entries} == files


def test_eu_only_data_never_reaches_a_us_cache_and_stages_into_an_eu_one(stage, rclone_s3, tmp_path):
    files = _small_files(25, 1500, seed=11)
    ds = _folder(tmp_path, "eu-claims", files)
    us_cache = _new_store(rclone_s3, "us")
    log = Requests(us_cache)
    with pytest.raises(SovereigntyError, match="'eu-claims' may only be processed in eu .*cloud-east"):
        stage(ds, us_cache, destination=PUBLIC_US)
    assert log.calls == []
    _bucket_is_empty(rclone_s3, us_cache)

    eu_cache = _new_store(rclone_s3, "eu")
    result = stage(ds, eu_cache, destination=PUBLIC_EU)
    assert result.objects_copied == 25
    manifest = read_manifest(eu_cache, result.manifest_key)
    assert manifest.sensitivity == "internal"
    assert {e.path: fetch_verified(eu_cache, e) for e in manifest.entries} == files
    _bucket_is_empty(rclone_s3, us_cache)  # the EU stage wrote nothing to the US bucket either


@pytest.mark.parametrize(("dataset", "raised", "destination", "recorded"), [
    ("open-data", None, PUBLIC_US, "public"),
    ("open-data", "internal", PUBLIC_US, "internal"),
    ("digits", None, PUBLIC_US, "internal"),
    ("digits", "public", PUBLIC_US, "internal"),  # a run may not lower the data's classification
    ("digits", "restricted", PRIVATE_EU, "restricted"),
    ("records", "internal", PRIVATE_EU, "restricted"),
])
def test_the_manifest_records_the_classification_the_data_was_handled_as(
    stage, store, tmp_path, dataset, raised, destination, recorded
):
    # A private destination here stands for a private cluster's own on-prem bucket.
    result = stage(_folder(tmp_path, dataset, _small_files(3, 100, seed=12)), store, destination=destination,
                   raised=raised)
    assert read_manifest(store, result.manifest_key).sensitivity == recorded
    assert json.loads(store.get_bytes(result.manifest_key))["sensitivity"] == recorded


def test_a_source_is_checked_under_the_catalogue_name_it_is_staged_as(stage, store, rclone_s3, tmp_path):
    export = _folder(tmp_path, "export-2024", {"a.csv": b"x\n"})
    # By its folder's name it is not in the catalogue, so it is handled as restricted ...
    with pytest.raises(SovereigntyError, match="'export-2024' is not in datasets.yaml"):
        stage(export, store)
    # ... and it cannot be judged under another entry's name: its objects would be stored under its own.
    with pytest.raises(StagingError, match="named 'export-2024' but the catalogue entry checked is 'records'"):
        stage(export, store, dataset="records")
    _bucket_is_empty(rclone_s3, store)


def test_unknown_target_location_is_refused_before_any_write(stage, digits, store):
    log = Requests(store)
    with pytest.raises(StagingError, match="target location 'cloud' is unknown"):
        stage(digits, store, destination=Destination("cloud", ("us-east-1",), "cloud-east"))
    assert log.calls == []


def test_a_catalogue_that_cannot_be_read_stops_the_stage_before_any_request(digits, store, tmp_path):
    log = Requests(store)
    with pytest.raises(ConfigError, match="file not found"):
        stage_dataset(digits, store, destination=PUBLIC_US, catalogue=tmp_path / "datasets.yaml", run_key="r")
    assert log.calls == []


@pytest.mark.parametrize("crt", [False, True], ids=["botocore", "crt"])
def test_manifest_appears_only_after_every_blob(stage, digits, store, monkeypatch, crt):
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


def test_unreadable_existing_manifest_is_reported(stage, digits, store):
    first = stage(digits, store)
    store.put_bytes(first.manifest_key, b"{not json")
    with pytest.raises(StagingError, match="unreadable"):
        stage(digits, store)


def test_read_manifest_of_a_missing_version(store):
    with pytest.raises(StagingError, match="run stage_data"):
        read_manifest(store, "datasets/digits/versions/nope.json")


def test_local_folder_store_is_verified_by_content(stage, digits, tmp_path, caplog):
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


# -- the staging engine: index, fan-out, multipart, packing, corruption, S3 sources, versions ------



def _folder(root: Path, name: str, files: dict[str, bytes]) -> LocalFolderSource:
    folder = root / name
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return LocalFolderSource(folder)


def _small_files(n: int, size: int, seed: int = 0) -> dict[str, bytes]:
    rng = __import__("random").Random(seed)
    return {f"class-{i % 10}/img-{i:05d}.bin": rng.randbytes(size) for i in range(n)}


def _age(folder: Path) -> None:
    """Files written seconds ago look racily clean to the hash index; make them older."""
    old = time.time() - 60
    for p in folder.rglob("*"):
        os.utime(p, (old, old))


NO_PACK = StagingSettings(pack="never")


def test_rerun_with_an_index_reads_no_file_and_blobs_fan_out(stage, store, tmp_path):
    ds = _folder(tmp_path, "fan", _small_files(40, 2048))
    _age(ds.path)
    index = tmp_path / "index.json"
    first = stage(ds, store, settings=NO_PACK, index_path=index)
    assert (first.objects_copied, first.files_read) == (40, 40)
    keys = [o.key for o in store.list(blob_prefix("fan"))]
    assert len(keys) == 40 and all(k.split("/")[-2] == k.split("/")[-1][:2] for k in keys)
    log = Requests(store)
    written = index.stat().st_mtime_ns
    again = stage(ds, store, settings=NO_PACK, index_path=index)
    assert (again.objects_copied, again.bytes_copied, again.files_read) == (0, 0, 0)
    # One listing and one HEAD of the committed manifest (its ETag is the one recorded): no
    # download, no write, and the unchanged index is not rewritten either.
    assert [op for op, _, _ in log.calls] == ["ListObjectsV2", "HeadObject"]
    assert index.stat().st_mtime_ns == written
    # a changed file is the only one read and sent again
    (ds.path / "class-3/img-00003.bin").write_bytes(b"new content")
    third = stage(ds, store, settings=NO_PACK, index_path=index)
    assert (third.objects_copied, third.files_read, third.bytes_copied) == (1, 1, len(b"new content"))
    assert third.version != first.version


def test_a_known_big_dataset_is_listed_fanned_out_while_it_is_scanned(stage, store, tmp_path):
    fanout = StagingSettings(pack="never", fanout_list_min_blobs=10)
    ds = _folder(tmp_path, "wide", _small_files(40, 1024))
    _age(ds.path)
    index = tmp_path / "index.json"
    first = stage(ds, store, settings=fanout, index_path=index)
    assert first.objects_copied == 40
    log = Requests(store)
    again = stage(ds, store, settings=fanout, index_path=index)
    assert (again.objects_copied, again.bytes_copied, again.files_read) == (0, 0, 0)
    assert sorted({op for op, _, _ in log.calls}) == ["HeadObject", "ListObjectsV2"]
    assert sum(op == "ListObjectsV2" for op, _, _ in log.calls) == 16  # one per first hex digit
    # the early listing still sees what changed since
    store.delete(next(iter(store.list(blob_prefix("wide")))).key)
    _settle()
    third = stage(ds, store, settings=fanout, index_path=index)
    assert third.objects_copied == 1 and third.version == first.version


def test_a_manifest_replaced_behind_the_index_is_read_and_refused(stage, store, tmp_path):
    ds = _folder(tmp_path, "swap", _small_files(5, 512))
    _age(ds.path)
    index = tmp_path / "index.json"
    first = stage(ds, store, settings=NO_PACK, index_path=index)
    body = json.loads(store.get_bytes(first.manifest_key))
    body["entries"][0]["size"] += 1
    store.put_bytes(first.manifest_key, json.dumps(body).encode())  # another ETag than recorded
    with pytest.raises(StagingError, match="inconsistent|different entries"):
        stage(ds, store, settings=NO_PACK, index_path=index)


def test_corrupted_cached_objects_are_all_detected_and_repaired(stage, store, rclone_s3, tmp_path):
    files = _small_files(120, 4096, seed=1)
    ds = _folder(tmp_path, "flip", files)
    first = stage(ds, store, settings=NO_PACK)
    manifest = read_manifest(store, first.manifest_key)
    for entry in manifest.entries:  # one flipped byte in every cached object, size unchanged
        path = _blob_file(rclone_s3, store, entry.key)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    _settle()
    again = stage(ds, store, settings=NO_PACK)
    assert (again.repaired, again.objects_copied) == (120, 120)
    for entry in manifest.entries:
        assert fetch_verified(store, entry) == files[entry.path]
    assert stage(ds, store, settings=NO_PACK).repaired == 0


def _multipart_settings(**kw) -> StagingSettings:
    tuning = TransferSettings(multipart_threshold=6 * MiB, part_size=5 * MiB, workers=4, **kw)
    return StagingSettings(transfer=tuning, pack="never", shard_max=6 * MiB, shard_target=4 * MiB)


def test_big_file_goes_up_in_verified_parts_and_an_interrupted_upload_resumes(stage, store, tmp_path, monkeypatch):
    big = os.urandom(23 * MiB)
    ds = _folder(tmp_path, "big", {"weights.bin": big, "meta.json": b"{}"})
    settings = _multipart_settings()
    real_part = store.upload_part
    sent = []

    def failing_part(key, upload_id, number, data, **kw):
        if len(sent) == 2:
            raise ConnectionError("link dropped")
        sent.append(number)
        return real_part(key, upload_id, number, data, **kw)

    monkeypatch.setattr(store, "upload_part", failing_part)
    with pytest.raises(StagingError, match="re-run stage_data to resume"):
        stage(ds, store, settings=settings)
    assert [o.key for o in store.list("datasets/big/versions/")] == []
    assert len(store.multipart_uploads(blob_prefix("big"))) == 1
    monkeypatch.setattr(store, "upload_part", real_part)
    log = Requests(store)
    resumed = stage(ds, store, settings=settings)
    assert resumed.resumed_parts == 2
    part_bytes = sum(n for op, _, n in log.calls if op == "UploadPart")
    assert part_bytes == len(big) - 2 * 5 * MiB  # only the parts the first run had not sent
    assert store.multipart_uploads(blob_prefix("big")) == []
    entry = read_manifest(store, resumed.manifest_key).entry("weights.bin")
    assert hashlib.sha256(fetch_verified(store, entry)).hexdigest() == hashlib.sha256(big).hexdigest()
    # the listing vouches for the multipart blob from now on (its ETag was recorded in the
    # manifest): nothing is re-sent and, once known to this machine's index, nothing re-read
    index = tmp_path / "idx.json"
    assert stage(ds, store, settings=settings, index_path=index).bytes_copied == 0
    log.calls.clear()
    assert stage(ds, store, settings=settings, index_path=index).bytes_copied == 0
    assert not any(op in ("GetObject", "UploadPart", "PutObject") for op, _, _ in log.calls[:-2])


def test_abandoned_multipart_uploads_are_aborted(stage, store, tmp_path):
    ds = _folder(tmp_path, "aband", {"weights.bin": os.urandom(7 * MiB)})
    stale = store.start_multipart(f"{blob_prefix('aband')}00/not-needed-any-more")
    stage(ds, store, settings=_multipart_settings(abandoned_upload_age_s=0.0))
    assert all(u["upload_id"] != stale for u in store.multipart_uploads(blob_prefix("aband")))


def test_small_files_are_packed_into_tar_shards_with_per_sample_integrity(stage, store, tmp_path):
    files = _small_files(600, 16 * 1024, seed=2)
    ds = _folder(tmp_path, "packed", files)
    settings = StagingSettings(pack="auto", pack_min_files=100, shard_target=2 * MiB, shard_max=4 * MiB)
    first = stage(ds, store, settings=settings, index_path=tmp_path / "idx.json")
    assert first.files_packed == 600 and 3 <= first.shards <= 6 and first.objects_copied == first.shards
    manifest = read_manifest(store, first.manifest_key)
    assert {e.path for e in manifest.entries} == set(files)
    for entry in list(manifest.entries)[::37]:
        assert entry.in_shard and fetch_verified(store, entry) == files[entry.path]  # one ranged read
    log = Requests(store)
    assert dict(iter_samples(store, manifest)) == files  # the loader: every sample checked
    assert sum(1 for op, _, _ in log.calls if op == "GetObject") == first.shards  # a request per shard
    shard = next(b for b in manifest.blobs if b.members)
    with tarfile.open(fileobj=io.BytesIO(store.get_bytes(shard.key))) as tar:  # a plain tar
        names = tar.getnames()
        assert len(names) == shard.members and tar.extractfile(names[0]).read() == files[names[0]]
    # one changed sample changes one shard (or two, at a boundary), not all of them
    (ds.path / "class-5/img-00305.bin").write_bytes(b"relabelled")
    second = stage(ds, store, settings=settings, index_path=tmp_path / "idx.json")
    assert 1 <= second.objects_copied <= 2 and second.version != first.version
    # staging only adds: the first version is still complete and readable
    for entry in read_manifest(store, first.manifest_key).entries[::50]:
        assert fetch_verified(store, entry) == files[entry.path]


def test_shards_staged_into_a_private_folder_store_read_back_verified(stage, tmp_path):
    files = _small_files(400, 3000, seed=4)
    ds = _folder(tmp_path, "foldered", files)
    target = LocalObjectStore(tmp_path / "cache")
    settings = StagingSettings(pack="always", shard_target=256 * 1024, shard_max=512 * 1024)
    first = stage(ds, target, destination=PRIVATE_EU, settings=settings)
    assert first.shards >= 3 and first.objects_copied == first.shards
    assert dict(iter_samples(target, read_manifest(target, first.manifest_key))) == files
    again = stage(ds, target, destination=PRIVATE_EU, settings=settings)
    assert (again.objects_copied, again.version) == (0, first.version)


def test_a_sample_corrupted_inside_a_shard_is_caught_by_the_reader(stage, store, rclone_s3, tmp_path):
    files = _small_files(300, 4096, seed=3)
    ds = _folder(tmp_path, "shardrot", files)
    settings = StagingSettings(pack="always", shard_target=1 * MiB, shard_max=2 * MiB)
    first = stage(ds, store, settings=settings)
    entry = read_manifest(store, first.manifest_key).entries[7]
    path = _blob_file(rclone_s3, store, entry.key)
    data = bytearray(path.read_bytes())
    data[entry.offset + 10] ^= 0xFF
    path.write_bytes(bytes(data))
    _settle()
    with pytest.raises(StagingError, match="corrupt"):
        fetch_verified(store, entry)
    repaired = stage(ds, store, settings=settings)
    assert repaired.repaired == 1 and fetch_verified(store, entry) == files[entry.path]


def test_stage_from_a_private_s3_bucket(stage, store, rclone_s3, tmp_path):
    endpoint, access, secret, _ = rclone_s3
    private = S3ObjectStore(f"hf-private-{uuid.uuid4().hex[:8]}", endpoint_url=endpoint, access_key=access,
                            secret_key=secret)
    private.ensure_bucket()
    files = _small_files(30, 3000, seed=4)
    for rel, data in files.items():
        private.put_bytes(f"datasets/shots/{rel}", data)
    source = S3DatasetSource(private, "datasets/shots")
    index = tmp_path / "s3-index.json"
    first = stage(source, store, settings=NO_PACK, index_path=index)
    assert first.objects_copied == 30 and first.dataset == "shots"
    for entry in read_manifest(store, first.manifest_key).entries:
        assert fetch_verified(store, entry) == files[entry.path]
    reads = Requests(private)
    again = stage(source, store, settings=NO_PACK, index_path=index)
    assert again.bytes_copied == 0 and again.files_read == 0
    assert [op for op, _, _ in reads.calls] == ["ListObjectsV2"]  # one listing of the source, nothing else


def test_restricted_data_from_an_s3_source_never_reaches_a_public_store(stage, store, rclone_s3):
    endpoint, access, secret, _ = rclone_s3
    private = S3ObjectStore(f"hf-private-{uuid.uuid4().hex[:8]}", endpoint_url=endpoint, access_key=access,
                            secret_key=secret)
    private.ensure_bucket()
    private.put_bytes("datasets/patients/a.csv", b"x,y\n")
    log = Requests(store)
    with pytest.raises(SovereigntyError, match="'patients' is restricted"):
        stage(S3DatasetSource(private, "datasets/patients"), store)
    assert log.calls == []
    _bucket_is_empty(rclone_s3, store)


def test_long_copies_log_progress(stage, store, tmp_path, caplog):
    ds = _folder(tmp_path, "progress", _small_files(200, 8192, seed=5))
    settings = StagingSettings(pack="never", transfer=TransferSettings(progress_every_s=0.0, workers=2))
    with caplog.at_level(logging.INFO, logger="hybridflow.staging"):
        stage(ds, store, settings=settings, log=logging.getLogger("hybridflow.staging"))
    lines = [r.getMessage() for r in caplog.records if "ETA" in r.getMessage()]
    assert lines and "/200 objects" in lines[-1] and ("KiB/s" in lines[-1] or "MiB/s" in lines[-1])


def test_versions_are_kept_until_pruned_and_pruning_keeps_at_least_three(stage, store, tmp_path):
    files = _small_files(12, 1000, seed=6)
    ds = _folder(tmp_path, "vers", files)
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


def test_prune_deletes_nothing_while_a_manifest_cannot_be_read(stage, store, tmp_path):
    ds = _folder(tmp_path, "unread", _small_files(4, 1000, seed=7))
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
    stage, rclone_s3, tmp_path, monkeypatch, capsys
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
    store = S3ObjectStore(bucket, endpoint_url=endpoint, access_key=access, secret_key=secret)
    store.ensure_bucket()
    ds = _folder(tmp_path, "clidata", {"a.txt": b"a"})
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


def test_several_big_files_go_up_whole_checked_by_md5_and_a_corrupted_one_is_recopied(stage, store, tmp_path, rclone_s3):
    big = {f"weights/{i}.bin": os.urandom(7 * MiB + i) for i in range(4)}
    ds = _folder(tmp_path, "whole", {**big, "meta.json": b"{}"})
    _age(ds.path)
    tuning = TransferSettings(multipart_threshold=6 * MiB, part_size=5 * MiB, workers=4, whole_objects_min=4)
    settings = StagingSettings(transfer=tuning, pack="never", shard_max=6 * MiB, shard_target=4 * MiB)
    index = tmp_path / "index.json"
    log = Requests(store)
    first = stage(ds, store, settings=settings, index_path=index)
    ops = [op for op, _, _ in log.calls]
    # One PutObject per file and no multipart request or HEAD after any of them.
    assert ops.count("PutObject") >= 5 and "CreateMultipartUpload" not in ops and "UploadPart" not in ops
    assert "HeadObject" not in ops[: ops.index("PutObject") + 5]  # HEADs only for the manifest's create-only write
    manifest = read_manifest(store, first.manifest_key)
    for rel, data in big.items():
        entry = manifest.entry(rel)
        assert fetch_verified(store, entry) == data
        info = store.stat(entry.key)
        assert info.etag == hashlib.md5(data).hexdigest()  # the store's ETag is the whole file's MD5
    # A flipped byte in one cached big file: the re-stage sees it from the listing and re-copies it alone.
    entry = manifest.entry("weights/2.bin")
    path = _blob_file(rclone_s3, store, entry.key)
    data = bytearray(path.read_bytes())
    data[12345] ^= 0xFF
    path.write_bytes(bytes(data))
    _settle()
    again = stage(ds, store, settings=settings, index_path=index)
    assert (again.repaired, again.objects_copied, again.bytes_copied) == (1, 1, len(big["weights/2.bin"]))
    assert fetch_verified(store, read_manifest(store, again.manifest_key).entry("weights/2.bin")) == big["weights/2.bin"]


def test_fewer_big_files_than_whole_objects_min_still_go_up_in_parts(stage, store, tmp_path):
    ds = _folder(tmp_path, "parts", {"a.bin": os.urandom(7 * MiB), "b.bin": os.urandom(8 * MiB)})
    log = Requests(store)
    stage(ds, store, settings=_multipart_settings())
    ops = [op for op, _, _ in log.calls]
    assert ops.count("CreateMultipartUpload") == 2 and ops.count("UploadPart") == 4


def test_small_files_go_up_through_the_crt_and_a_store_whose_etags_are_not_md5s_gets_them_again_checked(
    stage, store, tmp_path
):
    src = tmp_path / "small"
    src.mkdir()
    for i in range(12):
        (src / f"s{i:02d}.bin").write_bytes(os.urandom(3000 + i))
    ds = LocalFolderSource(src)
    log = Requests(store)
    first = stage(ds, store, settings=StagingSettings(pack="never"))
    assert first.objects_copied == 12
    crt_puts = [c for c in log.calls if c[0] == "PutObject" and c[2] in range(3000, 3012)]
    assert len(crt_puts) == 12 and not store.content_md5

    # A store answering ETags that are not MD5s (SSE-KMS): the CRT's answers cannot be checked,
    # so each object is sent again through botocore under Content-MD5, which the store checks.
    other = S3ObjectStore(f"hf-stage-{uuid.uuid4().hex[:10]}", prefix=PREFIX, endpoint_url=store.endpoint_url,
                          access_key=store._access_key, secret_key=store._secret_key)
    other.ensure_bucket()
    putter = other.crt_putter()
    real = putter.put_file

    def kms_like(*args, done, **kwargs):
        return real(*args, done=lambda etag, error: done(None if error else "3f1e-kms-etag", error), **kwargs)

    putter.put_file = kms_like
    sent = []
    other.client.meta.events.register(
        "before-send.s3.PutObject", lambda request, **kw: sent.append("Content-MD5" in request.headers)
    )
    again = stage(ds, other, settings=StagingSettings(pack="never"))
    assert again.objects_copied == 12 and other.content_md5
    assert sent.count(True) >= 12  # every blob (and the manifest) checked by the store
    manifest = read_manifest(other, again.manifest_key)
    for entry in manifest.entries:
        assert fetch_verified(other, entry) == (src / entry.path).read_bytes()
