"""The replica sets a takeover needs, read from where the platform keeps them:

- **dataset versions**: the versions validate_data pinned (``dataset-version.json`` in run folders:
  the SHA-256 of every split file it checked), newest first; their files are read where the
  dataset lives and must still match the pin;
- **model versions**: the bundles an endpoint serves or served, newest first, the one serving now
  always included: ``<endpoint>/versions/*.json`` of the local model gateway, or on the Kubernetes
  serving target the bundles published on its models volume (:mod:`hybridflow.dr.replication.sources_k8s`); a
  bundle keeps no digests, so its bytes as first replicated are what the DR manifest records;
- **checkpoints**: the newest committed checkpoint of a run, from either of its two places, every
  shard checked against the checkpoint's manifest.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from hybridflow.datasets import DatasetVersion, Location
from hybridflow.dr.replication.layout import (
    checkpoint_prefix,
    model_manifest,
    model_manifest_key,
    model_prefix,
)
from hybridflow.dr.replication.replicas import Copied, Problem, ReplicaSet, Wanted
from hybridflow.rundata import VERSION_FILE
from hybridflow.staging.layout import blob_key, manifest_key_for
from hybridflow.storage.manifest import BlobRecord, DatasetManifest, ManifestEntry
from hybridflow.storage.objectstore import ObjectStore
from hybridflow.training.checkpoint import MANIFEST_NAME, CheckpointStore, step_prefix


# -- dataset versions ------------------------------------------------------------------------------
def pinned_versions(private_root: Path, dataset: str) -> list[DatasetVersion]:
    """The distinct versions of ``dataset`` that runs validated, newest pin first."""
    found: dict[str, tuple[float, DatasetVersion]] = {}
    for path in (Path(private_root) / "runs").glob(f"*/{VERSION_FILE}"):
        try:
            pinned = DatasetVersion.from_json(path.read_bytes())
        except Exception:  # noqa: BLE001 - a damaged pin of one run must not hide the others
            continue
        if pinned.manifest.dataset != dataset:
            continue
        when = path.stat().st_mtime
        if pinned.version not in found or found[pinned.version][0] < when:
            found[pinned.version] = (when, pinned)
    return [v for _, v in sorted(found.values(), key=lambda t: (t[0], t[1].version), reverse=True)]


def _file_reader(location: Location, rel: str, open_store: Callable[[], ObjectStore]) -> Callable[[], bytes]:
    if location.path is not None:
        return lambda: (location.path / rel).read_bytes()  # type: ignore[operator]
    return lambda: open_store().get_bytes(f"{location.prefix}/{rel}")


def dataset_set(version: DatasetVersion, location: Location, *, open_store: Callable[[], ObjectStore],
                run_key: str = "dr-replication") -> ReplicaSet:
    """One pinned version: each file a content-addressed blob, the manifest as staging writes it."""
    m = version.manifest
    name = m.dataset
    entries = tuple(ManifestEntry(path=e.path, key=blob_key(name, e.sha256), size=e.size, sha256=e.sha256)
                    for e in sorted(m.entries, key=lambda e: e.path))
    # Folder datasets are checked and sent from where their files lie, never read whole into memory.
    objects = {e.key: Wanted(e.key, e.size, e.sha256, _file_reader(location, e.path, open_store),
                             source=f"{location.uri}/{e.path}",
                             path=location.path / e.path if location.path is not None else None)
               for e in entries}

    def manifest_for(_copied: list[Copied]) -> bytes:
        blobs = tuple(BlobRecord(key=k, size=w.size or 0, sha256=w.sha256 or "") for k, w in sorted(objects.items()))
        from datetime import UTC, datetime

        return DatasetManifest(dataset=name, entries=entries, blobs=blobs, source_uri=location.uri,
                               sensitivity=m.sensitivity, created_by=run_key,
                               created_at=datetime.now(UTC).isoformat(timespec="seconds")).to_json()

    return ReplicaSet("dataset", name, m.version, manifest_key_for(name, m.version), tuple(objects.values()),
                      manifest_for)


# -- model versions --------------------------------------------------------------------------------
def served_versions(serving_root: Path, endpoint: str) -> list[dict[str, Any]]:
    """The versions the local gateway started for ``endpoint`` (their records), newest first, the
    one serving now and its canary always included."""
    edir = Path(serving_root) / endpoint
    records = []
    for path in (edir / "versions").glob("*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("bundle") and record.get("version"):
            records.append(record)
    try:
        active = json.loads((edir / "active.json").read_text())
    except (OSError, ValueError):
        active = {}
    live = {active.get("version"), (active.get("canary") or {}).get("version")} - {None}
    return sorted(records, key=lambda r: (r["version"] in live, str(r.get("started_at") or "")), reverse=True)


def serves_locally(estate) -> bool:
    """Whether the estate serves through the local model gateway (else on Kubernetes: deployment or kserve)."""
    from hybridflow.serving import target_name

    return target_name(estate.pipeline.serving) == "local"


def served_endpoint_names(estate, settings) -> list[str]:
    """The endpoints the estate's deploy target serves or served: the local gateway's, or those with
    a bundle on the Kubernetes target's models volume."""
    if serves_locally(estate):
        from hybridflow.dr.replication.scope import served_endpoints

        return served_endpoints(Path(settings.state_dir) / "serving")
    from hybridflow.dr.replication.sources_k8s import published_endpoints

    k8s = estate.pipeline.serving.kubernetes
    if k8s is None:
        from hybridflow.dr.replication.scope import ReplicationError
        from hybridflow.serving import target_name

        raise ReplicationError("serving.kubernetes", f"not set, but serving.target is "
                                                     f"{target_name(estate.pipeline.serving)}: the served models "
                                                     "are on its models volume; add serving.kubernetes (cluster, "
                                                     "node_pool, image, models_claim, models_dir) to pipeline.yaml")
    return published_endpoints(Path(k8s.models_dir))


def endpoint_versions(estate, settings, endpoint: str, problems: list[Problem]) -> list[dict[str, Any]]:
    """The version records of ``endpoint`` (newest first, what serves now first) from the estate's
    deploy target; what could not be looked at is added to ``problems``."""
    if serves_locally(estate):
        return served_versions(Path(settings.state_dir) / "serving", endpoint)
    from hybridflow.dr.replication.sources_k8s import k8s_served_versions

    return k8s_served_versions(estate, settings, endpoint, problems)


def model_set(endpoint: str, record: dict[str, Any]) -> ReplicaSet:
    """A served bundle's files (``model.json`` last, as bundles are written) under the endpoint."""
    from hybridflow.bundle import CARD_FILE, WEIGHTS_FILE

    version, bundle = str(record["version"]), Path(record["bundle"])
    prefix = model_prefix(endpoint, version)
    # A bundle's own files are always wanted (a lost one is reported); other files it holds go too.
    extra = {p.name for p in bundle.glob("*") if p.is_file() and not p.name.startswith(".")} if bundle.is_dir() else set()
    names = sorted(extra - {CARD_FILE, WEIGHTS_FILE}) + [WEIGHTS_FILE, CARD_FILE]
    objects = tuple(Wanted(prefix + n, None, None, lambda p=bundle / n: p.read_bytes(), source=str(bundle / n))
                    for n in names)
    model = str(record.get("model") or endpoint)
    return ReplicaSet("model", endpoint, version, model_manifest_key(endpoint, version), objects,
                      lambda copied: model_manifest(endpoint, model, version, copied))


# -- checkpoints -----------------------------------------------------------------------------------
def checkpoint_set(run_key: str, places: Iterable[ObjectStore], problems: list[Problem]) -> ReplicaSet | None:
    """The newest committed checkpoint of ``run_key`` that verifies in any of ``places``; each newer
    one that does not (a shard missing or not matching the manifest) is added to ``problems``."""
    stores = [CheckpointStore(p) for p in places]
    candidates: list[tuple[int, CheckpointStore]] = []
    for store in stores:
        try:
            candidates += [(step, store) for step in store.committed_steps()]
        except Exception as exc:  # noqa: BLE001 - a lost place: the other may still have it
            problems.append(Problem("checkpoint", run_key, store.uri, f"cannot be listed: {type(exc).__name__}: {exc}"))
    for step, store in sorted(candidates, key=lambda c: -c[0]):
        try:
            checkpoint = store.load(step)
        except Exception as exc:  # noqa: BLE001 - corrupt or unreadable: reported, never propagated
            problems.append(Problem("checkpoint", run_key, f"{store.uri}/{step_prefix(step)}", f"{exc}; not copied"))
            continue
        folder = checkpoint_prefix(run_key) + step_prefix(step)
        manifest = checkpoint.manifest
        objects = tuple(Wanted(f"{folder}/{s.name}", s.size, s.sha256, lambda d=checkpoint.shards[s.name]: d,
                               source=f"{store.uri}/{step_prefix(step)}/{s.name}") for s in manifest.shards)
        return ReplicaSet("checkpoint", run_key, str(step), f"{folder}/{MANIFEST_NAME}", objects,
                          lambda _copied, m=manifest: m.to_json())
    return None
