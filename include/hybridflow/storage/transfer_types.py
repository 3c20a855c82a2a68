"""What an upload call is given and what it answers: settings, items, results."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

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
