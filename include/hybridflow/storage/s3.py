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
from pathlib import Path
from typing import Any

from hybridflow.storage.bandwidth import Cap, Throttle, body_length
from hybridflow.storage.objectstore import ObjectInfo, PagedListing, PartReceipt, StoreSpec, VerifiedPut
from hybridflow.storage.s3_checks import (
    NOT_SUPPORTED,
    PRECONDITION_FAILED,
    ResendVerified,
    b64,
    check_etag,
    clean_etag,
    crc32c_b64,
    error_code,
    is_md5_etag,
    is_not_found,
    md5_hex,
    status,
)
from hybridflow.storage.s3_multipart import S3Multipart
from hybridflow.storage.s3_native import S3NativeUploads
from hybridflow.storage.s3_session import SessionFactory
from hybridflow.storage.s3_session import fast_timestamp as _fast_timestamp

# Names other modules and tests import from here.
_check_etag = check_etag
__all__ = ["PartReceipt", "ResendVerified", "S3ObjectStore", "_check_etag", "_fast_timestamp"]

_MiB = 1024 * 1024


class S3ObjectStore(S3Multipart, S3NativeUploads, VerifiedPut, PagedListing):
    """An S3 bucket (optionally under ``prefix``) as an object store.

    One boto3 client serves every thread (low-level clients are thread-safe; only sessions are
    not), with a connection pool sized for ``max_pool_connections`` concurrent requests: a
    client per thread would cost ~60 ms of CPU each and its own pool.

    Credentials: ``access_key``/``secret_key`` (with ``session_token`` for temporary keys), or
    ``session``, a factory of boto3 Sessions (:class:`~hybridflow.hooks.object_store.ObjectStoreHook`
    passes the Amazon provider's, which assumes roles and refreshes them), or neither: boto3's
    default chain. The client is created once, on first use, from one new Session.
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
        session_token: str | None = None,
        session: SessionFactory | None = None,
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
        caps: tuple[Cap, ...] = (),
        priority: str = "bulk",
    ) -> None:
        if not bucket:
            raise ValueError("S3ObjectStore needs a bucket name")
        if checksums not in ("when_required", "when_supported"):
            raise ValueError(f"checksums={checksums!r}; use 'when_required' or 'when_supported'")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url or None
        self.region = region or "us-east-1"
        # Keys (or none: boto3's default chain), or a factory of boto3 Sessions (see s3_session).
        self._access_key = access_key
        self._secret_key = secret_key
        self._session_token = session_token
        self._session_factory = session
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
        # Every byte this store sends waits for its caps (storage.bandwidth); None: no cap, no cost.
        self._caps, self._priority = tuple(caps), priority
        self.throttle: Throttle | None = Throttle(caps, priority=priority) if caps else None

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
            session_token=spec.session_token,
            session=spec.session,
            caps=spec.caps,
            priority=spec.priority,
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
            session_token=self._session_token,
            session=self._session_factory,
            caps=self._caps,
            priority=self._priority,
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
        from hybridflow.storage.s3_session import ClientSettings, keys_session, make_client

        if self._session_factory is not None:
            session = self._session_factory()
        else:
            session = keys_session(self._access_key, self._secret_key, self._session_token, self.region)
        settings = ClientSettings(
            region=self.region, connect_timeout=self._connect_timeout, read_timeout=self._read_timeout,
            max_attempts=self._max_attempts, checksums=self._checksums,
            max_pool_connections=self._max_pool_connections,
        )
        client = make_client(session, self.endpoint_url, settings)
        self._boto_session = session
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
            if not is_not_found(exc):
                raise
        kwargs: dict[str, Any] = {"Bucket": self.bucket}
        if self.region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
        try:
            self.client.create_bucket(**kwargs)
            return True
        except ClientError as exc:
            # Lost a creation race (or rclone's answer for an existing bucket): confirm access.
            if error_code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise
            self.client.head_bucket(Bucket=self.bucket)
            return False

    # -- ObjectStore ---------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes, *, metadata: dict[str, str] | None = None) -> None:
        self.put_verified(key, data, md5=md5_hex(data), metadata=metadata)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        if self.exists(key):
            return False
        md5 = md5_hex(data)
        if self._conditional_put is not False:
            try:
                self._put(key, data, md5=md5, extra={"IfNoneMatch": "*"})
                self._conditional_put = True
                return True
            except ClientError as exc:
                code = error_code(exc)
                if code in PRECONDITION_FAILED or status(exc) == 412:
                    return False  # someone created it between our HEAD and PUT
                if code not in NOT_SUPPORTED and status(exc) != 501:
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
            if is_not_found(exc):
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
            if is_not_found(exc):
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
            if is_not_found(exc):
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
            kwargs["ChecksumSHA256"] = b64(sha256)
        else:
            kwargs["ChecksumCRC32C"] = crc32c_b64(data)
        if self.content_md5:
            kwargs["ContentMD5"] = b64(md5)
        body = data if self.throttle is None else self.throttle.body(data, body_length(data))
        response = self.client.put_object(
            Bucket=self.bucket, Key=self._key(key), Body=body, **kwargs, **self._extra_args(metadata)
        )
        etag = clean_etag(response.get("ETag")) or ""
        if not self.content_md5 and not is_md5_etag(etag):
            # This store's ETags are not MD5s: send this object again under Content-MD5 so the store
            # itself checks it, and every later one too.
            self.content_md5 = True
            return self._put(key, data, md5=md5, sha256=sha256, metadata=metadata, extra=extra)
        return check_etag(etag, md5, key)

    def put_verified(
        self, key: str, data, *, md5: str, sha256: str | None = None, metadata: dict[str, str] | None = None
    ) -> str:
        """PutObject with a checksum header; returns the ETag. Raises ValueError if the store's
        ETag contradicts ``md5``. ``data``: bytes, or a seekable file (then ``sha256`` is needed:
        a CRC32C header would cost a read of the whole file before sending it)."""
        return self._put(key, data, md5=md5, sha256=sha256, metadata=metadata)

    def stat(self, key: str) -> ObjectInfo | None:
        """Size and ETag of ``key`` (one HEAD), or None when it does not exist."""
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            if is_not_found(exc):
                return None
            raise
        return ObjectInfo(key=key, size=int(head["ContentLength"]), etag=clean_etag(head.get("ETag")))

    def metadata(self, key: str) -> dict[str, str]:
        """User metadata of ``key`` with lower-cased names (rclone capitalises them)."""
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            if is_not_found(exc):
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
                    etag=clean_etag(obj.get("ETag")),
                    last_modified=modified.timestamp() if modified is not None else None,
                )

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
