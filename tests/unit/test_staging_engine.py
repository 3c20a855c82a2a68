"""The staging engine: the hash index and fanned-out listings, verified multipart uploads that resume,
small files packed into tar shards, corruption found and repaired, S3 sources, progress logs, and big
files sent whole or through the CRT."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tarfile
import time
import uuid
from pathlib import Path

import pytest
from tests.support.staging import (  # noqa: F401 (fixtures)
    NO_PACK,
    PREFIX,
    Requests,
    blob_file,
    catalogue,
    dataset_folder,
    settle,
    small_files,
    stage,
    store,
)
from tests.unit.test_sovereignty import PRIVATE_EU

from hybridflow.errors import StagingError
from hybridflow.staging import StagingSettings, blob_prefix, read_manifest
from hybridflow.storage.manifest import fetch_verified
from hybridflow.storage.objectstore import LocalObjectStore
from hybridflow.storage.reader import iter_samples
from hybridflow.storage.s3 import S3ObjectStore
from hybridflow.storage.sources import LocalFolderSource, S3DatasetSource
from hybridflow.storage.transfer import TransferSettings

pytestmark = pytest.mark.s3

MiB = 1024 * 1024


def _age(folder: Path) -> None:
    """Files written seconds ago look racily clean to the hash index; make them older."""
    old = time.time() - 60
    for p in folder.rglob("*"):
        os.utime(p, (old, old))


def test_rerun_with_an_index_reads_no_file_and_blobs_fan_out(stage, store, tmp_path):  # noqa: F811
    ds = dataset_folder(tmp_path, "fan", small_files(40, 2048))
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


def test_a_known_big_dataset_is_listed_fanned_out_while_it_is_scanned(stage, store, tmp_path):  # noqa: F811
    fanout = StagingSettings(pack="never", fanout_list_min_blobs=10)
    ds = dataset_folder(tmp_path, "wide", small_files(40, 1024))
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
    settle()
    third = stage(ds, store, settings=fanout, index_path=index)
    assert third.objects_copied == 1 and third.version == first.version


def test_a_manifest_replaced_behind_the_index_is_read_and_refused(stage, store, tmp_path):  # noqa: F811
    ds = dataset_folder(tmp_path, "swap", small_files(5, 512))
    _age(ds.path)
    index = tmp_path / "index.json"
    first = stage(ds, store, settings=NO_PACK, index_path=index)
    body = json.loads(store.get_bytes(first.manifest_key))
    body["entries"][0]["size"] += 1
    store.put_bytes(first.manifest_key, json.dumps(body).encode())  # another ETag than recorded
    with pytest.raises(StagingError, match="inconsistent|different entries"):
        stage(ds, store, settings=NO_PACK, index_path=index)


def test_corrupted_cached_objects_are_all_detected_and_repaired(stage, store, rclone_s3, tmp_path):  # noqa: F811
    files = small_files(120, 4096, seed=1)
    ds = dataset_folder(tmp_path, "flip", files)
    first = stage(ds, store, settings=NO_PACK)
    manifest = read_manifest(store, first.manifest_key)
    for entry in manifest.entries:  # one flipped byte in every cached object, size unchanged
        path = blob_file(rclone_s3, store, entry.key)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    settle()
    again = stage(ds, store, settings=NO_PACK)
    assert (again.repaired, again.objects_copied) == (120, 120)
    for entry in manifest.entries:
        assert fetch_verified(store, entry) == files[entry.path]
    assert stage(ds, store, settings=NO_PACK).repaired == 0


def _multipart_settings(**kw) -> StagingSettings:
    tuning = TransferSettings(multipart_threshold=6 * MiB, part_size=5 * MiB, workers=4, **kw)
    return StagingSettings(transfer=tuning, pack="never", shard_max=6 * MiB, shard_target=4 * MiB)


def test_big_file_goes_up_in_verified_parts_and_an_interrupted_upload_resumes(stage, store, tmp_path, monkeypatch):  # noqa: F811
    big = os.urandom(23 * MiB)
    ds = dataset_folder(tmp_path, "big", {"weights.bin": big, "meta.json": b"{}"})
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


def test_abandoned_multipart_uploads_are_aborted(stage, store, tmp_path):  # noqa: F811
    ds = dataset_folder(tmp_path, "aband", {"weights.bin": os.urandom(7 * MiB)})
    stale = store.start_multipart(f"{blob_prefix('aband')}00/not-needed-any-more")
    stage(ds, store, settings=_multipart_settings(abandoned_upload_age_s=0.0))
    assert all(u["upload_id"] != stale for u in store.multipart_uploads(blob_prefix("aband")))


def test_small_files_are_packed_into_tar_shards_with_per_sample_integrity(stage, store, tmp_path):  # noqa: F811
    files = small_files(600, 16 * 1024, seed=2)
    ds = dataset_folder(tmp_path, "packed", files)
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


def test_shards_staged_into_a_private_folder_store_read_back_verified(stage, tmp_path):  # noqa: F811
    files = small_files(400, 3000, seed=4)
    ds = dataset_folder(tmp_path, "foldered", files)
    target = LocalObjectStore(tmp_path / "cache")
    settings = StagingSettings(pack="always", shard_target=256 * 1024, shard_max=512 * 1024)
    first = stage(ds, target, destination=PRIVATE_EU, settings=settings)
    assert first.shards >= 3 and first.objects_copied == first.shards
    assert dict(iter_samples(target, read_manifest(target, first.manifest_key))) == files
    again = stage(ds, target, destination=PRIVATE_EU, settings=settings)
    assert (again.objects_copied, again.version) == (0, first.version)


def test_a_sample_corrupted_inside_a_shard_is_caught_by_the_reader(stage, store, rclone_s3, tmp_path):  # noqa: F811
    files = small_files(300, 4096, seed=3)
    ds = dataset_folder(tmp_path, "shardrot", files)
    settings = StagingSettings(pack="always", shard_target=1 * MiB, shard_max=2 * MiB)
    first = stage(ds, store, settings=settings)
    entry = read_manifest(store, first.manifest_key).entries[7]
    path = blob_file(rclone_s3, store, entry.key)
    data = bytearray(path.read_bytes())
    data[entry.offset + 10] ^= 0xFF
    path.write_bytes(bytes(data))
    settle()
    with pytest.raises(StagingError, match="corrupt"):
        fetch_verified(store, entry)
    repaired = stage(ds, store, settings=settings)
    assert repaired.repaired == 1 and fetch_verified(store, entry) == files[entry.path]


def test_stage_from_a_private_s3_bucket(stage, store, rclone_s3, tmp_path):  # noqa: F811
    endpoint, access, secret, _ = rclone_s3
    private = S3ObjectStore(f"hf-private-{uuid.uuid4().hex[:8]}", endpoint_url=endpoint, access_key=access,
                            secret_key=secret)
    private.ensure_bucket()
    files = small_files(30, 3000, seed=4)
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

def test_long_copies_log_progress(stage, store, tmp_path, caplog):  # noqa: F811
    ds = dataset_folder(tmp_path, "progress", small_files(200, 8192, seed=5))
    settings = StagingSettings(pack="never", transfer=TransferSettings(progress_every_s=0.0, workers=2))
    with caplog.at_level(logging.INFO, logger="hybridflow.staging"):
        stage(ds, store, settings=settings, log=logging.getLogger("hybridflow.staging"))
    lines = [r.getMessage() for r in caplog.records if "ETA" in r.getMessage()]
    assert lines and "/200 objects" in lines[-1] and ("KiB/s" in lines[-1] or "MiB/s" in lines[-1])


def test_several_big_files_go_up_whole_checked_by_md5_and_a_corrupted_one_is_recopied(stage, store, tmp_path, rclone_s3):  # noqa: F811
    big = {f"weights/{i}.bin": os.urandom(7 * MiB + i) for i in range(4)}
    ds = dataset_folder(tmp_path, "whole", {**big, "meta.json": b"{}"})
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
    path = blob_file(rclone_s3, store, entry.key)
    data = bytearray(path.read_bytes())
    data[12345] ^= 0xFF
    path.write_bytes(bytes(data))
    settle()
    again = stage(ds, store, settings=settings, index_path=index)
    assert (again.repaired, again.objects_copied, again.bytes_copied) == (1, 1, len(big["weights/2.bin"]))
    assert fetch_verified(store, read_manifest(store, again.manifest_key).entry("weights/2.bin")) == big["weights/2.bin"]


def test_fewer_big_files_than_whole_objects_min_still_go_up_in_parts(stage, store, tmp_path):  # noqa: F811
    ds = dataset_folder(tmp_path, "parts", {"a.bin": os.urandom(7 * MiB), "b.bin": os.urandom(8 * MiB)})
    log = Requests(store)
    stage(ds, store, settings=_multipart_settings())
    ops = [op for op, _, _ in log.calls]
    assert ops.count("CreateMultipartUpload") == 2 and ops.count("UploadPart") == 4


def test_small_files_go_up_through_the_crt_and_a_store_whose_etags_are_not_md5s_gets_them_again_checked(
    stage, store, tmp_path  # noqa: F811
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
