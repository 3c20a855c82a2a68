"""One small object-store contract for private folders and S3-compatible endpoints.

Training workers, checkpointing, staging and artefact writers all speak this interface, so the
same code runs against a local folder (private storage), ``rclone serve s3``, MinIO or AWS.
A :class:`StoreSpec` is the serialisable description handed to worker processes; credentials
travel separately through the environment (:meth:`StoreSpec.credential_env`), never in argv,
files or logs.

What only some stores can do is declared, not probed: a store class names the capabilities it
has among its bases (:class:`VerifiedPut`, :class:`MultipartUploads`, ...) and callers check them
with ``isinstance``.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hybridflow.storage.bandwidth import Cap

ACCESS_KEY_ENV = "HYBRIDFLOW_STORE_ACCESS_KEY"
SECRET_KEY_ENV = "HYBRIDFLOW_STORE_SECRET_KEY"
SESSION_TOKEN_ENV = "HYBRIDFLOW_STORE_SESSION_TOKEN"


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str | None = None
    last_modified: float | None = None  # POSIX seconds, where the store reports it


class ObjectStore(Protocol):
    """Keys are '/'-separated relative names; the store adds its own root/prefix."""

    @property
    def uri(self) -> str: ...

    def put_bytes(self, key: str, data: bytes, *, metadata: dict[str, str] | None = None) -> None: ...

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if it does not exist. Returns False (and writes nothing) if it does."""
        ...

    def put_file(self, key: str, path: Path, *, metadata: dict[str, str] | None = None) -> None: ...

    def get_bytes(self, key: str) -> bytes: ...

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes of ``key`` from byte ``start`` (one ranged read)."""
        ...

    def get_file(self, key: str, path: Path) -> None: ...

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]: ...

    def delete(self, key: str) -> None: ...


# -- optional capabilities ------------------------------------------------------------------------


@dataclass(frozen=True)
class PartReceipt:
    """What the store answered for one uploaded part: its ETag and the CRC32C sent with it
    (CompleteMultipartUpload names both)."""

    etag: str
    crc32c: str | None = None


class VerifiedPut(ABC):
    """Writes the store checks: the answer's ETag is compared with the MD5 of the bytes sent."""

    @abstractmethod
    def put_verified(
        self, key: str, data: Any, *, md5: str, sha256: str | None = None, metadata: dict[str, str] | None = None
    ) -> str:
        """Write ``data`` (bytes or a seekable file) and return the stored object's ETag; raises
        ValueError when the store answers for other bytes than ``md5``."""


class ChunkedPut(ABC):
    """Writes streamed from an iterable of chunks, committed atomically."""

    @abstractmethod
    def put_chunks(self, key: str, chunks: Iterable[bytes]) -> tuple[int, str]:
        """Returns (size, sha256) of what was written."""


class ObjectStat(ABC):
    """One request for an object's size and ETag."""

    @abstractmethod
    def stat(self, key: str) -> ObjectInfo | None:
        """Size and ETag of ``key``, or None when it does not exist."""


class PagedListing(ABC):
    """Listings that are network requests of ``list_page_size`` keys each, so listing many
    prefixes in parallel pays off."""

    @property
    @abstractmethod
    def list_page_size(self) -> int: ...


class MultipartUploads(ObjectStat, ABC):
    """Resumable uploads in verified parts."""

    @abstractmethod
    def start_multipart(self, key: str, *, metadata: dict[str, str] | None = None) -> str:
        """Returns the new upload's id."""

    @abstractmethod
    def upload_part(self, key: str, upload_id: str, number: int, data: Any, *, md5: str) -> PartReceipt: ...

    @abstractmethod
    def complete_multipart(self, key: str, upload_id: str, parts: list[tuple[int, PartReceipt]]) -> str:
        """Returns the object's ETag."""

    @abstractmethod
    def abort_multipart(self, key: str, upload_id: str) -> None: ...

    @abstractmethod
    def multipart_uploads(self, prefix: str = "") -> list[dict[str, Any]]:
        """Unfinished uploads under ``prefix``: key, upload_id, initiated (POSIX s or None)."""

    @abstractmethod
    def uploaded_parts(self, key: str, upload_id: str) -> dict[int, tuple[int, PartReceipt]]:
        """part number -> (size, receipt) of the parts held for an unfinished upload."""


class NativeFilePut(ABC):
    """Local files sent without Python reading them (the AWS CRT), answered on another thread."""

    @abstractmethod
    def put_file_nowait(
        self, key: str, path: str, *, size: int, md5: str, sha256: str | None = None,
        metadata: dict[str, str] | None = None, done: Callable[[str | None, BaseException | None], None],
    ) -> bool:
        """Start the upload; False (nothing sent) where the store cannot at the moment."""


class PartialSweep(ABC):
    """Stores whose interrupted writes leave files behind that listings do not show."""

    @abstractmethod
    def sweep_partials(self, prefix: str = "", *, older_than_s: float = 3600.0) -> int:
        """Delete leftovers older than ``older_than_s``; returns how many went."""


@dataclass(frozen=True)
class StoreSpec:
    """Where a store lives: ``kind`` is ``local`` (``root``) or ``s3`` (``bucket``, ``endpoint_url``).

    An s3 spec names its credentials one of three ways: keys (``access_key``/``secret_key``, with
    ``session_token`` for temporary ones), a ``session`` factory (an Airflow Connection's: keys,
    an assumed role or web identity, refreshed as they expire), or neither: boto3's default chain
    (environment, shared config, web identity/IRSA, instance profile) of the process that opens it.
    """

    kind: str
    root: str | None = None
    bucket: str | None = None
    prefix: str = ""
    endpoint_url: str | None = None
    region: str = "us-east-1"
    # Credentials are not part of the spec's serialised form.
    access_key: str | None = field(default=None, repr=False, compare=False)
    secret_key: str | None = field(default=None, repr=False, compare=False)
    session_token: str | None = field(default=None, repr=False, compare=False)
    # Returns a new boto3 Session each call; used in this process only (children get the keys).
    session: Callable[[], Any] | None = field(default=None, repr=False, compare=False)
    # Byte-rate caps its uploads are under (storage.bandwidth), and whether they are a checkpoint's
    # (served first) or bulk: serialised, so a gang's worker on any machine keeps to them.
    caps: tuple[Cap, ...] = ()
    priority: str = "bulk"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind,
            "root": self.root,
            "bucket": self.bucket,
            "prefix": self.prefix,
            "endpoint_url": self.endpoint_url,
            "region": self.region,
        }
        if self.caps:  # only then: a spec without caps reads as it always has
            out["caps"] = [{"key": c.key, "bytes_per_s": c.bytes_per_s} for c in self.caps]
            out["priority"] = self.priority
        return out

    @classmethod
    def from_dict(cls, data: dict, *, environ: dict[str, str] | None = None) -> StoreSpec:
        env = os.environ if environ is None else environ
        return cls(
            kind=data["kind"],
            root=data.get("root"),
            bucket=data.get("bucket"),
            prefix=data.get("prefix") or "",
            endpoint_url=data.get("endpoint_url"),
            region=data.get("region") or "us-east-1",
            access_key=env.get(ACCESS_KEY_ENV),
            secret_key=env.get(SECRET_KEY_ENV),
            session_token=env.get(SESSION_TOKEN_ENV),
            caps=tuple(Cap(c["key"], float(c["bytes_per_s"])) for c in data.get("caps") or ()),
            priority=data.get("priority") or "bulk",
        )

    def credential_env(self) -> dict[str, str]:
        """Environment entries a child process needs to open this store (none for the default
        chain: the child resolves its own)."""
        if self.kind != "s3" or not self.access_key:
            return {}
        env = {ACCESS_KEY_ENV: self.access_key, SECRET_KEY_ENV: self.secret_key or ""}
        if self.session_token:
            env[SESSION_TOKEN_ENV] = self.session_token
        return env

    @property
    def uri(self) -> str:
        if self.kind == "local":
            return Path(self.root or ".").resolve().as_uri()
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def child(self, sub_prefix: str) -> StoreSpec:
        """The same store with ``sub_prefix`` appended to its prefix (or root)."""
        sub = sub_prefix.strip("/")
        if self.kind == "local":
            return StoreSpec(kind="local", root=str(Path(self.root or ".") / sub))
        return dataclasses.replace(self, prefix=f"{self.prefix.strip('/')}/{sub}".strip("/"))


# kind -> "module.Class" with a ``from_spec`` constructor; imported only when a store of that kind opens.
STORE_KINDS: dict[str, str] = {
    "local": "hybridflow.storage.objectstore.LocalObjectStore",
    "s3": "hybridflow.storage.s3.S3ObjectStore",
}


def open_store(spec: StoreSpec) -> ObjectStore:
    """The one place a store's implementation is picked, by ``spec.kind``."""
    path = STORE_KINDS.get(spec.kind)
    if path is None:
        raise ValueError(f"store kind {spec.kind!r} is not supported; use one of: {', '.join(sorted(STORE_KINDS))}")
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name).from_spec(spec)


class LocalObjectStore(VerifiedPut, ChunkedPut, PartialSweep):
    """A folder used as an object store. Writes land in a temp file and are renamed into place,
    so a reader never sees a half-written object."""

    @classmethod
    def from_spec(cls, spec: StoreSpec) -> LocalObjectStore:
        return cls(Path(spec.root or "."))

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @property
    def uri(self) -> str:
        return self.root.resolve().as_uri()

    def _path(self, key: str) -> Path:
        key = key.lstrip("/")
        path = (self.root / key).resolve()
        if self.root.resolve() not in path.parents and path != self.root.resolve():
            raise ValueError(f"object key {key!r} escapes the store root {self.root}")
        return path

    def _write_atomic(self, target: Path, write) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as fh:
                write(fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def put_bytes(self, key: str, data: bytes, *, metadata: dict[str, str] | None = None) -> None:
        self._write_atomic(self._path(key), lambda fh: fh.write(data))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            # link() fails if the target exists: an atomic create-only commit.
            os.link(tmp, target)
            return True
        except FileExistsError:
            return False
        finally:
            Path(tmp).unlink(missing_ok=True)

    def put_file(self, key: str, path: Path, *, metadata: dict[str, str] | None = None) -> None:
        def copy(fh) -> None:
            with open(path, "rb") as src:
                shutil.copyfileobj(src, fh, 1 << 20)

        self._write_atomic(self._path(key), copy)

    def put_verified(
        self, key: str, data: bytes, *, md5: str, sha256: str | None = None, metadata: dict[str, str] | None = None
    ) -> str:
        """Same contract as the S3 store's: write ``data`` and return its MD5 (the local 'ETag')."""
        self.put_bytes(key, data.getbuffer() if hasattr(data, "getbuffer") else data)
        return md5

    def put_chunks(self, key: str, chunks) -> tuple[int, str]:
        """Stream ``chunks`` into ``key`` atomically; returns (size, sha256) of what was written."""
        import hashlib

        sha, size = hashlib.sha256(), 0

        def write(fh) -> None:
            nonlocal size
            for chunk in chunks:
                sha.update(chunk)
                size += len(chunk)
                fh.write(chunk)

        self._write_atomic(self._path(key), write)
        return size, sha.hexdigest()

    def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        if not path.is_file():
            raise FileNotFoundError(f"{self.uri}/{key} does not exist")
        return path.read_bytes()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        path = self._path(key)
        if not path.is_file():
            raise FileNotFoundError(f"{self.uri}/{key} does not exist")
        with open(path, "rb") as fh:
            fh.seek(start)
            return fh.read(length)

    def get_file(self, key: str, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self._path(key), path)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # Walk only the folder the prefix names (a blob-prefix listing must not walk the store).
        head = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = self._path(head) if head else self.root
        if not base.is_dir():
            return
        for path in sorted(base.rglob("*")):
            if not path.is_file() or path.name.startswith("."):
                continue
            key = path.relative_to(self.root).as_posix()
            if key.startswith(prefix):
                st = path.stat()
                yield ObjectInfo(key=key, size=st.st_size, last_modified=st.st_mtime)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def sweep_partials(self, prefix: str = "", *, older_than_s: float = 3600.0) -> int:
        """Delete the temporary files of writes that were killed before their rename (a SIGKILL
        mid-write leaves ``.<name>.*.part``; listings hide them, so nothing else would). Only
        files older than ``older_than_s`` go: a younger one may be a write still in flight."""
        base = self._path(prefix) if prefix else self.root
        if not base.is_dir():
            return 0
        cutoff = time.time() - older_than_s
        swept = 0
        for path in base.rglob(".*.part"):
            try:
                if path.is_file() and path.stat().st_mtime < cutoff:
                    path.unlink()
                    swept += 1
            except FileNotFoundError:
                continue  # finished (renamed) or swept by someone else meanwhile
        return swept
