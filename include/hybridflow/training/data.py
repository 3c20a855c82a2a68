"""The dataset as a training function sees it: ``ctx.dataset.split("train").frame()``.

Every file is checked against the SHA-256 the run pinned before it is parsed: the version
validate_data validated (data read where it lives: a private folder or a private bucket) or the
staged manifest in a cluster's cache (``stage_data`` checked that it is the same version). A file that
changed since, or a corrupt staged copy, stops the worker with an error that says which file.

Data sources in the job spec (``data``)::

    {"kind": "local", "path": "<dataset folder>", "version": "<version json in the run folder>"}
    {"kind": "store", "store": {StoreSpec}, "version": "<version json>"}      # a private bucket
    {"kind": "manifest", "store": {StoreSpec}, "manifest_key": "datasets/<name>/versions/<v>.json"}
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.datasets import DatasetVersion, concat, read_table, samples_table, shard_samples
from hybridflow.errors import DataValidationError
from hybridflow.storage.manifest import DatasetManifest, ManifestEntry, fetch_verified
from hybridflow.storage.objectstore import StoreSpec, open_store

if TYPE_CHECKING:
    import pandas as pd

Fetch = Callable[[str], bytes]


class Split:
    """One split's files, each verified on read."""

    def __init__(self, dataset: str, name: str, files: list[str], fmt: str, fetch: Fetch) -> None:
        self.dataset, self.name, self.paths, self.format, self._fetch = dataset, name, list(files), fmt, fetch

    def files(self) -> Iterator[tuple[str, bytes]]:
        """(relative path, verified bytes) of every file of the split, in name order."""
        for rel in self.paths:
            yield rel, self._fetch(rel)

    def frame(self, columns: list[str] | None = None) -> pd.DataFrame:
        """The split as one table (CSV or Parquet files concatenated; shards as their sample table)."""
        if self.format == "shards":
            frame = samples_table(s for _, data in self.files() for s in shard_samples(data, self.name))
        else:
            frame = concat([read_table(data, self.format, f"{self.dataset}/{rel}") for rel, data in self.files()])
        return frame if columns is None else frame[columns]

    def samples(self) -> Iterator[tuple[str, bytes]]:
        """(member name, bytes) of every sample of a shards split."""
        if self.format != "shards":
            raise TypeError(f"split {self.name} is {self.format}; samples() reads shards, use frame()")
        for rel, data in self.files():
            yield from shard_samples(data, f"{self.dataset}/{rel}")


class Dataset:
    """The run's dataset: its name, format, columns and splits."""

    def __init__(self, info: Mapping[str, Any], fetch: Fetch, splits: Mapping[str, list[str]]) -> None:
        self.name: str = info["name"]
        self.format: str = info["format"]
        self.columns: list[str] = list(info.get("columns") or [])
        self.classification: str = info.get("classification", "restricted")
        self._splits = {k: list(v) for k, v in splits.items()}
        self._fetch = fetch

    @property
    def splits(self) -> list[str]:
        return list(self._splits)

    def split(self, name: str) -> Split:
        if name not in self._splits:
            raise KeyError(f"dataset {self.name} has no split {name!r}; it has {', '.join(self._splits)}")
        return Split(self.name, name, self._splits[name], self.format, self._fetch)


def _verified(entry: ManifestEntry, data: bytes, where: str) -> bytes:
    if len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256:
        raise DataValidationError(
            f"{where} is not the file validate_data checked (size {len(data)}, expected {entry.size}, or its "
            "SHA-256 differs): the data changed since; clear validate_data so the run validates what it trains on"
        )
    return data


def open_dataset(source: Mapping[str, Any], info: Mapping[str, Any], store=None) -> Dataset:
    """The dataset a job spec's ``data`` source and ``dataset`` info describe. ``store`` opens a
    ``store`` or ``manifest`` source where credentials are not in the environment (Airflow tasks)."""
    kind = source.get("kind")
    if kind in ("local", "store"):
        version = DatasetVersion.from_json(Path(source["version"]).read_bytes())
        entries = {e.path: e for e in version.manifest.entries}
        if kind == "local":
            root = Path(source["path"])

            def read(rel: str) -> bytes:
                return (root / rel).read_bytes()
        else:
            store = store or open_store(StoreSpec.from_dict(source["store"]))

            def read(rel: str) -> bytes:
                return store.get_bytes(entries[rel].key)

        def fetch(rel: str) -> bytes:
            if rel not in entries:
                raise DataValidationError(f"{rel} is not part of the validated version of {info['name']}")
            return _verified(entries[rel], read(rel), f"{info['name']}/{rel}")

        return Dataset(info, fetch, version.splits)
    if kind == "manifest":
        store = store or open_store(StoreSpec.from_dict(source["store"]))
        manifest = DatasetManifest.from_json(store.get_bytes(source["manifest_key"]))

        def fetch_staged(rel: str) -> bytes:
            return fetch_verified(store, manifest.entry(rel))

        return Dataset(info, fetch_staged, info["splits"])
    raise ValueError(f"data source kind {kind!r} is not supported; use 'local', 'store' or 'manifest'")
