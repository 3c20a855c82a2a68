"""Dataset manifests: the commit record of one staged dataset version.

Objects are stored content-addressed (``datasets/<name>/blobs/<ab>/<sha256>``, fanned out by the
first two hex characters so no store directory holds more than a few thousand keys), so an unchanged
file is never copied twice and a version can never be half-overwritten. Small files may be packed
into shards (tar files, themselves blobs); each file keeps its own size and SHA-256, so integrity
stays per sample. The manifest (``datasets/<name>/versions/<version>.json``) lists every file and
every blob and is written last, create-only: a reader that finds a manifest finds every object it
names.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property

from hybridflow.errors import StagingError

MANIFEST_FORMAT = "hybridflow.dataset-manifest/v2"
_READABLE_FORMATS = ("hybridflow.dataset-manifest/v1", MANIFEST_FORMAT)


@dataclass(frozen=True)
class ManifestEntry:
    """One file of the dataset: either a blob of its own (``key``) or a member of a shard
    (``key`` is then the shard's blob and ``offset`` where the file's bytes start in it)."""

    path: str  # relative path inside the dataset folder, e.g. "train.csv"
    key: str  # object key relative to the store, e.g. "datasets/claims/blobs/ab/<sha256>"
    size: int
    sha256: str
    offset: int | None = None  # set for shard members

    @property
    def in_shard(self) -> bool:
        return self.offset is not None


@dataclass(frozen=True)
class BlobRecord:
    """One stored object of the version, with what verifies it without downloading it:
    ``etag`` as the store listed it right after a verified upload (an MD5 for single-part
    objects on every S3 store; for multipart ones whatever the store reports)."""

    key: str
    size: int
    sha256: str
    etag: str | None = None
    members: int = 0  # files packed in it; 0 for a plain file blob
    members_digest: str | None = None  # identity of a shard's member list (paths, sizes, digests)


@dataclass(frozen=True)
class DatasetManifest:
    dataset: str
    entries: tuple[ManifestEntry, ...]
    blobs: tuple[BlobRecord, ...] = ()
    source_uri: str = ""
    sensitivity: str = "internal"
    created_by: str = ""
    created_at: str = ""
    format: str = field(default=MANIFEST_FORMAT)

    @cached_property
    def version(self) -> str:
        """Content identity: the same files give the same version, whoever staged them and however
        they are packed."""
        digest = hashlib.sha256()
        for e in sorted(self.entries, key=lambda e: e.path):
            digest.update(f"{e.path}\0{e.size}\0{e.sha256}\n".encode())
        return digest.hexdigest()[:20]

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries)

    def entry(self, path: str) -> ManifestEntry:
        for e in self.entries:
            if e.path == path:
                return e
        raise StagingError(f"dataset {self.dataset!r} version {self.version} has no file {path!r}")

    def to_json(self) -> bytes:
        # Built by hand: dataclasses.asdict deep-copies every field, seconds for 100k entries.
        entries = []
        for e in self.entries:
            row = {"key": e.key, "path": e.path, "sha256": e.sha256, "size": e.size}
            if e.offset is not None:
                row["offset"] = e.offset
            entries.append(row)
        blobs = []
        for b in self.blobs:
            row = {"etag": b.etag, "key": b.key, "sha256": b.sha256, "size": b.size}
            if b.members:
                row["members"], row["members_digest"] = b.members, b.members_digest
            blobs.append(row)
        body = {
            "dataset": self.dataset, "entries": entries, "blobs": blobs, "source_uri": self.source_uri,
            "sensitivity": self.sensitivity, "created_by": self.created_by, "created_at": self.created_at,
            "format": self.format, "version": self.version,
        }
        # Compact: a 100k-file manifest stays a few MB.
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> DatasetManifest:
        body = json.loads(data)
        if body.get("format") not in _READABLE_FORMATS:
            raise StagingError(f"unknown manifest format {body.get('format')!r}; expected {MANIFEST_FORMAT}")
        entries = tuple(ManifestEntry(**e) for e in body["entries"])
        blobs = tuple(BlobRecord(**b) for b in body.get("blobs", ()))
        if not blobs:  # v1: one blob per entry, nothing recorded about it
            blobs = tuple({e.key: BlobRecord(key=e.key, size=e.size, sha256=e.sha256) for e in entries}.values())
        manifest = cls(
            dataset=body["dataset"],
            entries=entries,
            blobs=blobs,
            source_uri=body.get("source_uri", ""),
            sensitivity=body.get("sensitivity", "internal"),
            created_by=body.get("created_by", ""),
            created_at=body.get("created_at", ""),
        )
        if body.get("version") and body["version"] != manifest.version:
            raise StagingError(f"manifest for {manifest.dataset!r} is inconsistent: version does not match entries")
        return manifest


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch_verified(store, entry: ManifestEntry) -> bytes:
    """Read one staged file (a blob, or its byte range in a shard) and check it against its entry."""
    if entry.in_shard:
        data = store.get_range(entry.key, entry.offset, entry.size)
    else:
        data = store.get_bytes(entry.key)
    if len(data) != entry.size or sha256_bytes(data) != entry.sha256:
        raise StagingError(
            f"staged object {entry.key} for {entry.path!r} is corrupt "
            f"(size {len(data)} vs {entry.size}); re-run stage_data to re-copy it"
        )
    return data
