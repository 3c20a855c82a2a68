"""Where replicated sets live in a DR store, and what each manifest says its objects hold.

::

    datasets/<name>/blobs/<ab>/<sha256>                  a dataset file, content-addressed (as staging)
    datasets/<name>/versions/<version>.json              its version's manifest (as staging)
    models/<endpoint>/<version>/<file>                   a served model bundle's files
    models/<endpoint>/<version>/MANIFEST.json            {"format", "endpoint", "model", "version", "objects"}
    checkpoints/<run_key>/step-<step>/<shard>            a run's checkpoint, laid out as training writes it
    checkpoints/<run_key>/step-<step>/MANIFEST.json      its checkpoint manifest

A dataset version in this layout can be read like a staged one, and ``checkpoints/<run_key>`` is a
checkpoint place a resumed run can load from.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime

from hybridflow.storage.manifest import DatasetManifest
from hybridflow.training.checkpoint import MANIFEST_NAME, Manifest

MODEL_FORMAT = "hybridflow.dr-model/v1"
MODEL_MANIFEST = "MANIFEST.json"

_DATASET = re.compile(r"^datasets/[^/]+/versions/[^/]+\.json$")
_MODEL = re.compile(r"^models/[^/]+/[^/]+/" + re.escape(MODEL_MANIFEST) + "$")
_CHECKPOINT = re.compile(r"^checkpoints/([^/]+)/step-(\d{9})/" + re.escape(MANIFEST_NAME) + "$")
MANIFEST_PREFIXES = ("datasets/", "models/", "checkpoints/")


@dataclass(frozen=True)
class Expected:
    """One object a DR manifest names: ``size`` bytes with ``sha256`` at ``key`` (from ``offset``
    for a file packed in a shard)."""

    key: str
    size: int
    sha256: str
    offset: int | None = None


def model_prefix(endpoint: str, version: str) -> str:
    return f"models/{endpoint}/{version}/"


def model_manifest_key(endpoint: str, version: str) -> str:
    return model_prefix(endpoint, version) + MODEL_MANIFEST


def checkpoint_prefix(run_key: str) -> str:
    return f"checkpoints/{run_key}/"


def model_manifest(endpoint: str, model: str, version: str, objects: list) -> bytes:
    body = {
        "format": MODEL_FORMAT, "endpoint": endpoint, "model": model, "version": version,
        "objects": [{"key": o.key, "size": o.size, "sha256": o.sha256} for o in sorted(objects, key=lambda o: o.key)],
        "replicated_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    return json.dumps(body, indent=2, sort_keys=True).encode()


def kind_of(manifest_key: str) -> str | None:
    """dataset, model or checkpoint for a DR manifest's key; None for any other key."""
    if _DATASET.match(manifest_key):
        return "dataset"
    if _MODEL.match(manifest_key):
        return "model"
    if _CHECKPOINT.match(manifest_key):
        return "checkpoint"
    return None


def name_of(manifest_key: str) -> str:
    """The dataset, endpoint or run a manifest key belongs to."""
    return manifest_key.split("/")[1]


def expected_objects(manifest_key: str, raw: bytes) -> list[Expected]:
    """The objects the manifest at ``manifest_key`` names; ValueError when it cannot be read."""
    kind = kind_of(manifest_key)
    if kind == "dataset":
        try:
            m = DatasetManifest.from_json(raw)
        except Exception as exc:  # noqa: BLE001 - StagingError, JSON and key errors alike
            raise ValueError(f"unreadable dataset manifest ({exc})") from exc
        return [Expected(e.key, e.size, e.sha256, e.offset) for e in m.entries]
    if kind == "model":
        try:
            body = json.loads(raw)
            if body.get("format") != MODEL_FORMAT:
                raise ValueError(f"format is {body.get('format')!r}, expected {MODEL_FORMAT!r}")
            return [Expected(str(o["key"]), int(o["size"]), str(o["sha256"])) for o in body["objects"]]
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"unreadable model manifest ({type(exc).__name__}: {exc})") from exc
    if kind == "checkpoint":
        run_key, step = _CHECKPOINT.match(manifest_key).groups()  # type: ignore[union-attr]
        manifest = Manifest.from_json(raw, int(step))
        folder = manifest_key.rsplit("/", 1)[0]
        return [Expected(f"{folder}/{s.name}", s.size, s.sha256) for s in manifest.shards]
    raise ValueError(f"{manifest_key} is not a manifest of a replicated set")
