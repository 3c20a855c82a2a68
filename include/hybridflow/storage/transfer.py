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

import hashlib
import io
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

_MiB = 1024 * 1024


@dataclass(frozen=True)
class TransferSettings:
    workers: int = 16  # requests in flight
    multipart_threshold: int = 64 * _MiB  # objects above this size go up in parts...
    part_size: int = 16 * _MiB
    # ...unless the call holds at least whole_objects_min of them up to whole_object_max: those go
    # up as one streamed PutObject each. Enough of them keep as many requests in flight as parts
    # would, and the store's ETag is then the MD5 of the whole object (checked against the one
    # computed while hashing), where a multipart object's whole-file ETag can only be learnt from
    # the store (a HEAD; rclone hashes the whole object again for it). 8 x 256 MiB to rclone on
    # 2 cores: 9.2 s whole, 11.1-13.2 s in parts, 10.7 s for s5cmd.
    whole_object_max: int = 512 * _MiB
    whole_objects_min: int = 4
    # Bytes read but not yet acknowledged: bounds memory, and the number of big parts in flight
    # (8 x 16 MiB did best against rclone on 2 cores; more only queues at the store).
    max_inflight_bytes: int = 128 * _MiB
    sha256_header: bool = True  # also send x-amz-checksum-sha256 (verified by AWS and MinIO)
    # Small local files go up through the AWS CRT (storage.crt) where the store offers it; at
    # most crt_window_per_worker x workers of them in flight.
    crt: bool = True
    crt_window_per_worker: int = 4
    progress_every_s: float = 10.0
    abandoned_upload_age_s: float = 24 * 3600.0  # unfinished uploads older than this are aborted

    def sends_whole(self, sizes: Iterable[int]) -> bool:
        """Whether objects of these sizes that are above the multipart threshold go up whole."""
        big = sum(1 for s in sizes if self.multipart_threshold < s <= self.whole_object_max)
        return big >= self.whole_objects_min


@dataclass
class UploadItem:
    """One object to upload. ``read(offset, length)`` returns its bytes.

    Two kinds of object learn their key only inside the pipeline, so that no byte waits for a
    whole-dataset hashing pass:

    - ``build`` (shards): packs into the buffer it is given (at least ``size`` bytes, reused from
      one build to the next) and returns ``(key, view of the bytes, sha256 or None, md5)``;
      ``size`` is an upper bound, used for memory accounting;
    - ``digest`` (big files not hashed yet): returns ``(key, sha256, md5 or None)`` after reading
      the file; the file then goes up (whole or in parts) unless the store already holds it.
    """

    key: str
    size: int
    sha256: str
    md5: str | None
    read: Callable[[int, int], bytes] | None = None
    # Fills a buffer from an offset and returns the bytes read: parts then reuse one buffer per
    # upload thread instead of faulting in a fresh allocation for every part.
    readinto: Callable[[int, bytearray], int] | None = None
    build: Callable[[bytearray], tuple[str, memoryview, str | None, str]] | None = None
    digest: Callable[[], tuple[str, str, str | None]] | None = None
    label: str = ""
    # A local file holding exactly the object's bytes: the CRT then sends it without Python
    # reading it (small objects with a known MD5 only).
    path: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    members: dict[str, str] = field(default_factory=dict)  # for shards: filled by build (path -> sha256)
    shard: Any = None  # the ShardPlan a built object packs (to check a stored copy member by member)


@dataclass(frozen=True)
class Uploaded:
    key: str
    size: int
    etag: str  # as the store reports it after the upload (what later listings are compared with)
    parts: int  # 0 for a single PutObject
    resumed_parts: int
    bytes_sent: int
    sha256: str = ""
    md5: str | None = None
    label: str = ""
    members: dict[str, str] = field(default_factory=dict)  # a shard's files and their SHA-256


class TransferProgress:
    """Thread-safe counters that log bytes, objects, rate and ETA at most every ``every_s``."""

    def __init__(self, total_bytes: int, total_objects: int, *, every_s: float, log: Any, what: str) -> None:
        self.total_bytes, self.total_objects = total_bytes, total_objects
        self.bytes = 0
        self.objects = 0
        self.every_s = every_s
        self.log = log
        self.what = what
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._last = self._started

    def add(self, nbytes: int = 0, objects: int = 0) -> None:
        with self._lock:
            self.bytes += nbytes
            self.objects += objects
            now = time.monotonic()
            if now - self._last < self.every_s:
                return
            self._last = now
            line = self.line(now)
        self.log.info(line)

    def line(self, now: float | None = None) -> str:
        elapsed = max((now or time.monotonic()) - self._started, 1e-9)
        rate = self.bytes / elapsed
        left = max(self.total_bytes - self.bytes, 0)
        eta = f"{left / rate:.0f}s" if rate > 0 else "?"
        pct = 100.0 * self.bytes / self.total_bytes if self.total_bytes else 100.0
        return (
            f"{self.what}: {_human(self.bytes)} of {_human(self.total_bytes)} ({pct:.0f}%), "
            f"{self.objects}/{self.total_objects} objects, {_human(rate)}/s, ETA {eta}"
        )


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GiB"


class _Budget:
    """Blocks readers while ``limit`` bytes are read but not yet acknowledged by the store."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0
        self._cond = threading.Condition()

    def take(self, n: int) -> None:
        with self._cond:
            # One item larger than the limit still proceeds alone.
            while self.used and self.used + n > self.limit:
                self._cond.wait()
            self.used += n

    def give(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()


class _Multipart:
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


class _ViewReader(io.RawIOBase):
    """A seekable file over a memoryview: a request body botocore can re-read on retry without the
    part being copied into a new bytes object first."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), len(self._view) - self._pos)
        b[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def read(self, n: int = -1) -> bytes:
        end = len(self._view) if n is None or n < 0 else min(len(self._view), self._pos + n)
        out = bytes(self._view[self._pos : end])
        self._pos = end
        return out

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def getbuffer(self) -> memoryview:
        return self._view

    def __len__(self) -> int:
        return len(self._view)


class _RangeReader(io.RawIOBase):
    """One object of an :class:`UploadItem` as a seekable raw file (botocore rewinds it on retry);
    wrapped in a large io.BufferedReader, the source is read in a few big ranges while the HTTP
    layer takes its small blocks from the buffer. ``on_read`` hears of bytes read for the first
    time (a retry re-reads from the start without counting twice)."""

    def __init__(self, item: UploadItem, on_read: Callable[[int], None]) -> None:
        super().__init__()
        self._item, self._pos, self._high, self._on_read = item, 0, 0, on_read

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), self._item.size - self._pos)
        if n <= 0:
            return 0
        view = memoryview(b)[:n]
        if self._item.readinto is not None:
            got = self._item.readinto(self._pos, view)
        else:
            data = self._item.read(self._pos, n)
            got = len(data)
            view[:got] = data
        if got <= 0:
            raise ValueError(f"{self._item.label or self._item.key}: short read at byte {self._pos}")
        self._pos += got
        if self._pos > self._high:
            self._on_read(self._pos - self._high)
            self._high = self._pos
        return got

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._item.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


_STREAM_BUFFER = 8 * _MiB


def _md5(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


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
        run = _Run(self, progress, stored, uploads_prefix)
        return run.execute(items)

    def is_big(self, item: UploadItem) -> bool:
        return item.build is None and item.size > self.settings.multipart_threshold

    def goes_native(self, item: UploadItem) -> bool:
        """Whether ``item`` goes up through the store's CRT client: a small local file whose MD5
        is known (the answer's ETag is checked against it)."""
        return (
            self.settings.crt and item.path is not None and item.build is None and item.digest is None
            and bool(item.md5) and not self.is_big(item) and hasattr(self.store, "put_file_nowait")
        )

    def can_go_whole(self, item: UploadItem) -> bool:
        # The whole-object MD5 must be known (the store's ETag is checked against it), and the
        # SHA-256 header sent, since a streamed body cannot be CRC'd before it is sent.
        return (
            hasattr(self.store, "put_verified")
            and item.size <= self.settings.whole_object_max
            and bool(item.md5 and item.sha256 and self.settings.sha256_header)
        )


class _Run:
    """One upload call: a thread pool fed dynamically (a big file's parts are queued once it is
    hashed and its multipart upload exists), with memory bounded by a byte budget."""

    def __init__(self, up: Uploader, progress: TransferProgress, stored, uploads_prefix: str) -> None:
        self.up, self.store, self.settings, self.log = up, up.store, up.settings, up.log
        self.progress, self.stored, self.uploads_prefix = progress, stored, uploads_prefix
        self.budget = _Budget(self.settings.max_inflight_bytes)
        self.results: list[Uploaded] = []
        self.lock = threading.Lock()
        self.futures: set[Future] = set()
        self.pool: ThreadPoolExecutor | None = None
        self.can_multipart = hasattr(self.store, "start_multipart")
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
            self._survey_unfinished({i.key for i in items if self.up.is_big(i) and i.digest is None})
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
                data = _ViewReader(view)
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
                md5 = item.md5 or _md5(data)
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
        from hybridflow.storage.s3 import ResendVerified

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
        mp = self._resume_or_start(item)
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
            body = io.BufferedReader(_RangeReader(item, self.progress.add), buffer_size=_STREAM_BUFFER)
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
        step = self.settings.part_size
        chunks = (item.read(o, min(step, item.size - o)) for o in range(0, item.size, step))
        size, sha256 = self.store.put_chunks(item.key, chunks)
        if (size, sha256) != (item.size, item.sha256):
            raise ValueError(f"{item.label or item.key}: wrote {size} bytes with another SHA-256 than scanned")
        self.progress.add(item.size, 1)
        self.done(Uploaded(item.key, size, "", 0, 0, size, sha256, None, item.label))

    def part(self, mp: _Multipart, number: int) -> None:
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
                body = _ViewReader(view)
            else:
                data = body = mp.item.read(start, length)
            if len(data) != length:
                raise ValueError(f"{mp.item.label or mp.item.key}: short read at byte {start}")
            receipt = self.store.upload_part(mp.item.key, mp.upload_id, number, body, md5=_md5(data))
        finally:
            self.budget.give(length)
        self.progress.add(length, 0)
        with mp.lock:
            mp.receipts[number] = receipt
            mp.sent += length
            finished = len(mp.receipts) == mp.count
        if finished:
            self.complete(mp)

    def complete(self, mp: _Multipart) -> None:
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

    # -- unfinished uploads ------------------------------------------------------------------------
    def _survey_unfinished(self, keys: set[str]) -> None:
        """List unfinished uploads once, before any part moves: those for ``keys`` (or for big files
        hashed on the way) may be resumed; others left longer than abandoned_upload_age_s are
        aborted (younger ones may belong to a concurrent stage and are left alone)."""
        now = time.time()
        for up in self.store.multipart_uploads(self.uploads_prefix):
            age = now - up["initiated"] if up.get("initiated") else None
            if up["key"] not in keys and age is not None and age > self.settings.abandoned_upload_age_s:
                self.log.info("aborting abandoned multipart upload of %s (%s)", up["key"], up["upload_id"])
                self.store.abort_multipart(up["key"], up["upload_id"])
                continue
            self.unfinished.setdefault(up["key"], []).append(up)

    def _resume_or_start(self, item: UploadItem) -> _Multipart:
        part_size = self.settings.part_size
        with self.lock:
            candidates = self.unfinished.pop(item.key, [])
        chosen: _Multipart | None = None
        for up in candidates:
            done = None if chosen else self._reusable_parts(item, up["upload_id"], part_size)
            if done is not None:
                chosen = _Multipart(item, up["upload_id"], part_size, done)
                if done:
                    self.log.info("resuming upload of %s: %d of %d parts already in the store",
                                  item.label or item.key, len(done), chosen.count)
            else:
                # A duplicate for a key being uploaded now, or one made with another part size.
                self.log.info("aborting abandoned multipart upload of %s (%s)", up["key"], up["upload_id"])
                self.store.abort_multipart(up["key"], up["upload_id"])
        if chosen is None:
            chosen = _Multipart(item, self.store.start_multipart(item.key, metadata=item.metadata), part_size, {})
        return chosen

    def _reusable_parts(self, item: UploadItem, upload_id: str, part_size: int) -> dict[int, Any] | None:
        """Parts of an unfinished upload that hold exactly our bytes, or None if it cannot be resumed."""
        from botocore.exceptions import ClientError

        try:
            held = self.store.uploaded_parts(item.key, upload_id)
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
            if _md5(item.read(start, size)) == receipt.etag.lower():
                done[number] = receipt
        return done
