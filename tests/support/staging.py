"""stage_dataset test fixtures and helpers: a catalogue listing every dataset the staging tests stage,
a fresh bucket on the session's ``rclone serve s3`` per test, a recorder of the requests a store sends,
and small synthetic datasets.

Import the fixtures a test module uses (``catalogue`` with ``stage``) from here."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from tests.unit.test_sovereignty import PUBLIC_US, write_catalogue

from hybridflow.sovereignty import Destination
from hybridflow.staging import StagingSettings, stage_dataset
from hybridflow.storage.s3 import S3ObjectStore
from hybridflow.storage.sources import LocalFolderSource
from hybridflow_examples.digits.data import seed as seed_digits

PREFIX = "cache"
# Every synthetic dataset staged in the staging tests: the guard refuses a dataset its catalogue does not list.
INTERNAL = (
    "digits", "fan", "wide", "swap", "flip", "big", "aband", "packed", "foldered", "shardrot", "shots",
    "progress", "vers", "unread", "clidata", "whole", "parts", "small",
)
NO_PACK = StagingSettings(pack="never")


class Requests:
    """HTTP requests a store sends, through boto3 and through the CRT: (operation, method,
    Content-Length)."""

    def __init__(self, store: S3ObjectStore) -> None:
        self.calls: list[tuple[str, str, int]] = []
        store.client.meta.events.register("before-send.s3", self._on_send)
        store.crt_observers.append(lambda op, method, size: self.calls.append((op, method, size)))

    def _on_send(self, request, **kwargs) -> None:
        op = kwargs.get("event_name", "").rsplit(".", 1)[-1]
        self.calls.append((op, request.method, int(request.headers.get("Content-Length") or 0)))

    @property
    def writes(self) -> list[tuple[str, str, int]]:
        return [c for c in self.calls if c[1] in ("PUT", "POST", "DELETE")]

    @property
    def bytes_sent(self) -> int:
        return sum(n for _, method, n in self.calls if method in ("PUT", "POST"))


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory) -> Path:
    """The staging tests' datasets.yaml: internal data, except where a test is about classification."""
    return write_catalogue(tmp_path_factory.mktemp("config") / "datasets.yaml", {
        **{name: {"classification": "internal"} for name in INTERNAL},
        "open-data": {"classification": "public"},
        "patients": {"classification": "restricted"},
        "records": {"classification": "restricted"},
        "eu-claims": {"classification": "internal", "regions": ["eu"]},
    })


@pytest.fixture
def stage(catalogue):
    """stage_dataset against the module's catalogue, towards a public US cache unless told."""

    def run(source, target, *, destination: Destination = PUBLIC_US, run_key: str = "run-1", **kw):
        return stage_dataset(source, target, destination=destination, catalogue=catalogue, run_key=run_key, **kw)

    return run


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> LocalFolderSource:
    return LocalFolderSource(seed_digits(tmp_path_factory.mktemp("private") / "digits"), name="digits")


def new_store(rclone_s3, label: str = "stage") -> S3ObjectStore:
    endpoint, access, secret, _ = rclone_s3
    s = S3ObjectStore(
        f"hf-{label}-{uuid.uuid4().hex[:10]}",
        prefix=PREFIX,
        endpoint_url=endpoint,
        access_key=access,
        secret_key=secret,
    )
    s.ensure_bucket()
    return s


@pytest.fixture
def store(rclone_s3) -> S3ObjectStore:
    return new_store(rclone_s3)


def settle() -> None:
    # The fixture's rclone lists a file deleted behind its back for up to DIR_CACHE_TIME (100ms).
    time.sleep(0.5)


def blob_file(rclone_s3, store: S3ObjectStore, key: str):
    return rclone_s3[3] / store.bucket / PREFIX / key


def bucket_is_empty(rclone_s3, store: S3ObjectStore) -> None:
    """Nothing at all in the bucket, under any prefix: by the S3 listing and on the server's disk."""
    listed = store.client.list_objects_v2(Bucket=store.bucket)
    assert listed.get("KeyCount", 0) == 0 and "Contents" not in listed, listed.get("Contents")
    assert [p for p in (rclone_s3[3] / store.bucket).rglob("*") if p.is_file()] == []
    endpoint, access, secret, _ = rclone_s3
    whole = S3ObjectStore(store.bucket, endpoint_url=endpoint, access_key=access, secret_key=secret)
    assert whole.multipart_uploads() == []  # no upload started either


def dataset_folder(root: Path, name: str, files: dict[str, bytes]) -> LocalFolderSource:
    folder = root / name
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return LocalFolderSource(folder)


def small_files(n: int, size: int, seed: int = 0) -> dict[str, bytes]:
    rng = __import__("random").Random(seed)
    return {f"class-{i % 10}/img-{i:05d}.bin": rng.randbytes(size) for i in range(n)}
