"""One upload call: a thread pool fed as work appears (a big file's parts are queued once it is
hashed and its multipart upload exists), with memory bounded by a byte budget."""

from __future__ import annotations

import io
import threading
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from hybridflow.storage.objectstore import ChunkedPut, MultipartUploads
from hybridflow.storage.s3_checks import ResendVerified
from hybridflow.storage.transfer_bodies import STREAM_BUFFER, RangeReader, ViewReader, md5_of
from hybridflow.storage.transfer_progress import ByteBudget, TransferProgress
from hybridflow.storage.transfer_resume import Multipart, resume_or_start, survey_unfinished
from hybridflow.storage.transfer_types import Uploaded, UploadItem

if TYPE_CHECKING:
    from hybridflow.storage.transfer import Uploader

_MiB = 1024 * 1024


class UploadRun:
    """One upload call: a thread pool fed dynamically (a big file's parts are queued once it is
    hashed and its multipart upload exists), with memory bounded by a byte budget."""

    def __init__(self, up: Uploader, progress: TransferProgress, stored, uploads_prefix: str) -> None:
        self.up, self.store, self.settings, self.log = up, up.store, up.settings, up.log
        self.progress, self.stored, self.uploads_prefix = progress, stored, uploads_prefix
        self.budget = ByteBudget(self.settings.max_inflight_bytes)
        self.results: list[Uploaded] = []
        self.lock = threading.Lock()
        self.futures: set[Future] = set()
        self.pool: ThreadPoolExecutor | None = None
        self.can_multipart = isinstance(self.store, MultipartUploads)
        self.unfinished: dict[str, list[dict[str, Any]]] = {}  # key -> unfinished uploads found
        self.buffers = threading.local()  # one reusable part buffer per upload thread
        self.shard_buffers: list[bytearray] = []  # free buffers for packing shards (see single)
        self.hashing = threading.Lock()
        self.whole = False  # big objects go up as one streamed PutObject each (see sends_whole)

    def submit(self, fn, *args) -> None:
        future = self.pool.submit(fn, *args)
        with self.lock:
            self.futures.add(future)

    def done(self, result: Uploaded) -> None:
        with self.lock:
            self.results.append(result)

    def execute(self, items: list[UploadItem]) -> list[Uploaded]:
        self.whole = self.settings.sends_whole(i.size for i in items if self.up.is_big(i))
        if self.can_multipart and any(self.up.is_big(i) for i in items):
            survey_unfinished(self, {i.key for i in items if self.up.is_big(i) and i.digest is None})
        native = [i for i in items if self.up.goes_native(i)]
        with ThreadPoolExecutor(max_workers=self.settings.workers, thread_name_prefix="upload") as pool:
            self.pool = pool
            if native:
                self.submit(self.send_native, native)
            for item in items:
                if native and self.up.goes_native(item):
                    continue
                if not self.up.is_big(item):
                    self.submit(self.single, item)
                elif item.digest is not None:
                    self.submit(self.hash_then_upload, item)
                else:
                    self.submit(self.start_big, item)
            try:
                while True:
                    with self.lock:
                        current = set(self.futures)
                    if not current:
                        break
                    finished, _ = wait(current, return_when=FIRST_EXCEPTION)
                    with self.lock:
                        self.futures -= finished
                    for f in finished:
                        if f.exception() is not None:
                            raise f.exception()
            except BaseException:
                with self.lock:
                    for f in self.futures:
                        f.cancel()
                raise
        return self.results

    # -- single requests ---------------------------------------------------------------------------
    def single(self, item: UploadItem) -> None:
        self.budget.take(item.size)
        buf = None
        try:
            if item.build is not None:
                buf = self._shard_buffer(item.size)
                key, view, sha256, md5 = item.build(buf)
                data = ViewReader(view)
                known = self.stored(key, sha256 or "", md5, item.shard) if self.stored else None
                if known is not None:
                    self.progress.add(item.size, 1)
                    self.done(Uploaded(key, len(view), known, 0, 0, 0, sha256 or "", md5, item.label, item.members))
                    return
                metadata = dict(item.metadata)
            else:
                key, sha256, metadata = item.key, item.sha256, item.metadata
                data = item.read(0, item.size)
                if len(data) != item.size:
                    raise ValueError(f"{item.label or item.key}: read {len(data)} bytes, expected {item.size}")
                md5 = item.md5 or md5_of(data)
            etag = self.store.put_verified(
                key, data, md5=md5, sha256=sha256 if self.settings.sha256_header else None, metadata=metadata
            )
        finally:
            if buf is not None:
                with self.lock:
                    self.shard_buffers.append(buf)
            self.budget.give(item.size)
        self.progress.add(item.size, 1)
        self.done(Uploaded(key, len(data), etag or md5, 0, 0, len(data), sha256 or "", md5, item.label, item.members))

    def _shard_buffer(self, size: int) -> bytearray:
        """A buffer for packing a shard: one a finished shard gave back, or a new one. The byte
        budget bounds how many shards are packed at once, so it bounds these buffers too."""
        with self.lock:
            for i, buf in enumerate(self.shard_buffers):
                if len(buf) >= size:
                    return self.shard_buffers.pop(i)
            if self.shard_buffers:
                self.shard_buffers.pop()  # too small: replaced, so buffers never outnumber the shards in flight
        return bytearray(-(-size // (4 * _MiB)) * 4 * _MiB)  # rounded up: the next shard's likely fits

    def send_native(self, items: list[UploadItem]) -> None:
        """Small local files through the store's CRT client, fed from this one pool thread with a
        window of requests in flight; the CRT's own threads send them and call back here. Returns
        when every request started has finished; raises the first failure (no new request is
        started after it)."""
        window = threading.Semaphore(max(1, self.settings.crt_window_per_worker * self.settings.workers))
        idle = threading.Condition()
        open_requests = [0]
        errors: list[BaseException] = []

        def finished(item: UploadItem, etag: str | None, error: BaseException | None) -> None:
            try:
                if isinstance(error, ResendVerified):
                    self.submit(self.single, item)  # the store now checks Content-MD5 itself
                elif error is not None:
                    errors.append(error)
                else:
                    self.progress.add(item.size, 1)
                    self.done(Uploaded(item.key, item.size, etag or item.md5, 0, 0, item.size, item.sha256,
                                       item.md5, item.label))
            except BaseException as exc:  # noqa: BLE001 -- a CRT thread must not swallow it
                errors.append(exc)
            finally:
                with idle:
                    open_requests[0] -= 1
                    idle.notify_all()
                window.release()

        for item in items:
            if errors:
                break
            window.acquire()
            with idle:
                open_requests[0] += 1
            started = False
            try:
                started = self.store.put_file_nowait(
                    item.key, item.path, size=item.size, md5=item.md5,
                    sha256=item.sha256 if self.settings.sha256_header else None, metadata=item.metadata,
                    done=lambda etag, error, item=item: finished(item, etag, error),
                )
            finally:
                if not started:
                    with idle:
                        open_requests[0] -= 1
                    window.release()
            if not started:  # the store cannot (any more): botocore, in parallel
                self.submit(self.single, item)
        with idle:
            while open_requests[0]:
                idle.wait()
        if errors:
            raise errors[0]

    # -- big files ---------------------------------------------------------------------------------
    def hash_then_upload(self, item: UploadItem) -> None:
        # One file hashed at a time: the first file's parts start moving after one file's hashing,
        # not after every file's, and hashing then overlaps the transfer of earlier files.
        with self.hashing:
            key, sha256, md5 = item.digest()
        item = UploadItem(key=key, size=item.size, sha256=sha256, md5=md5, read=item.read,
                          readinto=item.readinto, label=item.label, metadata={**item.metadata, "sha256": sha256})
        known = self.stored(key, sha256, md5) if self.stored else None
        if known is not None:
            self.progress.add(item.size, 1)
            self.done(Uploaded(key, item.size, known, 0, 0, 0, sha256, md5, item.label))
            return
        self.start_big(item)

    def start_big(self, item: UploadItem) -> None:
        if not self.can_multipart:
            self.stream(item)
            return
        if self.whole and self.up.can_go_whole(item):
            self.put_whole(item)
            return
        mp = resume_or_start(self, item)
        todo = [n for n in range(1, mp.count + 1) if n not in mp.receipts]
        if not todo:  # every part already uploaded by an earlier, interrupted run
            self.complete(mp)
        for n in todo:
            self.submit(self.part, mp, n)

    def put_whole(self, item: UploadItem) -> None:
        # Memory is the stream's buffer, but the budget is charged a part's worth so that no more
        # big objects are in flight than parts would be.
        charge = min(item.size, self.settings.part_size)
        self.budget.take(charge)
        try:
            body = io.BufferedReader(RangeReader(item, self.progress.add), buffer_size=STREAM_BUFFER)
            etag = self.store.put_verified(item.key, body, md5=item.md5, sha256=item.sha256, metadata=item.metadata)
        finally:
            self.budget.give(charge)
        # Unfinished multipart uploads of this key (an earlier run with other settings) are moot now.
        with self.lock:
            stale = self.unfinished.pop(item.key, [])
        for up in stale:
            self.store.abort_multipart(up["key"], up["upload_id"])
        self.progress.add(0, 1)
        self.done(Uploaded(item.key, item.size, etag or item.md5, 0, 0, item.size, item.sha256, item.md5, item.label))

    def stream(self, item: UploadItem) -> None:
        # A store without multipart (a private folder): copy in part-sized reads.
        if not isinstance(self.store, ChunkedPut):
            raise TypeError(
                f"{item.label or item.key}: {self.store!r} takes neither multipart uploads nor streamed "
                f"writes, so objects over {self.settings.multipart_threshold} bytes cannot go up"
            )
        step = self.settings.part_size
        chunks = (item.read(o, min(step, item.size - o)) for o in range(0, item.size, step))
        size, sha256 = self.store.put_chunks(item.key, chunks)
        if (size, sha256) != (item.size, item.sha256):
            raise ValueError(f"{item.label or item.key}: wrote {size} bytes with another SHA-256 than scanned")
        self.progress.add(item.size, 1)
        self.done(Uploaded(item.key, size, "", 0, 0, size, sha256, None, item.label))

    def part(self, mp: Multipart, number: int) -> None:
        start, length = mp.part_range(number)
        self.budget.take(length)
        try:
            if mp.item.readinto is not None:
                buf = getattr(self.buffers, "part", None)
                if buf is None or len(buf) < length:
                    buf = self.buffers.part = bytearray(max(length, mp.part_size))
                view = memoryview(buf)[:length]
                got = mp.item.readinto(start, view)
                data = view if got == length else b""
                body = ViewReader(view)
            else:
                data = body = mp.item.read(start, length)
            if len(data) != length:
                raise ValueError(f"{mp.item.label or mp.item.key}: short read at byte {start}")
            receipt = self.store.upload_part(mp.item.key, mp.upload_id, number, body, md5=md5_of(data))
        finally:
            self.budget.give(length)
        self.progress.add(length, 0)
        with mp.lock:
            mp.receipts[number] = receipt
            mp.sent += length
            finished = len(mp.receipts) == mp.count
        if finished:
            self.complete(mp)

    def complete(self, mp: Multipart) -> None:
        self.store.complete_multipart(mp.item.key, mp.upload_id, sorted(mp.receipts.items()))
        # What a later listing will show for this object: rclone lists the whole-file MD5, AWS
        # the "<md5 of part md5s>-<parts>" form; either way it is recorded from the store itself.
        info = self.store.stat(mp.item.key)
        if info is None or info.size != mp.item.size:
            raise ValueError(
                f"{mp.item.label or mp.item.key}: multipart upload completed but the store holds "
                f"{'nothing' if info is None else f'{info.size} bytes'}, expected {mp.item.size}"
            )
        self.progress.add(0, 1)
        self.done(Uploaded(mp.item.key, mp.item.size, info.etag or "", mp.count, mp.resumed, mp.sent,
                           mp.item.sha256, None, mp.item.label))
