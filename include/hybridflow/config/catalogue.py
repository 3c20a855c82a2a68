"""The dataset catalogue (``config/datasets.yaml``): every dataset described once, by its owner.

An entry says where the data lives (a folder in private storage, a folder under one of the
configured ``file://`` roots, or a prefix of a bucket on a private S3 endpoint), its format (CSV or
Parquet files, or packed tar shards of samples), its splits, its schema, the Great Expectations
suite that checks it (a GX 1.x suite file kept with the data) and its classification with the
regions or jurisdictions it may be processed in::

    datasets:
      claims:
        owner: risk-team
        location: private://datasets/claims     # or file:///srv/data/claims, or s3://bucket/prefix
        conn_id: claims_store                   # s3:// only: the private endpoint's Airflow Connection
        format: parquet                         # csv | parquet | shards
        splits:
          train: {files: [train/*.parquet]}
          test: {files: [test/*.parquet], suite: expectations/test.json}
        holdout: test                           # the split evaluation scores on (default: test)
        suite: expectations/train.json          # relative to the location; per-split override above
        schema:
          - {name: "feature_{0..29}", type: float}   # {a..b} numbers a run of columns
          - {name: label, type: int}
        classification: restricted              # public | internal | restricted (missing: restricted)
        regions: [eu]                           # cluster regions or jurisdictions; empty: anywhere

The classification belongs to the data: a run may raise it (``classification`` Param), never lower
it. Placement and the staging guard both read this file; the guard re-reads it itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from hybridflow.config.base import _Model
from hybridflow.errors import ConfigError

DATASETS_FILE = "datasets.yaml"

Classification = Literal["public", "internal", "restricted"]
CLASSIFICATIONS: tuple[str, ...] = ("public", "internal", "restricted")  # least to most sensitive
UNCLASSIFIED = "restricted"  # what an entry without a classification is treated as
ColumnType = Literal["int", "float", "bool", "string"]
DatasetFormat = Literal["csv", "parquet", "shards"]
# The per-sample table a shards dataset is validated as (one row per tar member).
SHARD_SAMPLE_SCHEMA = (("key", "string"), ("extension", "string"), ("size", "int"))

PRIVATE_SCHEME = "private://"
FILE_SCHEME = "file://"
S3_SCHEME = "s3://"
_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9_-]*[a-z0-9])?$")


def expand_names(pattern: str) -> list[str]:
    """``f_{0..29}`` -> ``f_0 .. f_29`` (one range per name; none: the name itself)."""
    found = _RANGE.findall(pattern)
    if not found:
        return [pattern]
    if len(found) > 1:
        raise ValueError(f"{pattern!r} has more than one {{a..b}} range; use one per name")
    lo, hi = (int(v) for v in found[0])
    if hi < lo:
        raise ValueError(f"{pattern!r}: range {{{lo}..{hi}}} runs backwards; write {{{hi}..{lo}}} as {{{lo}..{hi}}}")
    return [_RANGE.sub(str(i), pattern) for i in range(lo, hi + 1)]


def rank(classification: str) -> int:
    return CLASSIFICATIONS.index(classification)


def stricter(a: str, b: str) -> str:
    return a if rank(a) >= rank(b) else b


class Column(_Model):
    name: str = Field(min_length=1)
    type: ColumnType
    nullable: bool = False


class SplitSpec(_Model):
    # Paths or glob patterns relative to the dataset's location; matched files are read in name order.
    files: list[str] = Field(min_length=1)
    suite: str | None = Field(default=None, min_length=1)  # overrides the dataset's suite

    @field_validator("files")
    @classmethod
    def _relative(cls, files: list[str]) -> list[str]:
        for f in files:
            if f.startswith("/") or ".." in f.split("/") or not f.strip():
                raise ValueError(f"{f!r} must be a path inside the dataset's location (no leading '/', no '..')")
        return files


class DatasetEntry(_Model):
    location: str = Field(min_length=1)
    conn_id: str | None = Field(default=None, min_length=1)
    format: DatasetFormat
    splits: dict[str, SplitSpec] = Field(min_length=1)
    holdout: str = "test"
    suite: str | None = Field(default=None, min_length=1)
    # Columns and types of every split (csv and parquet); shards are checked as a table of samples.
    schema_: list[Column] = Field(default_factory=list, alias="schema")
    classification: Classification | None = None
    regions: list[str] = Field(default_factory=list)
    owner: str | None = None
    description: str = ""
    # Examples only: "package.module:function(root: Path)" that writes the data (``hybridflow seed``).
    seed: str | None = Field(default=None, min_length=1)

    _name: str = ""

    @model_validator(mode="after")
    def _consistent(self) -> DatasetEntry:
        scheme = next((s for s in (PRIVATE_SCHEME, FILE_SCHEME, S3_SCHEME) if self.location.startswith(s)), None)
        if scheme is None:
            raise ValueError(
                f"location {self.location!r} has an unknown scheme; use private://<folder>, file:///<folder> "
                "under a configured root, or s3://<bucket>/<prefix> with conn_id"
            )
        if scheme == S3_SCHEME and not self.conn_id:
            raise ValueError("an s3:// location needs conn_id: the Airflow Connection of the private S3 endpoint")
        if scheme != S3_SCHEME and self.conn_id:
            raise ValueError("conn_id is only used with an s3:// location; remove it")
        if self.holdout not in self.splits:
            raise ValueError(f"holdout {self.holdout!r} is not one of the splits ({', '.join(self.splits)})")
        if self.format != "shards" and not self.schema_:
            raise ValueError(f"format {self.format} needs a schema: [{{name, type}}, ...] of its columns")
        if self.format == "shards" and self.schema_:
            raise ValueError("format shards is checked as a table of samples (key, extension, size); remove schema")
        missing = [s for s, spec in self.splits.items() if not (spec.suite or self.suite)]
        if missing:
            raise ValueError(f"splits {', '.join(missing)} have no expectation suite; set suite (a GX 1.x suite file)")
        return self

    @property
    def name(self) -> str:
        return self._name

    @property
    def effective_classification(self) -> str:
        """What the data is handled as: its classification, or restricted when it has none."""
        return self.classification or UNCLASSIFIED

    @property
    def columns(self) -> list[tuple[str, str, bool]]:
        """(name, type, nullable) of every column, ranges expanded, in order."""
        if self.format == "shards":
            return [(n, t, False) for n, t in SHARD_SAMPLE_SCHEMA]
        return [(name, c.type, c.nullable) for c in self.schema_ for name in expand_names(c.name)]

    @property
    def column_types(self) -> dict[str, str]:
        return {name: kind for name, kind, _ in self.columns}

    def suite_of(self, split: str) -> str:
        return self.splits[split].suite or self.suite  # type: ignore[return-value]


@dataclass(frozen=True)
class Catalogue:
    path: Path
    datasets: dict[str, DatasetEntry]

    def get(self, name: str) -> DatasetEntry:
        """The entry named ``name``; KeyError says which names exist."""
        try:
            return self.datasets[name]
        except KeyError:
            raise KeyError(
                f"dataset {name!r} is not in {self.path.name}; use one of: {', '.join(sorted(self.datasets))} "
                "(or describe it there)"
            ) from None


class DatasetsFile(_Model):
    datasets: dict[str, DatasetEntry] = Field(default_factory=dict)


def check_catalogue(path: Path, datasets: Mapping[str, DatasetEntry], known_regions: Iterable[str] | None) -> list[str]:
    """Cross-checks a catalogue against the estate: names and regions (unless ``known_regions`` is None)."""
    problems = []
    known = None if known_regions is None else sorted(set(known_regions))
    for name, entry in datasets.items():
        at = f"{path}: datasets.{name}"
        if not _NAME_RE.match(name):
            problems.append(f"{at}: dataset names use lowercase letters, numbers, '-' and '_' (they name folders)")
        for i, region in enumerate(entry.regions):
            if known is not None and region not in known:
                problems.append(
                    f"{at}.regions[{i}]: unknown region {region!r}; use a region or jurisdiction of a cluster in "
                    f"clusters.yaml: {', '.join(known)}"
                )
        try:
            names = [n for n, _, _ in entry.columns]
        except ValueError as exc:
            problems.append(f"{at}.schema: {exc}")
            continue
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            problems.append(f"{at}.schema: columns {', '.join(dupes)} are listed twice; list each column once")
    return problems


def parse_catalogue(path: Path, known_regions: Iterable[str] | None) -> Catalogue:
    """Read and check ``datasets.yaml``; ConfigError names the key and the fix."""
    from hybridflow.config.reading import _validate

    if not path.is_file():
        return Catalogue(path=path, datasets={})  # nothing described: every dataset is unknown
    parsed = _validate(DatasetsFile, path, allow_empty=True)
    problems = check_catalogue(path, parsed.datasets, known_regions)
    if problems:
        raise ConfigError("invalid dataset catalogue:\n" + "\n".join(f"  - {p}" for p in problems))
    for name, entry in parsed.datasets.items():
        entry._name = name
    return Catalogue(path=path, datasets=dict(parsed.datasets))


def read_catalogue(path: Path) -> Catalogue:
    """The catalogue file as it is on disk now, never from a cache: the staging guard's own reading.
    Unlike an estate that never trains, the guard refuses to decide without the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: file not found; the staging guard reads each dataset's classification there")
    return parse_catalogue(path, known_regions=None)
