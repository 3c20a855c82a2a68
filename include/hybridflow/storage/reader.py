"""Reading a staged dataset version the way a training loader does: every file checked against its
SHA-256 from the manifest, a whole shard per request when files are packed (a few large sequential
reads instead of one request per sample), a bounded number of requests in flight."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from hybridflow.storage.manifest import DatasetManifest, fetch_verified
from hybridflow.storage.shards import iter_members


def iter_samples(store, manifest: DatasetManifest, *, workers: int = 8) -> Iterator[tuple[str, bytes]]:
    """Yield (path, bytes) for every file of ``manifest``; raises StagingError on the first sample
    that does not verify. Shards are read whole; plain blobs one request each."""
    shards: dict[str, dict[str, tuple[int, int, str]]] = {}
    plain = []
    for e in manifest.entries:
        if e.in_shard:
            shards.setdefault(e.key, {})[e.path] = (e.offset, e.size, e.sha256)
        else:
            plain.append(e)

    def read_shard(key: str) -> list[tuple[str, bytes]]:
        return list(iter_members(store.get_bytes(key), shards[key]))

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="read") as pool:
        for batch in pool.map(read_shard, shards):
            yield from batch
        for e, data in zip(plain, pool.map(lambda e: fetch_verified(store, e), plain), strict=True):
            yield e.path, data
