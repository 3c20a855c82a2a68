"""A run's data: validated where it lives, pinned, and read back verified by every later step.

validate_data reads every split file once (from the private folder or the private bucket),
checks the schema and the dataset's expectation suites, and pins the version it checked: the size
and SHA-256 of every split file, kept in the run's folder (``dataset-version.json``). Training,
evaluation, compression and the deploy smoke test read the data through that version, so a file
changed after validation is refused instead of silently used.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hybridflow.config.catalogue import DatasetEntry
from hybridflow.datasets import (
    DatasetVersion,
    Location,
    concat,
    list_relative,
    locate,
    pin_version,
    read_table,
    samples_table,
    schema_problems,
    sha256_of,
    shard_samples,
    split_files,
)
from hybridflow.errors import DataValidationError
from hybridflow.runs import run_dir, write_json_atomic

VERSION_FILE = "dataset-version.json"


def version_path(private_root: Path, run_key: str) -> Path:
    return run_dir(private_root, run_key) / VERSION_FILE


def _store_of(location: Location):
    from hybridflow.storage.objectstore import open_store

    return None if location.is_folder else open_store(location.store_spec())


def _read(location: Location, store, rel: str) -> bytes:
    if location.path is not None:
        return (location.path / rel).read_bytes()
    return store.get_bytes(f"{location.prefix}/{rel}")


def validate(entry: DatasetEntry, classification: str, run_key: str, *, private_root: Path,
             file_roots: list[Path], log) -> dict[str, Any]:
    """Read, check and pin the dataset for run ``run_key``; DataValidationError with a readable
    report when the data does not match its schema or its suites."""
    from hybridflow.validation import check_suite, validate_frames

    started = time.monotonic()
    location = locate(entry, private_root, file_roots)
    store = _store_of(location)
    files = split_files(entry, list_relative(location, store))
    report_dir = run_dir(private_root, run_key) / "validation"
    report_dir.mkdir(parents=True, exist_ok=True)
    digests: dict[str, tuple[int, str]] = {}
    frames, suites, offsets, problems = {}, {}, {}, []
    read_s = 0.0
    hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pin")
    for split, rels in files.items():
        t0 = time.monotonic()
        parts, samples = [], []
        for rel in rels:
            data = _read(location, store, rel)
            # Hashing and parsing both release the GIL on big buffers: pin and parse at once.
            digest = hasher.submit(sha256_of, data)
            where = f"{entry.location}/{rel}"
            if entry.format == "shards":
                samples.extend(shard_samples(data, where))
            else:
                parts.append(read_table(data, entry.format, where))
            digests[rel] = digest.result()
            del data
        frame = samples_table(samples) if entry.format == "shards" else concat(parts)
        read_s += time.monotonic() - t0
        problems += schema_problems(entry, frame, f"{split} ({', '.join(rels)})")
        frames[split] = frame
        suite = entry.suite_of(split)
        suites[split] = check_suite(_read(location, store, suite), f"{entry.location}/{suite}")
        if entry.format == "csv" and len(rels) == 1:
            offsets[split] = 2  # row i is line i + 2 of the file: one header line, lines counted from 1
    hasher.shutdown()
    if problems:
        text = (f"Data validation FAILED for {entry.name} ({entry.location}): the data does not match its schema "
                "in datasets.yaml\n" + "\n".join(f"  - {p}" for p in problems))
        (report_dir / "validation-summary.txt").write_text(text + "\n")
        raise DataValidationError(text)
    summary = validate_frames(entry.name, frames, suites, report_dir=report_dir, line_offset=offsets)
    key_of = None if location.is_folder else {rel: f"{location.prefix}/{rel}" for rel in digests}
    version = pin_version(entry.name, classification, location.uri, files, digests, key_of)
    path = version_path(private_root, run_key)
    path.write_bytes(version.to_json())
    log.info("Dataset %s version %s pinned: %d files, %d bytes read in %.2f s", entry.name, version.version,
             len(digests), sum(size for size, _ in digests.values()), read_s)
    return {**summary.to_xcom(), "version": version.version, "version_path": str(path),
            "read_s": round(read_s, 3), "seconds": round(time.monotonic() - started, 3)}


def read_version(private_root: Path, run_key: str) -> DatasetVersion:
    path = version_path(private_root, run_key)
    try:
        return DatasetVersion.from_json(path.read_bytes())
    except FileNotFoundError:
        raise DataValidationError(f"{path} is missing: the run's data was not validated; clear validate_data") from None


def dataset_info(entry: DatasetEntry, version: DatasetVersion, classification: str) -> dict[str, Any]:
    """What the training function learns of its dataset (the job spec's ``dataset``)."""
    return {"name": entry.name, "format": entry.format, "splits": version.splits,
            "columns": [n for n, _, _ in entry.columns], "classification": classification,
            "version": version.version, "holdout": entry.holdout}


def source_where_it_lives(entry: DatasetEntry, private_root: Path, run_key: str,
                          file_roots: list[Path]) -> tuple[dict[str, Any], dict[str, str]]:
    """The data source (and the credentials in the environment) for reading the dataset in place:
    a private folder, or the private bucket through its Connection."""
    source, spec = _in_place(locate(entry, private_root, file_roots), private_root, run_key)
    return source, spec.credential_env() if spec is not None else {}


def _in_place(location: Location, private_root: Path, run_key: str):
    """(data source, the bucket's StoreSpec or None for a folder)."""
    version = str(version_path(private_root, run_key))
    if location.path is not None:
        return {"kind": "local", "path": str(location.path), "version": version}, None
    spec = location.store_spec()
    return {"kind": "store", "store": spec.to_dict(), "version": version}, spec


def open_validated(entry: DatasetEntry, run_key: str, classification: str, *, private_root: Path,
                   file_roots: list[Path]):
    """The run's dataset, read where it lives, every file checked against the pinned version."""
    from hybridflow.storage.objectstore import open_store
    from hybridflow.training.data import open_dataset

    version = read_version(private_root, run_key)
    source, spec = _in_place(locate(entry, private_root, file_roots), private_root, run_key)
    store = open_store(spec) if spec is not None else None  # credentials from the Connection, not the env
    return open_dataset(source, dataset_info(entry, version, classification), store=store)


def check_staged(version: DatasetVersion, staged_manifest, dataset: str) -> None:
    """The staged copy holds exactly the files validate_data checked."""
    staged = {e.path: e for e in staged_manifest.entries}
    for e in version.manifest.entries:
        got = staged.get(e.path)
        if got is None or got.sha256 != e.sha256 or got.size != e.size:
            raise DataValidationError(
                f"{dataset}/{e.path} changed after validate_data checked it (the staged copy differs); clear "
                "validate_data so the run validates the data it trains on"
            )


def write_staging(private_root: Path, run_key: str, body: dict) -> None:
    write_json_atomic(run_dir(private_root, run_key) / "staging.json", body)

