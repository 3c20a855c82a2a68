"""Copying one replica set (a dataset version, a model version, a checkpoint) into a DR store.

A replica set is objects plus the manifest that names them. The copy is:

- **checked at the source**: every object read from the source is hashed and compared with the
  SHA-256 its source manifest records; a missing or different object is reported and never written,
  and the set's manifest is then not written either, so the DR side keeps what it had;
- **add-only**: objects and manifests are created, never replaced; an object already on the DR side
  that verifies is kept as it is (never overwritten), and nothing is ever deleted;
- **verified**: each object is read back after the copy and its SHA-256 compared;
- **manifest last**: the manifest is created once every object it names is in place and verified,
  so whoever finds a manifest on the DR side finds every object it names;
- **incremental**: a set whose manifest is already on the DR side costs one existence check.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.storage.objectstore import ObjectStat, ObjectStore

logger = logging.getLogger("hybridflow.dr")

CHUNK = 16 << 20  # objects are hashed in reads of this size


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Wanted:
    """One object of a set: its key on the DR side, what its source manifest records (``sha256``
    None where the source keeps no digest: the bytes read are then what the DR manifest records),
    and how to read it from the source."""

    key: str
    size: int | None
    sha256: str | None
    read: Callable[[], bytes] = field(repr=False, compare=False)
    source: str = ""  # where it is read from, for messages
    path: Path | None = None  # a local file: checked and sent from where it lies, not read whole


@dataclass(frozen=True)
class Copied:
    key: str
    size: int
    sha256: str


@dataclass(frozen=True)
class ReplicaSet:
    """What one takeover item needs on the DR side. ``manifest_for`` builds the manifest's bytes
    from the objects as copied (their keys, sizes and SHA-256s)."""

    kind: str  # dataset | model | checkpoint
    name: str  # the dataset, the endpoint, the run
    version: str  # the dataset version, the model version, the checkpoint step
    manifest_key: str
    objects: tuple[Wanted, ...]
    manifest_for: Callable[[list[Copied]], bytes] = field(repr=False, compare=False)

    @property
    def label(self) -> str:
        return f"{self.kind} {self.name} version {self.version}"


@dataclass(frozen=True)
class Problem:
    """Something replication or reconciliation found wrong, and what it did about it."""

    kind: str
    name: str
    key: str
    what: str

    def __str__(self) -> str:
        return f"{self.kind} {self.name}: {self.key}: {self.what}"

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "name": self.name, "key": self.key, "what": self.what}


@dataclass
class SetOutcome:
    kind: str
    name: str
    version: str
    status: str  # present (already replicated) | copied | incomplete (a source problem: no manifest)
    objects_copied: int = 0
    bytes_copied: int = 0
    repaired: int = 0  # DR objects that did not verify and were copied again from a good source
    problems: list[Problem] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "version": self.version, "status": self.status,
                "objects_copied": self.objects_copied, "bytes_copied": self.bytes_copied,
                "repaired": self.repaired, "problems": [p.to_dict() for p in self.problems]}


@dataclass(frozen=True)
class Body:
    """Source bytes that passed their check: in memory, or a local file sent from where it lies
    (big dataset files never pass through memory whole)."""

    size: int
    sha256: str
    data: bytes | None = field(default=None, repr=False)
    path: Path | None = None


def _hash_file(path: Path) -> tuple[int, str]:
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return size, sha.hexdigest()


def read_source(wanted: Wanted) -> tuple[Body | None, str | None]:
    """The source's content if it is what its manifest records, else (None, why)."""
    where = wanted.source or "source"
    try:
        if wanted.path is not None:
            size, digest = _hash_file(wanted.path)
            body = Body(size, digest, path=wanted.path)
        else:
            data = wanted.read()
            body = Body(len(data), sha256_of(data), data=data)
    except FileNotFoundError:
        return None, f"missing at the source ({where})"
    except Exception as exc:  # noqa: BLE001 - any read failure: the object is not propagated
        return None, f"cannot be read at the source ({where}): {type(exc).__name__}: {exc}"
    if wanted.size is not None and body.size != wanted.size:
        return None, f"the source ({where}) holds {body.size} bytes, its manifest records {wanted.size}; not copied"
    if wanted.sha256 is not None and body.sha256 != wanted.sha256:
        return None, (f"the source ({where}) no longer matches its manifest (SHA-256 {body.sha256[:12]}, recorded "
                      f"{wanted.sha256[:12]}); not copied")
    return body, None


def _stored_size(store: ObjectStore, key: str) -> int | None:
    if isinstance(store, ObjectStat):
        info = store.stat(key)
        return None if info is None else info.size
    return next((i.size for i in store.list(key) if i.key == key), None)


def stored_digest(store: ObjectStore, key: str) -> tuple[int, str] | None:
    """(size, SHA-256) of the DR object ``key``, read in ranges; None when it is missing."""
    size = _stored_size(store, key)
    if size is None:
        return None
    sha = hashlib.sha256()
    try:
        if size <= CHUNK:
            sha.update(store.get_bytes(key))
        else:
            for start in range(0, size, CHUNK):
                sha.update(store.get_range(key, start, min(CHUNK, size - start)))
    except FileNotFoundError:
        return None
    return size, sha.hexdigest()


def write_verified(store: ObjectStore, key: str, body: Body, *, repair: bool = False) -> str | None:
    """Create ``key`` (create-only; ``repair`` replaces an object that failed its check) and read it
    back: None when the stored bytes verify, else why not. An object created by someone else
    meanwhile is kept whatever it holds, and checked the same way."""
    if body.data is not None:
        if repair:
            store.put_bytes(key, body.data)
        else:
            store.put_if_absent(key, body.data)
    elif repair or not store.exists(key):
        store.put_file(key, body.path)  # type: ignore[arg-type]
    found = stored_digest(store, key)
    if found == (body.size, body.sha256):
        return None
    return "missing after the copy" if found is None else \
        f"SHA-256 {found[1][:12]} after the copy, expected {body.sha256[:12]}"


def _copy_object(rs: ReplicaSet, w: Wanted, store: ObjectStore, outcome: SetOutcome, log: Any) -> Copied | None:
    """One object in place on the DR side (copied, or found there and verified), or None with the
    problem noted in ``outcome``."""
    stored = stored_digest(store, w.key)
    have = stored[1] if stored is not None else None
    if stored is not None and have == w.sha256:
        return Copied(w.key, stored[0], stored[1])
    body, why = read_source(w)
    if body is None:
        outcome.problems.append(Problem(rs.kind, rs.name, w.key, why or "unreadable"))
        return None
    if have is not None and have == body.sha256:
        return Copied(w.key, body.size, body.sha256)
    if have is not None and w.sha256 is None:
        # No digest at the source to tell which side is right: the DR copy is kept, never overwritten.
        outcome.problems.append(Problem(rs.kind, rs.name, w.key, (
            f"the source ({w.source or 'source'}) differs from the copy already on the DR side (SHA-256 "
            f"{body.sha256[:12]} vs {have[:12]}); the DR copy is kept")))
        return None
    repair = have is not None
    if repair:
        # The DR object does not match the source manifest (damaged where it lies): replaced with
        # source bytes that do.
        log.warning("%s: %s on the DR side does not verify; copying it again from the source", rs.label, w.key)
    failed = write_verified(store, w.key, body, repair=repair)
    if failed is not None:
        outcome.problems.append(Problem(rs.kind, rs.name, w.key, f"copy did not verify: {failed}"))
        return None
    outcome.objects_copied += 1
    outcome.bytes_copied += body.size
    outcome.repaired += int(repair)
    return Copied(w.key, body.size, body.sha256)


def replicate_set(rs: ReplicaSet, store: ObjectStore, *, log: Any = logger) -> SetOutcome:
    """Copy ``rs`` into ``store`` (see the module's rules); never raises for a bad source object."""
    outcome = SetOutcome(rs.kind, rs.name, rs.version, "present")
    if store.exists(rs.manifest_key):
        log.info("%s is already replicated (%s); nothing to copy", rs.label, rs.manifest_key)
        return outcome
    copied = []
    for w in rs.objects:
        done = _copy_object(rs, w, store, outcome, log)
        if done is not None:
            copied.append(done)
    if outcome.problems:
        outcome.status = "incomplete"
        log.warning("%s not replicated: %d object(s) bad at the source; no manifest written, the DR side keeps "
                    "what it had: %s", rs.label, len(outcome.problems), "; ".join(map(str, outcome.problems)))
        return outcome
    manifest = rs.manifest_for(copied)
    if not store.put_if_absent(rs.manifest_key, manifest):
        log.info("%s: manifest %s was committed meanwhile; kept as it is", rs.label, rs.manifest_key)
    outcome.status = "copied"
    log.info("%s replicated: %d objects copied (%d bytes), %d already there", rs.label, outcome.objects_copied,
             outcome.bytes_copied, len(copied) - outcome.objects_copied)
    return outcome
