"""Replication ahead of need: keep a ``role: dr`` cluster's store holding what a takeover needs.

One pass copies, into the DR cluster's store (its ``cache`` bucket in clusters.yaml):

- the newest ``keep`` validated versions of every dataset in scope (and the version each running
  critical run trains on), refused towards a store its classification or regions keep it from;
- the newest ``keep`` model versions each endpoint in scope served (the one serving now first), from
  the local model gateway or, on the Kubernetes serving target, its models volume;
- the newest committed checkpoint that verifies of each running critical run.

Each set follows :mod:`hybridflow.dr.replication.replicas` (checked at the source, add-only, verified, manifest
last, incremental). Nothing is ever deleted on the DR side, so every version once replicated stays
there; ``keep`` (at least 3) is how many of each line a pass brings over.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.dr.replication.replicas import Problem, ReplicaSet, SetOutcome, logger, replicate_set
from hybridflow.dr.replication.scope import CriticalRun, Scope, dr_cluster, scope_of
from hybridflow.storage.objectstore import ObjectStore

MIN_KEEP = 3


@dataclass
class ReplicationReport:
    cluster: str
    store: str
    sets: list[SetOutcome] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)  # sources refused or unreadable, clusters unreachable
    seconds: float = 0.0

    @property
    def objects_copied(self) -> int:
        return sum(s.objects_copied for s in self.sets)

    @property
    def bytes_copied(self) -> int:
        return sum(s.bytes_copied for s in self.sets)

    @property
    def all_problems(self) -> list[Problem]:
        return self.problems + [p for s in self.sets for p in s.problems]

    def to_dict(self) -> dict[str, Any]:
        return {"cluster": self.cluster, "store": self.store, "objects_copied": self.objects_copied,
                "bytes_copied": self.bytes_copied, "seconds": round(self.seconds, 3),
                "sets": [s.to_dict() for s in self.sets], "problems": [p.to_dict() for p in self.all_problems]}


def _dataset_sets(estate, settings, dr, scope: Scope, keep: int, problems: list[Problem]) -> list[ReplicaSet]:
    from hybridflow.datasets import locate
    from hybridflow.dr.replication.sources import dataset_set, pinned_versions
    from hybridflow.errors import HybridFlowError
    from hybridflow.rundata import read_version
    from hybridflow.sovereignty import Destination, check_sovereignty
    from hybridflow.storage.objectstore import open_store

    wanted: dict[tuple[str, str], Any] = {}
    for name in scope.datasets:
        for v in pinned_versions(settings.private_root, name)[:keep]:
            wanted.setdefault((name, v.version), v)
    for run in scope.runs:  # the version a resumed run needs, however old
        try:
            v = read_version(settings.private_root, run.run_key)
            wanted.setdefault((v.manifest.dataset, v.version), v)
        except HybridFlowError as exc:
            problems.append(Problem("dataset", run.run_key, "dataset-version.json", str(exc)))
    sets = []
    destination = Destination(dr.location, dr.areas, dr.name)
    for (name, version), pinned in sorted(wanted.items()):
        try:
            entry = estate.datasets.get(name)
            # Before anything is read or written: data the catalogue keeps away from the DR store.
            check_sovereignty(name, destination, catalogue=Path(settings.config_dir) / "datasets.yaml",
                              raised=pinned.manifest.sensitivity)
            location = locate(entry, settings.private_root, estate.file_roots(settings.home))
        except (HybridFlowError, KeyError) as exc:
            problems.append(Problem("dataset", name, f"version {version}", f"{exc}; not replicated"))
            continue
        store_of = _lazy(lambda loc=location: open_store(loc.store_spec()))
        sets.append(dataset_set(pinned, location, open_store=store_of))
    return sets


def _lazy(make):
    made: list = []

    def get():
        if not made:
            made.append(make())
        return made[0]

    return get


def _model_sets(scope: Scope, keep: int) -> list[ReplicaSet]:
    """The newest ``keep`` versions of each endpoint, the one serving now among them whatever its age."""
    from hybridflow.dr.replication.sources import model_set

    return [model_set(e, r) for e in scope.endpoints for r in scope.versions.get(e, [])[:keep]]


def _checkpoint_sets(estate, settings, scope: Scope, problems: list[Problem]) -> list[ReplicaSet]:
    from hybridflow.backends import gang_backend
    from hybridflow.dr.replication.sources import checkpoint_set
    from hybridflow.placement.places import checkpoint_replica_spec, checkpoint_store_spec
    from hybridflow.storage.objectstore import open_store

    sets = []
    for run in scope.runs:
        cluster = estate.clusters[run.cluster]
        specs = [checkpoint_store_spec(run.run_key, cluster, settings), checkpoint_replica_spec(run.run_key, cluster, settings)]
        if not gang_backend(cluster, estate, settings.state_dir).reads_private_storage:
            specs = [s for s in specs if s.kind != "local"]  # a Kubernetes cluster's scratch is in its pods only
        found = checkpoint_set(run.run_key, [open_store(s) for s in specs], problems)
        if found is None:
            problems.append(Problem("checkpoint", run.run_key, cluster.name, "no committed checkpoint verifies yet"))
        else:
            sets.append(found)
    return sets


def replicate(
    estate,
    settings,
    *,
    cluster: str | None = None,
    endpoints: Sequence[str] | None = None,
    datasets: Sequence[str] | None = None,
    runs: Sequence[CriticalRun] | None = None,
    keep: int | None = None,
    store: ObjectStore | None = None,
    log: Any = logger,
) -> ReplicationReport:
    """One replication pass into the DR cluster ``cluster`` (default: the estate's only one).

    ``store`` replaces the cluster's store (tests); bad input raises
    :class:`~hybridflow.dr.replication.scope.ReplicationError` before anything is read or written."""
    started = time.monotonic()
    keep = max(MIN_KEEP, estate.pipeline.staging.keep_versions) if keep is None else keep
    if keep < MIN_KEEP:
        from hybridflow.dr.replication.scope import ReplicationError

        raise ReplicationError("keep", f"{keep}: the DR side keeps at least {MIN_KEEP} versions of each line; use "
                                       f"keep >= {MIN_KEEP}")
    dr = dr_cluster(estate, cluster)
    scope = scope_of(estate, settings, dr, endpoints=endpoints, datasets=datasets, runs=runs, log=log)
    if store is None:
        from hybridflow.placement.places import cache_store_spec
        from hybridflow.storage.objectstore import open_store

        store = open_store(cache_store_spec(dr))
    report = ReplicationReport(cluster=dr.name, store=store.uri)
    report.problems += [Problem("cluster", name, "", what) for name, what in scope.problems] + scope.serving_problems
    sets = (_dataset_sets(estate, settings, dr, scope, keep, report.problems) + _model_sets(scope, keep)
            + _checkpoint_sets(estate, settings, scope, report.problems))
    for rs in sets:
        report.sets.append(replicate_set(rs, store, log=log))
    report.seconds = time.monotonic() - started
    log.info("replicated to %s (%s): %d sets, %d objects copied (%d bytes), %d problems, %.2fs", dr.name,
             store.uri, len(report.sets), report.objects_copied, report.bytes_copied, len(report.all_problems),
             report.seconds)
    for p in report.all_problems:
        log.warning("DR replication problem: %s", p)
    return report


def healthy_sources(estate, settings, **kwargs) -> dict[str, Any]:
    """DR key -> :class:`~hybridflow.dr.replication.replicas.Wanted` of every object the current scope can be
    read from (what reconciliation repairs from); no store is opened, nothing is written."""
    problems: list[Problem] = []
    dr = dr_cluster(estate, kwargs.pop("cluster", None))
    keep = kwargs.pop("keep", None) or max(MIN_KEEP, estate.pipeline.staging.keep_versions)
    scope = scope_of(estate, settings, dr, **kwargs)
    sets = (_dataset_sets(estate, settings, dr, scope, keep, problems) + _model_sets(scope, keep)
            + _checkpoint_sets(estate, settings, scope, problems))
    return {w.key: w for rs in sets for w in rs.objects}
