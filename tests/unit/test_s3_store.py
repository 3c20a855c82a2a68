"""S3ObjectStore, ObjectStoreHook and the rclone dev endpoint, against a real ``rclone serve s3``."""

from __future__ import annotations

import hashlib
import os
import threading
import uuid
from pathlib import Path

import pytest

from hybridflow.devenv.rclone import RcloneS3Server, airflow_conn_uri, find_rclone
from hybridflow.errors import ConfigError
from hybridflow.storage.objectstore import StoreSpec, open_store
from hybridflow.storage.s3 import S3ObjectStore

pytestmark = pytest.mark.s3


class Requests:
    """Every HTTP request a boto3 client sends, as (operation, method, body bytes)."""

    def __init__(self, client) -> None:
        self.calls: list[tuple[str, str, int]] = []
        client.meta.events.register("before-send.s3", self._on_send)

    def _on_send(self, request, **kwargs) -> None:
        op = kwargs.get("event_name", "").rsplit(".", 1)[-1]
        self.calls.append((op, request.method, int(request.headers.get("Content-Length") or 0)))

    def ops(self, name: str) -> int:
        return sum(1 for op, _, _ in self.calls if op == name)


def _bucket() -> str:
    return f"hf-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def s3_args(rclone_s3):
    endpoint, access, secret, _ = rclone_s3
    return {"endpoint_url": endpoint, "access_key": access, "secret_key": secret}


@pytest.fixture
def store(s3_args) -> S3ObjectStore:
    s = S3ObjectStore(_bucket(), prefix="team/cache", **s3_args)
    s.ensure_bucket()
    return s


def test_ensure_bucket_creates_the_bucket_folder_once(rclone_s3, s3_args):
    data_dir = rclone_s3[3]
    s = S3ObjectStore(_bucket(), **s3_args)
    assert s.ensure_bucket() is True
    assert (data_dir / s.bucket).is_dir()
    # rclone answers BucketAlreadyExists to its owner; a second call must still succeed.
    assert s.ensure_bucket() is False


def test_put_get_roundtrip_and_keys_are_under_the_prefix(store, rclone_s3):
    store.put_bytes("a/b.txt", b"hello", metadata={"sha256": "abc"})
    assert store.get_bytes("a/b.txt") == b"hello"
    assert store.exists("a/b.txt")
    assert (rclone_s3[3] / store.bucket / "team/cache/a/b.txt").read_bytes() == b"hello"
    # rclone returns metadata names capitalised; the store normalises them.
    assert store.metadata("a/b.txt") == {"sha256": "abc"}
    info = store.stat("a/b.txt")
    assert info is not None and info.size == 5 and info.etag == hashlib.md5(b"hello").hexdigest()
    assert store.uri == f"s3://{store.bucket}/team/cache"
    assert "secret" not in repr(store)


def test_missing_objects(store, tmp_path):
    assert not store.exists("nope")
    assert store.stat("nope") is None
    with pytest.raises(FileNotFoundError, match="nope"):
        store.get_bytes("nope")
    with pytest.raises(FileNotFoundError):
        store.get_file("nope", tmp_path / "x")
    store.delete("nope")  # deleting a missing key is not an error, as on S3


def test_keys_cannot_escape_the_prefix(store):
    with pytest.raises(ValueError):
        store.put_bytes("../other/x", b"1")


def test_list_paginates_and_returns_relative_keys(store, s3_args):
    outside = S3ObjectStore(store.bucket, prefix="team/other", **s3_args)
    outside.put_bytes("d/zz", b"not mine")
    for i in range(5):
        store.put_bytes(f"d/{i}", b"x" * i)
    store.put_bytes("e/0", b"y")
    store.list_page_size = 2
    log = Requests(store.client)
    listed = list(store.list("d/"))
    assert [(o.key, o.size) for o in listed] == [(f"d/{i}", i) for i in range(5)]
    assert log.ops("ListObjectsV2") == 3  # 5 keys in pages of 2
    assert {o.key for o in store.list()} == {f"d/{i}" for i in range(5)} | {"e/0"}


def test_put_if_absent_never_overwrites(store):
    assert store.put_if_absent("m/v1.json", b"first") is True
    assert store.put_if_absent("m/v1.json", b"second") is False
    assert store.get_bytes("m/v1.json") == b"first"


def test_rclone_ignores_if_none_match(store):
    """Pins the finding behind put_if_absent's HEAD: rclone v1.75.2 accepts ``If-None-Match: *``
    but overwrites anyway. If this starts failing, rclone honours it and the comment in s3.py
    should say so."""
    full = f"{store.prefix}/raw"
    store.client.put_object(Bucket=store.bucket, Key=full, Body=b"1", IfNoneMatch="*")
    store.client.put_object(Bucket=store.bucket, Key=full, Body=b"2", IfNoneMatch="*")
    assert store.get_bytes("raw") == b"2"


def test_put_if_absent_falls_back_when_endpoint_rejects_if_none_match(store, monkeypatch):
    from botocore.exceptions import ClientError

    real_put = store.client.put_object
    seen = []

    def put_object(**kwargs):
        seen.append("IfNoneMatch" in kwargs)
        if "IfNoneMatch" in kwargs:
            raise ClientError(
                {"Error": {"Code": "NotImplemented"}, "ResponseMetadata": {"HTTPStatusCode": 501}},
                "PutObject",
            )
        return real_put(**kwargs)

    monkeypatch.setattr(store.client, "put_object", put_object)
    assert store.put_if_absent("k", b"1") is True
    assert store.put_if_absent("k2", b"2") is True
    assert seen == [True, False, False]  # remembered: no second conditional attempt
    assert store.get_bytes("k") == b"1"


@pytest.mark.parametrize("checksums", ["when_required", "when_supported"])
def test_multipart_upload_and_download_roundtrip(s3_args, tmp_path, checksums):
    s = S3ObjectStore(
        _bucket(), checksums=checksums, multipart_threshold=5 << 20, multipart_chunksize=5 << 20, **s3_args
    )
    s.ensure_bucket()
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(11 << 20))
    log = Requests(s.client)
    s.put_file("blobs/big", src, metadata={"sha256": "x"})
    assert log.ops("UploadPart") == 3
    out = tmp_path / "out" / "big.bin"
    s.get_file("blobs/big", out)
    assert out.read_bytes() == src.read_bytes()
    assert s.get_bytes("blobs/big") == src.read_bytes()
    # rclone --etag-hash MD5: the ETag is the MD5 of the whole object even after multipart.
    assert s.stat("blobs/big").etag == hashlib.md5(src.read_bytes()).hexdigest()


def test_threads_share_one_client_and_its_pool(store):
    seen, errors = [], []

    def work(i: int) -> None:
        try:
            seen.append(store.client)
            store.put_bytes(f"t/{i}", str(i).encode())
            assert store.get_bytes(f"t/{i}") == str(i).encode()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(c is store.client for c in seen)
    assert store.client.meta.config.max_pool_connections == 32
    assert sorted(o.key for o in store.list("t/")) == sorted(f"t/{i}" for i in range(24))


def test_listing_parses_timestamps_without_dateutil(store):
    from datetime import datetime

    from hybridflow.storage.s3 import _fast_timestamp

    assert _fast_timestamp("2026-12-03T10:00:00.123Z") == datetime.fromisoformat("2026-12-03T10:00:00.123+00:00")
    assert _fast_timestamp("Wed, 21 Oct 2015 07:28:00 GMT").year == 2015  # HTTP-date headers still parse
    store.put_bytes("ts", b"x")
    page = store.client.list_objects_v2(Bucket=store.bucket, Prefix=store.prefix)
    assert isinstance(page["Contents"][0]["LastModified"], datetime)


def test_open_store_and_spec_roundtrip(store, s3_args):
    spec = store.spec.child("run-1")
    assert spec.prefix == "team/cache/run-1"
    env = spec.credential_env()
    worker_spec = StoreSpec.from_dict(spec.to_dict(), environ=env)
    assert s3_args["secret_key"] not in str(spec.to_dict())  # credentials travel only via env
    worker = open_store(worker_spec)
    assert isinstance(worker, S3ObjectStore)
    worker.put_bytes("ckpt", b"state")
    assert store.get_bytes("run-1/ckpt") == b"state"


# -- ObjectStoreHook ---------------------------------------------------------------------------


def test_hook_reads_aws_connection_from_env(rclone_s3, monkeypatch):
    from hybridflow.hooks.object_store import ObjectStoreHook

    endpoint, access, secret, _ = rclone_s3
    monkeypatch.setenv("AIRFLOW_CONN_HF_TEST_CACHE", airflow_conn_uri(access, secret, endpoint))
    hook = ObjectStoreHook(object_store_conn_id="hf_test_cache")
    spec = hook.store_spec("hf-hook-bucket", prefix="/p/")
    assert (spec.kind, spec.bucket, spec.prefix, spec.endpoint_url, spec.region) == (
        "s3",
        "hf-hook-bucket",
        "p",
        endpoint,
        "us-east-1",
    )
    assert (spec.access_key, spec.secret_key) == (access, secret)
    s = hook.get_store("hf-hook-bucket")
    s.ensure_bucket()
    s.put_bytes("x", b"via hook")
    assert s.get_bytes("x") == b"via hook"


def test_hook_does_not_look_up_the_connection_in_init(monkeypatch):
    from hybridflow.hooks.object_store import ObjectStoreHook

    hook = ObjectStoreHook(object_store_conn_id="hf_does_not_exist")  # must not raise
    assert hook.object_store_conn_id == "hf_does_not_exist"


def test_hook_rejects_connection_without_secret(monkeypatch):
    from hybridflow.hooks.object_store import ObjectStoreHook

    monkeypatch.setenv("AIRFLOW_CONN_HF_NO_SECRET", "aws://onlyaccesskey12@/?endpoint_url=http%3A%2F%2Fx")
    with pytest.raises(ConfigError, match="hf_no_secret"):
        ObjectStoreHook(object_store_conn_id="hf_no_secret").store_spec("b")


# -- rclone dev endpoint -------------------------------------------------------------------------


def test_conn_uri_round_trips_through_airflow_connection():
    from airflow.sdk import Connection

    access, secret = "AKIA/EXAMPLE+12", "s3cr/t+=:@?&key"
    uri = airflow_conn_uri(access, secret, "http://127.0.0.1:9000")
    conn = Connection.from_uri(uri, conn_id="x")
    assert conn.conn_type == "aws"
    assert (conn.login, conn.password) == (access, secret)
    assert conn.extra_dejson == {"endpoint_url": "http://127.0.0.1:9000", "region_name": "us-east-1"}


def test_find_rclone_and_key_length_check(tmp_path):
    assert os.access(find_rclone(), os.X_OK)
    with pytest.raises(ValueError, match="12"):
        RcloneS3Server(tmp_path, "short", "alsoshort")


def test_server_stop_terminates_only_its_own_process(tmp_path, rclone_s3, s3_args):
    with RcloneS3Server(tmp_path / "data", "second-access-key", "second-secret-key") as server:
        pid = server.pid
        s = S3ObjectStore(
            "hf-b2",
            endpoint_url=server.endpoint_url,
            access_key="second-access-key",
            secret_key="second-secret-key",
        )
        s.ensure_bucket()
        s.put_bytes("k", b"v")
        assert (tmp_path / "data" / "hf-b2" / "k").read_bytes() == b"v"
        # The keys never show in the process list (`ps` shows every user the command line) ...
        assert b"second-secret-key" not in Path(f"/proc/{pid}/cmdline").read_bytes()
        # ... and the server still checks them.
        wrong = S3ObjectStore("hf-b2", endpoint_url=server.endpoint_url, access_key="second-access-key",
                              secret_key="not-the-secret-key")
        with pytest.raises(Exception, match="(?i)signature|denied|forbidden|invalid"):
            wrong.get_bytes("k")
    assert server.pid is None and not server.running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    # The session server is untouched.
    session = S3ObjectStore(_bucket(), **s3_args)
    assert session.ensure_bucket() is True


def _corrupt_bodies(client, op: str) -> None:
    """Flip a byte of every request body after it was checksummed and signed: what a broken link,
    proxy or store would do."""

    def corrupt(request, **kwargs) -> None:
        body = request.body
        if hasattr(body, "read"):
            body.seek(0)
            body = body.read()
        if isinstance(body, bytes | bytearray) and len(body) > 100:
            b = bytearray(body)
            b[50] ^= 1
            request.body = bytes(b)

    client.meta.events.register(f"before-send.s3.{op}", corrupt)


def test_verified_put_carries_a_checksum_and_checks_the_etag(store):
    from hybridflow.storage.s3 import _check_etag

    sent = []
    store.client.meta.events.register("before-send.s3", lambda request, **kw: sent.append(dict(request.headers)))
    data = os.urandom(10_000)
    md5, sha = hashlib.md5(data).hexdigest(), hashlib.sha256(data).hexdigest()
    assert store.put_verified("v/ok", data, md5=md5, sha256=sha) == md5
    headers = {k.lower(): v for k, v in sent[-1].items()}
    assert "x-amz-checksum-sha256" in headers and "content-md5" not in headers
    assert "expect" not in headers  # no 100-continue round trip per object
    store.put_bytes("v/crc", data)
    assert "x-amz-checksum-crc32c" in {k.lower() for k in sent[-1]}
    with pytest.raises(ValueError, match="the bytes were changed"):
        _check_etag('"' + "0" * 32 + '"', md5, "v/x")
    assert _check_etag('"abc-3"', md5, "v/x") == "abc-3"  # not an MD5 (multipart, SSE-KMS)


def test_bytes_changed_on_the_way_are_caught_with_or_without_content_md5(s3_args):
    from botocore.exceptions import ClientError

    data = os.urandom(10_000)
    md5 = hashlib.md5(data).hexdigest()
    plain = S3ObjectStore(_bucket(), **s3_args)
    plain.ensure_bucket()
    _corrupt_bodies(plain.client, "PutObject")
    with pytest.raises(ValueError, match="the bytes were changed"):  # the store's ETag gives it away
        plain.put_verified("x", data, md5=md5)
    strict = S3ObjectStore(_bucket(), content_md5=True, **s3_args)
    strict.ensure_bucket()
    _corrupt_bodies(strict.client, "PutObject")
    with pytest.raises(ClientError, match="BadDigest"):  # the store refuses it
        strict.put_verified("x", data, md5=md5)
    assert strict.stat("x") is None
    mp = S3ObjectStore(_bucket(), **s3_args)
    mp.ensure_bucket()
    _corrupt_bodies(mp.client, "UploadPart")
    upload = mp.start_multipart("big")
    part = os.urandom(5 << 20)
    with pytest.raises(ValueError, match="part 1"):
        mp.upload_part("big", upload, 1, part, md5=hashlib.md5(part).hexdigest())


def test_a_store_whose_etags_are_not_md5s_gets_content_md5(store):
    def kms_like(parsed, **kwargs) -> None:
        if "ETag" in parsed:
            parsed["ETag"] = '"0f1e2d-kms"'

    store.client.meta.events.register("after-call.s3.PutObject", kms_like)
    sent = []
    store.client.meta.events.register("before-send.s3.PutObject", lambda request, **kw: sent.append(dict(request.headers)))
    data = b"x" * 1000
    store.put_verified("k", data, md5=hashlib.md5(data).hexdigest())
    assert store.content_md5 is True
    assert ["content-md5" in {k.lower() for k in h} for h in sent] == [False, True]  # sent again, checked


def _put_nowait(store: S3ObjectStore, key: str, path, **kw):
    """put_file_nowait, waited for: (etag, error)."""
    answer: list = []
    finished = threading.Event()

    def done(etag, error):
        answer.extend([etag, error])
        finished.set()

    data = path.read_bytes()
    args = {"size": len(data), "md5": hashlib.md5(data).hexdigest(), "sha256": hashlib.sha256(data).hexdigest()}
    assert store.put_file_nowait(key, str(path), **(args | kw), done=done) is True
    assert finished.wait(30), "the CRT never answered"
    return answer[0], answer[1]


def test_a_file_sent_through_the_crt_lands_under_the_prefix_checked_by_its_etag(store, rclone_s3, tmp_path):
    path = tmp_path / "sample 1+x.bin"
    path.write_bytes(os.urandom(70_000))
    seen = []
    store.crt_observers.append(lambda *call: seen.append(call))
    etag, error = _put_nowait(store, "blobs/ab/sample 1+x.bin", path, metadata={"sha256": "f00"})
    assert error is None and etag == hashlib.md5(path.read_bytes()).hexdigest()
    assert seen == [("PutObject", "PUT", 70_000)]
    assert (rclone_s3[3] / store.bucket / "team/cache/blobs/ab/sample 1+x.bin").read_bytes() == path.read_bytes()
    assert store.metadata("blobs/ab/sample 1+x.bin") == {"sha256": "f00"}

    # An answer whose ETag is not the MD5 we hold means the store got other bytes.
    etag, error = _put_nowait(store, "blobs/ab/other", path, md5="0" * 32)
    assert etag is None and isinstance(error, ValueError) and "bytes were changed" in str(error)


def test_a_crt_request_the_store_refuses_names_the_key_and_the_error(s3_args, tmp_path):
    from hybridflow.storage.crt import CrtRequestError

    missing = S3ObjectStore(_bucket(), **s3_args)  # never created
    path = tmp_path / "x.bin"
    path.write_bytes(b"x" * 10)
    etag, error = _put_nowait(missing, "k/x.bin", path)
    assert etag is None and isinstance(error, CrtRequestError)
    assert error.status == 404 and "k/x.bin" in str(error) and "NoSuchBucket" in str(error)


def test_a_store_with_the_crt_switched_off_sends_nothing_through_it(s3_args, tmp_path):
    off = S3ObjectStore(_bucket(), crt=False, **s3_args)
    assert off.crt_putter() is None
    assert off.put_file_nowait("k", str(tmp_path), size=0, md5="0" * 32, done=lambda *a: None) is False
