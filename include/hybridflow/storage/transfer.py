"""Parallel, verified, resumable uploads of many objects into one store.

Small objects go up as one PutObject each and large ones as multipart uploads whose parts share a
single thread pool with everything else, so eight big files and ten thousand small ones keep the
same number of requests in flight; when a call holds several big objects, each goes up as one
streamed PutObject instead (see :attr:`TransferSettings.whole_object_max`). On an S3 store every
request carries a checksum header and its answer's ETag is checked against the MD5 computed here. Multipart uploads are
resumable: a part the store already holds for an unfinished upload of the same key, with the same
part size and the same MD5, is not sent again; abandoned uploads are aborted.

Built on boto3's client calls (see :class:`~hybridflow.storage.s3.S3ObjectStore`); s3transfer's
``upload_file`` is not used here because it neither resumes nor verifies parts, and its per-object
overhead (futures, callbacks, a HEAD per download) cost ~3 ms of CPU per small object. Small local
files go up through the store's AWS CRT client instead where it has one (see
:mod:`hybridflow.storage.crt`): botocore's own ~1 ms of Python per request is what capped them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from hybridflow.storage.objectstore import NativeFilePut, VerifiedPut
from hybridflow.storage.transfer_progress import TransferProgress
from hybridflow.storage.transfer_run import UploadRun
from hybridflow.storage.transfer_types import TransferSettings, Uploaded, UploadItem

__all__ = ["TransferProgress", "TransferSettings", "Uploaded", "Uploader", "UploadItem"]

log = logging.getLogger(__name__)


class Uploader:
    """Uploads :class:`UploadItem` objects into an S3 store (parallel, verified, resumable), or into
    a private folder store (streamed copies)."""

    def __init__(self, store, settings: TransferSettings, *, log: Any = log) -> None:
        self.store = store
        self.settings = settings
        self.log = log

    def upload(
        self,
        items: Iterable[UploadItem],
        *,
        uploads_prefix: str,
        progress: TransferProgress | None = None,
        stored: Callable[..., str | None] | None = None,
    ) -> list[Uploaded]:
        """Upload ``items``; returns one :class:`Uploaded` per item. ``stored(key, sha256, md5, shard)`` is
        asked about objects whose key is learnt in the pipeline (built shards, big files hashed on
        the way) and returns the ETag when the store already holds exactly those bytes; then
        nothing is sent (``bytes_sent`` 0)."""
        items = list(items)
        if not items:
            return []
        progress = progress or TransferProgress(
            sum(i.size for i in items), len(items), every_s=self.settings.progress_every_s, log=self.log,
            what="upload",
        )
        run = UploadRun(self, progress, stored, uploads_prefix)
        return run.execute(items)

    def is_big(self, item: UploadItem) -> bool:
        return item.build is None and item.size > self.settings.multipart_threshold

    def goes_native(self, item: UploadItem) -> bool:
        """Whether ``item`` goes up through the store's CRT client: a small local file whose MD5
        is known (the answer's ETag is checked against it)."""
        return (
            self.settings.crt and item.path is not None and item.build is None and item.digest is None
            and bool(item.md5) and not self.is_big(item) and isinstance(self.store, NativeFilePut)
            and getattr(self.store, "throttle", None) is None  # the CRT's reads cannot wait for a cap
        )

    def can_go_whole(self, item: UploadItem) -> bool:
        # The whole-object MD5 must be known (the store's ETag is checked against it), and the
        # SHA-256 header sent, since a streamed body cannot be CRC'd before it is sent.
        return (
            isinstance(self.store, VerifiedPut)
            and item.size <= self.settings.whole_object_max
            and bool(item.md5 and item.sha256 and self.settings.sha256_header)
        )
