"""Remembered digests of source files, so an unchanged dataset is not re-read to be re-staged.

A file's digests are reused while its (size, mtime_ns, inode) are what they were when it was
hashed, the test rsync and git use. A file modified within the same timestamp tick as its hashing
would look unchanged, so an entry is only trusted once its mtime is older than the hashing by more
than :data:`RACY_WINDOW_NS` ("racily clean" entries are hashed again). The index is a cache: losing
or deleting it only costs a re-read.

The same file also remembers shard digests (member list -> packed blob) and what each target store
listed for the blobs staged there, so a re-stage can be decided from one listing.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from hybridflow.runs import write_json_atomic

log = logging.getLogger(__name__)

INDEX_FORMAT = "hybridflow.hash-index/v1"
RACY_WINDOW_NS = 2_000_000_000


@dataclass(frozen=True)
class FileDigest:
    size: int
    sha256: str
    md5: str | None  # None for files too big to be sent in one request (multipart)


@dataclass(frozen=True)
class ShardDigest:
    size: int
    sha256: str
    md5: str | None


class HashIndex:
    """Digests for the files under one source root, kept in one JSON file (or only in memory)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._dirty = False  # anything to write back: an unchanged dataset rewrites nothing
        self._files: dict[str, list] = {}
        self._shards: dict[str, list] = {}
        self._stored: dict[str, dict[str, str]] = {}
        self._seen: set[str] = set()
        self.hits = 0
        self.misses = 0
        if path is not None and path.is_file():
            try:
                body = json.loads(path.read_text())
                if body.get("format") == INDEX_FORMAT:
                    self._files = body.get("files", {})
                    self._shards = body.get("shards", {})
                    self._stored = body.get("stored", {})
                else:
                    self._dirty = True
            except (OSError, ValueError) as exc:
                log.warning("hash index %s is unreadable (%s); hashing every file again", path, exc)
                self._dirty = True

    @property
    def file_count(self) -> int:
        """Files the index knew when it was loaded (a hint of the dataset's size)."""
        return len(self._files)

    @staticmethod
    def file_key(st: os.stat_result) -> list[int]:
        """Identity of a local file's content: (size, mtime_ns, inode)."""
        return [st.st_size, st.st_mtime_ns, st.st_ino]

    def lookup(self, rel: str, identity: list, mtime_ns: int | None) -> FileDigest | None:
        """The remembered digests if ``identity`` is unchanged; ``mtime_ns`` (local files) also
        rejects entries hashed within RACY_WINDOW_NS of the file's last change."""
        with self._lock:
            self._seen.add(rel)
            row = self._files.get(rel)
            if row and row[0] == identity and (mtime_ns is None or mtime_ns < row[1] - RACY_WINDOW_NS):
                self.hits += 1
                return FileDigest(size=row[2], sha256=row[3], md5=row[4])
            self.misses += 1
            return None

    def record(self, rel: str, identity: list, digest: FileDigest, hashed_at_ns: int) -> None:
        with self._lock:
            self._seen.add(rel)
            self._files[rel] = [list(identity), hashed_at_ns, digest.size, digest.sha256, digest.md5]
            self._dirty = True

    def shard(self, members_digest: str) -> ShardDigest | None:
        row = self._shards.get(members_digest)
        return ShardDigest(*row) if row else None

    def record_shard(self, members_digest: str, digest: ShardDigest) -> None:
        with self._lock:
            row = [digest.size, digest.sha256, digest.md5]
            if self._shards.get(members_digest) != row:
                self._shards[members_digest] = row
                self._dirty = True

    def stored_etags(self, store_uri: str) -> dict[str, str]:
        """key -> ETag that ``store_uri`` listed for a blob right after a verified upload."""
        return dict(self._stored.get(store_uri, {}))

    def set_stored(self, store_uri: str, etags: dict[str, str]) -> None:
        with self._lock:
            if self._stored.get(store_uri) != etags:
                self._stored[store_uri] = dict(etags)
                self._dirty = True

    def save(self, live_shards: set[str] | None = None) -> None:
        """Persist; files not seen by this scan are dropped (the folder no longer has them)."""
        if self.path is None:
            return
        with self._lock:
            files = {k: v for k, v in self._files.items() if k in self._seen}
            shards = self._shards if live_shards is None else {
                k: v for k, v in self._shards.items() if k in live_shards
            }
            if not self._dirty and len(files) == len(self._files) and len(shards) == len(self._shards):
                return
            body = {"format": INDEX_FORMAT, "files": files, "shards": shards, "stored": self._stored}
            self._files, self._shards, self._dirty = files, dict(shards), False
        write_json_atomic(self.path, body, compact=True)
