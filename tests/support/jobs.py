"""Training jobs for tests: an example dataset seeded and pinned as validate_data pins it, and job
specs for the gang backends built the way the train task builds them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Seeded:
    """An example dataset in a private folder, its catalogue and registry entries, and its pinned version."""

    root: Path  # the private storage root
    folder: Path
    entry: object  # catalogue DatasetEntry
    model: object  # registry ModelEntry
    version_path: Path
    version: object  # DatasetVersion

    @property
    def local_source(self) -> dict:
        return {"kind": "local", "path": str(self.folder), "version": str(self.version_path)}

    def info(self, classification: str = "internal") -> dict:
        from hybridflow.rundata import dataset_info

        return dataset_info(self.entry, self.version, classification)

    def frame(self, split: str):
        """The split as the training function reads it."""
        from hybridflow.training.data import open_dataset

        return open_dataset(self.local_source, self.info()).split(split).frame()


def seed_example(root: Path, model: str = "digits-mlp") -> Seeded:
    """Seed the model's dataset under ``root`` (private storage) and pin its version."""
    from hybridflow.config import load_estate
    from hybridflow.datasets import list_relative, locate, pin_version, seed, sha256_of, split_files

    estate = load_estate(REPO / "config")
    registered = estate.models.get(model)
    entry = estate.datasets.get(registered.dataset)
    seed(entry, root)
    location = locate(entry, root)
    files = split_files(entry, list_relative(location))
    digests = {rel: sha256_of((location.path / rel).read_bytes()) for rels in files.values() for rel in rels}
    version = pin_version(entry.name, entry.effective_classification, location.uri, files, digests)
    version_path = root / f"{entry.name}-version.json"
    version_path.write_bytes(version.to_json())
    return Seeded(root=root, folder=location.path, entry=entry, model=registered, version_path=version_path,
                  version=version)


def job_spec(seeded: Seeded, ckpt_root: Path, *, data: dict | None = None, hparams: dict | None = None,
             replica_root: Path | None = None, **overrides) -> dict:
    """A worker job spec for ``seeded``'s model: local data unless ``data`` says otherwise."""
    from hybridflow.storage.objectstore import StoreSpec

    spec = {
        "run_key": "test-run",
        "model": {"name": seeded.model.name, "entrypoint": seeded.model.entrypoint,
                  "hyperparameters": {**seeded.model.defaults(), **(hparams or {})}},
        "dataset": seeded.info(),
        "data": data or seeded.local_source,
        "checkpoint_store": StoreSpec(kind="local", root=str(ckpt_root)).to_dict(),
        "checkpoint_every_steps": 100,
        "keep": 2,
        "log_every_steps": 100,
    }
    if replica_root is not None:
        spec["checkpoint_replica"] = StoreSpec(kind="local", root=str(replica_root)).to_dict()
    spec.update(overrides)
    return spec


def staged_source(seeded: Seeded, store_root: Path) -> dict:
    """The dataset's split files staged content-addressed with a manifest, as stage_data leaves them."""
    from hybridflow.storage.manifest import DatasetManifest, ManifestEntry, sha256_bytes
    from hybridflow.storage.objectstore import LocalObjectStore, StoreSpec

    store = LocalObjectStore(store_root)
    entries = []
    for rels in seeded.version.splits.values():
        for rel in rels:
            data = (seeded.folder / rel).read_bytes()
            digest = sha256_bytes(data)
            key = f"datasets/{seeded.entry.name}/blobs/{digest[:2]}/{digest}"
            store.put_bytes(key, data)
            entries.append(ManifestEntry(path=rel, key=key, size=len(data), sha256=digest))
    manifest = DatasetManifest(dataset=seeded.entry.name, entries=tuple(entries))
    key = f"datasets/{seeded.entry.name}/versions/{manifest.version}.json"
    store.put_bytes(key, manifest.to_json())
    return {"kind": "manifest", "store": StoreSpec(kind="local", root=str(store_root)).to_dict(), "manifest_key": key}


def held_out_metric(seeded: Seeded, weights: bytes) -> float:
    """The model's registered metric on the held-out split for weights its training function saved."""
    from hybridflow.bundle import ModelCard, Predictor, build_module, inputs_and_target
    from hybridflow.scoring import metric_value

    card = ModelCard(**seeded.model.card(), hyperparameters=seeded.model.defaults())
    import io

    import torch

    module = build_module(card)
    module.load_state_dict(torch.load(io.BytesIO(weights), weights_only=True))
    predictor = Predictor(module.eval(), card)
    x, y = inputs_and_target(seeded.frame(seeded.entry.holdout), card)
    return metric_value(card.metric["name"], y, predictor.predict(x), card.output)
