"""Multipart uploads of an S3 store: started with a CRC32C checksum per part where the store
takes one, every part's ETag checked against its MD5, unfinished uploads listed for resuming."""

from __future__ import annotations

from typing import Any

from hybridflow.storage.bandwidth import body_length
from hybridflow.storage.objectstore import MultipartUploads, PartReceipt
from hybridflow.storage.s3_checks import b64, check_etag, clean_etag, crc32c_b64, error_code, is_md5_etag

_OLD_STORE = ("InvalidArgument", "InvalidRequest", "NotImplemented", "501")


class S3Multipart(MultipartUploads):
    """Mixed into :class:`~hybridflow.storage.s3.S3ObjectStore`, whose client, bucket, key
    mapping (``_key``, ``_rel``, ``_extra_args``) and Content-MD5 mode it uses."""

    client: Any
    bucket: str
    prefix: str
    content_md5: bool
    _part_checksums: bool | None
    throttle: Any  # storage.bandwidth.Throttle, or None

    def start_multipart(self, key: str, *, metadata: dict[str, str] | None = None) -> str:
        from botocore.exceptions import ClientError

        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self._key(key), **self._extra_args(metadata)}
        if self._part_checksums is not False:
            try:
                upload_id = self.client.create_multipart_upload(**kwargs, ChecksumAlgorithm="CRC32C")["UploadId"]
                self._part_checksums = True
                return upload_id
            except ClientError as exc:
                if error_code(exc) not in _OLD_STORE:
                    raise
                self._part_checksums = False  # an older store: parts go up with Content-MD5 alone
                self.content_md5 = True
        return self.client.create_multipart_upload(**kwargs)["UploadId"]

    def upload_part(self, key: str, upload_id: str, number: int, data, *, md5: str) -> PartReceipt:
        """Upload one part (``data``: bytes, or a seekable file botocore can re-read on retry)."""
        kwargs: dict[str, Any] = {}
        crc = None
        if self._part_checksums is not False:
            crc = crc32c_b64(data)
            kwargs["ChecksumCRC32C"] = crc
        if self.content_md5:
            kwargs["ContentMD5"] = b64(md5)
        if hasattr(data, "seek"):
            data.seek(0)
        body = data if self.throttle is None else self.throttle.body(data, body_length(data))
        response = self.client.upload_part(
            Bucket=self.bucket, Key=self._key(key), UploadId=upload_id, PartNumber=number, Body=body, **kwargs
        )
        etag = clean_etag(response.get("ETag")) or ""
        if not self.content_md5 and not is_md5_etag(etag):
            self.content_md5 = True
            return self.upload_part(key, upload_id, number, data, md5=md5)
        return PartReceipt(check_etag(etag, md5, f"{key} part {number}"), crc)

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
        return clean_etag(response.get("ETag")) or ""

    def abort_multipart(self, key: str, upload_id: str) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=self._key(key), UploadId=upload_id)
        except ClientError as exc:
            if error_code(exc) not in ("NoSuchUpload", "404"):
                raise

    def multipart_uploads(self, prefix: str = "") -> list[dict[str, Any]]:
        """Unfinished multipart uploads under ``prefix``: key, upload_id, initiated (POSIX s)."""
        from botocore.exceptions import ClientError

        full_prefix = f"{self.prefix}/{prefix.lstrip('/')}" if self.prefix else prefix.lstrip("/")
        paginator = self.client.get_paginator("list_multipart_uploads")
        try:
            pages = list(paginator.paginate(Bucket=self.bucket, Prefix=full_prefix))
        except ClientError as exc:
            # rclone v1.75.2 answers NoSuchUpload for a bucket that never had a multipart upload.
            if error_code(exc) == "NoSuchUpload":
                return []
            raise
        found: list[dict[str, Any]] = []
        for page in pages:
            for up in page.get("Uploads", []):
                initiated = up.get("Initiated")
                found.append({
                    "key": self._rel(up["Key"]),
                    "upload_id": up["UploadId"],
                    "initiated": initiated.timestamp() if initiated is not None else None,
                })
        return found

    def uploaded_parts(self, key: str, upload_id: str) -> dict[int, tuple[int, PartReceipt]]:
        """part number -> (size, receipt) of the parts a store holds for an unfinished upload."""
        parts: dict[int, tuple[int, PartReceipt]] = {}
        paginator = self.client.get_paginator("list_parts")
        for page in paginator.paginate(Bucket=self.bucket, Key=self._key(key), UploadId=upload_id):
            for part in page.get("Parts", []):
                receipt = PartReceipt(clean_etag(part.get("ETag")) or "", part.get("ChecksumCRC32C"))
                parts[int(part["PartNumber"])] = (int(part["Size"]), receipt)
        return parts
