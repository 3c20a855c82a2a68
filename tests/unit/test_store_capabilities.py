"""Optional store capabilities are declared by a store's class and checked with isinstance: what a
store merely happens to have is not used, and a store that declares one must implement it."""

from __future__ import annotations

import hashlib
import os

import pytest

from hybridflow.storage.objectstore import (
    ChunkedPut,
    LocalObjectStore,
    MultipartUploads,
    NativeFilePut,
    ObjectStat,
    PagedListing,
    PartialSweep,
    VerifiedPut,
)
from hybridflow.storage.s3 import S3ObjectStore
from hybridflow.storage.sources import LocalFiles, LocalFolderSource
from hybridflow.storage.transfer import TransferSettings, Uploader, UploadItem

ALL = (ChunkedPut, MultipartUploads, NativeFilePut, ObjectStat, PagedListing, PartialSweep, VerifiedPut)


def _declared(store) -> set[type]:
    return {cap for cap in ALL if isinstance(store, cap)}


def test_each_store_declares_what_it_can_do(tmp_path):
    assert _declared(LocalObjectStore(tmp_path)) == {VerifiedPut, ChunkedPut, PartialSweep}
    s3 = S3ObjectStore("b", endpoint_url="http://127.0.0.1:9", access_key="a" * 12, secret_key="s" * 12)
    assert _declared(s3) == {VerifiedPut, MultipartUploads, ObjectStat, NativeFilePut, PagedListing}
    assert isinstance(LocalFolderSource(tmp_path), LocalFiles)


def test_a_store_declaring_a_capability_must_implement_it(tmp_path):
    class Careless(LocalObjectStore, MultipartUploads):
        pass

    with pytest.raises(TypeError, match="abstract"):
        Careless(tmp_path)


class Undeclared(LocalObjectStore):
    """Has the multipart method names but does not declare MultipartUploads."""

    def start_multipart(self, key, *, metadata=None):
        raise AssertionError("an undeclared capability was used")

    def put_file_nowait(self, *args, **kwargs):
        raise AssertionError("an undeclared capability was used")


def _item(path, data: bytes) -> UploadItem:
    return UploadItem(
        key="big", size=len(data), sha256=hashlib.sha256(data).hexdigest(), md5=hashlib.md5(data).hexdigest(),
        read=lambda off, n: data[off:off + n], path=str(path),
    )


def test_uploads_use_only_declared_capabilities(tmp_path):
    data = os.urandom(300_000)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    store = Undeclared(tmp_path / "store")
    settings = TransferSettings(workers=2, multipart_threshold=100_000, part_size=64_000)
    [done] = Uploader(store, settings).upload([_item(src, data)], uploads_prefix="")
    assert (done.size, done.parts, done.sha256) == (len(data), 0, hashlib.sha256(data).hexdigest())
    assert store.get_bytes("big") == data  # streamed in chunks, the folder store's declared path


def test_a_store_without_a_way_to_send_big_objects_is_named(tmp_path):
    class PutOnly:
        uri = "memory://put-only"
        objects: dict = {}

        def put_bytes(self, key, data, *, metadata=None):
            self.objects[key] = bytes(data)

    data = os.urandom(200_000)
    settings = TransferSettings(workers=1, multipart_threshold=100_000, part_size=64_000)
    with pytest.raises(TypeError, match="neither multipart uploads nor streamed writes"):
        Uploader(PutOnly(), settings).upload([_item(tmp_path / "x", data)], uploads_prefix="")


def test_open_store_picks_the_implementation_by_kind_and_names_the_kinds_it_knows(tmp_path):
    from hybridflow.storage.objectstore import STORE_KINDS, StoreSpec, open_store

    store = open_store(StoreSpec(kind="local", root=str(tmp_path)))
    assert isinstance(store, LocalObjectStore) and store.uri.endswith(str(tmp_path))
    with pytest.raises(ValueError, match=r"store kind 'gcs' is not supported; use one of: local, s3"):
        open_store(StoreSpec(kind="gcs", root=str(tmp_path)))
    assert set(STORE_KINDS) == {"local", "s3"}
