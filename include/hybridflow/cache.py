"""A cloud cache's dataset versions, and pruning the old ones: the one place that deletes from it.

Staging only ever adds (:mod:`hybridflow.staging`), so every committed version stays readable
until an operator prunes. Pruning keeps the newest ``keep`` versions (at least three) and any
version younger than ``protect_s`` (a run may still be reading it), deletes the other manifests
first, so no reader can find a version whose blobs are going, and then deletes blobs no kept
version names, but only those older than ``min_blob_age_s``: a stage still in flight has
uploaded blobs that no manifest names yet. A manifest that cannot be read (a transient error, a
newer schema) may name any blob, so pruning then stops before deleting anything, naming it.

Two things are never pruned, whatever their age: the store of a ``role: dr`` cluster (it holds the
disaster-recovery replicas a takeover reads, in the same layout, add-only), and a version a live run
pins, on any cluster (:func:`live_pins`): the age rule cannot tell that a run still reads it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from hybridflow.errors import HybridFlowError
from hybridflow.staging import blob_prefix, read_manifest, versions_prefix
from hybridflow.storage.manifest import DatasetManifest
from hybridflow.storage.objectstore import ObjectStore

logger = logging.getLogger(__name__)

MIN_KEEP = 3
STAGING_FILE = "staging.json"  # in a run's folder: what stage_data staged for it (dataset, version, store)


class PruneRefused(HybridFlowError):
    """Pruning would be unsafe now (a manifest cannot be read); nothing was deleted."""


def refuse_dr_cluster(estate: Any, cluster_name: str) -> None:
    """PruneRefused when ``cluster_name`` is a disaster-recovery cluster: its store is never pruned."""
    cluster = estate.clusters.get(cluster_name)
    if cluster is None or not cluster.is_dr:
        return
    others = ", ".join(sorted(n for n, c in estate.clusters.items() if c.cache and not c.is_dr)) or "none"
    raise PruneRefused(
        f"--cluster {cluster_name} has role: dr: its store holds the disaster-recovery replicas a takeover reads "
        "(dataset versions in the same layout as a cache, kept add-only by dr_replication, docs/disaster-recovery.md), "
        f"so it is never pruned and nothing was deleted. Prune the cache of a cluster that stages data instead: {others}")


def _running(run: Path) -> bool:
    from hybridflow.training.attempts import ATTEMPTS_FILE, read_attempts

    try:
        attempts = read_attempts(run / ATTEMPTS_FILE)
    except (OSError, ValueError):
        return True  # cannot tell: kept as live, pruning never deletes on doubt
    return bool(attempts) and isinstance(attempts[-1], dict) and attempts[-1].get("outcome") == "running"


def live_pins(private_root: Path, dataset: str, *, recent_s: float, now: float) -> dict[str, list[str]]:
    """``{version: [run_key, ...]}``: the versions of ``dataset`` that live runs pin, whatever cluster
    they run on: the version validate_data pinned (``dataset-version.json``) and the one stage_data
    staged (``staging.json``). A run is live while its newest training attempt is running, or while
    anything in its folder changed less than ``recent_s`` ago (it is validating, staging, waiting for
    room, or between two tries). A live run's pin that cannot be read refuses the prune."""
    from hybridflow.datasets import DatasetVersion
    from hybridflow.rundata import VERSION_FILE

    pins: dict[str, list[str]] = {}
    for run in sorted((Path(private_root) / "runs").glob("*/")):
        files = [f for f in run.iterdir() if f.is_file()]
        if not (_running(run) or any(now - f.stat().st_mtime < recent_s for f in files)):
            continue
        for name in (VERSION_FILE, STAGING_FILE):
            path = run / name
            if not path.is_file():
                continue
            try:
                if name == VERSION_FILE:
                    manifest = DatasetVersion.from_json(path.read_bytes()).manifest
                    got = (manifest.dataset, manifest.version)
                else:
                    body = json.loads(path.read_bytes())
                    got = (body["dataset"], body["version"])
            except Exception as exc:  # noqa: BLE001 - any unreadable pin: which version it holds is unknown
                raise PruneRefused(
                    f"cannot read {path} ({type(exc).__name__}: {exc}), the pin of run {run.name}, which is live: it "
                    "may pin any version, so nothing was pruned. Repair the file or wait for the run to end, then "
                    "prune again") from exc
            if got[0] == dataset:
                pins.setdefault(str(got[1]), []).append(run.name)
    return {v: sorted(set(r)) for v, r in pins.items()}


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
    pinned: dict[str, list[str]] = field(default_factory=dict)  # version kept -> the live runs that pin it
    blobs_deleted: int = 0
    bytes_freed: int = 0
    blobs_kept_young: int = 0  # unreferenced but too recent to delete
    dry_run: bool = False

    def summary(self) -> str:
        """What ``hybridflow cache prune`` prints: the counts, then each version a live run kept."""
        verb = "would delete" if self.dry_run else "deleted"
        lines = [f"kept {len(self.kept)} versions; {verb} {len(self.versions_deleted)} versions and "
                 f"{self.blobs_deleted} blobs ({self.bytes_freed} bytes)"]
        lines += [f"kept {v}: pinned by live run {', '.join(runs)}" for v, runs in sorted(self.pinned.items())]
        return "\n".join(lines)


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
    pinned: Mapping[str, Collection[str]] | None = None,
    log: Any = logger,
) -> PruneReport:
    """Delete the old versions of ``dataset`` (see the module doc); ``pinned`` (version -> the live
    runs pinning it, :func:`live_pins`) are kept whatever their age."""
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
    pinned = pinned or {}
    kept = [v for i, v in enumerate(versions) if i < keep or now - v.created_at < protect_s or v.version in pinned]
    doomed = [v for v in versions if v not in kept]
    report = PruneReport(kept=[v.version for v in kept], versions_deleted=[v.version for v in doomed], dry_run=dry_run,
                         pinned={v.version: sorted(pinned[v.version]) for v in kept if v.version in pinned})
    for version, runs in sorted(report.pinned.items()):
        log.info("keeping version %s: pinned by live run %s", version, ", ".join(runs))
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


def prune_cluster(estate: Any, cluster_name: str, store: ObjectStore, dataset: str, *, private_root: Path,
                  keep: int = MIN_KEEP, protect_s: float = 24 * 3600.0, min_blob_age_s: float = 24 * 3600.0,
                  dry_run: bool = False, now: float | None = None, log: Any = logger) -> PruneReport:
    """``hybridflow cache prune``: never on a DR cluster, and never a version a live run pins."""
    refuse_dr_cluster(estate, cluster_name)
    now = time.time() if now is None else now
    pins = live_pins(private_root, dataset, recent_s=protect_s, now=now)
    return prune_versions(store, dataset, keep=keep, protect_s=protect_s, min_blob_age_s=min_blob_age_s,
                          dry_run=dry_run, now=now, pinned=pins, log=log)
