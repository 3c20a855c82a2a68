"""Where a dataset lives in a cache store (content-addressed blobs, one manifest per version), reading
a version's manifest, listing its blobs, and where a source's hash index is kept."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hybridflow.errors import StagingError
from hybridflow.staging.settings import StagingSettings
from hybridflow.storage.manifest import DatasetManifest
from hybridflow.storage.objectstore import ObjectInfo, ObjectStore, PagedListing


def blob_prefix(dataset: str) -> str:
    return f"datasets/{dataset}/blobs/"


def blob_key(dataset: str, sha256: str) -> str:
    return f"{blob_prefix(dataset)}{sha256[:2]}/{sha256}"


def versions_prefix(dataset: str) -> str:
    return f"datasets/{dataset}/versions/"


def manifest_key_for(dataset: str, version: str) -> str:
    return f"{versions_prefix(dataset)}{version}.json"


def read_manifest(store: ObjectStore, manifest_key: str) -> DatasetManifest:
    try:
        data = store.get_bytes(manifest_key)
    except FileNotFoundError as exc:
        raise StagingError(
            f"no dataset manifest at {store.uri}/{manifest_key}; run stage_data for that dataset first"
        ) from exc
    try:
        return DatasetManifest.from_json(data)
    except (ValueError, KeyError, TypeError) as exc:
        raise StagingError(
            f"dataset manifest {store.uri}/{manifest_key} is unreadable ({exc}); delete it and re-run stage_data"
        ) from exc


def list_blobs(store: ObjectStore, dataset: str, expected: int, settings: StagingSettings) -> dict[str, ObjectInfo]:
    """Every blob of ``dataset`` in ``store``, in one listing (many in parallel for big datasets:
    a fan-out prefix each, which also keeps each store directory small)."""
    prefix = blob_prefix(dataset)
    if expected < settings.fanout_list_min_blobs or not isinstance(store, PagedListing):
        return {i.key: i for i in store.list(prefix)}
    # About one full page (1000 keys) per request: 16 listings by first hex character for mid-sized
    # datasets, 256 (one per fan-out folder) for big ones.
    width = 1 if expected < 64 * settings.fanout_list_min_blobs else 2
    prefixes = [f"{prefix}{i:0{width}x}" for i in range(16**width)]
    found: dict[str, ObjectInfo] = {}
    with ThreadPoolExecutor(max_workers=settings.list_workers, thread_name_prefix="list") as pool:
        for infos in pool.map(lambda p: list(store.list(p)), prefixes):
            found.update((i.key, i) for i in infos)
    return found


def index_path_for(state_dir: Path, source_uri: str) -> Path:
    """Where the hash index of one source lives in the platform's state folder."""
    return Path(state_dir) / "staging-index" / f"{hashlib.sha256(source_uri.encode()).hexdigest()[:24]}.json"
