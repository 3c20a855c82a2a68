"""The daily reconciliation of a DR store: every replicated object against its manifest.

Every manifest under ``datasets/``, ``models/`` and ``checkpoints/`` is read, and every object it
names is read back and hashed. An object that is missing, or whose size or SHA-256 differs from
the manifest, is drift. Drift is repaired only by copying: from a source that holds the object's
bytes as the manifest records them (checked before anything is written). With no such source the
drift is reported and the object left as it is. Nothing is ever deleted.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridflow.dr.replication.layout import MANIFEST_PREFIXES, Expected, expected_objects, kind_of, name_of
from hybridflow.dr.replication.replicas import (
    Problem,
    Wanted,
    logger,
    read_source,
    sha256_of,
    stored_digest,
    write_verified,
)
from hybridflow.storage.objectstore import ObjectStore


@dataclass
class ReconcileReport:
    store: str
    manifests: int = 0
    objects_checked: int = 0
    drift: list[Problem] = field(default_factory=list)  # what was found wrong
    repaired: list[str] = field(default_factory=list)  # keys copied again from a healthy source
    unrepaired: list[Problem] = field(default_factory=list)  # drift left as it is, and why
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not self.unrepaired

    def to_dict(self) -> dict[str, Any]:
        return {"store": self.store, "manifests": self.manifests, "objects_checked": self.objects_checked,
                "drift": [p.to_dict() for p in self.drift], "repaired": list(self.repaired),
                "unrepaired": [p.to_dict() for p in self.unrepaired], "seconds": round(self.seconds, 3)}


def _check(store: ObjectStore, e: Expected) -> str | None:
    """Why the stored object does not hold what its manifest records, or None."""
    if e.offset is not None:  # a file packed in a shard: its byte range
        try:
            data = store.get_range(e.key, e.offset, e.size)
        except FileNotFoundError:
            return "missing"
        size, digest = len(data), sha256_of(data)
    else:
        found = stored_digest(store, e.key)
        if found is None:
            return "missing"
        size, digest = found
    if size != e.size:
        return f"corrupted: {size} bytes, the manifest records {e.size}"
    return None if digest == e.sha256 else f"corrupted: SHA-256 {digest[:12]}, the manifest records {e.sha256[:12]}"


def _repair(store: ObjectStore, e: Expected, source: Wanted | None) -> str | None:
    """Copy the object again from ``source``; None when done, else why it was left as it is."""
    if source is None:
        return "no healthy source to copy it from; left as it is"
    if e.offset is not None:
        return "a packed file: repair by replicating its version again; left as it is"
    body, why = read_source(Wanted(e.key, e.size, e.sha256, source.read, source.source, source.path))
    if body is None:
        return f"not repaired: {why}"
    failed = write_verified(store, e.key, body, repair=True)
    return None if failed is None else f"repair did not verify: {failed}"


def reconcile(store: ObjectStore, sources: Mapping[str, Wanted] | None = None, *, log: Any = logger) -> ReconcileReport:
    """Check every replicated object in ``store`` against its manifest and repair drift from
    ``sources`` (DR key -> where to read it; see :func:`hybridflow.dr.replication.replicate.healthy_sources`)."""
    started = time.monotonic()
    sources = sources or {}
    report = ReconcileReport(store=store.uri)
    seen: set[tuple[str, int | None]] = set()  # a blob several dataset versions share is read once
    for prefix in MANIFEST_PREFIXES:
        for info in store.list(prefix):
            kind = kind_of(info.key)
            if kind is None:
                continue
            report.manifests += 1
            try:
                expected = expected_objects(info.key, store.get_bytes(info.key))
            except (ValueError, FileNotFoundError) as exc:
                problem = Problem(kind, name_of(info.key), info.key, f"manifest unreadable: {exc}")
                report.drift.append(problem)
                report.unrepaired.append(problem)
                continue
            for e in expected:
                if (e.key, e.offset) in seen:
                    continue
                seen.add((e.key, e.offset))
                report.objects_checked += 1
                why = _check(store, e)
                if why is None:
                    continue
                report.drift.append(Problem(kind, name_of(info.key), e.key, why))
                left = _repair(store, e, sources.get(e.key))
                if left is None:
                    report.repaired.append(e.key)
                    log.warning("DR object %s was %s; copied again from %s", e.key, why, sources[e.key].source)
                else:
                    report.unrepaired.append(Problem(kind, name_of(info.key), e.key, f"{why}; {left}"))
    report.seconds = time.monotonic() - started
    log.info("reconciled %s: %d manifests, %d objects checked, %d drifted, %d repaired, %d left as they are (%.2fs)",
             store.uri, report.manifests, report.objects_checked, len(report.drift), len(report.repaired),
             len(report.unrepaired), report.seconds)
    for p in report.unrepaired:
        log.warning("DR drift not repaired: %s", p)
    return report
