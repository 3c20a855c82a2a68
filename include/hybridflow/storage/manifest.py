"""Dataset manifests: the commit record of one staged dataset version.

Objects are stored content-addressed (``<prefix>/blobs/<sha256>``) so an unchanged file is never
copied twice and a version can never be half-overwritten. The manifest
(``<prefix>/versions/<version>.json``) lists every file with its size and SHA-256 and is written
last, create-only: a reader that finds a manifest finds every object it names.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

from hybridflow.errors import StagingError

MANIFEST_FORMAT = "hybridflow.dataset-manifest/v1"


@dataclass(frozen=True)
class ManifestEntry:
    path: str  # relative path inside the dataset folder, e.g. "train.csv"
    key: str  # object key relative to the store, e.g. "datasets/digits/blobs/<sha256>"
    size: int
    sha256: str


@dataclass(frozen=True)
class DatasetManifest:
    dataset: str
    entries: tuple[ManifestEntry, ...]
    source_uri: str = ""
    sensitivity: str = "internal"
    created_by: str = ""
    format: str = field(default=MANIFEST_FORMAT)

    @property
    def version(self) -> str:
        """Content identity: the same files give the same version, whoever staged them."""
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
        body = asdict(self)
        body["version"] = self.version
        return json.dumps(body, indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> DatasetManifest:
        body = json.loads(data)
        if body.get("format") != MANIFEST_FORMAT:
            raise StagingError(f"unknown manifest format {body.get('format')!r}; expected {MANIFEST_FORMAT}")
        manifest = cls(
            dataset=body["dataset"],
            entries=tuple(ManifestEntry(**e) for e in body["entries"]),
            source_uri=body.get("source_uri", ""),
            sensitivity=body.get("sensitivity", "internal"),
            created_by=body.get("created_by", ""),
        )
        if body.get("version") and body["version"] != manifest.version:
            raise StagingError(f"manifest for {manifest.dataset!r} is inconsistent: version does not match entries")
        return manifest


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch_verified(store, entry: ManifestEntry) -> bytes:
    """Read one staged object and check it against its manifest entry."""
    data = store.get_bytes(entry.key)
    if len(data) != entry.size or sha256_bytes(data) != entry.sha256:
        raise StagingError(
            f"staged object {entry.key} for {entry.path!r} is corrupt "
            f"(size {len(data)} vs {entry.size}); re-run stage_data to re-copy it"
        )
    return data
