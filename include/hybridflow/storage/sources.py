"""Where a dataset is staged from: a private folder (local disk or an NFS mount) or a bucket on a
private S3 endpoint. A source lists its files once, with the SHA-256 of each (remembered in a
:class:`~hybridflow.storage.hashindex.HashIndex`, so only new or changed files are read), and reads
byte ranges of them for the upload.
"""

from __future__ import annotations

import hashlib
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from hybridflow.errors import StagingError
from hybridflow.storage.hashindex import FileDigest, HashIndex

_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class SourceFile:
    rel: str  # '/'-separated path inside the dataset
    size: int
    sha256: str  # "" until hashed (big files are hashed on their way up, see defer_above)
    md5: str | None  # known for files that go up in one request
    identity: tuple = ()  # what the hash index keys this file's content by
    mtime_ns: int | None = None

    @property
    def hashed(self) -> bool:
        return bool(self.sha256)


class DatasetSource(Protocol):
    name: str
    uri: str

    def scan(
        self, index: HashIndex, *, md5_max_size: int, workers: int,
        defer: Callable[[list[SourceFile]], set[str]] | None = None,
    ) -> list[SourceFile]:
        """Every file with its digests. ``defer`` sees every file (sizes known, digests where the
        index has them) and names files not to hash now: those come back unhashed (sha256 "") to be
        hashed on their way up (:meth:`digest`, or while packed into a shard)."""
        ...

    def digest(self, f: SourceFile, index: HashIndex, *, md5_max_size: int) -> FileDigest:
        """Hash a file the scan deferred, and remember it in ``index``."""
        ...

    def read(self, rel: str, offset: int = 0, length: int | None = None) -> bytes: ...


class LocalFiles(ABC):
    """A source whose files lie on this machine: read into caller buffers, sent by path."""

    @abstractmethod
    def local_path(self, rel: str) -> str:
        """The file's path on this machine (the CRT reads small files itself)."""

    @abstractmethod
    def readinto(self, rel: str, offset: int, buf) -> int:
        """Fill ``buf`` from byte ``offset`` of the file; returns the bytes read (fewer at its end)."""


def skipped(rel: str) -> bool:
    # Dot-files and *.part are in-flight writes (atomic writers rename them into place), not dataset content.
    return any(p.startswith(".") for p in rel.split("/")) or rel.endswith(".part")


def _digest_stream(chunks: Iterator[bytes], with_md5: bool) -> tuple[int, str, str | None]:
    sha = hashlib.sha256()
    md5 = hashlib.md5(usedforsecurity=False) if with_md5 else None
    size = 0
    for chunk in chunks:
        sha.update(chunk)
        if md5 is not None:
            md5.update(chunk)
        size += len(chunk)
    return size, sha.hexdigest(), md5.hexdigest() if md5 is not None else None


class LocalFolderSource(LocalFiles):
    """A dataset folder in private storage."""

    def __init__(self, path: Path, *, name: str | None = None, uri: str | None = None) -> None:
        self.path = Path(path)
        self.name = name or self.path.name
        self.uri = uri or self.path.resolve().as_uri()

    def _walk(self) -> Iterator[tuple[str, os.stat_result]]:
        stack = [(self.path, "")]
        while stack:
            folder, prefix = stack.pop()
            with os.scandir(folder) as it:
                for entry in it:
                    rel = f"{prefix}{entry.name}"
                    if skipped(rel):
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        stack.append((Path(entry.path), f"{rel}/"))
                    elif entry.is_file():
                        yield rel, entry.stat()

    def scan(
        self, index: HashIndex, *, md5_max_size: int, workers: int = 2,
        defer: Callable[[list[SourceFile]], set[str]] | None = None,
    ) -> list[SourceFile]:
        if not self.path.is_dir():
            raise StagingError(f"dataset folder {self.path} ({self.uri}) does not exist")
        files = []
        for rel, st in self._walk():
            identity = HashIndex.file_key(st)
            known = index.lookup(rel, identity, st.st_mtime_ns)
            f = SourceFile(rel=rel, size=st.st_size, sha256="", md5=None, identity=tuple(identity),
                           mtime_ns=st.st_mtime_ns)
            files.append(_with(f, known, md5_max_size) if known is not None else f)
        return _hash_rest(self, files, index, md5_max_size, workers, defer)

    def digest(self, f: SourceFile, index: HashIndex, *, md5_max_size: int) -> FileDigest:
        hashed_at = time.time_ns()
        path = self.path / f.rel

        def chunks() -> Iterator[bytes]:
            with open(path, "rb") as fh:
                while chunk := fh.read(_CHUNK):
                    yield chunk

        size, sha, md5 = _digest_stream(chunks(), f.size <= md5_max_size)
        now = os.stat(path)
        if size != f.size or now.st_mtime_ns != f.mtime_ns:
            raise StagingError(f"{path} changed while it was being staged; stop writers and re-run staging")
        digest = FileDigest(size=size, sha256=sha, md5=md5)
        index.record(f.rel, list(f.identity), digest, hashed_at)
        return digest

    def local_path(self, rel: str) -> str:
        """The file's path on this machine (the CRT reads small files itself)."""
        return str(self.path / rel)

    def readinto(self, rel: str, offset: int, buf) -> int:
        """Fill ``buf`` from byte ``offset`` of the file; returns the bytes read (fewer at its end)."""
        fd = os.open(self.path / rel, os.O_RDONLY)
        try:
            view, got = memoryview(buf), 0
            while got < len(view) and (n := os.preadv(fd, [view[got:]], offset + got)):
                got += n
            return got
        finally:
            os.close(fd)

    def read(self, rel: str, offset: int = 0, length: int | None = None) -> bytes:
        with open(self.path / rel, "rb") as fh:
            if offset:
                fh.seek(offset)
            return fh.read() if length is None else fh.read(length)


class S3DatasetSource:
    """A dataset under ``prefix`` of a bucket on a private S3 endpoint (``store`` is an
    :class:`~hybridflow.storage.s3.S3ObjectStore` built from an Airflow Connection).

    An object's identity for the index is its (size, ETag): S3 objects are immutable, so a changed
    object has a new ETag. Digests of unknown objects come from the ``sha256`` user metadata that
    hybridflow writes, else from reading the object once.
    """

    def __init__(self, store: Any, prefix: str, *, name: str | None = None) -> None:
        self.store = store
        self.prefix = prefix.strip("/")
        self.name = name or self.prefix.rsplit("/", 1)[-1]
        self.uri = f"{store.uri}/{self.prefix}"

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}"

    def scan(
        self, index: HashIndex, *, md5_max_size: int, workers: int = 8,
        defer: Callable[[list[SourceFile]], set[str]] | None = None,
    ) -> list[SourceFile]:
        listed = [i for i in self.store.list(f"{self.prefix}/") if not skipped(i.key[len(self.prefix) + 1 :])]
        if not listed:
            raise StagingError(f"no objects under {self.uri}; check the dataset URI")
        files = []
        for info in listed:
            rel = info.key[len(self.prefix) + 1 :]
            identity = (info.size, info.etag or "")
            known = index.lookup(rel, list(identity), None)
            f = SourceFile(rel=rel, size=info.size, sha256="", md5=None, identity=identity)
            files.append(_with(f, known, md5_max_size) if known is not None else f)
        return _hash_rest(self, files, index, md5_max_size, workers, defer)

    def digest(self, f: SourceFile, index: HashIndex, *, md5_max_size: int) -> FileDigest:
        with_md5 = f.size <= md5_max_size
        etag = str(f.identity[1]).lower() if len(f.identity) > 1 else ""
        recorded = self.store.metadata(self._key(f.rel)).get("sha256")
        if recorded and (not with_md5 or (len(etag) == 32 and "-" not in etag)):
            digest = FileDigest(size=f.size, sha256=recorded, md5=etag if with_md5 else None)
        else:
            size, sha, md5 = _digest_stream(self._chunks(f.rel, f.size), with_md5)
            digest = FileDigest(size=size, sha256=sha, md5=md5)
        index.record(f.rel, list(f.identity), digest, time.time_ns())
        return digest

    def _chunks(self, rel: str, size: int) -> Iterator[bytes]:
        step = 8 * _CHUNK
        for start in range(0, size, step):
            yield self.store.get_range(self._key(rel), start, min(step, size - start))

    def read(self, rel: str, offset: int = 0, length: int | None = None) -> bytes:
        if offset == 0 and length is None:
            return self.store.get_bytes(self._key(rel))
        if length is None:
            raise ValueError("a ranged read of an S3 source needs a length")
        return self.store.get_range(self._key(rel), offset, length)


def _with(f: SourceFile, d: FileDigest, md5_max_size: int) -> SourceFile:
    return SourceFile(rel=f.rel, size=d.size, sha256=d.sha256, md5=d.md5 if d.size <= md5_max_size else None,
                      identity=f.identity, mtime_ns=f.mtime_ns)


def _hash_rest(source, files: list[SourceFile], index: HashIndex, md5_max_size: int, workers: int,
               defer: Callable[[list[SourceFile]], set[str]] | None) -> list[SourceFile]:
    """Hash the files the index did not know, except those ``defer`` names."""
    later = defer(files) if defer else set()
    todo = [f for f in files if not f.hashed and f.rel not in later]
    done = {f.rel: f for f in files if f.hashed or f.rel in later}
    # hashlib drops the GIL on large buffers: threads hash on every core.
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="hash") as pool:
        for f in pool.map(lambda f: _with(f, source.digest(f, index, md5_max_size=md5_max_size), md5_max_size), todo):
            done[f.rel] = f
    return [done[rel] for rel in sorted(done)]
