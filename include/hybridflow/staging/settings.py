"""How a stage runs (its settings, from pipeline.yaml ``staging``) and what it reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from hybridflow.storage.transfer import TransferSettings

_MiB = 1024 * 1024


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
