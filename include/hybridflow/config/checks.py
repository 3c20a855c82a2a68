"""Cross-checks between the estate files that the models alone cannot express."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args

from hybridflow.config.base import CLUSTERS_FILE, DATASETS_FILE, MODELS_FILE, PROJECTS_FILE
from hybridflow.config.clusters import NCCL_IFNAME_RE, CheckpointPlace, Cluster, ClustersFile
from hybridflow.config.pipeline import DEPLOY_TARGET_NAMES, MeteringSettings, ReaperSettings, ServingSettings
from hybridflow.config.projects import ProjectsFile

# Cluster names end up in Airflow pool names, connection ids and Kubernetes labels.
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
_LABEL_KEY_RE = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE_RE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def _check_clusters(path: Path, cf: ClustersFile, pf: ProjectsFile) -> list[str]:
    problems: list[str] = []
    for name, c in cf.clusters.items():
        at = f"clusters.{name}"
        if not _NAME_RE.match(name):
            problems.append(
                f"{at}: cluster names use lowercase letters, numbers and '-' (they become pool and label names)"
            )
        problems += _check_backend(at, c)
        if c.location == "public" and c.cache is None:
            problems.append(f"{at}.cache: a public cluster needs cache: {{conn_id, bucket}} to stage data into")
        problems += _check_checkpoint_places(at, c)
        problems += _check_node_pools(at, c, pf)
        problems += _check_role(at, c)
    if not any(c.location == "private" for c in cf.clusters.values()):
        problems.append(
            "clusters: no cluster has location: private; add at least one (restricted data may only run there)"
        )
    if all(c.is_dr for c in cf.clusters.values()):
        problems.append("clusters: every cluster has role: dr; normal work needs a primary or elastic cluster")
    # One missing price is reported once even when several pools need it.
    return list(dict.fromkeys(f"{path}: {p}" for p in problems))


def _check_role(at: str, c: Cluster) -> list[str]:
    """A dr cluster says its takeover scale (within its pools) and, if public, why, and has the object
    store replication fills; others have no dr block."""
    if not c.is_dr:
        return [] if c.dr is None else [f"{at}.dr: only for role: dr (the cluster's role is {c.role}); remove it"]
    problems: list[str] = []
    if c.cache is None:  # replication copies into it ahead of need; a takeover reads from it
        problems.append(f"{at}.cache: a dr cluster needs cache: {{conn_id, bucket}}, the object store its takeover "
                        "reads; add one")
    if c.dr is None:
        return problems + [f"{at}.dr: a role: dr cluster needs dr: {{min_gpus: N}}, the GPUs of its minimum "
                           "takeover scale"]
    if c.dr.min_gpus > c.total_gpus:
        problems.append(f"{at}.dr.min_gpus: {c.dr.min_gpus} GPUs, but the cluster's node pools hold "
                        f"{c.total_gpus}; lower min_gpus or add the GPUs to node_pools")
    if not c.is_private and c.dr.public_reason is None:
        problems.append(f"{at}.dr.public_reason: a dr cluster on location: public must say why (restricted data "
                        "can never fail over there); add public_reason or use a private cluster")
    if c.is_private and c.dr.public_reason is not None:
        problems.append(f"{at}.dr.public_reason: only for a dr cluster on location: public; remove it")
    return problems


def _check_dr_replicate(path: Path, cf: ClustersFile, catalogue: Any, registry: Any) -> list[str]:
    """``dr.replicate`` names datasets of the catalogue and endpoints of the registry (each checked only
    when its file exists: an estate that only meters has neither)."""
    problems: list[str] = []
    endpoints = sorted({m.endpoint for m in registry.models.values()})
    for name, c in cf.clusters.items():
        if c.dr is None:
            continue
        problems += _check_dr_serving(f"{path}: clusters.{name}.dr.serving", c)
        at = f"{path}: clusters.{name}.dr.replicate"
        if Path(catalogue.path).is_file():
            for i, ds in enumerate(c.dr.replicate.datasets):
                if ds not in catalogue.datasets:
                    problems.append(f"{at}.datasets[{i}]: {ds!r} is not in {DATASETS_FILE}; use one of: "
                                    f"{', '.join(sorted(catalogue.datasets)) or 'none'}")
        if Path(registry.path).is_file():
            for i, ep in enumerate(c.dr.replicate.endpoints):
                if ep not in endpoints:
                    problems.append(f"{at}.endpoints[{i}]: {ep!r} is no model's endpoint in {MODELS_FILE}; use one "
                                    f"of: {', '.join(endpoints) or 'none'}")
    return problems


def _check_dr_serving(at: str, c: Cluster) -> list[str]:
    """``dr.serving`` is the inference pool of a kubernetes DR cluster, on one of its node pools."""
    serving = c.dr.serving if c.dr is not None else None
    if serving is None:
        return []
    if not c.runs_pods:
        return [f"{at}: only used with backend: kubernetes (a local DR cluster serves through the model gateway); "
                "remove it or set backend: kubernetes"]
    pools = [p.name for p in c.node_pools]
    if serving.node_pool not in pools:
        return [f"{at}.node_pool: {serving.node_pool!r} is no node pool of this cluster; use one of: {', '.join(pools)}"]
    return []


def _check_backend(at: str, c: Cluster) -> list[str]:
    """What backend kubernetes needs, and the keys only it uses."""
    problems: list[str] = []

    def bad(keys: str, msg: str) -> None:
        problems.append(f"{keys}: {msg}")

    if not c.runs_pods:
        for key in ("conn_id", "scheduler", "namespace", "image", "scratch_claim", "nccl_socket_ifname"):
            if getattr(c, key) is not None:
                bad(
                    f"{at}.{key}",
                    "only used with backend: kubernetes; remove it or set backend: kubernetes",
                )
        return problems
    for i, pool in enumerate(c.node_pools):
        for key, value in pool.node_labels.items():
            if not _LABEL_KEY_RE.match(key) or not _LABEL_VALUE_RE.match(value):
                bad(
                    f"{at}.node_pools[{i}].node_labels.{key}",
                    "not a valid Kubernetes label (key [prefix/]name, value up to 63 of "
                    "[A-Za-z0-9._-] starting and ending alphanumeric); fix the label",
                )
    if c.nccl_socket_ifname is not None and not NCCL_IFNAME_RE.match(c.nccl_socket_ifname):
        bad(f"{at}.nccl_socket_ifname", f"{c.nccl_socket_ifname!r} is not a list of network interface names "
            "(comma-separated, each 1-15 of [A-Za-z0-9_.-], optionally led by ^ to exclude or = to match exactly), "
            "e.g. eth0 or ^lo,docker; fix it or remove the key to let NCCL choose")
    if not c.conn_id:
        bad(f"{at}.conn_id", "backend kubernetes needs conn_id: the Airflow Connection of the cluster")
    if not c.scheduler:
        bad(
            f"{at}.scheduler",
            "backend kubernetes needs scheduler: volcano or kueue (gang scheduling)",
        )
    if not c.image:
        bad(f"{at}.image", "backend kubernetes needs image: the training image its gang workers run")
    if c.cache is None:
        # Pods cannot reach this machine's private storage: data and checkpoints go through
        # the cluster's own bucket (for a private cluster, object storage in its data centre).
        bad(f"{at}.cache", "backend kubernetes needs cache: {conn_id, bucket}, the cluster's object "
            "storage its pods read staged data from and write checkpoints to")
    return problems


def _check_node_pools(at: str, c: Cluster, pf: ProjectsFile) -> list[str]:
    """Pool names, GPU types (as in projects.yaml), spot, labels, billing classes and their prices."""
    problems: list[str] = []
    gpu_names = ", ".join(sorted(pf.gpu_types))

    def bad(keys: str, msg: str) -> None:
        problems.append(f"{keys}: {msg}")

    seen_pools: set[str] = set()
    for i, pool in enumerate(c.node_pools):
        p_at = f"{at}.node_pools[{i}]"
        if pool.name in seen_pools:
            bad(f"{p_at}.name", f"duplicate node pool name {pool.name!r}; pool names must be unique")
        seen_pools.add(pool.name)
        gpu = pf.gpu_types.get(pool.gpu_model)
        if gpu is None:
            bad(
                f"{p_at}.gpu_model",
                f"{pool.gpu_model!r} is not in gpu_types ({PROJECTS_FILE}); add it there or use one of: "
                f"{gpu_names}",
            )
        elif gpu.memory_gib != pool.gpu_memory_gib:
            bad(
                f"{p_at}.gpu_memory_gib",
                f"{pool.gpu_memory_gib} GiB disagrees with gpu_types.{pool.gpu_model}.memory_gib = "
                f"{gpu.memory_gib} in {PROJECTS_FILE}; make them equal",
            )
        if pool.spot and c.location == "private":
            bad(f"{p_at}.spot", "spot capacity exists only on public clusters; set spot: false")
        if pool.node_labels and not c.runs_pods:
            bad(f"{p_at}.node_labels", "only used with backend: kubernetes; remove it")
        if pool.pricing is not None:
            allowed = ("onprem", "reserved") if c.is_private else ("on_demand", "reserved", "spot")
            if pool.pricing not in allowed:
                bad(
                    f"{p_at}.pricing",
                    f"{pool.pricing!r} is not a billing class of a {c.location} cluster; use one of: "
                    + ", ".join(allowed),
                )
            elif (pool.pricing == "spot") != pool.spot:
                bad(f"{p_at}.pricing", "pricing spot goes with spot: true (and only with it); make them agree")
        needed = c.pricing_class(pool)
        if needed not in c.prices:
            bad(
                f"{at}.prices",
                f"pool {pool.name!r} is billed as {needed!r} but prices has no {needed}; "
                f"add `{needed}: <USD per GPU-hour>`",
            )
    return problems


def _check_checkpoint_places(at: str, c: Cluster) -> list[str]:
    problems: list[str] = []
    primary, replica = c.checkpoint_places
    for key, place in (("checkpoint_store", primary), ("checkpoint_replica", replica)):
        if c.runs_pods and place == "private":
            problems.append(
                f"{at}.{key}: the pods of a kubernetes cluster cannot reach private storage; use 'cache' "
                "(the cluster's bucket) or 'scratch' (its scratch_claim volume)"
            )
        elif place == "cache" and c.cache is None:
            problems.append(f"{at}.{key}: 'cache' needs a cache: {{conn_id, bucket}}; add one or use 'private'")
        elif place == "cache" and c.is_private and c.on_this_machine:
            problems.append(
                f"{at}.{key}: checkpoints of a private cluster may hold restricted data and never go to a "
                "cloud cache; use 'private' or 'scratch'"
            )
    if primary == replica:
        other = ", ".join(repr(p) for p in get_args(CheckpointPlace) if p != primary)
        problems.append(
            f"{at}.checkpoint_replica: {replica!r} is also checkpoint_store; the latest checkpoint is kept "
            f"in two different places: use one of {other}"
        )
    if c.runs_pods and "scratch" in (primary, replica):
        if not c.scratch_claim:
            problems.append(
                f"{at}.scratch_claim: checkpoints on 'scratch' need the PersistentVolumeClaim of the "
                "cluster's scratch filesystem; set scratch_claim or keep checkpoints in 'cache'"
            )
        if not (c.scratch_dir or "").startswith("/"):
            problems.append(
                f"{at}.scratch_dir: {c.scratch_dir!r} must be the absolute path scratch_claim is mounted at "
                "in the gang's pods, e.g. /scratch"
            )
    elif c.runs_pods and c.scratch_claim is not None:
        problems.append(f"{at}.scratch_claim: only used when a checkpoint place is 'scratch'; remove it")
    if c.scratch_dir is not None and "scratch" not in (primary, replica):
        problems.append(
            f"{at}.scratch_dir: only used when checkpoint_store or checkpoint_replica is 'scratch'; "
            "remove it or set checkpoint_replica: scratch"
        )
    return problems


def _check_serving(path: Path, serving: ServingSettings, cf: ClustersFile) -> list[str]:
    k8s = serving.kubernetes
    if serving.target is not None and serving.target not in DEPLOY_TARGET_NAMES:
        return [f"{path}: serving.target: {serving.target!r} is not a deploy target; use one of: "
                + ", ".join(sorted(DEPLOY_TARGET_NAMES))]
    if serving.target == "kubernetes" and k8s is None:
        return [f"{path}: serving.target: kubernetes needs serving.kubernetes (the private inference pool); "
                "add that section or remove serving.target"]
    if k8s is None:
        return []
    at = f"{path}: serving.kubernetes"
    cluster = cf.clusters.get(k8s.cluster)
    if cluster is None or not cluster.runs_pods or not cluster.is_private:
        fit = ", ".join(n for n, c in cf.clusters.items() if c.runs_pods and c.is_private) or "none"
        return [f"{at}.cluster: {k8s.cluster!r} is not a private cluster with backend kubernetes in "
                f"{CLUSTERS_FILE} (the private inference pool); use one of: {fit}"]
    problems = []
    if k8s.node_pool not in {p.name for p in cluster.node_pools}:
        problems.append(f"{at}.node_pool: {k8s.node_pool!r} is not a node pool of {k8s.cluster}; use one of: "
                        + ", ".join(p.name for p in cluster.node_pools))
    if not k8s.models_dir.startswith("/"):
        problems.append(f"{at}.models_dir: {k8s.models_dir!r} must be the absolute path where models_claim is "
                        "mounted on the Airflow workers")
    for key in ("namespace", "models_claim"):
        if not _NAME_RE.match(getattr(k8s, key)):
            problems.append(f"{at}.{key}: {getattr(k8s, key)!r} is not a DNS-1123 label (lowercase letters, numbers, '-')")
    return problems


def _check_projects(path: Path, pf: ProjectsFile) -> list[str]:
    problems: list[str] = []
    teams = ", ".join(sorted(pf.teams))
    shares = sum(t.guaranteed_share for t in pf.teams.values())
    if shares > 1 + 1e-9:
        problems.append(
            f"{path}: teams: guaranteed_share adds up to {shares:.2f} over all teams; the shares of private "
            "capacity must add up to at most 1.0"
        )
    queues: dict[str, str] = {}
    for name, team in pf.teams.items():
        if not _NAME_RE.match(name):
            problems.append(f"{path}: teams.{name}: team names use lowercase letters, numbers and '-' (they name queues)")
        q = team.queue or name
        if q in queues:
            problems.append(f"{path}: teams.{name}.queue: {q!r} is also the queue of team {queues[q]!r}; give each team its own")
        queues[q] = name
    for name, project in pf.projects.items():
        if project.team not in pf.teams:
            problems.append(
                f"{path}: projects.{name}.team: team {project.team!r} is not defined under teams; "
                f"add `{project.team}: {{}}` under teams or use one of: {teams}"
            )
    return problems


def _check_metering(path: Path, metering: MeteringSettings, cf: ClustersFile) -> list[str]:
    problems = []
    for name, source in metering.clusters.items():
        at = f"{path}: metering.clusters.{name}"
        cluster = cf.clusters.get(name)
        if cluster is None:
            problems.append(f"{at}: no such cluster in {CLUSTERS_FILE}; use one of: {', '.join(sorted(cf.clusters))}")
        elif source.source == "local" and not cluster.on_this_machine:
            problems.append(
                f"{at}.source: 'local' reads the local backend's slots, but {name} has backend "
                f"{cluster.backend!r}; use 'exporters' or 'prometheus'"
            )
    return problems


def _check_reaper(path: Path, reaper: ReaperSettings, cf: ClustersFile) -> list[str]:
    return [
        f"{path}: reaper.clusters.{name}: no such cluster in {CLUSTERS_FILE}; fix the name or remove the entry "
        f"(clusters: {', '.join(sorted(cf.clusters))})"
        for name in sorted(reaper.clusters) if name not in cf.clusters
    ]
