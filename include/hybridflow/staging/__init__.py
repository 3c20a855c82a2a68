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

The package: ``settings`` (StagingSettings, StagingResult), ``layout`` (keys, manifests, listing),
``blobs`` (the blobs a version needs and their upload items), ``verify`` (whether a stored blob is
good), ``commit`` (the manifest and its create-only commit) and ``stage`` (:func:`stage_dataset`).
"""

from __future__ import annotations

from hybridflow.staging.blobs import (
    _Blob,
    _BlobPlan,
    _deferred_item,
    _label,
    _local_path,
    _packed,
    _packed_sha,
    _plan_blobs,
    _readinto,
    _shard_item,
    _upload_items,
)
from hybridflow.staging.commit import (
    _commit_manifest,
    _commit_version,
    _version_contents,
)
from hybridflow.staging.layout import (
    blob_key,
    blob_prefix,
    index_path_for,
    list_blobs,
    manifest_key_for,
    read_manifest,
    versions_prefix,
)
from hybridflow.staging.settings import (
    StagingResult,
    StagingSettings,
    _MiB,
)
from hybridflow.staging.stage import (
    _scan,
    _upload,
    logger,
    stage_dataset,
)
from hybridflow.staging.verify import (
    VERIFY_DOWNLOAD_MAX,
    _is_md5,
    _Stager,
)

__all__ = [
    "StagingResult",
    "StagingSettings",
    "VERIFY_DOWNLOAD_MAX",
    "_Blob",
    "_BlobPlan",
    "_MiB",
    "_Stager",
    "_commit_manifest",
    "_commit_version",
    "_deferred_item",
    "_is_md5",
    "_label",
    "_local_path",
    "_packed",
    "_packed_sha",
    "_plan_blobs",
    "_readinto",
    "_scan",
    "_shard_item",
    "_upload",
    "_upload_items",
    "_version_contents",
    "blob_key",
    "blob_prefix",
    "index_path_for",
    "list_blobs",
    "logger",
    "manifest_key_for",
    "read_manifest",
    "stage_dataset",
    "versions_prefix",
]
