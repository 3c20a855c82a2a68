"""Parallel, verified, resumable uploads of many objects into one store.

Small objects go up as one PutObject each and large ones as multipart uploads whose parts share a
single thread pool with everything else, so eight big files and ten thousand small ones keep the
same number of requests in flight. On an S3 store every request carries Content-MD5 (checked by
the store) and its answer's ETag is checked against the MD5 computed here. Multipart uploads are
resumable: a part the store already holds for an unfinished upload of the same key, with the same
part size and the same MD5, is not sent again; abandoned uploads are aborted.

Built on boto3's client calls (see :class:`~hybridflow.storage.s3.S3ObjectStore`); s3transfer's
``upload_file`` is not used here because it neither resumes nor verifies parts, and its per-object
overhead (futures, callbacks, a HEAD per download) cost ~3 ms of CPU per small object.
"""

from __future__ import annotations

import hashlib
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
    multipart_threshold: int = 64 * _MiB  # objects above this size go up in parts
    part_size: int = 16 * _MiB
    max_inflight_bytes: int = 512 * _MiB  # bounds memory: bytes read but not yet acknowledged
    sha256_header: bool = True  # also send x-amz-checksum-sha256 (verified by AWS and MinIO)
    progress_every_s: float = 10.0
    abandoned_upload_age_s: float = 24 * 3600.0  # unfinished uploads older than this are aborted


@dataclass
class UploadItem:
    """One object to upload. ``read(offset, length)`` returns its bytes. Objects whose key is only
    known once they are built (content-addressed shards) have ``build`` instead: it returns
    ``(key, bytes, sha256, md5)``, and ``size`` is then an upper bound used for memory accounting."""

    key: str
    size: int
    sha256: str
    md5: str | None
    read: Callable[[int, int], bytes] | None = None
    build: Callable[[], tuple[str, bytes, str, str]] | None = None
    label: str = ""
    metadata: dict[str, str] = field(default_factory=dict)


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

    def __init__(self, item: UploadItem, upload_id: str, part_size: int, done: dict[int, str]) -> None:
        self.item = item
        self.upload_id = upload_id
        self.part_size = part_size
        self.count = max(1, -(-item.size // part_size))
        self.etags: dict[int, str] = dict(done)
        self.resumed = len(done)
        self.sent = 0
        self.lock = threading.Lock()

    def part_range(self, number: int) -> tuple[int, int]:
        start = (number - 1) * self.part_size
        return start, min(self.part_size, self.item.size - start)


def _md5(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


class Uploader:
    """Uploads :class:`UploadItem` objects into an S3 store (parallel, verified, resumable)."""

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
        stored: Callable[[str, str, str], str | None] | None = None,
    ) -> list[Uploaded]:
        """Upload ``items``; returns what was sent. ``stored(key, sha256, md5)`` is asked about built
        objects (their key is known only then) and returns the ETag if the store already holds
        exactly those bytes, in which case nothing is sent."""
        items = list(items)
        if not items:
            return []
        progress = progress or TransferProgress(
            sum(i.size for i in items), len(items), every_s=self.settings.progress_every_s, log=self.log,
            what="upload",
        )
        budget = _Budget(self.settings.max_inflight_bytes)
        big = [i for i in items if i.build is None and i.size > self.settings.multipart_threshold]
        can_multipart = hasattr(self.store, "start_multipart")
        multiparts = self._prepare_multipart(big, uploads_prefix) if big and can_multipart else {}
        streamed = {i.key for i in big} - set(multiparts)
        results: list[Uploaded] = []
        results_lock = threading.Lock()

        def single(item: UploadItem) -> None:
            budget.take(item.size)
            try:
                if item.build is not None:
                    key, data, sha256, md5 = item.build()
                    known = stored(key, sha256, md5) if stored else None
                    if known is not None:
                        progress.add(item.size, 1)
                        with results_lock:
                            results.append(Uploaded(key, len(data), known, 0, 0, 0, sha256, md5, item.label))
                        return
                    metadata = {**item.metadata, "sha256": sha256}
                else:
                    key, sha256, metadata = item.key, item.sha256, item.metadata
                    data = item.read(0, item.size)
                    if len(data) != item.size:
                        raise ValueError(f"{item.label or item.key}: read {len(data)} bytes, expected {item.size}")
                    md5 = item.md5 or _md5(data)
                etag = self.store.put_verified(
                    key,
                    data,
                    md5=md5,
                    sha256=sha256 if self.settings.sha256_header else None,
                    metadata=metadata,
                )
            finally:
                budget.give(item.size)
            progress.add(item.size, 1)
            with results_lock:
                results.append(Uploaded(key, len(data), etag or md5, 0, 0, len(data), sha256, md5, item.label))

        def stream(item: UploadItem) -> None:
            # A store without multipart (a private folder): copy in part-sized reads.
            step = self.settings.part_size
            chunks = (item.read(o, min(step, item.size - o)) for o in range(0, item.size, step))
            size, sha256 = self.store.put_chunks(item.key, chunks)
            if (size, sha256) != (item.size, item.sha256):
                raise ValueError(f"{item.label or item.key}: wrote {size} bytes with another SHA-256 than scanned")
            progress.add(item.size, 1)
            with results_lock:
                results.append(Uploaded(item.key, size, "", 0, 0, size, sha256, None, item.label))

        def part(mp: _Multipart, number: int) -> None:
            start, length = mp.part_range(number)
            budget.take(length)
            try:
                data = mp.item.read(start, length)
                if len(data) != length:
                    raise ValueError(f"{mp.item.label or mp.item.key}: short read at byte {start}")
                etag = self.store.upload_part(mp.item.key, mp.upload_id, number, data, md5=_md5(data))
            finally:
                budget.give(length)
            progress.add(length, 0)
            with mp.lock:
                mp.etags[number] = etag
                mp.sent += length
                finished = len(mp.etags) == mp.count
            if finished:
                self._complete(mp, results, results_lock, progress)

        with ThreadPoolExecutor(max_workers=self.settings.workers, thread_name_prefix="upload") as pool:
            futures: list[Future] = []
            for item in items:
                if item.key in streamed:
                    futures.append(pool.submit(stream, item))
                    continue
                mp = multiparts.get(item.key)
                if mp is None:
                    futures.append(pool.submit(single, item))
                    continue
                todo = [n for n in range(1, mp.count + 1) if n not in mp.etags]
                if not todo:  # every part already uploaded by an earlier, interrupted run
                    futures.append(pool.submit(self._complete, mp, results, results_lock, progress))
                for n in todo:
                    futures.append(pool.submit(part, mp, n))
            done, pending = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None]
            if failed:
                for f in pending:
                    f.cancel()
                raise failed[0].exception()
        return results

    # -- multipart ---------------------------------------------------------------------------------
    def _complete(self, mp: _Multipart, results, results_lock, progress: TransferProgress) -> None:
        parts = sorted(mp.etags.items())
        self.store.complete_multipart(mp.item.key, mp.upload_id, parts)
        # What a later listing will show for this object: rclone lists the whole-file MD5, AWS
        # the "<md5 of part md5s>-<parts>" form; either way it is recorded from the store itself.
        info = self.store.stat(mp.item.key)
        if info is None or info.size != mp.item.size:
            raise ValueError(
                f"{mp.item.label or mp.item.key}: multipart upload completed but the store holds "
                f"{'nothing' if info is None else f'{info.size} bytes'}, expected {mp.item.size}"
            )
        progress.add(0, 1)
        with results_lock:
            results.append(
                Uploaded(
                    mp.item.key, mp.item.size, info.etag or "", mp.count, mp.resumed, mp.sent,
                    mp.item.sha256, None, mp.item.label,
                )
            )

    def _prepare_multipart(self, big: list[UploadItem], uploads_prefix: str) -> dict[str, _Multipart]:
        """Resume or start one multipart upload per large item; abort abandoned uploads."""
        wanted = {i.key: i for i in big}
        part_size = self.settings.part_size
        existing = self.store.multipart_uploads(uploads_prefix)
        now = time.time()
        resumable: dict[str, _Multipart] = {}
        for up in existing:
            item = wanted.get(up["key"])
            if item is not None and item.key not in resumable:
                done = self._reusable_parts(item, up["upload_id"], part_size)
                if done is not None:
                    resumable[item.key] = _Multipart(item, up["upload_id"], part_size, done)
                    if done:
                        self.log.info(
                            "resuming upload of %s: %d of %d parts already in the store",
                            item.label or item.key, len(done), resumable[item.key].count,
                        )
                    continue
            age = now - up["initiated"] if up.get("initiated") else None
            if item is not None or (age is not None and age > self.settings.abandoned_upload_age_s):
                # A duplicate for a key we are uploading, or left behind long ago by a killed copy.
                self.log.info("aborting abandoned multipart upload of %s (%s)", up["key"], up["upload_id"])
                self.store.abort_multipart(up["key"], up["upload_id"])
        for key, item in wanted.items():
            if key not in resumable:
                upload_id = self.store.start_multipart(key, metadata=item.metadata)
                resumable[key] = _Multipart(item, upload_id, part_size, {})
        return resumable

    def _reusable_parts(self, item: UploadItem, upload_id: str, part_size: int) -> dict[int, str] | None:
        """Parts of an unfinished upload that hold exactly our bytes, or None if it cannot be resumed."""
        from botocore.exceptions import ClientError

        try:
            held = self.store.uploaded_parts(item.key, upload_id)
        except ClientError:
            return None
        count = max(1, -(-item.size // part_size))
        done: dict[int, str] = {}
        for number, (size, etag) in held.items():
            if number > count:
                return None
            start = (number - 1) * part_size
            if size != min(part_size, item.size - start):
                return None  # uploaded with another part size: start over
            # Re-read and hash locally (cheap) instead of trusting the earlier run's bytes.
            if _md5(item.read(start, size)) == etag.lower():
                done[number] = etag
        return done
