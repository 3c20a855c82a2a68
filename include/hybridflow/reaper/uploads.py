"""Unfinished multipart uploads the product left in a store: parts a killed upload paid for and
nobody will complete. Only keys under the product's own prefixes are looked at, and only uploads
started longer ago than the set age are candidates (younger ones may belong to a staging or a
checkpoint upload still sending parts, which resumes them)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from hybridflow.reaper.base import Finder, Leftover
from hybridflow.storage.objectstore import MultipartUploads, ObjectStore, StoreSpec, open_store

# What the product writes into a cluster's cache bucket: staged datasets (hybridflow.staging.layout)
# and checkpoints (hybridflow.placement.places); nothing else there is ours.
PRODUCT_PREFIXES = ("datasets/", "checkpoints/")


class MultipartUploadsFinder(Finder):
    """Multipart uploads under ``prefixes`` of one store, started more than ``max_age`` ago.

    What to pass: ``place``, the cluster or store name as in config (e.g. the cluster whose cache
    bucket it is); ``store``, the store itself or its :class:`StoreSpec` (opened on first use, e.g.
    ``hybridflow.placement.places.cache_store_spec(cluster)`` for a cluster's cache bucket at its
    root); ``max_age``, ``reaper.multipart_max_age_h`` as a timedelta (longer than the longest single
    file upload takes: the age is counted from the upload's start); ``prefixes``, keys relative to
    the store that only the product writes (default: the cache bucket's ``datasets/`` and
    ``checkpoints/``; give a private store's own prefix for a store shared with others). A store
    that cannot hold multipart uploads (a folder) has none to find.
    """

    kind = "multipart-upload"

    def __init__(self, place: str, store: ObjectStore | StoreSpec, max_age: timedelta,
                 prefixes: Sequence[str] = PRODUCT_PREFIXES) -> None:
        if max_age <= timedelta(0):
            raise ValueError(f"{place}: max_age {max_age} must be positive")
        if not prefixes or any(not p.strip("/") for p in prefixes):
            raise ValueError(f"{place}: prefixes {list(prefixes)!r} must name the product's own key prefixes "
                             "(an empty prefix would take in the whole store)")
        self.place, self.max_age, self.prefixes = place, max_age, tuple(prefixes)
        self._spec = store if isinstance(store, StoreSpec) else None
        self._store: Any = None if isinstance(store, StoreSpec) else store

    @property
    def store(self) -> Any:
        if self._store is None:
            self._store = open_store(self._spec)
        return self._store

    def find(self, now: datetime) -> list[Leftover]:
        store = self.store
        if not isinstance(store, MultipartUploads):
            return []
        found: dict[str, Leftover] = {}
        for prefix in self.prefixes:
            for up in store.multipart_uploads(prefix):
                if up.get("initiated") is None:
                    continue  # no start time: its age cannot be judged, so it is kept
                started = datetime.fromtimestamp(up["initiated"], UTC)
                age = now - started
                if age <= self.max_age:
                    continue
                name = f"{store.uri}/{up['key']}#{up['upload_id']}"
                found[name] = Leftover(
                    self.place, self.kind, name, since=started,
                    reason=f"unfinished for {_hours(age)} (more than {_hours(self.max_age)})",
                    detail={"key": up["key"], "upload_id": up["upload_id"]},
                )
        return sorted(found.values(), key=lambda lo: lo.name)

    def release(self, leftover: Leftover) -> None:
        """Abort the upload: the store frees its parts. An upload already gone is not an error."""
        self.store.abort_multipart(leftover.detail["key"], leftover.detail["upload_id"])


def _hours(delta: timedelta) -> str:
    return f"{delta.total_seconds() / 3600:.1f} h"
