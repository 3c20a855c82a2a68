"""``stage_dataset``: one stage of a dataset into a cache store, from the sovereignty guard to the
committed manifest."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hybridflow.errors import StagingError
from hybridflow.sovereignty import Destination, check_sovereignty
from hybridflow.staging.blobs import _BlobPlan, _packed, _plan_blobs, _upload_items
from hybridflow.staging.commit import _commit_version, _version_contents
from hybridflow.staging.layout import blob_prefix, list_blobs
from hybridflow.staging.settings import StagingResult, StagingSettings
from hybridflow.staging.verify import _Stager
from hybridflow.storage.hashindex import HashIndex
from hybridflow.storage.objectstore import ObjectInfo, ObjectStore
from hybridflow.storage.sources import DatasetSource, SourceFile
from hybridflow.storage.transfer import TransferProgress, Uploaded, Uploader, UploadItem

# The package's logger: a stage logs there unless given another.
logger = logging.getLogger("hybridflow.staging")


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
    files, early = _scan(source, target, settings, index)
    if not files:
        raise StagingError(f"dataset {source.uri} holds no files; nothing to stage")
    log.info(
        "scanned %s: %d files, %d bytes (%d digests reused, %d files read)",
        source.uri, len(files), sum(f.size for f in files), index.hits, index.misses,
    )
    stager = _Stager(source, target, settings, log, index)
    plan = _plan_blobs(name, files, settings, index)

    # One listing for the whole dataset, not a HEAD per file.
    expected = len(plan.blobs) + len(plan.unknown_shards) + len(plan.deferred)
    existing = early.result() if early is not None else list_blobs(target, name, expected, settings)
    recorded = index.stored_etags(target.uri)
    items, repaired = _upload_items(name, plan, stager, source, target, existing, recorded, index, settings, log)
    uploaded = _upload(name, items, plan, stager, target, existing, recorded, index, settings, log)

    files, entries, records, etags = _version_contents(name, files, plan, existing, uploaded, index)
    version, manifest_key, created = _commit_version(
        name, source, target, classification, run_key, entries, records, etags, recorded, index, plan.plans, log
    )

    result = StagingResult(
        dataset=name,
        version=version,
        manifest_key=manifest_key,
        store_uri=target.uri,
        objects_total=len(files),
        objects_copied=sum(1 for u in uploaded if u.bytes_sent or u.parts),
        bytes_copied=sum(u.bytes_sent for u in uploaded),
        seconds=time.monotonic() - started,
        blobs_total=len(records),
        files_packed=len(plan.packed),
        shards=len(plan.plans),
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


def _scan(
    source: DatasetSource, target: ObjectStore, settings: StagingSettings, index: HashIndex
) -> tuple[list[SourceFile], Future[dict[str, ObjectInfo]] | None]:
    """The source's files, and the target's blobs being listed meanwhile when the index knows the
    dataset (None: list them once the scan tells how many to expect)."""
    name = source.name
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
    return files, early


def _upload(
    name: str,
    items: list[UploadItem],
    plan: _BlobPlan,
    stager: _Stager,
    target: ObjectStore,
    existing: dict[str, ObjectInfo],
    recorded: dict[str, str],
    index: HashIndex,
    settings: StagingSettings,
    log: Any,
) -> list[Uploaded]:
    """Send ``items`` to the target; on failure the index keeps the digests learned so far."""
    tuning = settings.transfer
    uploaded: list[Uploaded] = []
    if items:
        total = sum(i.size for i in items)
        log.info("uploading up to %d of %d blobs (%d bytes) to %s", len(items),
                 len(plan.blobs) + len(plan.unknown_shards) + len(plan.deferred), total, target.uri)
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
    return uploaded
