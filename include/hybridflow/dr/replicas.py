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
from typing import Any

from hybridflow.storage.objectstore import ObjectStore

logger = logging.getLogger("hybridflow.dr")


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


def read_source(wanted: Wanted) -> tuple[bytes | None, str | None]:
    """The source's bytes if they are what its manifest records, else (None, why)."""
    try:
        data = wanted.read()
    except FileNotFoundError:
        return None, f"missing at the source ({wanted.source or 'source'})"
    except Exception as exc:  # noqa: BLE001 - any read failure: the object is not propagated
        return None, f"cannot be read at the source ({wanted.source or 'source'}): {type(exc).__name__}: {exc}"
    if wanted.size is not None and len(data) != wanted.size:
        return None, (f"the source ({wanted.source or 'source'}) holds {len(data)} bytes, its manifest records "
                      f"{wanted.size}; not copied")
    digest = sha256_of(data)
    if wanted.sha256 is not None and digest != wanted.sha256:
        return None, (f"the source ({wanted.source or 'source'}) no longer matches its manifest (SHA-256 "
                      f"{digest[:12]}, recorded {wanted.sha256[:12]}); not copied")
    return data, None


def stored_sha256(store: ObjectStore, key: str) -> str | None:
    """SHA-256 of the DR object ``key``, None when it is missing."""
    try:
        return sha256_of(store.get_bytes(key))
    except FileNotFoundError:
        return None


def write_verified(store: ObjectStore, key: str, data: bytes, *, repair: bool = False) -> str | None:
    """Create ``key`` (create-only; ``repair`` replaces an object that failed its check) and read it
    back: None when the stored bytes verify, else why not."""
    expected = sha256_of(data)
    if repair:
        store.put_bytes(key, data)
    elif not store.put_if_absent(key, data):
        # Created by someone else meanwhile: it is kept whatever it holds, and checked below.
        pass
    found = stored_sha256(store, key)
    if found == expected:
        return None
    return "missing after the copy" if found is None else f"SHA-256 {found[:12]} after the copy, expected {expected[:12]}"


def _copy_object(rs: ReplicaSet, w: Wanted, store: ObjectStore, outcome: SetOutcome, log: Any) -> Copied | None:
    """One object in place on the DR side (copied, or found there and verified), or None with the
    problem noted in ``outcome``."""
    try:
        existing = store.get_bytes(w.key)
    except FileNotFoundError:
        existing = None
    have = sha256_of(existing) if existing is not None else None
    if have is not None and have == w.sha256:
        return Copied(w.key, len(existing), have)  # type: ignore[arg-type]
    data, why = read_source(w)
    if data is None:
        outcome.problems.append(Problem(rs.kind, rs.name, w.key, why or "unreadable"))
        return None
    digest = sha256_of(data)
    if have is not None and have == digest:
        return Copied(w.key, len(data), digest)
    if have is not None and w.sha256 is None:
        # No digest at the source to tell which side is right: the DR copy is kept, never overwritten.
        outcome.problems.append(Problem(rs.kind, rs.name, w.key, (
            f"the source ({w.source or 'source'}) differs from the copy already on the DR side (SHA-256 "
            f"{digest[:12]} vs {have[:12]}); the DR copy is kept")))
        return None
    repair = have is not None
    if repair:
        # The DR object does not match the source manifest (damaged where it lies): replaced with
        # source bytes that do.
        log.warning("%s: %s on the DR side does not verify; copying it again from the source", rs.label, w.key)
    failed = write_verified(store, w.key, data, repair=repair)
    if failed is not None:
        outcome.problems.append(Problem(rs.kind, rs.name, w.key, f"copy did not verify: {failed}"))
        return None
    outcome.objects_copied += 1
    outcome.bytes_copied += len(data)
    outcome.repaired += int(repair)
    return Copied(w.key, len(data), digest)


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
