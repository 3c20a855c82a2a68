"""The bytes each project holds in the cloud caches and the DR stores, counted from their manifests.

What ties stored data to a project is what the platform records, not the store's layout (blobs live
under the dataset's name, shared by every project that trains on it):

- a dataset version belongs to every project whose run records name it (``dataset`` and
  ``dataset_version``, the version validate_data pinned and staging must match), to the project of
  the run that committed its manifest (``created_by``), and to every project whose runs the ledger
  recorded staging it (``transfer`` rows, written when a stage commits, before the run's record
  exists);
- a replicated model version (``models/<endpoint>/<version>/MANIFEST.json``) to the project of the
  run that deployed it (the version is that run's key), else to its model's project in models.yaml;
- a replicated checkpoint (``checkpoints/<run_key>/...``) to its run's project.

Within one store each object a project's manifests name counts once for that project, however many
of its versions share it; an object that manifests of two projects name counts for each. The same
object in two stores is two copies and counts in each. Data no project can be found for is counted
under ``unattributed``, so it shows rather than vanishes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridflow.storage.manifest import DatasetManifest
from hybridflow.storage.objectstore import ObjectStore

log = logging.getLogger(__name__)

UNATTRIBUTED = "unattributed"


@dataclass
class Owners:
    """Which projects hold what: run key -> project, (dataset, version) -> projects, model -> project."""

    by_run: dict[str, str] = field(default_factory=dict)
    by_version: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    by_model: dict[str, str] = field(default_factory=dict)

    def add_version(self, dataset: str | None, version: str | None, project: str | None) -> None:
        if dataset and version and project:
            self.by_version.setdefault((dataset, version), set()).add(project)

    def of_dataset(self, manifest: DatasetManifest) -> set[str]:
        found = set(self.by_version.get((manifest.dataset, manifest.version), ()))
        if project := self.by_run.get(manifest.created_by):
            found.add(project)
        return found

    def of_model(self, body: Mapping[str, Any]) -> set[str]:
        project = self.by_run.get(str(body.get("version"))) or self.by_model.get(str(body.get("model")))
        return {project} if project else set()

    def of_run(self, run_key: str) -> set[str]:
        return {self.by_run[run_key]} if run_key in self.by_run else set()


def owners_from(records: Iterable[Mapping[str, Any]], staged: Iterable[Any] = (),
                models: Mapping[str, str | None] | None = None) -> Owners:
    """Owners from run records (hybridflow.records), the ledger's staging transfers
    (hybridflow.ledger.transfers.Transfer) and models.yaml's model -> project."""
    owners = Owners(by_model={m: p for m, p in (models or {}).items() if p})
    for rec in records:
        if rec.get("run_key") and rec.get("project"):
            owners.by_run[rec["run_key"]] = rec["project"]
            owners.add_version(rec.get("dataset"), rec.get("dataset_version"), rec["project"])
    for t in staged:
        if t.run_key:
            owners.by_run.setdefault(t.run_key, t.project)
        owners.add_version(t.dataset, t.version, t.project)
    return owners


def _objects(kind: str, key: str, raw: bytes, owners: Owners) -> tuple[set[str], list[tuple[str, int]]]:
    """(projects, [(object key, size)]) of one manifest; the manifest itself is held too."""
    from hybridflow.dr.replication.layout import expected_objects, name_of

    own = (key, len(raw))
    if kind == "dataset":
        m = DatasetManifest.from_json(raw)
        return owners.of_dataset(m), [own, *((b.key, b.size) for b in m.blobs)]
    objects = [own, *((o.key, o.size) for o in expected_objects(key, raw))]
    if kind == "model":
        return owners.of_model(json.loads(raw)), objects
    return owners.of_run(name_of(key)), objects


def _manifest_keys(store: ObjectStore, datasets: Iterable[str]) -> Iterable[tuple[str, str]]:
    """(kind, key) of every manifest in ``store``; dataset versions are listed per catalogue dataset,
    so the listing never walks the blobs."""
    from hybridflow.dr.replication.layout import kind_of

    prefixes = [f"datasets/{d}/versions/" for d in sorted(datasets)] + ["models/", "checkpoints/"]
    for prefix in prefixes:
        for info in store.list(prefix):
            kind = kind_of(info.key)
            if kind is not None:
                yield kind, info.key


def held_bytes(stores: Mapping[str, ObjectStore], owners: Owners, datasets: Iterable[str]) -> dict[str, dict[str, int]]:
    """project -> place (the cluster whose cache or DR store it is) -> bytes held there."""
    datasets = list(datasets)
    held: dict[str, dict[str, int]] = {}
    for place, store in sorted(stores.items()):
        sizes: dict[str, int] = {}
        keys_of: dict[str, set[str]] = {}
        for kind, key in _manifest_keys(store, datasets):
            try:
                projects, objects = _objects(kind, key, store.get_bytes(key), owners)
            except Exception as exc:  # noqa: BLE001 - one unreadable manifest must not hide the rest
                log.warning("storage usage: %s/%s is unreadable (%s: %s); not counted", store.uri, key,
                            type(exc).__name__, exc)
                continue
            sizes.update(objects)
            for project in projects or {UNATTRIBUTED}:
                keys_of.setdefault(project, set()).update(k for k, _ in objects)
        for project, keys in keys_of.items():
            held.setdefault(project, {})[place] = sum(sizes[k] for k in keys)
    return held
