"""What a version needs stored: its blobs (files of their own, shards of small files) and the upload
items that send them, hashing or packing on the way what is not known yet."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridflow.staging.layout import blob_key
from hybridflow.staging.settings import StagingSettings
from hybridflow.storage.hashindex import FileDigest, HashIndex
from hybridflow.storage.objectstore import ObjectInfo, ObjectStore
from hybridflow.storage.shards import Member, ShardPlan, build_shard, plan_shards
from hybridflow.storage.sources import DatasetSource, LocalFiles, SourceFile
from hybridflow.storage.transfer import Uploaded, UploadItem

if TYPE_CHECKING:
    from hybridflow.staging.verify import _Stager


@dataclass
class _Blob:
    """A blob this version needs: a file of its own, or a shard whose digest is known."""

    key: str
    size: int
    sha256: str
    md5: str | None
    file: SourceFile | None = None
    shard: ShardPlan | None = None



def _label(blob: _Blob) -> str:
    if blob.file is not None:
        return blob.file.rel
    return f"shard of {len(blob.shard.members)} files" if blob.shard else "?"


def _deferred_item(name: str, f: SourceFile, source: DatasetSource, index: HashIndex, md5_max: int) -> UploadItem:
    def digest() -> tuple[str, str, str | None]:
        d = source.digest(f, index, md5_max_size=md5_max)
        return blob_key(name, d.sha256), d.sha256, d.md5

    return UploadItem(
        key="", size=f.size, sha256="", md5=None, digest=digest, label=f.rel,
        read=lambda off, n, rel=f.rel: source.read(rel, off, n), readinto=_readinto(source, f.rel),
    )


def _readinto(source: DatasetSource, rel: str):
    return (lambda off, buf: source.readinto(rel, off, buf)) if isinstance(source, LocalFiles) else None


def _local_path(source: DatasetSource, rel: str) -> str | None:
    return source.local_path(rel) if isinstance(source, LocalFiles) else None


def _packed(files: list[SourceFile], settings: StagingSettings) -> set[str]:
    """The files that go into shards: the small ones, when the dataset has enough of them."""
    small = [f.rel for f in files if f.size < settings.pack_below]
    if small and (settings.pack == "always" or (settings.pack == "auto" and len(small) >= settings.pack_min_files)):
        return set(small)
    return set()


def _packed_sha(u: Uploaded, path: str) -> str:
    return u.members[path]


def _shard_item(name: str, number: int, plan: ShardPlan, source: DatasetSource, by_rel: dict[str, SourceFile],
                index: HashIndex) -> UploadItem:
    item = UploadItem(
        key="", size=plan.max_bytes, sha256="", md5=None, label=f"shard:{number}",
        metadata={"members": str(len(plan.members))}, shard=plan,
    )

    readinto = source.readinto if isinstance(source, LocalFiles) else None

    def build(buf: bytearray) -> tuple[str, memoryview, str | None, str]:
        started = time.time_ns()
        data, hashed = build_shard(
            plan, buf, read=source.read, readinto=(lambda rel, view: readinto(rel, 0, view)) if readinto else None
        )
        item.shard = hashed
        for m in hashed.members:
            f = by_rel[m.path]
            item.members[m.path] = m.sha256
            if not f.hashed:  # hashed while packed: remembered like any other file's digests
                index.record(f.rel, list(f.identity), FileDigest(size=f.size, sha256=m.sha256, md5=None), started)
        # No SHA-256 header for the shard's bytes: its name is its member list's digest, and its
        # PUT carries a CRC32C header and is checked by its ETag like any other.
        return blob_key(name, hashed.members_digest), data, None, hashlib.md5(data, usedforsecurity=False).hexdigest()

    item.build = build
    return item


@dataclass
class _BlobPlan:
    """The blobs of a version, before the target is listed."""

    packed: set[str]  # files that go into shards
    plans: list[ShardPlan]
    by_rel: dict[str, SourceFile]
    blobs: dict[str, _Blob]  # by key: the files and shards whose digests are known
    deferred: list[SourceFile]  # files sent on their own, hashed on their way up
    unknown_shards: list[int]  # plans with members not hashed yet: packed before named


def _plan_blobs(name: str, files: list[SourceFile], settings: StagingSettings, index: HashIndex) -> _BlobPlan:
    packed = _packed(files, settings)
    plans = (
        plan_shards(
            [Member(f.rel, f.size, f.sha256) for f in files if f.rel in packed],
            target_size=settings.shard_target,
            max_size=settings.shard_max,
        )
        if packed
        else []
    )
    by_rel = {f.rel: f for f in files}

    blobs: dict[str, _Blob] = {}
    deferred = [f for f in files if not f.hashed and f.rel not in packed]
    for f in files:
        if f.rel not in packed and f.hashed:
            key = blob_key(name, f.sha256)
            blobs.setdefault(key, _Blob(key=key, size=f.size, sha256=f.sha256, md5=f.md5, file=f))
    # A shard is named by its member list (paths, sizes, SHA-256s), from which its bytes follow:
    # known members give its key without packing it.
    unknown_shards: list[int] = []  # plans with members not hashed yet: packed before named
    for i, plan in enumerate(plans):
        if not plan.hashed:
            unknown_shards.append(i)
            continue
        key = blob_key(name, plan.members_digest)
        digest = index.shard(plan.members_digest)
        blobs.setdefault(key, _Blob(key=key, size=plan.packed_size, sha256=plan.members_digest,
                                    md5=digest.md5 if digest else None, shard=plan))
    return _BlobPlan(packed, plans, by_rel, blobs, deferred, unknown_shards)


def _upload_items(
    name: str,
    plan: _BlobPlan,
    stager: _Stager,
    source: DatasetSource,
    target: ObjectStore,
    existing: dict[str, ObjectInfo],
    recorded: dict[str, str],
    index: HashIndex,
    settings: StagingSettings,
    log: Any,
) -> tuple[list[UploadItem], int]:
    """What must go up (missing or bad blobs, unknown shards, deferred files) and how many stored
    blobs were found bad."""
    tuning = settings.transfer
    items: list[UploadItem] = []
    repaired = 0
    for blob in plan.blobs.values():
        problem = stager.problem(blob, existing.get(blob.key), recorded)
        if problem is None:
            continue
        if problem != "missing":
            repaired += 1
            log.warning("blob %s (%s) in %s is bad (%s); re-copying it", blob.key, _label(blob), target.uri, problem)
        if blob.file is not None:
            f = blob.file
            items.append(UploadItem(
                key=blob.key, size=f.size, sha256=f.sha256, md5=f.md5, label=f.rel,
                read=lambda off, n, rel=f.rel: source.read(rel, off, n), readinto=_readinto(source, f.rel),
                path=_local_path(source, f.rel), metadata={"sha256": f.sha256},
            ))
        else:
            items.append(_shard_item(name, plan.plans.index(blob.shard), blob.shard, source, plan.by_rel, index))
    items.extend(_shard_item(name, i, plan.plans[i], source, plan.by_rel, index) for i in plan.unknown_shards)
    # Big files hashed on the way get an MD5 too when they will go up whole (it checks the PUT).
    big = tuning.multipart_threshold
    md5_max = tuning.whole_object_max if tuning.sends_whole(f.size for f in plan.deferred) else big
    items.extend(_deferred_item(name, f, source, index, md5_max) for f in plan.deferred)
    return items, repaired
