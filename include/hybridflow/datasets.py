"""Finding and reading a catalogue dataset where it lives, and pinning the version a run uses.

- :func:`locate` turns a catalogue entry's ``location`` into a folder (``private://`` under private
  storage, ``file://`` under one of ``data.file_roots``, symlinks resolved before either check) or a
  prefix of a bucket on a private S3 endpoint (``s3://``, opened through the entry's Connection);
- :func:`split_files` expands each split's file patterns;
- :func:`read_table` parses one CSV or Parquet file, :func:`shard_samples` lists a tar shard's samples;
- :func:`schema_problems` / :func:`header_problems` compare data with the catalogue's schema (the
  whole table at validation, the header at admission);
- :class:`DatasetVersion` is the SHA-256 of every split file a run validated: training reads the
  same bytes or refuses (``hybridflow.training.data``).

Nothing here imports Airflow or torch at module level: the training worker reads data through it.
"""

from __future__ import annotations

import fnmatch
import io
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridflow.config.catalogue import FILE_SCHEME, PRIVATE_SCHEME, S3_SCHEME, DatasetEntry
from hybridflow.errors import AdmissionError, DataValidationError
from hybridflow.storage.manifest import DatasetManifest, ManifestEntry, sha256_bytes
from hybridflow.storage.sources import skipped

if TYPE_CHECKING:
    import pandas as pd



@dataclass(frozen=True)
class Location:
    """Where a dataset's files are: a folder on this machine, or a prefix of a private bucket."""

    uri: str
    path: Path | None = None  # folder datasets
    conn_id: str | None = None  # s3 datasets: the private endpoint's Airflow Connection
    bucket: str | None = None
    prefix: str = ""

    @property
    def is_folder(self) -> bool:
        return self.path is not None

    def store_spec(self):
        """The private bucket as a StoreSpec with credentials (reads the Connection: tasks only)."""
        from hybridflow.hooks.object_store import ObjectStoreHook

        return ObjectStoreHook(self.conn_id).store_spec(self.bucket or "", "")

    def source(self, name: str):
        """The dataset as a staging source (its files listed and hashed incrementally)."""
        from hybridflow.storage.objectstore import open_store
        from hybridflow.storage.sources import LocalFolderSource, S3DatasetSource

        if self.path is not None:
            return LocalFolderSource(self.path, name=name, uri=self.uri)
        return S3DatasetSource(open_store(self.store_spec()), self.prefix, name=name)


def _inside(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
    except ValueError:
        return False
    return True


def locate(entry: DatasetEntry, private_root: Path, file_roots: Sequence[Path] = ()) -> Location:
    """Resolve ``entry.location``; AdmissionError (field ``dataset``) names the catalogue key and the fix.

    Folders are resolved (every symlink followed) before they are checked against private storage
    or the configured roots, so a link cannot lead a dataset out of them.
    """
    where = f"datasets.yaml datasets.{entry.name}.location"
    uri = entry.location
    if uri.startswith(S3_SCHEME):
        bucket, _, prefix = uri[len(S3_SCHEME):].partition("/")
        if not bucket or not prefix.strip("/"):
            raise AdmissionError("dataset", f"{where}: {uri!r} needs a bucket and a prefix, s3://<bucket>/<prefix>")
        return Location(uri=uri, conn_id=entry.conn_id, bucket=bucket, prefix=prefix.strip("/"))
    if uri.startswith(PRIVATE_SCHEME):
        rel = uri[len(PRIVATE_SCHEME):].strip("/")
        if not rel or ".." in rel.split("/"):
            raise AdmissionError("dataset", f"{where}: {uri!r} is not a folder in private storage; use private://<folder>")
        roots = [Path(private_root).resolve()]
        raw = Path(private_root) / rel
        allowed = "private storage"
    else:
        raw = Path(uri[len(FILE_SCHEME):])
        if not raw.is_absolute():
            raise AdmissionError("dataset", f"{where}: {uri!r} must be an absolute path, file:///<folder>")
        roots = [Path(r).resolve() for r in file_roots]
        allowed = "data.file_roots (" + (", ".join(map(str, roots)) or "none configured") + ")"
    path = raw.resolve()
    if not any(_inside(path, root) for root in roots):
        via = f" (it resolves to {path} through a symlink)" if path != raw.absolute() else ""
        fix = ("move the data into one of them or add its folder to data.file_roots in pipeline.yaml"
               if uri.startswith(FILE_SCHEME) else "keep private datasets inside private storage")
        raise AdmissionError("dataset", f"{where}: {uri!r} is outside {allowed}{via}; {fix}")
    if not path.is_dir():
        raise AdmissionError("dataset", f"{where}: {uri!r} does not exist ({path}); seed or copy the data there")
    return Location(uri=uri, path=path)


def list_relative(location: Location, store=None) -> list[tuple[str, int]]:
    """(relative path, size) of every visible file of the dataset."""
    if location.path is not None:
        root = location.path
        out = []
        for p in root.rglob("*"):
            if p.is_file():
                rel = p.relative_to(root).as_posix()
                if not skipped(rel):  # what staging skips is not part of the dataset either
                    # A symlinked file must not pull in data from outside the dataset either.
                    if not _inside(p.resolve(), root):
                        raise AdmissionError("dataset", f"{p} links outside the dataset folder {root}; copy the file in")
                    out.append((rel, p.stat().st_size))
        return sorted(out)
    prefix = f"{location.prefix}/"
    return sorted((info.key[len(prefix):], info.size) for info in store.list(prefix) if not skipped(info.key[len(prefix):]))


def split_files(entry: DatasetEntry, listing: Iterable[tuple[str, int]]) -> dict[str, list[str]]:
    """Split name -> the files its patterns match, in name order; AdmissionError if one matches nothing."""
    names = [rel for rel, _ in listing]
    out: dict[str, list[str]] = {}
    for split, spec in entry.splits.items():
        matched: list[str] = []
        for pattern in spec.files:
            hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                raise AdmissionError(
                    "dataset",
                    f"datasets.yaml datasets.{entry.name}.splits.{split}: no file matches {pattern!r} in "
                    f"{entry.location}; fix the pattern or add the data",
                )
            matched.extend(h for h in hits if h not in matched)
        out[split] = sorted(matched)
    return out


# -- reading -----------------------------------------------------------------------------------------
def read_table(data: bytes, fmt: str, where: str) -> pd.DataFrame:
    """One CSV or Parquet file; DataValidationError says why it cannot be read."""
    import pandas as pd

    try:
        if fmt == "csv":
            return pd.read_csv(io.BytesIO(data))
        if fmt == "parquet":
            return pd.read_parquet(io.BytesIO(data))
    except pd.errors.EmptyDataError:
        raise DataValidationError(f"{where} is empty (no header, no rows); expected a CSV with a header") from None
    except Exception as exc:  # noqa: BLE001 - parsers raise many types; the first line says what
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataValidationError(f"{where} is not a readable {fmt.upper()} file: {first}") from None
    raise ValueError(f"format {fmt!r} is not a table format")


def concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    import pandas as pd

    return frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)


def shard_samples(data: bytes, where: str) -> list[tuple[str, bytes]]:
    """The (member name, bytes) samples of one tar shard, in order."""
    import tarfile

    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isfile()]  # type: ignore[union-attr]
    except tarfile.TarError as exc:
        raise DataValidationError(f"{where} is not a readable tar shard: {exc}") from None


def samples_table(samples: Iterable[tuple[str, bytes]]) -> pd.DataFrame:
    """The table a shards dataset is validated as: one row per sample (key, extension, size)."""
    import pandas as pd

    rows = []
    for name, data in samples:
        key, dot, ext = name.rpartition(".")
        rows.append((key if dot else name, ext if dot else "", len(data)))
    return pd.DataFrame(rows, columns=["key", "extension", "size"]).astype({"size": "int64"})


# -- schema ------------------------------------------------------------------------------------------
def _type_of_dtype(dtype: Any) -> str:
    kind = getattr(dtype, "kind", "O")
    if kind in "iu":
        return "int"
    if kind == "f":
        return "float"
    if kind == "b":
        return "bool"
    return "string"


def _fits(expected: str, found: str) -> bool:
    return expected == found or (expected == "float" and found == "int")


def header_problems(entry: DatasetEntry, found: Sequence[tuple[str, str]], where: str) -> list[str]:
    """Compare (column, type) pairs read from the data with the catalogue's schema."""
    expected = [(n, t) for n, t, _ in entry.columns]
    names = [n for n, _ in found]
    want = [n for n, _ in expected]
    problems = []
    missing = [n for n in want if n not in names]
    extra = [n for n in names if n not in want]
    if missing:
        problems.append(f"{where} has no column {_clip(missing)}")
    if extra:
        problems.append(f"{where} has columns the schema does not list: {_clip(extra)}")
    if not missing and not extra and names != want:
        problems.append(f"{where} has the schema's columns in another order")
    types = dict(found)
    for name, kind in expected:
        if name in types and not _fits(kind, types[name]):
            problems.append(f"{where}: column {name} holds {types[name]} values, the schema says {kind}")
    return problems


def schema_problems(entry: DatasetEntry, frame: pd.DataFrame, where: str) -> list[str]:
    """The whole table against the schema: columns, order, types and nulls where not allowed."""
    found = [(str(c), _type_of_dtype(frame[c].dtype)) for c in frame.columns]
    problems = header_problems(entry, found, where)
    nullable = {n: null for n, _, null in entry.columns}
    for name in frame.columns:
        if not nullable.get(name, True):
            count = int(frame[name].isna().sum())
            if count:
                problems.append(f"{where}: column {name} has {count} empty values; the schema does not allow nulls")
    return problems


class _RangeFile(io.RawIOBase):
    """A read-only, seekable view of one object, read in ranges: Parquet's schema sits in its footer
    and a CSV's header at its start, so admission never downloads the whole file."""

    def __init__(self, store, key: str, size: int) -> None:
        self._store, self._key, self._size, self._pos = store, key, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self._size - self._pos)
        if n <= 0:
            return 0
        data = self._store.get_range(self._key, self._pos, n)
        buf[: len(data)] = data
        self._pos += len(data)
        return len(data)


def open_file(location: Location, rel: str, size: int, store=None):
    """A binary file object for one of the dataset's files (ranged reads on a bucket)."""
    if location.path is not None:
        return open(location.path / rel, "rb")  # noqa: SIM115 - the caller closes it
    return io.BufferedReader(_RangeFile(store, f"{location.prefix}/{rel}", size), buffer_size=1 << 16)


def read_header(fh, fmt: str, where: str) -> list[tuple[str, str]]:
    """(column, type) pairs from a file's start: Parquet's own schema, or the types pandas infers from
    a CSV's first rows (admission compares these with the schema before any work starts)."""
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            schema = pq.read_schema(fh)
        except Exception as exc:  # noqa: BLE001
            raise DataValidationError(f"{where} is not a readable Parquet file: {exc}") from None
        out = []
        for field in schema:
            t = field.type
            kind = ("int" if pa.types.is_integer(t) else "float" if pa.types.is_floating(t)
                    else "bool" if pa.types.is_boolean(t) else "string")
            out.append((field.name, kind))
        return out
    import pandas as pd

    try:
        frame = pd.read_csv(fh, nrows=1000)
    except Exception as exc:  # noqa: BLE001
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataValidationError(f"{where} is not a readable CSV file: {first}") from None
    return [(str(c), _type_of_dtype(frame[c].dtype)) for c in frame.columns]


def _clip(items: list[str], limit: int = 6) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" (+{len(items) - limit} more)" if len(items) > limit else "")


# -- the version a run uses --------------------------------------------------------------------------
@dataclass(frozen=True)
class DatasetVersion:
    """Every split file of a dataset with its size and SHA-256, as validated."""

    manifest: DatasetManifest
    splits: dict[str, list[str]]

    @property
    def version(self) -> str:
        return self.manifest.version

    def to_json(self) -> bytes:
        return json.dumps({"manifest": json.loads(self.manifest.to_json()), "splits": self.splits},
                          sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> DatasetVersion:
        body = json.loads(raw)
        return cls(manifest=DatasetManifest.from_json(json.dumps(body["manifest"]).encode()),
                   splits={k: list(v) for k, v in body["splits"].items()})


def pin_version(name: str, classification: str, source_uri: str, splits: Mapping[str, list[str]],
                digests: Mapping[str, tuple[int, str]], key_of: Mapping[str, str] | None = None) -> DatasetVersion:
    """The version made of ``digests`` (relative path -> (size, SHA-256) of the bytes validated)."""
    entries = tuple(
        ManifestEntry(path=rel, key=(key_of or {}).get(rel, rel), size=size, sha256=sha)
        for rel, (size, sha) in sorted(digests.items())
    )
    manifest = DatasetManifest(dataset=name, entries=entries, source_uri=source_uri, sensitivity=classification)
    return DatasetVersion(manifest=manifest, splits={k: list(v) for k, v in splits.items()})


def sha256_of(data: bytes) -> tuple[int, str]:
    return len(data), sha256_bytes(data)


def seed(entry: DatasetEntry, private_root: Path, file_roots: Sequence[Path] = ()) -> Path:
    """Write an example dataset where the catalogue says it lives, with its ``seed`` function."""
    from hybridflow.config.registry import resolve

    if entry.seed is None:
        raise ValueError(f"dataset {entry.name} has no seed function in datasets.yaml; its owner provides the data")
    if entry.location.startswith(S3_SCHEME):
        raise ValueError(f"dataset {entry.name} lives in a bucket ({entry.location}); seeding writes folders only")
    if entry.location.startswith(PRIVATE_SCHEME):
        folder = Path(private_root) / entry.location[len(PRIVATE_SCHEME):].strip("/")
    else:
        folder = Path(entry.location[len(FILE_SCHEME):])
    folder.mkdir(parents=True, exist_ok=True)
    resolve(entry.seed, argument="folder")(folder)
    return locate(entry, private_root, file_roots).path  # type: ignore[return-value]
