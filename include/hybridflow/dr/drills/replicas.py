"""What a drill's takeover reads, and only from the DR store (never from the primary): the newest
replicated model version of an endpoint, the newest replicated checkpoint of a run, and the newest
replicated dataset version (:mod:`hybridflow.dr.replication.layout`). Everything read is checked against its
DR manifest first; a replicated set that does not verify is refused, naming the key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hybridflow.dr.drills.report import DrillError
from hybridflow.dr.replication.layout import MODEL_MANIFEST, checkpoint_prefix
from hybridflow.dr.replication.replicas import sha256_of
from hybridflow.storage.objectstore import StoreSpec, open_store
from hybridflow.training.checkpoint import CheckpointStore


@dataclass(frozen=True)
class ReplicatedModel:
    endpoint: str
    model: str
    version: str
    bundle: Path  # the bundle as fetched (verified) from the DR store onto the DR side's scratch
    replicated_at: str


@dataclass(frozen=True)
class ReplicatedData:
    dataset: str
    manifest_key: str
    created_at: str
    age_s: float | None
    paths: list[str]


def _names(store, prefix: str) -> list[str]:
    return sorted({i.key[len(prefix):].split("/", 1)[0] for i in store.list(prefix) if "/" in i.key[len(prefix):]})


def model_manifests(store, endpoint: str) -> list[dict[str, Any]]:
    prefix = f"models/{endpoint}/"
    found = []
    for info in store.list(prefix):
        if info.key.endswith("/" + MODEL_MANIFEST):
            body = json.loads(store.get_bytes(info.key))
            found.append({**body, "_key": info.key})
    return sorted(found, key=lambda b: (str(b.get("replicated_at") or ""), str(b.get("version"))), reverse=True)


def choose_endpoint(store, endpoint: str | None) -> str:
    endpoints = _names(store, "models/")
    if endpoint:
        if endpoint not in endpoints:
            raise DrillError("endpoint", f"{endpoint!r} has no model replicated to the DR store (replicated: "
                                         f"{', '.join(endpoints) or 'none'}); run dr_replication first")
        return endpoint
    if len(endpoints) != 1:
        raise DrillError("endpoint", f"the DR store holds models of {len(endpoints)} endpoints "
                                     f"({', '.join(endpoints) or 'none'}); name the critical one")
    return endpoints[0]


def fetch_bundle(store, body: dict, bundle: Path) -> None:
    """Every file of the replicated model ``body`` (a manifest of :func:`model_manifests`) written to
    ``bundle``, each checked against the manifest; ValueError names the first that does not match."""
    bundle.mkdir(parents=True, exist_ok=True)
    for obj in body["objects"]:
        data = store.get_bytes(obj["key"])
        if len(data) != int(obj["size"]) or sha256_of(data) != obj["sha256"]:
            raise ValueError(f"{obj['key']} in the DR store does not match its manifest {body['_key']}; run "
                             "dr_reconciliation to repair it")
        (bundle / obj["key"].rsplit("/", 1)[1]).write_bytes(data)


def fetch_model(spec: StoreSpec, endpoint: str, dest: Path) -> ReplicatedModel:
    """The newest replicated version of ``endpoint`` whose every file verifies, written to ``dest``."""
    store = open_store(spec)
    manifests = model_manifests(store, endpoint)
    if not manifests:
        raise DrillError("endpoint", f"no model of {endpoint!r} is replicated to the DR store; run dr_replication")
    body = manifests[0]
    version = str(body["version"])
    bundle = dest / f"{endpoint}-{version}"
    try:
        fetch_bundle(store, body, bundle)
    except ValueError as exc:
        raise DrillError("endpoint", str(exc)) from exc
    return ReplicatedModel(endpoint, str(body.get("model") or endpoint), version, bundle,
                           str(body.get("replicated_at") or ""))


def choose_run(store, run_key: str | None) -> str:
    runs = _names(store, "checkpoints/")
    if run_key:
        if run_key not in runs:
            raise DrillError("run_key", f"{run_key!r} has no checkpoint replicated to the DR store (replicated: "
                                        f"{', '.join(runs) or 'none'}); run dr_replication while it trains")
        return run_key
    if len(runs) != 1:
        raise DrillError("run_key", f"the DR store holds checkpoints of {len(runs)} runs "
                                    f"({', '.join(runs) or 'none'}); name the critical run to resume")
    return runs[0]


def replicated_checkpoint(spec: StoreSpec, run_key: str):
    """The newest replicated checkpoint of ``run_key`` that verifies (shards against its manifest)."""
    checkpoint = CheckpointStore(open_store(spec.child(checkpoint_prefix(run_key)))).latest()
    if checkpoint is None:
        raise DrillError("run_key", f"no checkpoint of {run_key!r} in the DR store verifies; run dr_reconciliation")
    return checkpoint


def newest_dataset(spec: StoreSpec, dataset: str, now: datetime | None = None) -> ReplicatedData | None:
    """The dataset's newest version in the DR store (by when it was replicated), None if none."""
    from hybridflow.storage.manifest import DatasetManifest

    store = open_store(spec)
    newest = None
    for info in store.list(f"datasets/{dataset}/versions/"):
        m = DatasetManifest.from_json(store.get_bytes(info.key))
        if newest is None or m.created_at > newest[1].created_at:
            newest = (info.key, m)
    if newest is None:
        return None
    key, m = newest
    age = None
    if m.created_at:
        created = datetime.fromisoformat(m.created_at)
        age = round(((now or datetime.now(UTC)) - created.astimezone(UTC)).total_seconds(), 1)
    return ReplicatedData(dataset, key, m.created_at, age, sorted(e.path for e in m.entries))
