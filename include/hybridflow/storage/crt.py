"""PutObjects of local files sent by the AWS Common Runtime's S3 client (``awscrt``).

botocore spends about 1 ms of Python per request whatever the payload (events, serialising,
signing, http.client's header parsing), all of it under the GIL, which caps one process at about
800 small objects a second. The CRT does the HTTP exchange, SigV4 signing, retries and the file
reads in native threads: a 64 KiB file costs ~0.1 ms of Python here, the rest of its CPU is
native and parallel. Only single PutObjects of files go this way (no multipart: parts, resume
and the whole-object path stay on botocore), and every answer's ETag is still checked against
the file's MD5 by the caller's ``done``.

Built on :class:`awscrt.s3.S3Client` as s3transfer's CRT manager is; the request is the plain
PutObject a botocore client with path-style addressing would send.
"""

from __future__ import annotations

import base64
import os
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlsplit

Done = Callable[[str | None, BaseException | None], None]


def crt_available() -> bool:
    try:
        import awscrt.s3  # noqa: F401
    except ImportError:
        return False
    return True


class CrtRequestError(OSError):
    """A request the store refused (HTTP status and S3 error code), or one that never got an
    answer (the CRT's error name, e.g. AWS_IO_SOCKET_CONNECTION_REFUSED)."""

    def __init__(self, message: str, *, status: int | None = None, code: str = "") -> None:
        super().__init__(message)
        self.status, self.code = status, code


class CrtPutter:
    """One CRT S3 client for one bucket; :meth:`put_file` starts a PutObject and returns at once.

    ``credentials()`` returns (access key, secret key, session token or None) and is asked again
    whenever the CRT signs with expired ones (botocore's refreshable credentials fit)."""

    def __init__(
        self, *, bucket: str, endpoint_url: str | None, region: str,
        credentials: Callable[[], tuple[str, str, str | None]], connect_timeout_s: float, max_attempts: int,
    ) -> None:
        from awscrt.auth import AwsCredentials, AwsCredentialsProvider
        from awscrt.io import ClientBootstrap, DefaultHostResolver, EventLoopGroup
        from awscrt.s3 import S3Client, S3RequestTlsMode, S3RetryConfig, create_default_s3_signing_config

        self.bucket = bucket
        if endpoint_url:
            url = urlsplit(endpoint_url)
            tls = url.scheme == "https"
            # Path-style, as the botocore client (rclone/MinIO on an IP:port serve no bucket hosts).
            self.host, self.base = url.netloc, f"{url.path.rstrip('/')}/{quote(bucket, safe='')}/"
        elif "." in bucket:
            tls, self.host, self.base = True, f"s3.{region}.amazonaws.com", f"/{bucket}/"
        else:
            tls, self.host, self.base = True, f"{bucket}.s3.{region}.amazonaws.com", "/"

        def provide() -> AwsCredentials:
            access, secret, token = credentials()
            return AwsCredentials(access, secret, token)

        loops = EventLoopGroup(max(2, min(4, os.cpu_count() or 2)))
        self._client = S3Client(
            bootstrap=ClientBootstrap(loops, DefaultHostResolver(loops)),
            region=region,
            tls_mode=S3RequestTlsMode.ENABLED if tls else S3RequestTlsMode.DISABLED,
            signing_config=create_default_s3_signing_config(
                region=region, credential_provider=AwsCredentialsProvider.new_delegate(provide)
            ),
            throughput_target_gbps=10.0,
            retry_config=S3RetryConfig(max_retries=max(0, max_attempts - 1)),
            connect_timeout_ms=max(1, int(connect_timeout_s * 1000)),
        )
        self._inflight: dict[int, Any] = {}  # keeps each native request referenced until done
        self._finished: set[int] = set()  # done before make_request returned
        self._lock = threading.Lock()
        self._next = 0
        self.pid = os.getpid()  # native threads do not survive fork: a child makes its own

    def put_file(
        self, full_key: str, path: str, *, size: int, sha256: str | None,
        metadata: dict[str, str] | None, done: Done,
    ) -> None:
        """Start PutObject of ``path`` (``size`` bytes) as ``full_key``; ``done(etag, None)`` or
        ``done(None, error)`` is called once, from a CRT thread. The request carries
        x-amz-checksum-sha256 when ``sha256`` is given (else the CRT adds a CRC32C header)."""
        from awscrt.http import HttpHeaders, HttpRequest
        from awscrt.s3 import S3ChecksumAlgorithm, S3ChecksumConfig, S3ChecksumLocation, S3RequestType

        headers = [("Host", self.host), ("Content-Length", str(size))]
        checksum = None
        if sha256:
            headers.append(("x-amz-checksum-sha256", base64.b64encode(bytes.fromhex(sha256)).decode()))
        else:
            checksum = S3ChecksumConfig(algorithm=S3ChecksumAlgorithm.CRC32C, location=S3ChecksumLocation.HEADER)
        headers.extend((f"x-amz-meta-{k}", v) for k, v in (metadata or {}).items())
        request = HttpRequest("PUT", self.base + quote(full_key, safe="/~"), HttpHeaders(headers))
        answer: dict[str, str] = {}
        with self._lock:
            token = self._next
            self._next += 1

        def on_headers(status_code: int, headers, **_: Any) -> None:
            for name, value in headers:
                if name.lower() == "etag":
                    answer["etag"] = value.strip('"')

        def on_done(error: BaseException | None = None, status_code: int | None = None,
                    error_body: bytes | None = None, **_: Any) -> None:
            with self._lock:
                if self._inflight.pop(token, None) is None:
                    self._finished.add(token)
            if error is not None:
                done(None, _error(full_key, error, status_code, error_body))
            else:
                done(answer.get("etag", ""), None)

        # The CRT sends anything up to its part size in one request: nothing this class is given
        # is split into parts.
        native = self._client.make_request(
            type=S3RequestType.PUT_OBJECT, request=request, send_filepath=path, checksum_config=checksum,
            part_size=max(size, 5 * 1024 * 1024), multipart_upload_threshold=max(size, 5 * 1024 * 1024) + 1,
            on_headers=on_headers, on_done=on_done,
        )
        with self._lock:
            if token in self._finished:
                self._finished.discard(token)
            else:
                self._inflight[token] = native


def _error(key: str, error: BaseException, status: int | None, body: bytes | None) -> CrtRequestError:
    code = message = ""
    if body:
        import xml.etree.ElementTree as ET

        try:
            root = ET.fromstring(body)
            code, message = root.findtext("Code") or "", root.findtext("Message") or ""
        except ET.ParseError:
            message = body[:200].decode(errors="replace")
    if status:
        what = f"HTTP {status}" + (f" {code}" if code else "") + (f": {message}" if message else "")
    else:
        what = getattr(error, "name", "") or type(error).__name__
        what += f" ({getattr(error, 'message', '') or error})"
    return CrtRequestError(f"PutObject {key}: {what}", status=status, code=code)
