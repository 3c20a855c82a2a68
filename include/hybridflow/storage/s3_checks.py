"""What an S3 answer means: error codes, ETags checked against MD5s, checksum headers."""

from __future__ import annotations

import base64
import hashlib
import struct

NOT_FOUND = {"404", "NoSuchKey", "NotFound", "NoSuchBucket"}
PRECONDITION_FAILED = {"412", "PreconditionFailed", "ConditionalRequestConflict"}
NOT_SUPPORTED = {"501", "NotImplemented"}


class ResendVerified(Exception):
    """A CRT upload whose answer could not be checked by its ETag: send it with put_verified."""


def error_code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def status(exc: Exception) -> int:
    response = getattr(exc, "response", None) or {}
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def is_not_found(exc: Exception) -> bool:
    return error_code(exc) in NOT_FOUND or status(exc) == 404


def md5_hex(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def b64(hex_digest: str) -> str:
    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


def crc32c_b64(data) -> str:
    """The x-amz-checksum-crc32c header of ``data`` (bytes, or a reader over a memoryview)."""
    import crc32c

    if hasattr(data, "getbuffer"):
        data = data.getbuffer()
    return base64.b64encode(struct.pack(">I", crc32c.crc32c(data))).decode()


def clean_etag(etag: str | None) -> str | None:
    # AWS quotes ETags; rclone's listing does not.
    return etag.strip('"') if etag else None


def is_md5_etag(etag: str) -> bool:
    return len(etag) == 32 and all(c in "0123456789abcdef" for c in etag.lower())


def check_etag(etag: str | None, md5: str, what: str) -> str:
    """The cleaned ETag; ValueError when it is an MD5 other than ``md5``. Any other form (multipart,
    SSE-KMS) was checked by the store against Content-MD5 instead."""
    etag = clean_etag(etag) or ""
    if is_md5_etag(etag) and etag.lower() != md5:
        raise ValueError(f"the store answered ETag {etag} for {what}, whose MD5 is {md5}: the bytes were changed")
    return etag
