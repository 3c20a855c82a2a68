"""Multipart uploads found unfinished in the store: resumed where their parts hold our bytes,
aborted when abandoned."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from hybridflow.storage.transfer_bodies import md5_of
from hybridflow.storage.transfer_types import UploadItem

if TYPE_CHECKING:
    from hybridflow.storage.transfer_run import UploadRun


class Multipart:
    """State of one multipart upload while its parts are in flight."""

    def __init__(self, item: UploadItem, upload_id: str, part_size: int, done: dict[int, Any]) -> None:
        self.item = item
        self.upload_id = upload_id
        self.part_size = part_size
        self.count = max(1, -(-item.size // part_size))
        self.receipts: dict[int, Any] = dict(done)  # part number -> the store's PartReceipt
        self.resumed = len(done)
        self.sent = 0
        self.lock = threading.Lock()

    def part_range(self, number: int) -> tuple[int, int]:
        start = (number - 1) * self.part_size
        return start, min(self.part_size, self.item.size - start)


def survey_unfinished(run: UploadRun, keys: set[str]) -> None:
    """List unfinished uploads once, before any part moves: those for ``keys`` (or for big files
    hashed on the way) may be resumed; others left longer than abandoned_upload_age_s are
    aborted (younger ones may belong to a concurrent stage and are left alone)."""
    now = time.time()
    for up in run.store.multipart_uploads(run.uploads_prefix):
        age = now - up["initiated"] if up.get("initiated") else None
        if up["key"] not in keys and age is not None and age > run.settings.abandoned_upload_age_s:
            run.log.info("aborting abandoned multipart upload of %s (%s)", up["key"], up["upload_id"])
            run.store.abort_multipart(up["key"], up["upload_id"])
            continue
        run.unfinished.setdefault(up["key"], []).append(up)

def resume_or_start(run: UploadRun, item: UploadItem) -> Multipart:
    part_size = run.settings.part_size
    with run.lock:
        candidates = run.unfinished.pop(item.key, [])
    chosen: Multipart | None = None
    for up in candidates:
        done = None if chosen else _reusable_parts(run, item, up["upload_id"], part_size)
        if done is not None:
            chosen = Multipart(item, up["upload_id"], part_size, done)
            if done:
                run.log.info("resuming upload of %s: %d of %d parts already in the store",
                              item.label or item.key, len(done), chosen.count)
        else:
            # A duplicate for a key being uploaded now, or one made with another part size.
            run.log.info("aborting abandoned multipart upload of %s (%s)", up["key"], up["upload_id"])
            run.store.abort_multipart(up["key"], up["upload_id"])
    if chosen is None:
        chosen = Multipart(item, run.store.start_multipart(item.key, metadata=item.metadata), part_size, {})
    return chosen

def _reusable_parts(run: UploadRun, item: UploadItem, upload_id: str, part_size: int) -> dict[int, Any] | None:
    """Parts of an unfinished upload that hold exactly our bytes, or None if it cannot be resumed."""
    from botocore.exceptions import ClientError

    try:
        held = run.store.uploaded_parts(item.key, upload_id)
    except ClientError:
        return None
    count = max(1, -(-item.size // part_size))
    done: dict[int, Any] = {}
    for number, (size, receipt) in held.items():
        if number > count:
            return None
        start = (number - 1) * part_size
        if size != min(part_size, item.size - start):
            return None  # uploaded with another part size: start over
        # Re-read and hash locally (cheap) instead of trusting the earlier run's bytes.
        if md5_of(item.read(start, size)) == receipt.etag.lower():
            done[number] = receipt
    return done
