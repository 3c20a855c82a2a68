"""A version's manifest: its entries and blob records once every blob is in place, and the create-only
commit that makes the version readable."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from hybridflow.errors import StagingError
from hybridflow.staging.blobs import _Blob, _BlobPlan, _packed_sha
from hybridflow.staging.layout import blob_key, manifest_key_for, read_manifest
from hybridflow.storage.hashindex import HashIndex, ShardDigest
from hybridflow.storage.manifest import BlobRecord, DatasetManifest, ManifestEntry
from hybridflow.storage.objectstore import ObjectInfo, ObjectStat, ObjectStore
from hybridflow.storage.shards import Member, ShardPlan, shard_offsets
from hybridflow.storage.sources import DatasetSource, SourceFile
from hybridflow.storage.transfer import Uploaded


def _commit_version(
    name: str,
    source: DatasetSource,
    target: ObjectStore,
    classification: str,
    run_key: str,
    entries: list[ManifestEntry],
    records: dict[str, BlobRecord],
    etags: dict[str, str],
    recorded: dict[str, str],
    index: HashIndex,
    plans: list[ShardPlan],
    log: Any,
) -> tuple[str, str, bool]:
    """Commit the version's manifest; however that ends, the index keeps what verifies each blob.
    Returns the version, its manifest key and whether this call created the manifest."""
    manifest = DatasetManifest(
        dataset=name,
        entries=tuple(sorted(entries, key=lambda e: e.path)),
        blobs=tuple(sorted(records.values(), key=lambda b: b.key)),
        source_uri=source.uri,
        sensitivity=classification,
        created_by=run_key,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    manifest_key = manifest_key_for(name, manifest.version)
    stored_etags = {k: r.etag for k, r in records.items() if r.etag}
    try:
        created = _commit_manifest(target, manifest, manifest_key, recorded, entries, etags, stored_etags, log)
    finally:
        index.set_stored(target.uri, stored_etags)
        index.save(live_shards={p.members_digest for p in plans})
    return manifest.version, manifest_key, created


def _commit_manifest(target: ObjectStore, manifest: DatasetManifest, manifest_key: str, recorded: dict[str, str],
                     entries: list[ManifestEntry], etags: dict[str, str], stored_etags: dict[str, str],
                     log: Any) -> bool:
    """The commit point: the manifest is created (create-only) after every blob is in place and
    verified. True when this call created it; ``stored_etags`` gets the manifest's ETag, so an
    unchanged re-stage recognises the committed manifest from one HEAD, without reading it."""
    stat = target.stat if isinstance(target, ObjectStat) else None
    info = stat(manifest_key) if stat else None
    if info is not None and info.etag and recorded.get(manifest_key) == info.etag:
        log.info("manifest %s already committed and unchanged (ETag %s); nothing to write", manifest_key, info.etag)
        stored_etags[manifest_key] = info.etag
        return False
    created = info is None and target.put_if_absent(manifest_key, manifest.to_json())
    if created:
        log.info("committed manifest %s/%s", target.uri, manifest_key)
        info = stat(manifest_key) if stat else None
    else:
        current = read_manifest(target, manifest_key)
        if current.version != manifest.version or {(e.path, e.size, e.sha256) for e in current.entries} != {
            (e.path, e.size, e.sha256) for e in entries
        }:
            raise StagingError(
                f"manifest {target.uri}/{manifest_key} exists with different entries; it is corrupt: "
                "delete it and re-run stage_data"
            )
        missing = {e.key for e in current.entries} - set(etags)
        if missing:
            raise StagingError(
                f"manifest {target.uri}/{manifest_key} names {len(missing)} blob(s) this dataset no longer "
                f"has (e.g. {sorted(missing)[0]}); it was packed differently: delete it and re-run stage_data"
            )
        log.info("manifest %s already committed (by %s); nothing to write", manifest_key, current.created_by or "?")
    if info is not None and info.etag:
        stored_etags[manifest_key] = info.etag
    return created


def _version_contents(
    name: str,
    files: list[SourceFile],
    plan: _BlobPlan,
    existing: dict[str, ObjectInfo],
    uploaded: list[Uploaded],
    index: HashIndex,
) -> tuple[list[SourceFile], list[ManifestEntry], dict[str, BlobRecord], dict[str, str]]:
    """The version's files (every digest known now), manifest entries, blob records and ETags.

    Shards packed on the way get their final plans in ``plan.plans``."""
    plans, by_rel = plan.plans, plan.by_rel
    # The version's blobs and what verifies each of them from now on.
    etags = {k: (i.etag or "") for k, i in existing.items()}
    etags.update({u.key: u.etag for u in uploaded})
    shard_keys: dict[str, _Blob] = {}
    for blob in plan.blobs.values():
        if blob.shard is not None:
            shard_keys[blob.shard.members_digest] = blob
    hashed_late = {u.label: u.sha256 for u in uploaded if not u.label.startswith("shard:")}
    for u in uploaded:
        if u.label.startswith("shard:"):
            i = int(u.label.removeprefix("shard:"))
            plans[i] = ShardPlan(tuple(Member(m.path, m.size, by_rel[m.path].sha256 or _packed_sha(u, m.path))
                                       for m in plans[i].members))
            md = plans[i].members_digest
            shard_keys[md] = _Blob(key=u.key, size=u.size, sha256=md, md5=u.md5, shard=plans[i])
            index.record_shard(md, ShardDigest(size=u.size, sha256=md, md5=u.md5))
            hashed_late.update((m.path, m.sha256) for m in plans[i].members)
    files = [  # not dataclasses.replace, which costs ~10 us a file
        f if f.hashed else SourceFile(rel=f.rel, size=f.size, sha256=hashed_late[f.rel], md5=f.md5,
                                      identity=f.identity, mtime_ns=f.mtime_ns)
        for f in files
    ]
    entries: list[ManifestEntry] = []
    records: dict[str, BlobRecord] = {}
    for f in files:
        if f.rel in plan.packed:
            continue
        key = blob_key(name, f.sha256)
        entries.append(ManifestEntry(path=f.rel, key=key, size=f.size, sha256=f.sha256))
        records[key] = BlobRecord(key=key, size=f.size, sha256=f.sha256, etag=etags.get(key) or None)
    for shard in plans:
        blob = shard_keys[shard.members_digest]
        offsets = shard_offsets(shard)
        entries.extend(
            ManifestEntry(path=m.path, key=blob.key, size=m.size, sha256=m.sha256, offset=offsets[m.path])
            for m in shard.members
        )
        records[blob.key] = BlobRecord(
            key=blob.key, size=blob.size, sha256=blob.sha256, etag=etags.get(blob.key) or None,
            members=len(shard.members), members_digest=shard.members_digest,
        )
    return files, entries, records, etags
