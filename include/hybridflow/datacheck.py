"""Admission's look at the data and the code before anything runs: the dataset's location and
files, its expectation suites, its header against the catalogue's schema, and the model's entry
points. Everything here only reads; a problem is an :class:`AdmissionError` naming what to fix."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hybridflow.config.catalogue import DatasetEntry
from hybridflow.config.registry import EntrypointError, ModelEntry, resolve
from hybridflow.datasets import header_problems, list_relative, locate, open_file, read_header, split_files
from hybridflow.errors import AdmissionError, DataValidationError


def check_dataset(entry: DatasetEntry, private_root: Path, file_roots: Sequence[Path]) -> str:
    """The dataset is where the catalogue says, its splits have files, its suites are GX suites and
    its files start with the schema's columns. Returns the resolved location (a URI)."""
    from hybridflow.validation import SuiteError, check_suite

    location = locate(entry, private_root, file_roots)
    store = None
    if not location.is_folder:
        from hybridflow.storage.objectstore import open_store

        try:
            store = open_store(location.store_spec())
        except Exception as exc:  # noqa: BLE001 - the connection's own error says which id
            raise AdmissionError("dataset", f"datasets.yaml datasets.{entry.name}.conn_id: cannot open "
                                 f"{entry.location}: {exc}") from None
    listing = list_relative(location, store)
    sizes = dict(listing)
    files = split_files(entry, listing)
    for split in entry.splits:
        suite = entry.suite_of(split)
        where = f"{entry.location}/{suite}"
        if suite not in sizes:
            raise AdmissionError("dataset", f"datasets.yaml datasets.{entry.name}: the suite of split {split}, {where}, "
                                 "does not exist; keep the GX suite file with the data")
        with open_file(location, suite, sizes[suite], store) as fh:
            raw = fh.read()
        try:
            check_suite(raw, where)
        except SuiteError as exc:
            raise AdmissionError("dataset", f"{exc}; fix the suite file (datasets.yaml datasets.{entry.name})") from None
    if entry.format != "shards":
        for rels in files.values():
            rel = rels[0]
            where = f"{entry.location}/{rel}"
            try:
                with open_file(location, rel, sizes[rel], store) as fh:
                    found = read_header(fh, entry.format, where)
            except DataValidationError as exc:
                raise AdmissionError("dataset", f"{exc}; datasets.yaml says format {entry.format}") from None
            problems = header_problems(entry, found, where)
            if problems:
                raise AdmissionError("dataset", f"{problems[0]}; fix the data or the schema in datasets.yaml "
                                     f"datasets.{entry.name}.schema" + (f" (+{len(problems) - 1} more problems)"
                                                                       if len(problems) > 1 else ""))
    return location.uri if location.path is None else location.path.as_uri()


def dataset_bytes(entry: DatasetEntry, private_root: Path, file_roots: Sequence[Path]) -> int:
    """Bytes of every file of the dataset where it lives: at most what staging it would copy."""
    location = locate(entry, private_root, file_roots)
    store = None
    if not location.is_folder:
        from hybridflow.storage.objectstore import open_store

        store = open_store(location.store_spec())
    return sum(size for _, size in list_relative(location, store))


def check_entrypoints(model: ModelEntry) -> None:
    """Both entry points import here and take one argument (train(ctx), build(hparams))."""
    for key, argument in (("entrypoint", "ctx"), ("build", "hparams")):
        try:
            resolve(getattr(model, key), argument=argument)
        except EntrypointError as exc:
            raise AdmissionError("model", f"models.yaml models.{model.name}.{key}: {exc}") from None
