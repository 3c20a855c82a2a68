"""The :class:`~hybridflow.storage.objectstore.ObjectStore` contract over an S3-compatible endpoint.

Works against AWS S3, MinIO and ``rclone serve s3`` (the dev/CI endpoint). Findings against
rclone v1.75.2 (``rclone serve s3 --etag-hash MD5``) that shape this module:

* Checksums: botocore >= 1.36 sends CRC32 checksums by default (``when_supported``). rclone accepts
  them for PutObject, single-part and multipart uploads and returns ``x-amz-checksum-crc32`` on
  HEAD/GET, so both modes work there. We still default to ``when_required`` because other
  S3-compatible stores (older MinIO, Ceph RGW, GCS interop) reject the aws-chunked trailer
  encoding, and staging verifies content itself (ETag/MD5 or SHA-256 of a re-download).
* Conditional PUT: rclone *accepts* ``If-None-Match: *`` but ignores it -- a second PUT silently
  overwrites. So :meth:`S3ObjectStore.put_if_absent` always HEADs first (the only protection on
  rclone) and then sends the conditional PUT, which makes the create atomic on stores that honour
  it (AWS since 2024, recent MinIO). A store that rejects the header (501/NotImplemented) is
  remembered and gets plain PUTs.
* ETags: with ``--etag-hash MD5`` rclone's ETag is the MD5 of the whole stored file, also after
  a multipart upload and after the file is changed on disk; AWS gives ``<md5>-<parts>`` for
  multipart objects, which callers must not compare against an MD5.
* User metadata comes back with capitalised keys (``Sha256``); :meth:`S3ObjectStore.metadata`
  lower-cases them. rclone keeps it in memory only, so it is a hint, not an integrity check.
* ``CreateBucket`` on an existing bucket answers ``BucketAlreadyExists`` even to its owner.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.storage.objectstore import ObjectInfo, StoreSpec

_MiB = 1024 * 1024
_NOT_FOUND = {"404", "NoSuchKey", "NotFound", "NoSuchBucket"}
_PRECONDITION_FAILED = {"412", "PreconditionFailed", "ConditionalRequestConflict"}
_NOT_SUPPORTED = {"501", "NotImplemented"}


def _error_code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def _status(exc: Exception) -> int:
    response = getattr(exc, "response", None) or {}
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _is_not_found(exc: Exception) -> bool:
    return _error_code(exc) in _NOT_FOUND or _status(exc) == 404


def _fast_timestamp(value: str):
    """ISO-8601 timestamps (every LastModified in a listing) without dateutil, which costs ~40 us
    each and dominated the CPU of listing 100k objects; other forms go to botocore's parser."""
    from datetime import datetime

    try:
        return datetime.fromisoformat(value)
    except (TypeError, ValueError):
        from botocore.utils import parse_timestamp

        return parse_timestamp(value)


class S3ObjectStore:
    """An S3 bucket (optionally under ``prefix``) as an object store.

    One boto3 client serves every thread (low-level clients are thread-safe; only sessions are
    not), with a connection pool sized for ``max_pool_connections`` concurrent requests: a
    client per thread would cost ~60 ms of CPU each and its own pool.
    """

    list_page_size = 1000  # keys per ListObjectsV2 request (the S3 maximum)

    def __init__(
        self,
        bucket: str,
        *,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str = "us-east-1",
        access_key: str | None = None,
        secret_key: str | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        max_attempts: int = 5,
        checksums: str = "when_required",
        multipart_threshold: int = 64 * _MiB,
        multipart_chunksize: int = 16 * _MiB,
        max_concurrency: int = 4,
        max_pool_connections: int = 32,
        content_md5: bool = False,
        crt: bool = True,
    ) -> None:
        if not bucket:
            raise ValueError("S3ObjectStore needs a bucket name")
        if checksums not in ("when_required", "when_supported"):
            raise ValueError(f"checksums={checksums!r}; use 'when_required' or 'when_supported'")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url or None
        self.region = region or "us-east-1"
        self._access_key = access_key
        self._secret_key = secret_key
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._max_attempts = max_attempts
        self._checksums = checksums
        self._multipart_threshold = multipart_threshold
        self._multipart_chunksize = multipart_chunksize
        self._max_concurrency = max_concurrency
        self._max_pool_connections = max_pool_connections
        self._client = None
        self._client_lock = threading.Lock()
        # None: not known yet; False: the endpoint rejected If-None-Match, send plain PUTs.
        self._conditional_put: bool | None = None
        # Content-MD5 on every write (see _put); switched on by itself for stores whose ETags are
        # not MD5s, or for multipart stores that refuse part checksums.
        self.content_md5 = content_md5
        self._part_checksums: bool | None = None
        # Small files go up through the AWS CRT where awscrt is installed (see storage.crt).
        self._crt_wanted = crt
        self._crt = None
        self._boto_session = None
        # Told (operation, method, Content-Length) of every request sent through the CRT, which
        # botocore's event hooks do not see.
        self.crt_observers: list[Any] = []

    @classmethod
    def from_spec(cls, spec: StoreSpec, **kwargs: Any) -> S3ObjectStore:
        if spec.kind != "s3":
            raise ValueError(f"StoreSpec kind {spec.kind!r} is not 's3'")
        if not spec.bucket:
            raise ValueError("an s3 StoreSpec needs a bucket")
        return cls(
            spec.bucket,
            prefix=spec.prefix,
            endpoint_url=spec.endpoint_url,
            region=spec.region,
            access_key=spec.access_key,
            secret_key=spec.secret_key,
            **kwargs,
        )

    @property
    def spec(self) -> StoreSpec:
        return StoreSpec(
            kind="s3",
            bucket=self.bucket,
            prefix=self.prefix,
            endpoint_url=self.endpoint_url,
            region=self.region,
            access_key=self._access_key,
            secret_key=self._secret_key,
        )

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def __repr__(self) -> str:  # never shows credentials
        return f"S3ObjectStore({self.uri!r}, endpoint_url={self.endpoint_url!r})"

    # -- clients -------------------------------------------------------------------------------

    @property
    def client(self):
        """The store's boto3 S3 client, shared by all threads (created on first use)."""
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    self._client = self._make_client()
        return self._client

    def _make_client(self):
        import boto3
        import botocore.session
        from botocore.config import Config

        config = Config(
            region_name=self.region,
            connect_timeout=self._connect_timeout,
            read_timeout=self._read_timeout,
            retries={"max_attempts": self._max_attempts, "mode": "standard"},
            # Path-style: rclone/MinIO on an IP:port cannot serve virtual-host buckets. No SigV4
            # payload hash: every PUT here carries Content-MD5 instead (which stores do check;
            # rclone does not check the signed payload hash), and over plain HTTP botocore would
            # otherwise SHA-256 every byte a second time.
            s3={"addressing_style": "path", "payload_signing_enabled": False},
            request_checksum_calculation=self._checksums,
            response_checksum_validation=self._checksums,
            max_pool_connections=self._max_pool_connections,
        )
        core = botocore.session.get_session()
        core.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=_fast_timestamp)
        session = boto3.session.Session(
            aws_access_key_id=self._access_key,
            aws_secret_access_key=self._secret_key,
            region_name=self.region,
            botocore_session=core,
        )
        client = session.client("s3", endpoint_url=self.endpoint_url, config=config)
        self._boto_session = session
        # No "Expect: 100-continue" on PUTs: it costs a round trip per request (most of the time
        # of a small object on a fast link) to save a body that an error answer would discard.
        from botocore.handlers import add_expect_header

        client.meta.events.unregister("before-call.s3", add_expect_header)
        return client

    @property
    def transfer_config(self):
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(
            multipart_threshold=self._multipart_threshold,
            multipart_chunksize=self._multipart_chunksize,
            max_concurrency=self._max_concurrency,
            use_threads=self._max_concurrency > 1,
        )

    # -- keys ----------------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        key = key.lstrip("/")
        if not key or ".." in key.split("/"):
            raise ValueError(f"object key {key!r} is empty or escapes the store prefix {self.uri}")
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, full_key: str) -> str:
        return full_key[len(self.prefix) + 1 :] if self.prefix else full_key

    def _extra_args(self, metadata: dict[str, str] | None) -> dict[str, Any]:
        return {"Metadata": dict(metadata)} if metadata else {}

    # -- bucket --------------------------------------------------------------------------------

    def ensure_bucket(self) -> bool:
        """Create the bucket if it is missing. Returns True when this call created it."""
        from botocore.exceptions import ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
            return False
        except ClientError as exc:
            if not _is_not_found(exc):
                raise
        kwargs: dict[str, Any] = {"Bucket": self.bucket}
        if self.region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
        try:
            self.client.create_bucket(**kwargs)
            return True
        except ClientError as exc:
            # Lost a creation race (or rclone's answer for an existing bucket): confirm access.
            if _error_code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise
            self.client.head_bucket(Bucket=self.bucket)
            return False

    # -- ObjectStore ---------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes, *, metadata: dict[str, str] | None = None) -> None:
        self.put_verified(key, data, md5=_md5_hex(data), metadata=metadata)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        if self.exists(key):
            return False
        md5 = _md5_hex(data)
        if self._conditional_put is not False:
            try:
                self._put(key, data, md5=md5, extra={"IfNoneMatch": "*"})
                self._conditional_put = True
                return True
            except ClientError as exc:
                code = _error_code(exc)
                if code in _PRECONDITION_FAILED or _status(exc) == 412:
                    return False  # someone created it between our HEAD and PUT
                if code not in _NOT_SUPPORTED and _status(exc) != 501:
                    raise
                self._conditional_put = False
        self._put(key, data, md5=md5)
        return True

    def put_file(self, key: str, path: Path, *, metadata: dict[str, str] | None = None) -> None:
        """Upload a file with the same checks as staging: Content-MD5 on every request, and a
        multipart upload in verified parts above the multipart threshold."""
        import hashlib

        from hybridflow.storage.transfer import TransferSettings, Uploader, UploadItem

        path = Path(path)
        size = path.stat().st_size

        def read(offset: int, length: int) -> bytes:
            with open(path, "rb") as fh:
                fh.seek(offset)
                return fh.read(length)

        md5 = None
        if size <= self._multipart_threshold:
            md5 = hashlib.md5(path.read_bytes(), usedforsecurity=False).hexdigest()
        settings = TransferSettings(
            workers=max(1, self._max_concurrency),
            multipart_threshold=self._multipart_threshold,
            part_size=max(5 * _MiB, self._multipart_chunksize),
            sha256_header=False,
        )
        item = UploadItem(key=key, size=size, sha256="", md5=md5, read=read, label=str(path),
                          metadata=dict(metadata or {}))
        Uploader(self, settings).upload([item], uploads_prefix=key)

    def get_bytes(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            if _is_not_found(exc):
                raise FileNotFoundError(f"{self.uri}/{key} does not exist") from exc
            raise
        with response["Body"] as body:
            return body.read()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        from botocore.exceptions import ClientError

        if length <= 0:
            return b""
        try:
            response = self.client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{start + length - 1}"
            )
        except ClientError as exc:
            if _is_not_found(exc):
                raise FileNotFoundError(f"{self.uri}/{key} does not exist") from exc
            raise
        with response["Body"] as body:
            return body.read()

    def get_file(self, key: str, path: Path) -> None:
        from botocore.exceptions import ClientError

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            # s3transfer downloads into a temp name and renames, so no half-written file remains.
            self.client.download_file(self.bucket, self._key(key), str(path), Config=self.transfer_config)
        except ClientError as exc:
            if _is_not_found(exc):
                raise FileNotFoundError(f"{self.uri}/{key} does not exist") from exc
            raise

    # -- verified uploads ------------------------------------------------------------------------
    # Every write carries a checksum header the store can check (x-amz-checksum-sha256 where the
    # SHA-256 is known anyway, x-amz-checksum-crc32c otherwise: AWS, MinIO and Ceph verify them),
    # and every answer's ETag is compared with the MD5 computed here, which catches a store that
    # got other bytes even where it checks no header (rclone v1.75.2 ignores x-amz-checksum-*).
    # Content-MD5 is sent only where ETags cannot vouch (SSE-KMS) or when asked for: with it,
    # rclone hashes every byte a second time, which cost ~30 % of throughput on 2 cores.

    def _put(
        self, key: str, data, *, md5: str, sha256: str | None = None, metadata: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        kwargs: dict[str, Any] = dict(extra or {})
        if hasattr(data, "seek"):
            data.seek(0)  # a streamed body sent again (see below) starts from its first byte
        if sha256:
            kwargs["ChecksumSHA256"] = _b64(sha256)
        else:
            kwargs["ChecksumCRC32C"] = _crc32c_b64(data)
        if self.content_md5:
            kwargs["ContentMD5"] = _b64(md5)
        response = self.client.put_object(
            Bucket=self.bucket, Key=self._key(key), Body=data, **kwargs, **self._extra_args(metadata)
        )
        etag = _clean_etag(response.get("ETag")) or ""
        if not self.content_md5 and not _is_md5_etag(etag):
            # This store's ETags are not MD5s: send this object again under Content-MD5 so the store
            # itself checks it, and every later one too.
            self.content_md5 = True
            return self._put(key, data, md5=md5, sha256=sha256, metadata=metadata, extra=extra)
        return _check_etag(etag, md5, key)

    def put_verified(
        self, key: str, data, *, md5: str, sha256: str | None = None, metadata: dict[str, str] | None = None
    ) -> str:
        """PutObject with a checksum header; returns the ETag. Raises ValueError if the store's
        ETag contradicts ``md5``. ``data``: bytes, or a seekable file (then ``sha256`` is needed:
        a CRC32C header would cost a read of the whole file before sending it)."""
        return self._put(key, data, md5=md5, sha256=sha256, metadata=metadata)

    def crt_putter(self):
        """The store's :class:`~hybridflow.storage.crt.CrtPutter` (created on first use), or None
        where it cannot serve: awscrt missing, switched off, no credentials, or Content-MD5 mode
        (the ETags of this store are not MD5s, so every write must be checked by the store)."""
        from hybridflow.storage.crt import CrtPutter, crt_available

        if not self._crt_wanted or self.content_md5 or not crt_available():
            return None
        import os

        putter = self._crt
        if putter is None or putter.pid != os.getpid():
            # Outside the lock: the client property takes the same (non-reentrant) lock.
            self.client  # noqa: B018 -- resolves the session and its credentials
            with self._client_lock:
                if self._crt is None or self._crt.pid != os.getpid():
                    creds = self._boto_session.get_credentials() if self._boto_session else None
                    if creds is None:
                        self._crt_wanted = False
                        return None

                    def credentials(creds=creds) -> tuple[str, str, str | None]:
                        frozen = creds.get_frozen_credentials()
                        return frozen.access_key, frozen.secret_key, frozen.token

                    self._crt = CrtPutter(
                        bucket=self.bucket, endpoint_url=self.endpoint_url, region=self.region,
                        credentials=credentials, connect_timeout_s=self._connect_timeout,
                        max_attempts=self._max_attempts,
                    )
                putter = self._crt
        return putter

    def put_file_nowait(
        self, key: str, path: str, *, size: int, md5: str, sha256: str | None = None,
        metadata: dict[str, str] | None = None, done,
    ) -> bool:
        """Start PutObject of a local file through the CRT; False (nothing sent) where the store
        cannot (see :meth:`crt_putter`): use :meth:`put_verified`. ``done(etag, error)`` is called
        once from a CRT thread; ``error`` is a ValueError when the ETag contradicts ``md5``, and
        :class:`ResendVerified` when the store's ETags turn out not to be MD5s."""
        putter = self.crt_putter()
        if putter is None:
            return False
        for observe in self.crt_observers:
            observe("PutObject", "PUT", size)

        def checked(etag: str | None, error: BaseException | None) -> None:
            if error is None:
                etag = _clean_etag(etag) or ""
                if not _is_md5_etag(etag):
                    self.content_md5 = True  # and from now on every write goes through botocore
                    error = ResendVerified(f"{key}: the store's ETag {etag!r} is not an MD5")
                else:
                    try:
                        etag = _check_etag(etag, md5, key)
                    except ValueError as exc:
                        error = exc
            done(None if error else etag, error)

        putter.put_file(self._key(key), str(path), size=size, sha256=sha256, metadata=metadata, done=checked)
        return True

    def start_multipart(self, key: str, *, metadata: dict[str, str] | None = None) -> str:
        from botocore.exceptions import ClientError

        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self._key(key), **self._extra_args(metadata)}
        if self._part_checksums is not False:
            try:
                upload_id = self.client.create_multipart_upload(**kwargs, ChecksumAlgorithm="CRC32C")["UploadId"]
                self._part_checksums = True
                return upload_id
            except ClientError as exc:
                if _error_code(exc) not in ("InvalidArgument", "InvalidRequest", "NotImplemented", "501"):
                    raise
                self._part_checksums = False  # an older store: parts go up with Content-MD5 alone
                self.content_md5 = True
        return self.client.create_multipart_upload(**kwargs)["UploadId"]

    def upload_part(self, key: str, upload_id: str, number: int, data, *, md5: str) -> PartReceipt:
        """Upload one part (``data``: bytes, or a seekable file botocore can re-read on retry)."""
        kwargs: dict[str, Any] = {}
        crc = None
        if self._part_checksums is not False:
            crc = _crc32c_b64(data)
            kwargs["ChecksumCRC32C"] = crc
        if self.content_md5:
            kwargs["ContentMD5"] = _b64(md5)
        if hasattr(data, "seek"):
            data.seek(0)
        response = self.client.upload_part(
            Bucket=self.bucket, Key=self._key(key), UploadId=upload_id, PartNumber=number, Body=data, **kwargs
        )
        etag = _clean_etag(response.get("ETag")) or ""
        if not self.content_md5 and not _is_md5_etag(etag):
            self.content_md5 = True
            return self.upload_part(key, upload_id, number, data, md5=md5)
        return PartReceipt(_check_etag(etag, md5, f"{key} part {number}"), crc)

    def complete_multipart(self, key: str, upload_id: str, parts: list[tuple[int, PartReceipt]]) -> str:
        listed = []
        for n, receipt in sorted(parts):
            part: dict[str, Any] = {"PartNumber": n, "ETag": f'"{receipt.etag}"'}
            if receipt.crc32c:
                part["ChecksumCRC32C"] = receipt.crc32c
            listed.append(part)
        response = self.client.complete_multipart_upload(
            Bucket=self.bucket, Key=self._key(key), UploadId=upload_id, MultipartUpload={"Parts": listed}
        )
        return _clean_etag(response.get("ETag")) or ""

    def abort_multipart(self, key: str, upload_id: str) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=self._key(key), UploadId=upload_id)
        except ClientError as exc:
            if _error_code(exc) not in ("NoSuchUpload", "404"):
                raise

    def multipart_uploads(self, prefix: str = "") -> list[dict[str, Any]]:
        """Unfinished multipart uploads under ``prefix``: key, upload_id, initiated (POSIX s)."""
        full_prefix = f"{self.prefix}/{prefix.lstrip('/')}" if self.prefix else prefix.lstrip("/")
        from botocore.exceptions import ClientError

        found: list[dict[str, Any]] = []
        paginator = self.client.get_paginator("list_multipart_uploads")
        try:
            pages = list(paginator.paginate(Bucket=self.bucket, Prefix=full_prefix))
        except ClientError as exc:
            # rclone v1.75.2 answers NoSuchUpload for a bucket that never had a multipart upload.
            if _error_code(exc) == "NoSuchUpload":
                return []
            raise
        for page in pages:
            for up in page.get("Uploads", []):
                initiated = up.get("Initiated")
                found.append(
                    {
                        "key": self._rel(up["Key"]),
                        "upload_id": up["UploadId"],
                        "initiated": initiated.timestamp() if hasattr(initiated, "timestamp") else None,
                    }
                )
        return found

    def uploaded_parts(self, key: str, upload_id: str) -> dict[int, tuple[int, PartReceipt]]:
        """part number -> (size, receipt) of the parts a store holds for an unfinished upload."""
        parts: dict[int, tuple[int, PartReceipt]] = {}
        paginator = self.client.get_paginator("list_parts")
        for page in paginator.paginate(Bucket=self.bucket, Key=self._key(key), UploadId=upload_id):
            for part in page.get("Parts", []):
                receipt = PartReceipt(_clean_etag(part.get("ETag")) or "", part.get("ChecksumCRC32C"))
                parts[int(part["PartNumber"])] = (int(part["Size"]), receipt)
        return parts

    def stat(self, key: str) -> ObjectInfo | None:
        """Size and ETag of ``key`` (one HEAD), or None when it does not exist."""
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            if _is_not_found(exc):
                return None
            raise
        return ObjectInfo(key=key, size=int(head["ContentLength"]), etag=_clean_etag(head.get("ETag")))

    def metadata(self, key: str) -> dict[str, str]:
        """User metadata of ``key`` with lower-cased names (rclone capitalises them)."""
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            if _is_not_found(exc):
                raise FileNotFoundError(f"{self.uri}/{key} does not exist") from exc
            raise
        return {k.lower(): v for k, v in (head.get("Metadata") or {}).items()}

    def exists(self, key: str) -> bool:
        return self.stat(key) is not None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        full_prefix = f"{self.prefix}/{prefix.lstrip('/')}" if self.prefix else prefix.lstrip("/")
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(
            Bucket=self.bucket, Prefix=full_prefix, PaginationConfig={"PageSize": self.list_page_size}
        ):
            for obj in page.get("Contents", []):
                modified = obj.get("LastModified")
                yield ObjectInfo(
                    key=self._rel(obj["Key"]),
                    size=int(obj["Size"]),
                    etag=_clean_etag(obj.get("ETag")),
                    last_modified=modified.timestamp() if hasattr(modified, "timestamp") else None,
                )

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))


def _md5_hex(data: bytes) -> str:
    import hashlib

    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def _b64(hex_digest: str) -> str:
    import base64

    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


class ResendVerified(Exception):
    """A CRT upload whose answer could not be checked by its ETag: send it with put_verified."""


@dataclass(frozen=True)
class PartReceipt:
    """What the store answered for one uploaded part: its ETag and the CRC32C we sent with it
    (CompleteMultipartUpload names both)."""

    etag: str
    crc32c: str | None = None


def _crc32c_b64(data) -> str:
    import base64
    import struct

    import crc32c

    if hasattr(data, "getbuffer"):
        data = data.getbuffer()
    return base64.b64encode(struct.pack(">I", crc32c.crc32c(data))).decode()


def _is_md5_etag(etag: str) -> bool:
    return len(etag) == 32 and all(c in "0123456789abcdef" for c in etag.lower())


def _check_etag(etag: str | None, md5: str, what: str) -> str:
    etag = _clean_etag(etag) or ""
    # A 32-hex ETag is the MD5 of the bytes stored; anything else (SSE-KMS) was still checked by
    # the store against Content-MD5.
    if len(etag) == 32 and all(c in "0123456789abcdef" for c in etag.lower()) and etag.lower() != md5:
        raise ValueError(f"the store answered ETag {etag} for {what}, whose MD5 is {md5}: the bytes were changed")
    return etag


def _clean_etag(etag: str | None) -> str | None:
    # AWS quotes ETags; rclone's listing does not.
    return etag.strip('"') if etag else None
