"""stage_dataset against a real S3 endpoint (``rclone serve s3``) and a local folder store."""

from __future__ import annotations

import json
import logging
import threading
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
    log = Requests(store)
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
    log = Requests(store)
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
    log = Requests(store)
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
    log = Requests(store)
    with pytest.raises(StagingError, match="target_location"):
        _stage(digits, store, target_location="cloud")
    assert log.calls == []


@pytest.mark.parametrize("crt", [False, True], ids=["botocore", "crt"])
def test_manifest_appears_only_after_every_blob(digits, store, monkeypatch, crt):
    settings = StagingSettings(transfer=TransferSettings(crt=crt, workers=1, crt_window_per_worker=1))
    method = "put_file_nowait" if crt else "put_verified"
    real_put = getattr(store, method)
    uploads = []
    lock = threading.Lock()

    def flaky_put(key, *args, **kwargs):
        with lock:
            uploads.append(key)
            fail = len(uploads) == 2
        if not fail:
            return real_put(key, *args, **kwargs)
        if not crt:
            raise ConnectionError("network went away")
        kwargs["done"](None, ConnectionError("network went away"))  # as the CRT reports it
        return True

    monkeypatch.setattr(store, method, flaky_put)
    with pytest.raises(StagingError, match="no manifest was written"):
        _stage(digits, store, settings=settings)
    assert len(uploads) == 2
    assert [o.key for o in store.list("datasets/digits/versions/")] == []
    assert len(list(store.list("datasets/digits/blobs/"))) == 1

    monkeypatch.setattr(store, method, real_put)
    resumed = _stage(digits, store, settings=settings)
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


# -- the staging engine: index, fan-out, multipart, packing, corruption, S3 sources, versions ------

import hashlib  # noqa: E402
import io  # noqa: E402
import os  # noqa: E402
import tarfile  # noqa: E402
from pathlib import Path  # noqa: E402

from hybridflow.cache import list_versions, prune_versions  # noqa: E402
from hybridflow.datasets import DatasetRef  # noqa: E402
from hybridflow.staging import StagingSettings, blob_prefix  # noqa: E402
from hybridflow.storage.reader import iter_samples  # noqa: E402
from hybridflow.storage.sources import S3DatasetSource  # noqa: E402
from hybridflow.storage.transfer import TransferSettings  # noqa: E402

MiB = 1024 * 1024


def _folder(root: Path, name: str, files: dict[str, bytes]) -> DatasetRef:
    folder = root / name
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return DatasetRef(uri=f"file://{folder}", path=folder)


def _small_files(n: int, size: int, seed: int = 0) -> dict[str, bytes]:
    rng = __import__("random").Random(seed)
    return {f"class-{i % 10}/img-{i:05d}.bin": rng.randbytes(size) for i in range(n)}


def _age(folder: Path) -> None:
    """Files written seconds ago look racily clean to the hash index; make them older."""
    old = time.time() - 60
    for p in folder.rglob("*"):
        os.utime(p, (old, old))


NO_PACK = StagingSettings(pack="never")


def test_rerun_with_an_index_reads_no_file_and_blobs_fan_out(store, tmp_path):
    ds = _folder(tmp_path, "fan", _small_files(40, 2048))
    _age(ds.path)
    index = tmp_path / "index.json"
    first = _stage(ds, store, settings=NO_PACK, index_path=index)
    assert (first.objects_copied, first.files_read) == (40, 40)
    keys = [o.key for o in store.list(blob_prefix("fan"))]
    assert len(keys) == 40 and all(k.split("/")[-2] == k.split("/")[-1][:2] for k in keys)
    log = Requests(store)
    written = index.stat().st_mtime_ns
    again = _stage(ds, store, settings=NO_PACK, index_path=index)
    assert (again.objects_copied, again.bytes_copied, again.files_read) == (0, 0, 0)
    # One listing and one HEAD of the committed manifest (its ETag is the one recorded): no
    # download, no write, and the unchanged index is not rewritten either.
    assert [op for op, _, _ in log.calls] == ["ListObjectsV2", "HeadObject"]
    assert index.stat().st_mtime_ns == written
    # a changed file is the only one read and sent again
    (ds.path / "class-3/img-00003.bin").write_bytes(b"new content")
    third = _stage(ds, store, settings=NO_PACK, index_path=index)
    assert (third.objects_copied, third.files_read, third.bytes_copied) == (1, 1, len(b"new content"))
    assert third.version != first.version


def test_a_known_big_dataset_is_listed_fanned_out_while_it_is_scanned(store, tmp_path):
    fanout = StagingSettings(pack="never", fanout_list_min_blobs=10)
    ds = _folder(tmp_path, "wide", _small_files(40, 1024))
    _age(ds.path)
    index = tmp_path / "index.json"
    first = _stage(ds, store, settings=fanout, index_path=index)
    assert first.objects_copied == 40
    log = Requests(store)
    again = _stage(ds, store, settings=fanout, index_path=index)
    assert (again.objects_copied, again.bytes_copied, again.files_read) == (0, 0, 0)
    assert sorted({op for op, _, _ in log.calls}) == ["HeadObject", "ListObjectsV2"]
    assert sum(op == "ListObjectsV2" for op, _, _ in log.calls) == 16  # one per first hex digit
    # the early listing still sees what changed since
    store.delete(next(iter(store.list(blob_prefix("wide")))).key)
    _settle()
    third = _stage(ds, store, settings=fanout, index_path=index)
    assert third.objects_copied == 1 and third.version == first.version


def test_a_manifest_replaced_behind_the_index_is_read_and_refused(store, tmp_path):
    ds = _folder(tmp_path, "swap", _small_files(5, 512))
    _age(ds.path)
    index = tmp_path / "index.json"
    first = _stage(ds, store, settings=NO_PACK, index_path=index)
    body = json.loads(store.get_bytes(first.manifest_key))
    body["entries"][0]["size"] += 1
    store.put_bytes(first.manifest_key, json.dumps(body).encode())  # another ETag than recorded
    with pytest.raises(StagingError, match="inconsistent|different entries"):
        _stage(ds, store, settings=NO_PACK, index_path=index)


def test_corrupted_cached_objects_are_all_detected_and_repaired(store, rclone_s3, tmp_path):
    files = _small_files(120, 4096, seed=1)
    ds = _folder(tmp_path, "flip", files)
    first = _stage(ds, store, settings=NO_PACK)
    manifest = read_manifest(store, first.manifest_key)
    for entry in manifest.entries:  # one flipped byte in every cached object, size unchanged
        path = _blob_file(rclone_s3, store, entry.key)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    _settle()
    again = _stage(ds, store, settings=NO_PACK)
    assert (again.repaired, again.objects_copied) == (120, 120)
    for entry in manifest.entries:
        assert fetch_verified(store, entry) == files[entry.path]
    assert _stage(ds, store, settings=NO_PACK).repaired == 0


def _multipart_settings(**kw) -> StagingSettings:
    tuning = TransferSettings(multipart_threshold=6 * MiB, part_size=5 * MiB, workers=4, **kw)
    return StagingSettings(transfer=tuning, pack="never", shard_max=6 * MiB, shard_target=4 * MiB)


def test_big_file_goes_up_in_verified_parts_and_an_interrupted_upload_resumes(store, tmp_path, monkeypatch):
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
        _stage(ds, store, settings=settings)
    assert [o.key for o in store.list("datasets/big/versions/")] == []
    assert len(store.multipart_uploads(blob_prefix("big"))) == 1
    monkeypatch.setattr(store, "upload_part", real_part)
    log = Requests(store)
    resumed = _stage(ds, store, settings=settings)
    assert resumed.resumed_parts == 2
    part_bytes = sum(n for op, _, n in log.calls if op == "UploadPart")
    assert part_bytes == len(big) - 2 * 5 * MiB  # only the parts the first run had not sent
    assert store.multipart_uploads(blob_prefix("big")) == []
    entry = read_manifest(store, resumed.manifest_key).entry("weights.bin")
    assert hashlib.sha256(fetch_verified(store, entry)).hexdigest() == hashlib.sha256(big).hexdigest()
    # the listing vouches for the multipart blob from now on (its ETag was recorded in the
    # manifest): nothing is re-sent and, once known to this machine's index, nothing re-read
    index = tmp_path / "idx.json"
    assert _stage(ds, store, settings=settings, index_path=index).bytes_copied == 0
    log.calls.clear()
    assert _stage(ds, store, settings=settings, index_path=index).bytes_copied == 0
    assert not any(op in ("GetObject", "UploadPart", "PutObject") for op, _, _ in log.calls[:-2])


def test_abandoned_multipart_uploads_are_aborted(store, tmp_path):
    ds = _folder(tmp_path, "aband", {"weights.bin": os.urandom(7 * MiB)})
    stale = store.start_multipart(f"{blob_prefix('aband')}00/not-needed-any-more")
    _stage(ds, store, settings=_multipart_settings(abandoned_upload_age_s=0.0))
    assert all(u["upload_id"] != stale for u in store.multipart_uploads(blob_prefix("aband")))


def test_small_files_are_packed_into_tar_shards_with_per_sample_integrity(store, tmp_path):
    files = _small_files(600, 16 * 1024, seed=2)
    ds = _folder(tmp_path, "packed", files)
    settings = StagingSettings(pack="auto", pack_min_files=100, shard_target=2 * MiB, shard_max=4 * MiB)
    first = _stage(ds, store, settings=settings, index_path=tmp_path / "idx.json")
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
    second = _stage(ds, store, settings=settings, index_path=tmp_path / "idx.json")
    assert 1 <= second.objects_copied <= 2 and second.version != first.version
    # staging only adds: the first version is still complete and readable
    for entry in read_manifest(store, first.manifest_key).entries[::50]:
        assert fetch_verified(store, entry) == files[entry.path]


def test_shards_staged_into_a_private_folder_store_read_back_verified(tmp_path):
    files = _small_files(400, 3000, seed=4)
    ds = _folder(tmp_path, "foldered", files)
    target = LocalObjectStore(tmp_path / "cache")
    settings = StagingSettings(pack="always", shard_target=256 * 1024, shard_max=512 * 1024)
    first = _stage(ds, target, target_location="private", settings=settings)
    assert first.shards >= 3 and first.objects_copied == first.shards
    assert dict(iter_samples(target, read_manifest(target, first.manifest_key))) == files
    again = _stage(ds, target, target_location="private", settings=settings)
    assert (again.objects_copied, again.version) == (0, first.version)


def test_a_sample_corrupted_inside_a_shard_is_caught_by_the_reader(store, rclone_s3, tmp_path):
    files = _small_files(300, 4096, seed=3)
    ds = _folder(tmp_path, "shardrot", files)
    settings = StagingSettings(pack="always", shard_target=1 * MiB, shard_max=2 * MiB)
    first = _stage(ds, store, settings=settings)
    entry = read_manifest(store, first.manifest_key).entries[7]
    path = _blob_file(rclone_s3, store, entry.key)
    data = bytearray(path.read_bytes())
    data[entry.offset + 10] ^= 0xFF
    path.write_bytes(bytes(data))
    _settle()
    with pytest.raises(StagingError, match="corrupt"):
        fetch_verified(store, entry)
    repaired = _stage(ds, store, settings=settings)
    assert repaired.repaired == 1 and fetch_verified(store, entry) == files[entry.path]


def test_stage_from_a_private_s3_bucket(store, rclone_s3, tmp_path):
    endpoint, access, secret, _ = rclone_s3
    private = S3ObjectStore(f"hf-private-{uuid.uuid4().hex[:8]}", endpoint_url=endpoint, access_key=access,
                            secret_key=secret)
    private.ensure_bucket()
    files = _small_files(30, 3000, seed=4)
    for rel, data in files.items():
        private.put_bytes(f"datasets/shots/{rel}", data)
    source = S3DatasetSource(private, "datasets/shots")
    index = tmp_path / "s3-index.json"
    first = _stage(source, store, settings=NO_PACK, index_path=index)
    assert first.objects_copied == 30 and first.dataset == "shots"
    for entry in read_manifest(store, first.manifest_key).entries:
        assert fetch_verified(store, entry) == files[entry.path]
    reads = Requests(private)
    again = _stage(source, store, settings=NO_PACK, index_path=index)
    assert again.bytes_copied == 0 and again.files_read == 0
    assert [op for op, _, _ in reads.calls] == ["ListObjectsV2"]  # one listing of the source, nothing else


def test_restricted_data_from_an_s3_source_never_reaches_a_public_store(store, rclone_s3):
    endpoint, access, secret, _ = rclone_s3
    private = S3ObjectStore(f"hf-private-{uuid.uuid4().hex[:8]}", endpoint_url=endpoint, access_key=access,
                            secret_key=secret)
    private.ensure_bucket()
    private.put_bytes("datasets/patients/a.csv", b"x,y\n")
    log = Requests(store)
    with pytest.raises(SovereigntyError):
        _stage(S3DatasetSource(private, "datasets/patients"), store, sensitivity="restricted")
    assert log.calls == []


def test_long_copies_log_progress(store, tmp_path, caplog):
    ds = _folder(tmp_path, "progress", _small_files(200, 8192, seed=5))
    settings = StagingSettings(pack="never", transfer=TransferSettings(progress_every_s=0.0, workers=2))
    with caplog.at_level(logging.INFO, logger="hybridflow.staging"):
        _stage(ds, store, settings=settings, log=logging.getLogger("hybridflow.staging"))
    lines = [r.getMessage() for r in caplog.records if "ETA" in r.getMessage()]
    assert lines and "/200 objects" in lines[-1] and ("KiB/s" in lines[-1] or "MiB/s" in lines[-1])


def test_versions_are_kept_until_pruned_and_pruning_keeps_at_least_three(store, tmp_path):
    files = _small_files(12, 1000, seed=6)
    ds = _folder(tmp_path, "vers", files)
    results = []
    for i in range(5):
        (ds.path / "changing.txt").write_bytes(f"version {i}".encode())
        results.append(_stage(ds, store, settings=NO_PACK))
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


def test_cache_command_lists_and_prunes_versions_through_the_clusters_connection(
    rclone_s3, tmp_path, monkeypatch, capsys
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
        made.append(_stage(ds, store, settings=NO_PACK).version)
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


def test_several_big_files_go_up_whole_checked_by_md5_and_a_corrupted_one_is_recopied(store, tmp_path, rclone_s3):
    big = {f"weights/{i}.bin": os.urandom(7 * MiB + i) for i in range(4)}
    ds = _folder(tmp_path, "whole", {**big, "meta.json": b"{}"})
    _age(ds.path)
    tuning = TransferSettings(multipart_threshold=6 * MiB, part_size=5 * MiB, workers=4, whole_objects_min=4)
    settings = StagingSettings(transfer=tuning, pack="never", shard_max=6 * MiB, shard_target=4 * MiB)
    index = tmp_path / "index.json"
    log = Requests(store)
    first = _stage(ds, store, settings=settings, index_path=index)
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
    again = _stage(ds, store, settings=settings, index_path=index)
    assert (again.repaired, again.objects_copied, again.bytes_copied) == (1, 1, len(big["weights/2.bin"]))
    assert fetch_verified(store, read_manifest(store, again.manifest_key).entry("weights/2.bin")) == big["weights/2.bin"]


def test_fewer_big_files_than_whole_objects_min_still_go_up_in_parts(store, tmp_path):
    ds = _folder(tmp_path, "parts", {"a.bin": os.urandom(7 * MiB), "b.bin": os.urandom(8 * MiB)})
    log = Requests(store)
    _stage(ds, store, settings=_multipart_settings())
    ops = [op for op, _, _ in log.calls]
    assert ops.count("CreateMultipartUpload") == 2 and ops.count("UploadPart") == 4


def test_small_files_go_up_through_the_crt_and_a_store_whose_etags_are_not_md5s_gets_them_again_checked(
    store, tmp_path
):
    src = tmp_path / "small"
    src.mkdir()
    for i in range(12):
        (src / f"s{i:02d}.bin").write_bytes(os.urandom(3000 + i))
    ds = DatasetRef(uri=f"file://{src}", path=src)
    log = Requests(store)
    first = _stage(ds, store, settings=StagingSettings(pack="never"))
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
    again = _stage(ds, other, settings=StagingSettings(pack="never"))
    assert again.objects_copied == 12 and other.content_md5
    assert sent.count(True) >= 12  # every blob (and the manifest) checked by the store
    manifest = read_manifest(other, again.manifest_key)
    for entry in manifest.entries:
        assert fetch_verified(other, entry) == (src / entry.path).read_bytes()
