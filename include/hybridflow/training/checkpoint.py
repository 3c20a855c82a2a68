"""Training checkpoints in an object store, committed so a reader never loads a partial one.

Layout, relative to one place that holds a run's checkpoints (a folder or an S3 prefix)::

    step-000000100/model.pt        shards: one or more files, written first
    step-000000100/optimizer.pt
    step-000000100/MANIFEST.json   written last: {"format", "step", "time", "meta",
                                                  "shards": [{"name", "size", "sha256"}, ...]}

A checkpoint exists only once its manifest does, and it is loaded only if every shard the manifest
lists is present with the recorded size and SHA-256. A worker killed while writing shards leaves a
folder without a manifest, which is skipped (and later pruned); one killed after the manifest left a
complete checkpoint. A run keeps its checkpoints in two places (see :func:`latest_of`); each place
follows this protocol on its own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hybridflow.storage.objectstore import MultipartUploads, ObjectStore, PartialSweep, VerifiedPut

log = logging.getLogger(__name__)

FORMAT = "hybridflow.checkpoint/v2"
MANIFEST_NAME = "MANIFEST.json"
_KEY_RE = re.compile(r"^step-(\d{9})/([^/]+)$")
_SHARD_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def step_prefix(step: int) -> str:
    return f"step-{step:09d}"


@dataclass(frozen=True)
class Shard:
    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    step: int
    shards: tuple[Shard, ...]
    time: float
    meta: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return sum(s.size for s in self.shards)

    def to_json(self) -> bytes:
        body = {
            "format": FORMAT,
            "step": self.step,
            "time": self.time,
            "meta": self.meta,
            "shards": [{"name": s.name, "size": s.size, "sha256": s.sha256} for s in self.shards],
        }
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, step: int) -> Manifest:
        """Parse a manifest; ValueError says what is wrong with it."""
        try:
            body = json.loads(raw)
            if body.get("format") != FORMAT:
                raise ValueError(f"format is {body.get('format')!r}, expected {FORMAT!r}")
            if body.get("step") != step:
                raise ValueError(f"it names step {body.get('step')!r}")
            shards = tuple(
                Shard(name=str(s["name"]), size=int(s["size"]), sha256=str(s["sha256"]))
                for s in body["shards"]
            )
            if not shards:
                raise ValueError("it lists no shards")
            return cls(
                step=step, shards=shards, time=float(body.get("time", 0.0)), meta=body.get("meta") or {}
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f"unreadable ({type(exc).__name__}: {exc})") from exc


@dataclass(frozen=True)
class PreparedCheckpoint:
    """Shards with their digests computed once, ready to be committed to any number of places."""

    manifest: Manifest
    data: dict[str, bytes] = field(repr=False)

    @property
    def step(self) -> int:
        return self.manifest.step


def check_shard_name(name: str) -> None:
    """ValueError unless ``name`` can be a shard of a checkpoint folder."""
    if name == MANIFEST_NAME or not _SHARD_NAME_RE.match(name):
        raise ValueError(
            f"shard name {name!r} is not allowed: use letters, numbers, '.', '_' or '-' "
            f"(not starting with '.'), and not {MANIFEST_NAME}"
        )


def prepare(step: int, shards: Mapping[str, bytes], meta: dict | None = None) -> PreparedCheckpoint:
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    if not shards:
        raise ValueError("a checkpoint needs at least one shard")
    for name in shards:
        check_shard_name(name)
    infos = tuple(
        Shard(name=name, size=len(data), sha256=hashlib.sha256(data).hexdigest())
        for name, data in shards.items()
    )
    manifest = Manifest(step=step, shards=infos, time=time.time(), meta=dict(meta or {}))
    return PreparedCheckpoint(manifest=manifest, data=dict(shards))


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint whose every shard was read back and verified."""

    manifest: Manifest
    shards: dict[str, bytes] = field(repr=False)
    uri: str = ""

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def meta(self) -> dict:
        return self.manifest.meta

    @property
    def size(self) -> int:
        return self.manifest.size


class CheckpointStore:
    """Commit, find, verify and prune the checkpoints of one run in one place (``store``)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    @property
    def uri(self) -> str:
        return self.store.uri

    # -- writing -----------------------------------------------------------------------------
    def save(self, step: int, shards: Mapping[str, bytes], meta: dict | None = None) -> Manifest:
        return self.commit(prepare(step, shards, meta))

    def commit(self, prepared: PreparedCheckpoint) -> Manifest:
        """Write every shard, then the manifest. Only the manifest makes the checkpoint exist."""
        step = prepared.step
        prefix = step_prefix(step)
        manifest_key = f"{prefix}/{MANIFEST_NAME}"
        # Re-saving a step (a rerun reaching the same step) first withdraws the old manifest, so a
        # reader in between falls back to an older checkpoint instead of a mix of old and new shards.
        if self.store.exists(manifest_key):
            self.store.delete(manifest_key)
        for shard in prepared.manifest.shards:
            log.debug(
                "checkpoint step %d: writing shard %s (%d bytes) to %s",
                step,
                shard.name,
                shard.size,
                self.uri,
            )
            self._put_shard(f"{prefix}/{shard.name}", prepared.data[shard.name], shard.sha256)
        log.debug("checkpoint step %d: writing manifest to %s", step, self.uri)
        self.store.put_bytes(manifest_key, prepared.manifest.to_json())
        log.debug("checkpoint step %d: committed in %s", step, self.uri)
        return prepared.manifest

    def _put_shard(self, key: str, data: bytes, sha256: str) -> None:
        # The manifest's SHA-256 goes in the request's checksum header: the store checks it, and no
        # CRC32C pass over the shard is made (a third hash of every byte, on a GPU node's busy CPUs).
        if isinstance(self.store, VerifiedPut) and isinstance(self.store, MultipartUploads):  # an S3 endpoint
            self.store.put_verified(key, data, md5=hashlib.md5(data, usedforsecurity=False).hexdigest(), sha256=sha256)
        else:
            self.store.put_bytes(key, data)

    def commit_manifest(self, manifest: Manifest) -> Manifest:
        """Commit shards that other writers (the ranks of a gang) already put in this place.

        The listing must show every shard the manifest names, with its size; otherwise ValueError
        names the first gap and nothing is committed. Writing the manifest replaces any earlier
        one of the step in a single put, so the shards must not overwrite those an earlier
        manifest of the step names (give each attempt its own shard names)."""
        step = manifest.step
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        if not manifest.shards:
            raise ValueError("a checkpoint needs at least one shard")
        prefix = step_prefix(step)
        listed = {}
        for info in self.store.list(f"{prefix}/"):
            m = _KEY_RE.match(info.key)
            if m and int(m.group(1)) == step:
                listed[m.group(2)] = info.size
        for shard in manifest.shards:
            check_shard_name(shard.name)
            if shard.name not in listed:
                raise ValueError(f"checkpoint step {step}: shard {shard.name} is not in {self.uri}")
            if listed[shard.name] != shard.size:
                raise ValueError(
                    f"checkpoint step {step}: shard {shard.name} in {self.uri} has size "
                    f"{listed[shard.name]}, the manifest says {shard.size}"
                )
        log.debug("checkpoint step %d: writing manifest to %s", step, self.uri)
        self.store.put_bytes(f"{prefix}/{MANIFEST_NAME}", manifest.to_json())
        log.debug("checkpoint step %d: committed in %s", step, self.uri)
        return manifest

    # -- reading -----------------------------------------------------------------------------
    def _scan(self) -> dict[int, dict[str, int]]:
        """step -> {file name: listed size} for every step folder present."""
        found: dict[int, dict[str, int]] = {}
        for info in self.store.list("step-"):
            m = _KEY_RE.match(info.key)
            if m:
                found.setdefault(int(m.group(1)), {})[m.group(2)] = info.size
        return found

    def committed_steps(self) -> list[int]:
        """Steps that have a manifest, oldest first (their shards are not verified here)."""
        return sorted(s for s, files in self._scan().items() if MANIFEST_NAME in files)

    def manifest(self, step: int) -> Manifest:
        """The manifest of ``step``; ValueError if there is none or it is unreadable."""
        try:
            raw = self.store.get_bytes(f"{step_prefix(step)}/{MANIFEST_NAME}")
        except FileNotFoundError as exc:
            raise ValueError(f"checkpoint step {step} in {self.uri} is not committed") from exc
        try:
            return Manifest.from_json(raw, step)
        except ValueError as exc:
            raise ValueError(f"checkpoint step {step} in {self.uri} has a bad manifest: {exc}") from exc

    def load(self, step: int) -> Checkpoint:
        """The committed checkpoint at ``step`` with every shard verified; ValueError if any is
        missing or differs from the manifest."""
        manifest = self.manifest(step)
        prefix = step_prefix(step)
        shards: dict[str, bytes] = {}
        for shard in manifest.shards:
            try:
                data = self.store.get_bytes(f"{prefix}/{shard.name}")
            except FileNotFoundError as exc:
                raise ValueError(
                    f"checkpoint step {step} in {self.uri} is committed but its shard {shard.name} is missing"
                ) from exc
            digest = hashlib.sha256(data).hexdigest()
            if len(data) != shard.size or digest != shard.sha256:
                raise ValueError(
                    f"checkpoint step {step} in {self.uri} is corrupt: shard {shard.name} has size "
                    f"{len(data)} sha256 {digest[:12]}, the manifest says size {shard.size} sha256 "
                    f"{shard.sha256[:12]}"
                )
            shards[shard.name] = data
        return Checkpoint(manifest=manifest, shards=shards, uri=self.uri)

    def latest(self) -> Checkpoint | None:
        """The newest committed checkpoint that verifies; partial and corrupt ones are skipped."""
        found = latest_of([self])
        return found[0] if found else None

    # -- retention ---------------------------------------------------------------------------
    def _listing_matches(self, step: int, files: dict[str, int]) -> bool:
        """Cheap check from the listing: a manifest whose shards are all listed with their sizes."""
        if MANIFEST_NAME not in files:
            return False
        try:
            manifest = self.manifest(step)
        except ValueError:
            return False
        return all(files.get(s.name) == s.size for s in manifest.shards)

    def prune(self, keep: int) -> list[int]:
        """Delete all but the ``keep`` newest committed checkpoints, plus partial folders older
        than the newest commit (those writes were abandoned). Returns the steps deleted."""
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        scan = self._scan()
        # A commit whose listed shard sizes are wrong does not count towards ``keep``, so a corrupt
        # newest checkpoint never causes the last good one to be deleted.
        kept: set[int] = set()
        for step in sorted(scan, reverse=True):
            if len(kept) >= keep:
                break
            if self._listing_matches(step, scan[step]):
                kept.add(step)
        newest_commit = max((s for s, f in scan.items() if MANIFEST_NAME in f), default=None)
        deleted = []
        for step, files in sorted(scan.items()):
            if step in kept:
                continue
            committed = MANIFEST_NAME in files
            if not committed and (newest_commit is None or step > newest_commit):
                continue  # possibly a write still in flight
            if committed and step > min(kept, default=step):
                continue  # a newer commit that failed the cheap check; leave it for inspection
            prefix = step_prefix(step)
            # Manifest first: a half-deleted folder then reads as partial, never as committed.
            if committed:
                self.store.delete(f"{prefix}/{MANIFEST_NAME}")
            for name in files:
                if name != MANIFEST_NAME:
                    self.store.delete(f"{prefix}/{name}")
            deleted.append(step)
        if isinstance(self.store, PartialSweep):  # folder stores: temp files of writes killed mid-way
            self.store.sweep_partials()
        return deleted


def latest_of(places: Sequence[CheckpointStore]) -> tuple[Checkpoint, int] | None:
    """The newest committed checkpoint that verifies in any of ``places`` and the index of the place
    it came from (the earlier place wins a tie). A place that cannot be listed or read is skipped
    with a warning, so losing one place (say, the cloud cache) still resumes from the other."""
    candidates: list[tuple[int, int]] = []
    for index, place in enumerate(places):
        try:
            scan = place._scan()
        except Exception as exc:  # any store error: the other place may still have the checkpoint
            log.warning(
                "cannot list checkpoints in %s (%s: %s); looking in the other places",
                place.uri,
                type(exc).__name__,
                exc,
            )
            continue
        for step, files in scan.items():
            if MANIFEST_NAME in files:
                candidates.append((step, index))
            else:
                log.info("skipping checkpoint step %d in %s: not committed (partial write)", step, place.uri)
    for step, index in sorted(candidates, key=lambda c: (-c[0], c[1])):
        try:
            return places[index].load(step), index
        except ValueError as exc:
            log.warning("skipping %s", exc)
        except Exception as exc:
            log.warning(
                "skipping checkpoint step %d in %s: cannot read it (%s: %s)",
                step,
                places[index].uri,
                type(exc).__name__,
                exc,
            )
    return None
