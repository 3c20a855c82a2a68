"""Sharded checkpoints: every rank saves its own part with ``torch.distributed.checkpoint`` (DCP).

One save, per rank::

    training thread     dcp.save into <workdir>/step-NNNNNNNNN/rank-RRRRR/ (local disk, collective)
                        agree on an attempt id (a broadcast from rank 0)
    background thread   upload this rank's files, then its record, to the primary; the same to the
                        replica; delete the local files
    rank 0 only         per place: wait until every rank's record is there, commit MANIFEST.json
                        (checkpoint.py's format, listing every file of every rank), then prune

Layout of a committed sharded checkpoint in one place (attempt ``3f9a2c1b``, two ranks)::

    step-000000100/dcp-3f9a2c1b-.metadata         DCP's file names behind "dcp-<attempt>-"
    step-000000100/dcp-3f9a2c1b-__0_0.distcp
    step-000000100/dcp-3f9a2c1b-__1_0.distcp
    step-000000100/rank-00000-3f9a2c1b.json       per-rank records: {"files": [{name, size, sha256}]}
    step-000000100/rank-00001-3f9a2c1b.json
    step-000000100/MANIFEST.json                  meta: {"kind": "sharded", "world_size": 2,
                                                         "attempt": "3f9a2c1b", ...caller's meta}

The manifest is written last, so until every rank has uploaded, the step is a partial folder that
:func:`~hybridflow.training.checkpoint.latest_of` skips and prune later deletes. Each save attempt
uploads under names of its own: saving a step again (a rerun that resumed from an older step)
never overwrites files that a committed manifest of that step names, nor mixes with files a dead
rank left, and rank 0 deletes those leftovers once the new manifest is in.

Nothing on the background thread talks to the process group: if a rank dies mid-upload, rank 0's
commit times out (``commit_timeout_s``) and the error surfaces at the next ``save``/``wait``/``close``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from hybridflow.training.checkpoint import (
    MANIFEST_NAME,
    Checkpoint,
    CheckpointStore,
    Manifest,
    Shard,
    check_shard_name,
    step_prefix,
)
from hybridflow.training.checkpointer import BackgroundWriter

log = logging.getLogger(__name__)

SHARDED_KIND = "sharded"
RECORD_FORMAT = "hybridflow.sharded-rank/v1"
_RESERVED_META = ("kind", "world_size", "attempt")
_DCP_NAME_RE = re.compile(r"^dcp-([0-9a-f]{8})-(.+)$")
_RECORD_NAME_RE = re.compile(r"^rank-(\d{5})-([0-9a-f]{8})\.json$")
_DCP_METADATA = ".metadata"
_MB = 1e6

# Fault-injection point for tests only: when set, called as hook(step, rank, place_index, files_done)
# after each of this rank's DCP files is uploaded, so a test can kill a rank part-way through.
_fault_after_file_upload: Callable[[int, int, int, int], None] | None = None


def shard_name(dcp_name: str, attempt: str) -> str:
    """The shard name under which DCP's file ``dcp_name`` of save attempt ``attempt`` is stored
    (DCP's names start with '_' or '.', which checkpoint shard names may not)."""
    name = f"dcp-{attempt}-{dcp_name}"
    check_shard_name(name)
    return name


def dcp_name(name: str) -> str | None:
    """DCP's original file name for a stored shard name, or None for a shard that is not a DCP file."""
    m = _DCP_NAME_RE.match(name)
    return m.group(2) if m else None


def record_name(rank: int, attempt: str) -> str:
    return f"rank-{rank:05d}-{attempt}.json"


def is_sharded(manifest: Manifest) -> bool:
    return manifest.meta.get("kind") == SHARDED_KIND


def _world_size_of(manifest: Manifest, uri: str) -> int:
    where = f"checkpoint step {manifest.step} in {uri}"
    if not is_sharded(manifest):
        raise ValueError(
            f"{where} is not a sharded checkpoint (meta kind is {manifest.meta.get('kind')!r}, "
            f"expected {SHARDED_KIND!r}); load it with CheckpointStore.load"
        )
    world = manifest.meta.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"{where} is sharded but its world size is unreadable: {world!r}")
    records = [s.name for s in manifest.shards if _RECORD_NAME_RE.match(s.name)]
    if len(records) != world:
        raise ValueError(
            f"{where} says world size {world} but lists {len(records)} rank records: {sorted(records)}"
        )
    return world


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class _LocalFile:
    path: Path
    shard: Shard  # name as stored (with the dcp-<attempt>- prefix), size, sha256


class ShardedCheckpointer(BackgroundWriter):
    """Saves DCP state from every rank of a gang and commits it as one checkpoint.

    Every rank constructs one with the same places, ``keep`` and ``world_size``. :meth:`save` is
    collective; it returns once the state is on local disk, and one background thread per rank
    uploads it (at most one upload in flight per rank). Rank 0 commits and prunes; the other
    ranks only upload. ``writer_threads`` is DCP's ``thread_count``: each thread writes a file of
    its own, so a rank uploads that many data files.
    """

    def __init__(
        self,
        primary: CheckpointStore,
        replica: CheckpointStore | None,
        *,
        rank: int,
        world_size: int,
        keep: int,
        workdir: Path,
        commit_timeout_s: float = 120.0,
        writer_threads: int = 1,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        if commit_timeout_s <= 0:
            raise ValueError(f"commit_timeout_s must be positive, got {commit_timeout_s}")
        if dist.is_initialized() and (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise ValueError(
                f"rank {rank} of {world_size} does not match the process group "
                f"(rank {dist.get_rank()} of {dist.get_world_size()})"
            )
        super().__init__("sharded-checkpoint")  # history: one entry per finished upload (rank 0: per commit)
        self.primary = primary
        self.replica = replica
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self.workdir = Path(workdir)
        self.commit_timeout_s = commit_timeout_s
        self.writer_threads = max(1, int(writer_threads))
        self.primary_step: int | None = None  # rank 0: newest step committed to the primary
        self._places = [primary] + ([replica] if replica is not None else [])

    # -- the training thread -----------------------------------------------------------------
    def save(self, step: int, state_dict: dict, meta: dict | None = None) -> None:
        """Collective: write this rank's part of ``state_dict`` to local disk and hand it to the
        upload thread. Waits for this rank's previous upload first, re-raising its error (the
        other ranks then wait in DCP's collective until the process group's timeout: the gang
        fails rather than training on without a recovery point)."""
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        meta = dict(meta or {})
        clash = sorted(set(meta) & set(_RESERVED_META))
        if clash:
            raise ValueError(f"meta keys {clash} are reserved for sharded checkpoints")
        json.dumps(meta)  # the manifest is JSON: fail here, on every rank, not on rank 0's thread
        started, saved_at = time.perf_counter(), time.time()
        self.wait()
        waited_s = time.perf_counter() - started
        local = self.workdir / step_prefix(step) / f"rank-{self.rank:05d}"
        shutil.rmtree(local, ignore_errors=True)  # files of an earlier process would be uploaded too
        t0 = time.perf_counter()
        # sync_files=False: these files are a staging copy; a crash loses the step either way.
        dcp.save(
            state_dict,
            storage_writer=FileSystemWriter(local, sync_files=False, thread_count=self.writer_threads),
        )
        dcp_s = time.perf_counter() - t0
        attempt = self._agree_attempt()
        blocked_s = time.perf_counter() - started
        self._pending = self._pool.submit(
            self._upload,
            step,
            attempt,
            local,
            meta,
            {"blocked_s": blocked_s, "waited_s": waited_s, "dcp_s": dcp_s, "saved_at": saved_at},
        )

    def _agree_attempt(self) -> str:
        """A fresh id shared by every rank for this save: the names its files are uploaded under."""
        box = [secrets.token_hex(4) if self.rank == 0 else None]
        if self.world_size > 1 or dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        return str(box[0])

    # -- the background thread ---------------------------------------------------------------
    def _upload(self, step: int, attempt: str, local: Path, meta: dict, stats: dict) -> None:
        t_start, cpu0 = time.perf_counter(), time.thread_time()
        prefix = step_prefix(step)
        try:
            files = [
                _LocalFile(p, Shard(shard_name(p.name, attempt), p.stat().st_size, _sha256_file(p)))
                for p in sorted(local.iterdir())
                if p.is_file()
            ]
            if not files:
                raise RuntimeError(
                    f"checkpoint step {step}: DCP wrote no files for rank {self.rank} in {local}"
                )
            record = self._record(step, attempt, files)
            timings: dict[str, float] = {}
            for index, place in enumerate(self._places):
                t0 = time.perf_counter()
                for done, f in enumerate(files, start=1):
                    place.store.put_file(f"{prefix}/{f.shard.name}", f.path)
                    if _fault_after_file_upload is not None:
                        _fault_after_file_upload(step, self.rank, index, done)
                # The record goes last: rank 0 reads it as "this rank's files are all there".
                place.store.put_bytes(f"{prefix}/{record_name(self.rank, attempt)}", record)
                timings[f"upload{index}_s"] = time.perf_counter() - t0
                if self.rank == 0:
                    t1 = time.perf_counter()
                    manifest = self._commit(place, step, attempt, meta, stats["saved_at"])
                    timings[f"commit{index}_s"] = time.perf_counter() - t1
                    if index == 0:
                        with self._lock:
                            self.primary_step = step
            t2 = time.perf_counter()
            if self.rank == 0:
                for place in self._places:
                    place.prune(self.keep)
            entry = {
                "step": step,
                "bytes": sum(f.shard.size for f in files),
                "files": len(files),
                "blocked_s": round(stats["blocked_s"], 6),
                "waited_s": round(stats["waited_s"], 6),
                "dcp_save_s": round(stats["dcp_s"], 4),
                "primary_s": round(timings.get("upload0_s", 0.0), 4),
                "replica_s": round(timings.get("upload1_s", 0.0), 4),
                "prune_s": round(time.perf_counter() - t2, 4),
                "cpu_s": round(time.thread_time() - cpu0, 4),
                "total_s": round(time.perf_counter() - t_start, 4),
            }
            if self.rank == 0:
                entry["commit_primary_s"] = round(timings.get("commit0_s", 0.0), 4)
                entry["commit_replica_s"] = round(timings.get("commit1_s", 0.0), 4)
                entry["checkpoint_bytes"] = manifest.size
            with self._lock:
                self.history.append(entry)
            log.info(
                "sharded checkpoint step %d: rank %d uploaded %.1f MB in %d files (training blocked %.1f ms)%s",
                step,
                self.rank,
                entry["bytes"] / _MB,
                entry["files"],
                stats["blocked_s"] * 1000,
                f"; committed {manifest.size / _MB:.1f} MB from {self.world_size} ranks"
                if self.rank == 0
                else "",
            )
        finally:
            shutil.rmtree(local, ignore_errors=True)
            try:
                local.parent.rmdir()  # the step folder, once no rank on this machine still uses it
            except OSError:
                pass

    def _record(self, step: int, attempt: str, files: list[_LocalFile]) -> bytes:
        """This rank's record of its files in the step: what rank 0 checks before it commits."""
        return json.dumps(
            {
                "format": RECORD_FORMAT,
                "step": step,
                "rank": self.rank,
                "world_size": self.world_size,
                "attempt": attempt,
                "files": [{"name": f.shard.name, "size": f.shard.size, "sha256": f.shard.sha256} for f in files],
            },
            sort_keys=True,
        ).encode()

    def _commit(
        self, place: CheckpointStore, step: int, attempt: str, meta: dict, saved_at: float
    ) -> Manifest:
        """Rank 0: wait for every rank's record of this attempt in ``place``, then commit."""
        prefix = step_prefix(step)
        wanted = {record_name(r, attempt): r for r in range(self.world_size)}
        deadline = time.monotonic() + self.commit_timeout_s
        pause = 0.02
        while True:
            present = {info.key.rsplit("/", 1)[-1] for info in place.store.list(f"{prefix}/")}
            missing = sorted(r for name, r in wanted.items() if name not in present)
            if not missing:
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"sharded checkpoint step {step} not committed to {place.uri}: ranks {missing} did not "
                    f"finish uploading within {self.commit_timeout_s:g}s (the step stays a partial folder)"
                )
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 1.0)
        shards: list[Shard] = []
        for name, r in sorted(wanted.items(), key=lambda item: item[1]):
            raw = place.store.get_bytes(f"{prefix}/{name}")
            shards.extend(self._read_record(raw, step, r, attempt, place.uri))
            shards.append(Shard(name, len(raw), hashlib.sha256(raw).hexdigest()))
        names = [s.name for s in shards]
        if len(set(names)) != len(names):
            raise ValueError(f"sharded checkpoint step {step}: ranks uploaded clashing file names {names}")
        if _DCP_METADATA not in {dcp_name(n) for n in names}:
            raise ValueError(f"sharded checkpoint step {step}: no rank uploaded DCP's {_DCP_METADATA}")
        manifest = Manifest(
            step=step,
            shards=tuple(shards),
            time=saved_at,  # when the state was taken: the same manifest in every place
            meta={**meta, "kind": SHARDED_KIND, "world_size": self.world_size, "attempt": attempt},
        )
        place.commit_manifest(manifest)
        # Files of earlier attempts at this step (a dead rank's partial upload, or the checkpoint the
        # new manifest just replaced) are referenced by nothing now.
        keep_names = set(names) | {MANIFEST_NAME}
        for info in list(place.store.list(f"{prefix}/")):
            if info.key.rsplit("/", 1)[-1] not in keep_names:
                place.store.delete(info.key)
        log.debug("sharded checkpoint step %d: committed %d files in %s", step, len(shards), place.uri)
        return manifest

    def _read_record(self, raw: bytes, step: int, rank: int, attempt: str, uri: str) -> list[Shard]:
        try:
            body = json.loads(raw)
            expected = (RECORD_FORMAT, step, rank, self.world_size, attempt)
            got = (
                body.get("format"),
                body.get("step"),
                body.get("rank"),
                body.get("world_size"),
                body.get("attempt"),
            )
            if got != expected:
                raise ValueError(f"it is for {got}, expected {expected}")
            return [Shard(str(f["name"]), int(f["size"]), str(f["sha256"])) for f in body["files"]]
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError, ValueError) as exc:
            raise ValueError(
                f"sharded checkpoint step {step}: bad record of rank {rank} in {uri}: {exc}"
            ) from exc

    def summary(self) -> dict:
        """Per-run figures for result files and benchmarks."""
        blocked = [h["blocked_s"] for h in self.history]
        return {
            "written": len(self.history),
            "bytes_last": self.history[-1]["bytes"] if self.history else 0,
            "blocked_s_total": round(sum(blocked), 6),
            "blocked_s_mean": round(sum(blocked) / len(blocked), 6) if blocked else 0.0,
            "blocked_s_max": round(max(blocked), 6) if blocked else 0.0,
            "history": list(self.history),
        }


def load_sharded(
    place: CheckpointStore,
    step: int,
    state_dict: dict,
    workdir: Path,
    *,
    checkpoint: Checkpoint | None = None,
) -> Manifest:
    """Every rank: load the committed sharded checkpoint ``step`` of ``place`` into ``state_dict``
    in place (DCP collective; tensors keep their storage, other values are replaced).

    Every file is read and verified against the manifest before DCP sees it. ``checkpoint`` may
    pass one already read from ``place`` (what ``latest_of`` returned on rank 0) to skip reading
    it again. ValueError if the step is not committed, fails verification, is not a sharded
    checkpoint or its world size cannot be read back; the saved world size may differ from the
    current one (DCP reshards), it is in the returned manifest's ``meta["world_size"]``.
    """
    if checkpoint is None or checkpoint.step != step:
        checkpoint = place.load(step)
    manifest = checkpoint.manifest
    _world_size_of(manifest, place.uri)
    files = {dcp_name(n): data for n, data in checkpoint.shards.items() if dcp_name(n) is not None}
    if _DCP_METADATA not in files:
        raise ValueError(f"checkpoint step {step} in {place.uri} is sharded but has no DCP {_DCP_METADATA}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"load-{step_prefix(step)}-rank{rank:05d}-", dir=workdir))
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        dcp.load(state_dict, storage_reader=FileSystemReader(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest
