"""Whether a blob already in the cache holds exactly the wanted bytes: by size and the ETag verified at
upload, or, with nothing to compare with, by reading it back."""

from __future__ import annotations

import hashlib
import threading
from typing import Any

from hybridflow.errors import StagingError
from hybridflow.staging.blobs import _Blob
from hybridflow.staging.layout import read_manifest, versions_prefix
from hybridflow.staging.settings import StagingSettings, _MiB
from hybridflow.storage.hashindex import HashIndex
from hybridflow.storage.manifest import DatasetManifest
from hybridflow.storage.objectstore import ObjectInfo, ObjectStore
from hybridflow.storage.shards import ShardPlan, iter_members, shard_offsets
from hybridflow.storage.sources import DatasetSource

# A blob the listing cannot vouch for (no usable ETag recorded) is re-read to check its SHA-256.
VERIFY_DOWNLOAD_MAX = 256 * _MiB


def _is_md5(etag: str) -> bool:
    return len(etag) == 32 and not etag.strip("0123456789abcdef")


class _Stager:
    def __init__(self, source: DatasetSource, target: ObjectStore, settings: StagingSettings, log: Any,
                 index: HashIndex) -> None:
        self.source, self.target, self.settings, self.log, self.index = source, target, settings, log, index
        self.name = source.name
        self._previous: DatasetManifest | None | bool = False  # False: not looked up yet
        self.repaired = 0  # bad blobs found only once built or hashed on the way (see stored)
        self.lock = threading.Lock()

    # -- what was verified before ------------------------------------------------------------------
    def previous_manifest(self) -> DatasetManifest | None:
        """The newest committed manifest of this dataset in the target (read at most once)."""
        if self._previous is False:
            versions = sorted(self.target.list(versions_prefix(self.name)), key=lambda i: i.last_modified or 0)
            self._previous = None
            for info in reversed(versions):
                try:
                    self._previous = read_manifest(self.target, info.key)
                    break
                except StagingError as exc:
                    self.log.warning("ignoring %s", exc)
        return self._previous or None


    def recorded_etag(self, key: str, recorded: dict[str, str]) -> str | None:
        if key in recorded:
            return recorded[key]
        prev = self.previous_manifest()
        if prev is not None:
            for b in prev.blobs:
                if b.etag:
                    recorded.setdefault(b.key, b.etag)
        return recorded.get(key)

    # -- checks ------------------------------------------------------------------------------------
    def problem(self, blob: _Blob, info: ObjectInfo | None, recorded: dict[str, str]) -> str | None:
        """Why the stored blob is unusable, or None when it holds exactly the wanted bytes."""
        if info is None:
            return "missing"
        if info.size != blob.size:
            return f"size {info.size} bytes, expected {blob.size}"
        etag = (info.etag or "").strip('"').lower()
        if etag and blob.md5 and _is_md5(etag):
            return None if etag == blob.md5 else "content differs (MD5)"
        known = self.recorded_etag(blob.key, recorded)
        if etag and known:
            return None if etag == known.lower() else f"ETag {etag} differs from {known} recorded at upload"
        # Nothing to compare with (a folder store, or a blob from another machine): settle it with
        # the stored bytes (a shard: every member's SHA-256 at its offset).
        if blob.shard is not None:
            return None if self._shard_ok(blob) else "a packed file differs (SHA-256)"
        if info.size > VERIFY_DOWNLOAD_MAX and etag:
            self.log.warning("blob %s: no recorded ETag to check; trusting its size", blob.key)
            return None
        return None if self._stored_sha256(blob.key, info.size) == blob.sha256 else "content differs (SHA-256)"

    def _shard_ok(self, blob: _Blob) -> bool:
        offsets = shard_offsets(blob.shard)
        expected = {m.path: (offsets[m.path], m.size, m.sha256) for m in blob.shard.members}
        try:
            for _ in iter_members(self.target.get_bytes(blob.key), expected):
                pass
        except StagingError:
            return False
        return True

    def _stored_sha256(self, key: str, size: int) -> str:
        sha = hashlib.sha256()
        step = 16 * _MiB
        for start in range(0, size, step):
            sha.update(self.target.get_range(key, start, min(step, size - start)))
        return sha.hexdigest()

    def stored(self, existing: dict[str, ObjectInfo], recorded: dict[str, str]):
        """For built shards: the ETag if ``key`` is already stored with these bytes."""

        def check(key: str, sha256: str, md5: str | None, shard: ShardPlan | None = None) -> str | None:
            info = existing.get(key)
            if info is None:
                return None
            blob = _Blob(key=key, size=info.size, sha256=sha256, md5=md5, shard=shard)
            problem = self.problem(blob, info, recorded)
            if problem is None:
                return info.etag or md5
            with self.lock:
                self.repaired += 1
            self.log.warning("blob %s in %s is bad (%s); re-copying it", key, self.target.uri, problem)
            return None

        return check
