"""A cloud cache's dataset versions, and pruning the old ones: the one place that deletes from it.

Staging only ever adds (:mod:`hybridflow.staging`), so every committed version stays readable
until an operator prunes. Pruning keeps the newest ``keep`` versions (at least three) and any
version younger than ``protect_s`` (a run may still be reading it), deletes the other manifests
first, so no reader can find a version whose blobs are going, and then deletes blobs no kept
version names, but only those older than ``min_blob_age_s``: a stage still in flight has
uploaded blobs that no manifest names yet. A manifest that cannot be read (a transient error, a
newer schema) may name any blob, so pruning then stops before deleting anything, naming it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from hybridflow.errors import HybridFlowError
from hybridflow.staging import blob_prefix, read_manifest, versions_prefix
from hybridflow.storage.manifest import DatasetManifest
from hybridflow.storage.objectstore import ObjectStore

logger = logging.getLogger(__name__)

MIN_KEEP = 3


class PruneRefused(HybridFlowError):
    """Pruning would be unsafe now (a manifest cannot be read); nothing was deleted."""


@dataclass(frozen=True)
class CachedVersion:
    version: str
    manifest_key: str
    created_at: float  # POSIX seconds
    files: int
    bytes: int
    created_by: str
    manifest: DatasetManifest = field(repr=False, compare=False)


@dataclass
class PruneReport:
    kept: list[str]
    versions_deleted: list[str]
    blobs_deleted: int = 0
    bytes_freed: int = 0
    blobs_kept_young: int = 0  # unreferenced but too recent to delete
    dry_run: bool = False


def _created(manifest: DatasetManifest, fallback: float | None) -> float:
    if manifest.created_at:
        try:
            return datetime.fromisoformat(manifest.created_at).timestamp()
        except ValueError:
            pass
    return fallback or 0.0


def _read_versions(store: ObjectStore, dataset: str) -> tuple[list[CachedVersion], dict[str, str]]:
    """Committed versions of ``dataset``, newest first, and the manifests that could not be read
    (key -> why)."""
    out, unreadable = [], {}
    for info in store.list(versions_prefix(dataset)):
        if not info.key.endswith(".json"):
            continue
        try:
            m = read_manifest(store, info.key)
        except Exception as exc:  # noqa: BLE001 - one bad manifest must not hide the others
            unreadable[info.key] = f"{type(exc).__name__}: {exc}"
            continue
        out.append(
            CachedVersion(
                version=m.version,
                manifest_key=info.key,
                created_at=_created(m, info.last_modified),
                files=len(m.entries),
                bytes=m.total_bytes,
                created_by=m.created_by,
                manifest=m,
            )
        )
    return sorted(out, key=lambda v: (v.created_at, v.version), reverse=True), unreadable


def list_versions(store: ObjectStore, dataset: str, *, log: Any = logger) -> list[CachedVersion]:
    """Committed versions of ``dataset`` in ``store``, newest first (unreadable manifests are skipped
    with a warning; :func:`prune_versions` refuses to run while there is one)."""
    versions, unreadable = _read_versions(store, dataset)
    for key, why in unreadable.items():
        log.warning("skipping %s: %s", key, why)
    return versions


def prune_versions(
    store: ObjectStore,
    dataset: str,
    *,
    keep: int = MIN_KEEP,
    protect_s: float = 24 * 3600.0,
    min_blob_age_s: float = 24 * 3600.0,
    dry_run: bool = False,
    now: float | None = None,
    log: Any = logger,
) -> PruneReport:
    if keep < MIN_KEEP:
        raise ValueError(f"keep={keep}: the cache keeps at least the last {MIN_KEEP} versions; use keep >= {MIN_KEEP}")
    now = time.time() if now is None else now
    versions, unreadable = _read_versions(store, dataset)
    if unreadable:
        key, why = next(iter(sorted(unreadable.items())))
        raise PruneRefused(
            f"cannot read manifest {key} ({why}){f' and {len(unreadable) - 1} more' if len(unreadable) > 1 else ''}: "
            "its version may own any blob of the cache, so nothing was pruned. Retry if the store was briefly "
            "unavailable; otherwise repair or remove that manifest, then prune again"
        )
    kept = [v for i, v in enumerate(versions) if i < keep or now - v.created_at < protect_s]
    doomed = [v for v in versions if v not in kept]
    report = PruneReport(kept=[v.version for v in kept], versions_deleted=[v.version for v in doomed], dry_run=dry_run)
    for v in doomed:
        log.info("%s version %s (%s, %d files)", "would delete" if dry_run else "deleting", v.version,
                 datetime.fromtimestamp(v.created_at).isoformat(timespec="seconds"), v.files)
        if not dry_run:
            store.delete(v.manifest_key)
    referenced = {b.key for v in kept for b in v.manifest.blobs} | {e.key for v in kept for e in v.manifest.entries}
    for info in store.list(blob_prefix(dataset)):
        if info.key in referenced:
            continue
        if info.last_modified is not None and now - info.last_modified < min_blob_age_s:
            report.blobs_kept_young += 1
            continue
        report.blobs_deleted += 1
        report.bytes_freed += info.size
        if not dry_run:
            store.delete(info.key)
    log.info(
        "%s %s: kept %d versions, %s %d versions and %d blobs (%d bytes); %d unreferenced blobs are too recent",
        "dry run for" if dry_run else "pruned", dataset, len(kept), "would delete" if dry_run else "deleted",
        len(doomed), report.blobs_deleted, report.bytes_freed, report.blobs_kept_young,
    )
    return report
