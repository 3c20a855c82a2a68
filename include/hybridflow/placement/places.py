"""A cluster's storage places: its cache bucket, its scratch filesystem, and a run's checkpoint places
(clusters.yaml ``checkpoint_store`` and ``checkpoint_replica``: private storage, cache or scratch)."""

from __future__ import annotations

from pathlib import Path

from hybridflow.settings import Settings


def cache_store_spec(cluster, prefix: str = ""):
    """The cluster's cache bucket (under ``prefix``), through its cache connection, with the
    bandwidth caps its uploads share: the cluster's ``upload_cap`` and its endpoint's
    (pipeline.yaml ``bandwidth``)."""
    import dataclasses

    from hybridflow.hooks.object_store import ObjectStoreHook

    spec = ObjectStoreHook(cluster.cache.conn_id).store_spec(cluster.cache.bucket, prefix)
    return dataclasses.replace(spec, caps=upload_caps(cluster, spec.endpoint_url, spec.region))


def upload_caps(cluster, endpoint_url: str | None, region: str) -> tuple:
    """The caps on uploads into ``cluster``'s cache bucket at that endpoint (none: no cap)."""
    from hybridflow.storage.bandwidth import Cap, endpoint_key

    caps = []
    key = endpoint_key(endpoint_url, region)
    endpoint_rate = cluster.endpoint_cap(key.removeprefix("endpoint:"))
    if endpoint_rate is not None:
        caps.append(Cap(key, endpoint_rate))
    if cluster.upload_cap is not None:
        caps.append(Cap(f"cluster:{cluster.name}", cluster.upload_cap))
    return tuple(caps)


def checkpoint_store_spec(run_key: str, cluster, settings: Settings):
    """The run's primary checkpoint place (clusters.yaml ``checkpoint_store``): the worker commits
    there first; model/final.pt and result.json go there too."""
    return checkpoint_place_spec(cluster.checkpoint_places[0], run_key, cluster, settings)


def checkpoint_replica_spec(run_key: str, cluster, settings: Settings):
    """The second place the run's latest checkpoints are kept (``checkpoint_replica``)."""
    return checkpoint_place_spec(cluster.checkpoint_places[1], run_key, cluster, settings)


def checkpoint_place_spec(place: str, run_key: str, cluster, settings: Settings):
    """The run's checkpoint folder in ``place``: private storage, the cluster's cache bucket or its
    scratch filesystem."""
    from hybridflow.storage.objectstore import StoreSpec

    if place == "cache":
        import dataclasses

        # A checkpoint commit goes before bulk uploads under the same caps (storage.bandwidth).
        return dataclasses.replace(cache_store_spec(cluster, f"checkpoints/{run_key}"), priority="checkpoint")
    if place == "scratch":
        return StoreSpec(kind="local", root=str(scratch_root(cluster, settings) / "checkpoints" / run_key))
    if place == "private":
        return StoreSpec(kind="local", root=str(settings.private_root / "checkpoints" / run_key))
    raise ValueError(f"unknown checkpoint place {place!r}; use 'private', 'cache' or 'scratch'")


def scratch_root(cluster, settings: Settings) -> Path:
    """The cluster's scratch filesystem (``scratch_dir``, relative to HYBRIDFLOW_HOME unless absolute)."""
    if cluster.scratch_dir is None:
        return settings.home / "scratch" / cluster.name
    path = Path(cluster.scratch_dir)
    return path if path.is_absolute() else settings.home / path
