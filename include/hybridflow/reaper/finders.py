"""The one place that builds the sweep's finders for an estate: per cluster, its gangs (local
processes and slot holdings, or Kubernetes jobs, pods and Secrets), the unfinished multipart uploads
of its cache bucket, the scratch folders of finished runs, and serving versions.

A finder that cannot even be built (a missing provider, a bad setting) becomes one that fails when
the sweep asks it, so its place is an error of the sweep and the other places are still swept.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from hybridflow.reaper.base import Finder, Leftover
from hybridflow.reaper.liveness import ENDED


class Unbuildable(Finder):
    """Stands for a finder of ``place`` that could not be built; finding raises why."""

    def __init__(self, place: str, what: str, error: BaseException) -> None:
        self.place, self.what, self.error = place, what, error

    def find(self, now: datetime) -> list[Leftover]:
        raise RuntimeError(f"the {self.what} finder could not be set up: {type(self.error).__name__}: {self.error}")

    def release(self, leftover: Leftover) -> None:  # pragma: no cover - it never finds anything
        raise RuntimeError("nothing to release")


def finders_for(estate: Any, settings: Any, config: Any, states: Any = None) -> list[Finder]:
    """Every finder of the estate, clusters in name order (``config``: ``pipeline.reaper``;
    ``states``: what judges an owner, for finders that only list what belongs to finished runs)."""
    out: list[Finder] = []
    for name in sorted(estate.clusters):
        cluster = estate.clusters[name]
        for what, build in _builders(cluster, estate, settings, config, states):
            try:
                built = build()
            except Exception as exc:  # noqa: BLE001 - recorded as the place's error by the sweep
                built = [Unbuildable(name, what, exc)]
            out.extend(built)
    out.extend(_serving(estate, settings, config))
    return out


def _builders(cluster, estate, settings, config, states) -> list[tuple[str, Callable[[], list[Finder]]]]:
    builders = [("gang", lambda: [_gang_finder(cluster, estate, settings)])]
    if cluster.cache is not None:
        builders.append(("multipart upload", lambda: _uploads(cluster, config)))
    if cluster.on_this_machine:  # a Kubernetes cluster's scratch is mounted in its pods only
        builders.append(("scratch", lambda: _scratch(cluster, settings, config, states)))
    return builders


def _gang_finder(cluster, estate, settings) -> Finder:
    from hybridflow.backends import gang_backend
    from hybridflow.reaper.gangs import GangFinder

    return GangFinder(gang_backend(cluster, estate, settings.state_dir))


def _uploads(cluster, config) -> list[Finder]:
    from hybridflow.placement.places import cache_store_spec
    from hybridflow.reaper.uploads import MultipartUploadsFinder

    return [MultipartUploadsFinder(cluster.name, cache_store_spec(cluster), timedelta(hours=config.multipart_max_age_h))]


def _scratch(cluster, settings, config, states) -> list[Finder]:
    if states is None:
        return []
    from hybridflow.placement.places import scratch_root
    from hybridflow.reaper.scratch import ScratchFinder

    return [ScratchFinder(cluster.name, scratch_root(cluster, settings),
                          lambda owner: states.judge(owner).verdict == ENDED,
                          keep=timedelta(hours=config.scratch_keep_h))]


def _serving(estate, settings, config) -> list[Finder]:
    from hybridflow.reaper.serving import finders

    try:
        return list(finders(estate, settings, config))
    except Exception as exc:  # noqa: BLE001 - recorded as an error of the sweep
        return [Unbuildable("serving", "serving", exc)]
