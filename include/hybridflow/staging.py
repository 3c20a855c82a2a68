"""Stage a dataset from private storage into a cluster's object store.

Layout in the target store (see :mod:`hybridflow.storage.manifest`)::

    datasets/<name>/blobs/<sha256>            one object per distinct file content
    datasets/<name>/versions/<version>.json   the manifest, written last and create-only

Staging is resumable and idempotent: blobs already present with the right size and content are
not copied again, so re-running an unchanged stage uploads zero bytes, and a run that dies
half-way leaves no manifest, so no reader ever sees a partial version.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hybridflow.datasets import DatasetRef
from hybridflow.errors import SovereigntyError, StagingError
from hybridflow.storage.manifest import DatasetManifest, ManifestEntry
from hybridflow.storage.objectstore import ObjectInfo, ObjectStore

logger = logging.getLogger(__name__)

LOCATIONS = ("private", "public")
# Objects up to this size are re-downloaded to verify their SHA-256 when the store offers no
# usable MD5 ETag; bigger ones rely on the ETag or the sha256 metadata.
VERIFY_DOWNLOAD_MAX = 32 * 1024 * 1024
_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class StagingResult:
    dataset: str
    version: str
    manifest_key: str
    store_uri: str
    objects_total: int
    objects_copied: int
    bytes_copied: int  # blob bytes uploaded by this run (the manifest is not counted)
    seconds: float

    def to_xcom(self) -> dict[str, Any]:
        body = asdict(self)
        body["seconds"] = round(self.seconds, 3)
        return body


@dataclass(frozen=True)
class _LocalFile:
    path: Path
    rel: str
    size: int
    sha256: str
    md5: str


def blob_prefix(dataset: str) -> str:
    return f"datasets/{dataset}/blobs/"


def manifest_key_for(dataset: str, version: str) -> str:
    return f"datasets/{dataset}/versions/{version}.json"


def check_sovereignty(sensitivity: str, target_location: str, dataset: str = "") -> None:
    """Raise unless data of ``sensitivity`` may be copied to a ``target_location`` store."""
    if target_location not in LOCATIONS:
        raise StagingError(
            f"target_location {target_location!r} is unknown; use one of {', '.join(LOCATIONS)}"
        )
    if sensitivity.strip().lower() == "restricted" and target_location != "private":
        what = f"dataset {dataset!r}" if dataset else "the dataset"
        raise SovereigntyError(
            f"{what} is restricted and the target store is {target_location}: restricted data never "
            "leaves private storage; choose a private cluster (location: private) for this run"
        )


def hash_file(path: Path) -> tuple[int, str, str]:
    """(size, sha256, md5) of ``path`` in one streaming pass. MD5 only to compare with S3 ETags."""
    sha, md5, size = hashlib.sha256(), hashlib.md5(usedforsecurity=False), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            sha.update(chunk)
            md5.update(chunk)
            size += len(chunk)
    return size, sha.hexdigest(), md5.hexdigest()


def _scan(folder: Path) -> list[_LocalFile]:
    files = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        # Dot-files and *.part are in-flight writes (see seed_digits), not dataset content.
        if not path.is_file() or any(p.startswith(".") for p in rel.split("/")) or path.suffix == ".part":
            continue
        before = path.stat().st_size
        size, sha, md5 = hash_file(path)
        if size != before:
            raise StagingError(f"{path} changed while it was being hashed; stop writers and re-run staging")
        files.append(_LocalFile(path=path, rel=rel, size=size, sha256=sha, md5=md5))
    return files


def _is_md5(etag: str) -> bool:
    return len(etag) == 32 and all(c in "0123456789abcdef" for c in etag)


def _sha256_of_object(store: ObjectStore, key: str, size: int) -> str:
    if size <= VERIFY_DOWNLOAD_MAX:
        return hashlib.sha256(store.get_bytes(key)).hexdigest()
    with tempfile.TemporaryDirectory(prefix="hf-verify-") as tmp:
        path = Path(tmp) / "blob"
        store.get_file(key, path)
        return hash_file(path)[1]


def _blob_problem(store: ObjectStore, key: str, want: _LocalFile, info: ObjectInfo | None) -> str | None:
    """Why the stored blob is unusable, or None when it holds exactly ``want``'s bytes."""
    if info is None:
        return "missing"
    if info.size != want.size:
        return f"size {info.size} bytes, expected {want.size}"
    etag = (info.etag or "").strip('"').lower()
    if _is_md5(etag) and etag == want.md5:
        return None  # a single-part (or rclone) ETag is the MD5 of the stored bytes
    # No ETag (local folder), a multipart ETag, or an MD5 mismatch (corruption, or SSE-KMS whose
    # ETag is not the MD5): settle it with the SHA-256.
    if (_is_md5(etag) and etag != want.md5) or info.size <= VERIFY_DOWNLOAD_MAX:
        return None if _sha256_of_object(store, key, info.size) == want.sha256 else "content differs (sha256)"
    metadata = getattr(store, "metadata", None)
    if metadata is not None:
        recorded = metadata(key).get("sha256")
        if recorded and recorded != want.sha256:
            return "sha256 metadata differs"
    return None


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


def stage_dataset(
    dataset: DatasetRef,
    target: ObjectStore,
    *,
    sensitivity: str,
    target_location: str,
    run_key: str,
    log: Any = logger,
) -> StagingResult:
    """Copy ``dataset`` into ``target`` as content-addressed blobs plus a manifest written last."""
    # Before anything touches the target: restricted data must not even start to move.
    check_sovereignty(sensitivity, target_location, dataset.name)
    started = time.monotonic()
    name = dataset.name

    files = _scan(dataset.path)
    if not files:
        raise StagingError(f"dataset folder {dataset.path} ({dataset.uri}) holds no files; nothing to stage")
    entries = tuple(
        ManifestEntry(path=f.rel, key=f"{blob_prefix(name)}{f.sha256}", size=f.size, sha256=f.sha256)
        for f in files
    )
    manifest = DatasetManifest(
        dataset=name, entries=entries, source_uri=dataset.uri, sensitivity=sensitivity, created_by=run_key
    )
    version = manifest.version
    manifest_key = manifest_key_for(name, version)
    log.info(
        "staging %s version %s (%d files, %d bytes) to %s for run %s",
        name,
        version,
        len(files),
        manifest.total_bytes,
        target.uri,
        run_key,
    )

    # One listing for the whole dataset, not a HEAD per file.
    existing = {info.key: info for info in target.list(blob_prefix(name))}
    blobs: dict[str, _LocalFile] = {}
    for f in files:
        blobs.setdefault(f"{blob_prefix(name)}{f.sha256}", f)

    to_copy: list[tuple[str, _LocalFile]] = []
    for key, f in blobs.items():
        problem = _blob_problem(target, key, f, existing.get(key))
        if problem is None:
            log.info("blob %s (%s, %d bytes) already staged and verified", f.sha256[:12], f.rel, f.size)
            continue
        if problem != "missing":
            log.warning(
                "blob %s (%s) in %s is bad (%s); re-copying it", f.sha256[:12], f.rel, target.uri, problem
            )
        to_copy.append((key, f))

    bytes_copied = 0
    for i, (key, f) in enumerate(to_copy, 1):
        try:
            target.put_file(key, f.path, metadata={"sha256": f.sha256})
        except Exception as exc:
            raise StagingError(
                f"uploading {f.rel} to {target.uri}/{key} failed ({exc}); no manifest was written, "
                "re-run stage_data to resume (blobs already copied are kept)"
            ) from exc
        bytes_copied += f.size
        log.info("uploaded %d/%d %s (%d bytes) -> %s", i, len(to_copy), f.rel, f.size, key)

    if to_copy:
        after = {info.key: info for info in target.list(blob_prefix(name))}
        for key, f in to_copy:
            problem = _blob_problem(target, key, f, after.get(key))
            if problem is not None:
                target.delete(key)  # never leave a wrong object under a content address
                raise StagingError(
                    f"uploaded {f.rel} to {target.uri}/{key} but it does not verify ({problem}); "
                    "was the file modified during staging? re-run stage_data"
                )
        log.info("verified %d uploaded blob(s)", len(to_copy))

    # The commit point: create-only, after every blob is in place and verified.
    if target.put_if_absent(manifest_key, manifest.to_json()):
        log.info("committed manifest %s/%s", target.uri, manifest_key)
    else:
        current = read_manifest(target, manifest_key)
        if sorted(current.entries, key=lambda e: e.path) != sorted(entries, key=lambda e: e.path):
            raise StagingError(
                f"manifest {target.uri}/{manifest_key} exists with different entries; it is corrupt: "
                "delete it and re-run stage_data"
            )
        log.info(
            "manifest %s already committed (by %s); nothing to write", manifest_key, current.created_by or "?"
        )

    result = StagingResult(
        dataset=name,
        version=version,
        manifest_key=manifest_key,
        store_uri=target.uri,
        objects_total=len(entries),
        objects_copied=len(to_copy),
        bytes_copied=bytes_copied,
        seconds=time.monotonic() - started,
    )
    log.info(
        "staged %s version %s: %d/%d objects copied, %d bytes, %.2fs",
        name,
        version,
        result.objects_copied,
        result.objects_total,
        result.bytes_copied,
        result.seconds,
    )
    return result
