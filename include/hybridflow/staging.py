"""Stage a dataset from private storage into a cluster's cloud cache.

Layout in the target store (see :mod:`hybridflow.storage.manifest`)::

    datasets/<name>/blobs/<ab>/<sha256>        one object per distinct file (or shard of small files)
    datasets/<name>/versions/<version>.json    the manifest, written last and create-only

How a stage runs:

1. the sovereignty guard (:mod:`hybridflow.sovereignty`, reading the catalogue itself): restricted
   data never starts towards a public store, region-limited data never leaves its regions;
2. the source is listed once; digests of unchanged files come from the hash index, so only new or
   changed files are read;
3. the target's blobs are listed once (in parallel over the 256 fan-out prefixes for big
   datasets); a blob is reused when its size and listed ETag match what was verified when it was
   uploaded, so an unchanged dataset costs no per-object request and no object bytes, and a
   corrupted cached blob is noticed and re-copied;
4. what is missing or bad is uploaded in parallel with per-request checksums (see
   :mod:`hybridflow.storage.transfer`), big files in resumable multipart uploads;
5. the manifest is created last (create-only), so no reader ever sees a partial version.

Staging only adds: it never deletes from the cache, so earlier versions stay readable; pruning
old versions is the separate, explicit :func:`hybridflow.cache.prune_versions`.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from hybridflow.errors import StagingError
from hybridflow.sovereignty import Destination, check_sovereignty
from hybridflow.storage.hashindex import FileDigest, HashIndex, ShardDigest
from hybridflow.storage.manifest import BlobRecord, DatasetManifest, ManifestEntry
from hybridflow.storage.objectstore import ObjectInfo, ObjectStore
from hybridflow.storage.shards import Member, ShardPlan, build_shard, iter_members, plan_shards, shard_offsets
from hybridflow.storage.sources import DatasetSource, SourceFile
from hybridflow.storage.transfer import TransferProgress, TransferSettings, Uploaded, Uploader, UploadItem

logger = logging.getLogger(__name__)

_MiB = 1024 * 1024
# A blob the listing cannot vouch for (no usable ETag recorded) is re-read to check its SHA-256.
VERIFY_DOWNLOAD_MAX = 256 * _MiB


@dataclass(frozen=True)
class StagingSettings:
    transfer: TransferSettings = field(default_factory=TransferSettings)
    pack: Literal["auto", "always", "never"] = "auto"
    pack_below: int = 1 * _MiB  # files smaller than this may be packed into shards
    pack_min_files: int = 256  # "auto" packs only datasets with at least this many small files
    shard_target: int = 32 * _MiB
    shard_max: int = 64 * _MiB
    hash_workers: int = 2
    list_workers: int = 8
    fanout_list_min_blobs: int = 2000  # from this many blobs on, list fan-out prefixes in parallel

    @classmethod
    def from_config(cls, cfg) -> StagingSettings:
        """From pipeline.yaml's ``staging`` section (:class:`hybridflow.config.StagingConfig`)."""
        return cls(
            transfer=TransferSettings(
                workers=cfg.workers,
                multipart_threshold=cfg.multipart_threshold_mib * _MiB,
                part_size=cfg.part_size_mib * _MiB,
                max_inflight_bytes=cfg.max_inflight_mib * _MiB,
                sha256_header=cfg.sha256_header,
                crt=cfg.crt,
                progress_every_s=cfg.progress_every_s,
                abandoned_upload_age_s=cfg.abandoned_upload_age_h * 3600.0,
            ),
            pack=cfg.pack_small_files,
            pack_below=cfg.pack_below_kib * 1024,
            pack_min_files=cfg.pack_min_files,
            shard_target=cfg.shard_target_mib * _MiB,
            shard_max=cfg.shard_max_mib * _MiB,
        )

    def __post_init__(self) -> None:
        if self.shard_max > self.transfer.multipart_threshold:
            raise ValueError("staging shard_max must not exceed the multipart threshold (a shard goes up in one request)")


@dataclass(frozen=True)
class StagingResult:
    dataset: str
    version: str
    manifest_key: str
    store_uri: str
    objects_total: int  # files in the dataset version
    objects_copied: int  # blobs uploaded by this run (files or shards; the manifest is not counted)
    bytes_copied: int  # blob bytes uploaded by this run
    seconds: float
    blobs_total: int = 0
    files_packed: int = 0  # files stored inside shards
    shards: int = 0
    repaired: int = 0  # cached blobs found corrupt and copied again
    resumed_parts: int = 0  # multipart parts an interrupted earlier run had already sent
    files_read: int = 0  # files hashed by this run (the others' digests came from the index)
    manifest_created: bool = True

    def to_xcom(self) -> dict[str, Any]:
        body = asdict(self)
        body["seconds"] = round(self.seconds, 3)
        return body


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
    if expected < settings.fanout_list_min_blobs or not hasattr(store, "client"):
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


def _is_md5(etag: str) -> bool:
    return len(etag) == 32 and not etag.strip("0123456789abcdef")


@dataclass
class _Blob:
    """A blob this version needs: a file of its own, or a shard whose digest is known."""

    key: str
    size: int
    sha256: str
    md5: str | None
    file: SourceFile | None = None
    shard: ShardPlan | None = None


class _Stager:
    def __init__(self, source: DatasetSource, target: ObjectStore, settings: StagingSettings, log: Any,
                 index: HashIndex) -> None:
        self.source, self.target, self.settings, self.log, self.index = source, target, settings, log, index
        self.name = source.name
        self._previous: DatasetManifest | None | bool = False  # False: not looked up yet
        self.repaired = 0  # bad blobs found only once built or hashed on the way (see stored)
        self.lock = threading.Lock()

    # -- what was verified before ------------------------------------------------------------------
    def previous_manifest(self) -> DatasetManifest | None:
        """The newest committed manifest of this dataset in the target (read at most once)."""
        if self._previous is False:
            versions = sorted(self.target.list(versions_prefix(self.name)), key=lambda i: i.last_modified or 0)
            self._previous = None
            for info in reversed(versions):
                try:
                    self._previous = read_manifest(self.target, info.key)
                    break
                except StagingError as exc:
                    self.log.warning("ignoring %s", exc)
        return self._previous or None


    def recorded_etag(self, key: str, recorded: dict[str, str]) -> str | None:
        if key in recorded:
            return recorded[key]
        prev = self.previous_manifest()
        if prev is not None:
            for b in prev.blobs:
                if b.etag:
                    recorded.setdefault(b.key, b.etag)
        return recorded.get(key)

    # -- checks ------------------------------------------------------------------------------------
    def problem(self, blob: _Blob, info: ObjectInfo | None, recorded: dict[str, str]) -> str | None:
        """Why the stored blob is unusable, or None when it holds exactly the wanted bytes."""
        if info is None:
            return "missing"
        if info.size != blob.size:
            return f"size {info.size} bytes, expected {blob.size}"
        etag = (info.etag or "").strip('"').lower()
        if etag and blob.md5 and _is_md5(etag):
            return None if etag == blob.md5 else "content differs (MD5)"
        known = self.recorded_etag(blob.key, recorded)
        if etag and known:
            return None if etag == known.lower() else f"ETag {etag} differs from {known} recorded at upload"
        # Nothing to compare with (a folder store, or a blob from another machine): settle it with
        # the stored bytes (a shard: every member's SHA-256 at its offset).
        if blob.shard is not None:
            return None if self._shard_ok(blob) else "a packed file differs (SHA-256)"
        if info.size > VERIFY_DOWNLOAD_MAX and etag:
            self.log.warning("blob %s: no recorded ETag to check; trusting its size", blob.key)
            return None
        return None if self._stored_sha256(blob.key, info.size) == blob.sha256 else "content differs (SHA-256)"

    def _shard_ok(self, blob: _Blob) -> bool:
        offsets = shard_offsets(blob.shard)
        expected = {m.path: (offsets[m.path], m.size, m.sha256) for m in blob.shard.members}
        try:
            for _ in iter_members(self.target.get_bytes(blob.key), expected):
                pass
        except StagingError:
            return False
        return True

    def _stored_sha256(self, key: str, size: int) -> str:
        sha = hashlib.sha256()
        step = 16 * _MiB
        for start in range(0, size, step):
            sha.update(self.target.get_range(key, start, min(step, size - start)))
        return sha.hexdigest()

    def stored(self, existing: dict[str, ObjectInfo], recorded: dict[str, str]):
        """For built shards: the ETag if ``key`` is already stored with these bytes."""

        def check(key: str, sha256: str, md5: str | None, shard: ShardPlan | None = None) -> str | None:
            info = existing.get(key)
            if info is None:
                return None
            blob = _Blob(key=key, size=info.size, sha256=sha256, md5=md5, shard=shard)
            problem = self.problem(blob, info, recorded)
            if problem is None:
                return info.etag or md5
            with self.lock:
                self.repaired += 1
            self.log.warning("blob %s in %s is bad (%s); re-copying it", key, self.target.uri, problem)
            return None

        return check


def index_path_for(state_dir: Path, source_uri: str) -> Path:
    """Where the hash index of one source lives in the platform's state folder."""
    return Path(state_dir) / "staging-index" / f"{hashlib.sha256(source_uri.encode()).hexdigest()[:24]}.json"


def stage_dataset(
    source: DatasetSource,
    target: ObjectStore,
    *,
    destination: Destination,
    catalogue: Path,
    run_key: str,
    dataset: str | None = None,
    raised: str | None = None,
    settings: StagingSettings | None = None,
    index_path: Path | None = None,
    log: Any = logger,
) -> StagingResult:
    """Copy ``source`` into ``target`` as content-addressed blobs plus a manifest written last.

    ``dataset`` is the source's name in the catalogue file ``catalogue`` (default: the source's
    name); the guard reads its classification and regions there, stricter if the run ``raised`` it,
    against ``destination``. ``index_path`` keeps file digests between runs (see :class:`HashIndex`);
    without it every file is read again.
    """
    if dataset is not None and dataset != source.name:
        # The guard must judge the data that is copied: its objects are stored under the source's name.
        raise StagingError(f"the source is named {source.name!r} but the catalogue entry checked is {dataset!r}; "
                           "stage a dataset under its catalogue name")
    # Before anything touches the target: data the catalogue keeps away from it must not even start.
    classification = check_sovereignty(dataset or source.name, destination, catalogue=catalogue, raised=raised)
    settings = settings or StagingSettings()
    started = time.monotonic()
    name = source.name
    index = HashIndex(index_path)
    tuning = settings.transfer
    # Files the index does not know are read once: big ones are hashed on their way up (their
    # parts start moving as soon as each file is hashed), small ones going into shards while they
    # are packed; only files sent on their own are hashed in the scan.
    big = tuning.multipart_threshold
    # A dataset staged before (the index knows its files) is listed in the target while the source
    # is scanned: on a re-stage both take seconds, and neither needs the other. A first stage lists
    # after the scan, which tells how many blobs to expect (and so how to fan the listing out).
    background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="list-early")
    early = (
        background.submit(list_blobs, target, name, index.file_count, settings)
        if index.file_count >= settings.fanout_list_min_blobs
        else None
    )
    try:
        # MD5s of big files the index knows are kept: one sent whole is checked by it.
        files = source.scan(
            index, md5_max_size=tuning.whole_object_max, workers=settings.hash_workers,
            defer=lambda fs: {f.rel for f in fs if f.size > big} | _packed(fs, settings),
        )
    except BaseException:
        background.shutdown(wait=False, cancel_futures=True)
        raise
    background.shutdown(wait=False)
    if not files:
        raise StagingError(f"dataset {source.uri} holds no files; nothing to stage")
    log.info(
        "scanned %s: %d files, %d bytes (%d digests reused, %d files read)",
        source.uri, len(files), sum(f.size for f in files), index.hits, index.misses,
    )
    stager = _Stager(source, target, settings, log, index)

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

    # One listing for the whole dataset, not a HEAD per file.
    expected = len(blobs) + len(unknown_shards) + len(deferred)
    existing = early.result() if early is not None else list_blobs(target, name, expected, settings)
    recorded = index.stored_etags(target.uri)
    items: list[UploadItem] = []
    repaired = 0
    for blob in blobs.values():
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
            items.append(_shard_item(name, plans.index(blob.shard), blob.shard, source, by_rel, index))
    items.extend(_shard_item(name, i, plans[i], source, by_rel, index) for i in unknown_shards)
    # Big files hashed on the way get an MD5 too when they will go up whole (it checks the PUT).
    md5_max = tuning.whole_object_max if tuning.sends_whole(f.size for f in deferred) else big
    items.extend(_deferred_item(name, f, source, index, md5_max) for f in deferred)

    uploaded: list[Uploaded] = []
    if items:
        total = sum(i.size for i in items)
        log.info("uploading up to %d of %d blobs (%d bytes) to %s", len(items),
                 len(blobs) + len(unknown_shards) + len(deferred), total, target.uri)
        progress = TransferProgress(total, len(items), every_s=tuning.progress_every_s, log=log, what=f"staging {name}")
        try:
            uploaded = Uploader(target, tuning, log=log).upload(
                items, uploads_prefix=blob_prefix(name), progress=progress, stored=stager.stored(existing, recorded)
            )
        except Exception as exc:
            index.save()  # digests are still valid: a resumed run does not re-read the files
            raise StagingError(
                f"uploading {name} to {target.uri} failed ({type(exc).__name__}: {exc}); no manifest was "
                "written, re-run stage_data to resume (blobs already copied are kept)"
            ) from exc
        log.info(progress.line())

    # The version's blobs and what verifies each of them from now on.
    etags = {k: (i.etag or "") for k, i in existing.items()}
    etags.update({u.key: u.etag for u in uploaded})
    shard_keys: dict[str, _Blob] = {}
    for blob in blobs.values():
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
        if f.rel in packed:
            continue
        key = blob_key(name, f.sha256)
        entries.append(ManifestEntry(path=f.rel, key=key, size=f.size, sha256=f.sha256))
        records[key] = BlobRecord(key=key, size=f.size, sha256=f.sha256, etag=etags.get(key) or None)
    for plan in plans:
        blob = shard_keys[plan.members_digest]
        offsets = shard_offsets(plan)
        entries.extend(
            ManifestEntry(path=m.path, key=blob.key, size=m.size, sha256=m.sha256, offset=offsets[m.path])
            for m in plan.members
        )
        records[blob.key] = BlobRecord(
            key=blob.key, size=blob.size, sha256=blob.sha256, etag=etags.get(blob.key) or None,
            members=len(plan.members), members_digest=plan.members_digest,
        )

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

    result = StagingResult(
        dataset=name,
        version=manifest.version,
        manifest_key=manifest_key,
        store_uri=target.uri,
        objects_total=len(files),
        objects_copied=sum(1 for u in uploaded if u.bytes_sent or u.parts),
        bytes_copied=sum(u.bytes_sent for u in uploaded),
        seconds=time.monotonic() - started,
        blobs_total=len(records),
        files_packed=len(packed),
        shards=len(plans),
        repaired=repaired + stager.repaired,
        resumed_parts=sum(u.resumed_parts for u in uploaded),
        files_read=index.misses,
        manifest_created=created,
    )
    log.info(
        "staged %s version %s: %d files in %d blobs (%d shards), %d blobs copied, %d bytes, %d repaired, %.2fs",
        name, result.version, result.objects_total, result.blobs_total, result.shards,
        result.objects_copied, result.bytes_copied, result.repaired, result.seconds,
    )
    return result


def _commit_manifest(target: ObjectStore, manifest: DatasetManifest, manifest_key: str, recorded: dict[str, str],
                     entries: list[ManifestEntry], etags: dict[str, str], stored_etags: dict[str, str],
                     log: Any) -> bool:
    """The commit point: the manifest is created (create-only) after every blob is in place and
    verified. True when this call created it; ``stored_etags`` gets the manifest's ETag, so an
    unchanged re-stage recognises the committed manifest from one HEAD, without reading it."""
    stat = getattr(target, "stat", None)
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
    fill = getattr(source, "readinto", None)
    return (lambda off, buf: fill(rel, off, buf)) if fill else None


def _local_path(source: DatasetSource, rel: str) -> str | None:
    where = getattr(source, "local_path", None)
    return where(rel) if where else None


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

    readinto = getattr(source, "readinto", None)

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
