"""The estate description under ``config/``: clusters, projects, pipeline-wide defaults, and the
dataset catalogue and model registry (``hybridflow.catalogue``, ``hybridflow.registry``).

``load_estate`` parses ``clusters.yaml``, ``projects.yaml``, ``pipeline.yaml``, ``datasets.yaml`` and
``models.yaml`` into frozen pydantic models and cross-checks them. Any problem raises :class:`~hybridflow.errors.ConfigError` whose message
names the file, the key path (``clusters.cloud-east.node_pools[0].gpus``) and what to change, so an
operator can fix the YAML without reading this code.
"""

from __future__ import annotations

import re
import threading
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from hybridflow.errors import ConfigError

if TYPE_CHECKING:
    from hybridflow.catalogue import Catalogue
    from hybridflow.registry import Registry

CLUSTERS_FILE = "clusters.yaml"
PROJECTS_FILE = "projects.yaml"
PIPELINE_FILE = "pipeline.yaml"
DATASETS_FILE = "datasets.yaml"
MODELS_FILE = "models.yaml"

PricingClass = Literal["onprem", "on_demand", "reserved", "spot"]
# Cluster names end up in Airflow pool names, connection ids and Kubernetes labels.
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
_LABEL_KEY_RE = re.compile(r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE_RE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


class _Model(BaseModel):
    # Frozen: the estate is shared (and cached) across tasks; extra=forbid: a typo is an error, not a no-op.
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- clusters.yaml ---------------------------------------------------------------------------------


class NodePool(_Model):
    name: str = Field(min_length=1)
    gpu_model: str = Field(min_length=1)
    gpu_memory_gib: int = Field(gt=0)
    gpus: int = Field(gt=0)
    rdma: bool = False
    spot: bool = False
    # Billing class of the pool when it is not the cluster's default (onprem on private clusters,
    # spot or on_demand on public ones): e.g. reserved capacity bought for a term.
    pricing: PricingClass | None = None
    # Kubernetes only: node labels that select this pool's nodes (nodeSelector of gang pods).
    node_labels: dict[str, str] = Field(default_factory=dict)


class CacheConfig(_Model):
    conn_id: str = Field(min_length=1)
    bucket: str = Field(min_length=1)


# Where a run's checkpoints can live: private storage, the cluster's cloud cache bucket, or the
# cluster's scratch (parallel) filesystem.
CheckpointPlace = Literal["private", "cache", "scratch"]


class Cluster(_Model):
    location: Literal["private", "public"]
    region: str = Field(min_length=1)
    # The legal area the region is in (e.g. eu, us): a dataset's ``regions`` may name either.
    jurisdiction: str | None = Field(default=None, min_length=1)
    backend: Literal["local", "kubernetes"] = "local"
    conn_id: str | None = None  # kubernetes only: the Airflow Connection holding the kubeconfig
    scheduler: Literal["volcano", "kueue"] | None = None  # kubernetes only: the gang scheduler
    namespace: str | None = Field(default=None, min_length=1)  # kubernetes only (default "hybridflow")
    # kubernetes only: the training image (hybridflow and torch installed) every gang worker runs.
    image: str | None = Field(default=None, min_length=1)
    # kubernetes only: PersistentVolumeClaim of the cluster's scratch filesystem, mounted at scratch_dir.
    scratch_claim: str | None = Field(default=None, min_length=1)
    node_pools: list[NodePool] = Field(min_length=1)
    prices: dict[PricingClass, Annotated[float, Field(ge=0)]]
    cache: CacheConfig | None = None
    # The latest checkpoints are kept in two places: the worker commits to checkpoint_store first,
    # then replicates to checkpoint_replica (default: private storage, or scratch if the primary is
    # private storage).
    checkpoint_store: CheckpointPlace = "private"
    checkpoint_replica: CheckpointPlace | None = None
    # The cluster's scratch filesystem: absolute, or relative to HYBRIDFLOW_HOME (default scratch/<cluster>).
    scratch_dir: str | None = Field(default=None, min_length=1)

    _name: str = PrivateAttr(default="")

    @property
    def name(self) -> str:
        return self._name

    @property
    def is_private(self) -> bool:
        return self.location == "private"

    @property
    def areas(self) -> tuple[str, ...]:
        """The names a dataset's ``regions`` can allow this cluster by: its region and jurisdiction."""
        return (self.region,) if self.jurisdiction is None else (self.region, self.jurisdiction)

    @property
    def k8s_namespace(self) -> str:
        """Namespace of the cluster's gang jobs (kubernetes backend)."""
        return self.namespace or "hybridflow"

    @property
    def checkpoint_places(self) -> tuple[CheckpointPlace, CheckpointPlace]:
        """(primary, replica) places of the cluster's training checkpoints."""
        default = "scratch" if self.checkpoint_store == "private" else "private"
        return self.checkpoint_store, self.checkpoint_replica or default

    @property
    def total_gpus(self) -> int:
        return sum(p.gpus for p in self.node_pools)

    @property
    def gpu_models(self) -> list[str]:
        return sorted({p.gpu_model for p in self.node_pools})

    def gpus_of(self, model: str, spot: bool | None = None) -> int:
        """GPUs of ``model``; ``spot`` None counts every pool, True/False only spot/non-spot pools."""
        return sum(
            p.gpus for p in self.node_pools if p.gpu_model == model and (spot is None or p.spot == spot)
        )

    def pool(self, name: str) -> NodePool:
        for p in self.node_pools:
            if p.name == name:
                return p
        raise KeyError(f"cluster {self.name!r} has no node pool {name!r}")

    def pricing_class(self, pool: NodePool) -> PricingClass:
        if pool.pricing is not None:
            return pool.pricing
        if self.is_private:
            return "onprem"
        return "spot" if pool.spot else "on_demand"

    def price_of(self, pool: NodePool) -> float:
        """USD per GPU-hour on ``pool``; load_estate guarantees the class has a price."""
        return self.prices[self.pricing_class(pool)]


class ClustersFile(_Model):
    clusters: dict[str, Cluster] = Field(min_length=1)


# --- projects.yaml ---------------------------------------------------------------------------------


class GpuType(_Model):
    memory_gib: int = Field(gt=0)


class Team(_Model):
    # Most GPUs the team's runs may hold at once across the estate (None: no cap beyond projects').
    gpu_cap: int | None = Field(default=None, ge=1)
    # Share of private GPU capacity guaranteed to the team: its idle part is billed to the team.
    guaranteed_share: float = Field(default=0.0, ge=0, le=1)
    # Queue of the team on Kubernetes gang schedulers (Volcano queue / Kueue LocalQueue); default: the team name.
    queue: str | None = Field(default=None, min_length=1)


class Project(_Model):
    team: str = Field(min_length=1)
    max_workers: int = Field(ge=1)


class ProjectsFile(_Model):
    gpu_types: dict[str, GpuType] = Field(min_length=1)
    teams: dict[str, Team] = Field(min_length=1)
    projects: dict[str, Project] = Field(min_length=1)


# --- pipeline.yaml ---------------------------------------------------------------------------------


class TrainingSettings(_Model):
    # A gang waiting this long for admission looks for another eligible cluster with room now; with
    # none it keeps its place in the queue (in the triggerer, no worker slot held) ...
    gang_admission_timeout_s: int = Field(default=120, gt=0)
    # ... until it is admitted or has waited this long in all (then the train task fails, no retry).
    max_queue_wait_s: int = Field(default=86_400, ge=0)
    # How often a waiting gang's place in the queue is read, logged and shown on the run's page.
    queue_poll_s: float = Field(default=5, gt=0, le=600)
    checkpoint_keep: int = Field(default=3, ge=1)  # committed checkpoints kept in each place
    # Interruptible runs also checkpoint on this timer: even a reclaim without SIGTERM loses about this much.
    interruptible_checkpoint_every_s: float = Field(default=300, gt=0)
    # SIGTERM -> SIGKILL: the time a preempted worker has to commit its final checkpoint.
    preemption_grace_s: float = Field(default=30, gt=0, le=3600)
    # The train task relaunches a preempted gang itself this many times per task try (resuming from
    # the final checkpoint); application errors use the task's Airflow retries instead.
    preemption_retries: int = Field(default=3, ge=0)
    # Kubernetes gangs: the train task waits in the triggerer (deferrable) rather than in a worker
    # slot, polling the job this often.
    kubernetes_deferrable: bool = True
    kubernetes_poll_s: float = Field(default=15, gt=0, le=600)


class AdmissionSettings(_Model):
    # Share of each GPU's memory left for activations and workspace by the memory check.
    activation_headroom: float = Field(default=0.2, ge=0, lt=1)
    # A run that would take its team past teams.<team>.gpu_cap: "wait" (its gang queues until the
    # team's GPUs free up) or "refuse" (admit turns it away). Critical runs are never held by the cap.
    over_team_cap: Literal["wait", "refuse"] = "wait"
    # On the local backend a critical gang that cannot be admitted stops batch gangs (SIGTERM: they
    # checkpoint, exit as preempted and queue again behind it).
    critical_preempts_batch: bool = True


class DefaultsSettings(_Model):
    """What a run trains when its trigger names no model (its project then comes from models.yaml)."""

    model: str | None = Field(default=None, min_length=1)


class DataSettings(_Model):
    # Folders file:// datasets may live in (absolute, or relative to HYBRIDFLOW_HOME); symlinks are
    # resolved before the check. private:// datasets are always under private storage.
    file_roots: list[str] = Field(default_factory=list)


class KubernetesServing(_Model):
    """The private inference pool on a kubernetes cluster: where deploy rolls new versions out."""

    cluster: str = Field(min_length=1)  # a private cluster with backend: kubernetes
    node_pool: str = Field(min_length=1)
    namespace: str = Field(default="hybridflow-serving", min_length=1)
    image: str = Field(min_length=1)  # the serving image (hybridflow and torch installed)
    # PersistentVolumeClaim (private storage) holding <version>/<variant>.pt, mounted read-only in
    # the serving pods, and the folder where the same volume is mounted on the Airflow workers.
    models_claim: str = Field(min_length=1)
    models_dir: str = Field(min_length=1)
    replicas: int = Field(default=2, ge=1, le=100)
    gpus_per_replica: int = Field(default=1, ge=0)
    port: int = Field(default=8080, ge=1, le=65535)
    canary_percent: int = Field(default=10, ge=1, le=50)  # share of pods the new version gets first
    ready_timeout_s: float = Field(default=600, gt=0)


class ServingSettings(_Model):
    # The model gateway on 127.0.0.1: every model's endpoint is /v1/models/<endpoint>:predict on it.
    port: int = Field(default=8790, ge=1, le=65535)
    # None: serve on this machine (blue/green behind 127.0.0.1:port); else roll out on Kubernetes.
    kubernetes: KubernetesServing | None = None


class StagingConfig(_Model):
    """How stage_data copies datasets into cloud caches (pipeline.yaml ``staging``)."""

    workers: int = Field(default=16, ge=1, le=256)  # requests in flight
    part_size_mib: int = Field(default=16, ge=5, le=5120)  # S3 parts are 5 MiB..5 GiB
    multipart_threshold_mib: int = Field(default=64, ge=5)
    max_inflight_mib: int = Field(default=128, ge=1)  # bytes read but not yet stored: memory bound
    pack_small_files: Literal["auto", "always", "never"] = "auto"
    pack_below_kib: int = Field(default=1024, ge=1)  # files smaller than this may go into shards
    pack_min_files: int = Field(default=256, ge=1)  # auto packs only datasets with this many small files
    shard_target_mib: int = Field(default=32, ge=1)
    shard_max_mib: int = Field(default=64, ge=1)
    sha256_header: bool = True  # send x-amz-checksum-sha256 too (verified by AWS and MinIO)
    crt: bool = True  # small local files go up through the AWS CRT (hybridflow.storage.crt)
    progress_every_s: float = Field(default=10.0, gt=0)
    abandoned_upload_age_h: float = Field(default=24.0, gt=0)
    keep_versions: int = Field(default=3, ge=3)  # what `hybridflow cache prune` keeps by default

    @model_validator(mode="after")
    def _sizes_fit(self) -> StagingConfig:
        if self.pack_below_kib > self.shard_max_mib * 1024:
            raise ValueError(f"pack_below_kib {self.pack_below_kib} is above shard_max_mib {self.shard_max_mib} (in KiB)")
        if self.shard_target_mib > self.shard_max_mib:
            raise ValueError(f"shard_target_mib {self.shard_target_mib} is above shard_max_mib {self.shard_max_mib}")
        if self.shard_max_mib > self.multipart_threshold_mib:
            raise ValueError(
                f"shard_max_mib {self.shard_max_mib} is above multipart_threshold_mib "
                f"{self.multipart_threshold_mib}: a shard goes up in one request; lower shard_max_mib"
            )
        return self


class PlacementSettings(_Model):
    # Share of private GPUs in use at which auto runs go to public clusters instead.
    spill_threshold: float = Field(default=0.7, ge=0, le=1)
    # Count GPUs of gangs waiting for admission on private clusters towards that share (the queue).
    spill_counts_queue: bool = True
    # Kubernetes clusters: each reading of a cluster's queues and usage is bounded by this timeout and
    # reused for this long (a cluster that does not answer is shown as unknown and not chosen).
    cluster_read_timeout_s: float = Field(default=5, gt=0, le=60)
    cluster_load_cache_s: float = Field(default=5, ge=0, le=300)
    # start_by: a cluster's wait is estimated from the ledger's queue waits of the last wait_history_days
    # for gangs of half to twice the size; at least wait_min_samples of them, their wait_quantile.
    wait_history_days: int = Field(default=30, ge=1, le=3650)
    wait_min_samples: int = Field(default=5, ge=1)
    wait_quantile: float = Field(default=0.8, gt=0, le=1)


class MeteringCluster(_Model):
    """Where one cluster's GPU samples come from.

    local: the local backend's slots through the stand-in exporter (local clusters only);
    exporters: scrape each dcgm-exporter URL (a URL may be a path on the connection's host);
    prometheus: range queries to the Prometheus at ``prometheus_url`` (or the connection's host).
    ``conn_id`` names an Airflow Connection with the base URL (schema, host, port) and any
    credentials (login/password for basic auth); credentials never go into this file.
    """

    source: Literal["local", "exporters", "prometheus"]
    exporters: list[str] = Field(default_factory=list)
    prometheus_url: str | None = Field(default=None, min_length=1)
    conn_id: str | None = Field(default=None, min_length=1)
    selector: str = ""  # prometheus: label matchers picking this cluster's exporters, e.g. cluster="a"
    node: str | None = Field(default=None, min_length=1)  # for exporters run without a Hostname label

    @model_validator(mode="after")
    def _source_needs(self) -> MeteringCluster:
        if self.source == "exporters" and not self.exporters:
            raise ValueError("source 'exporters' needs exporters: [http://<node>:9400/metrics, ...]")
        if self.source == "prometheus" and not (self.prometheus_url or self.conn_id):
            raise ValueError("source 'prometheus' needs prometheus_url or conn_id (the Prometheus base URL)")
        if self.source != "exporters" and self.exporters:
            raise ValueError(f"exporters are only read with source 'exporters', not {self.source!r}")
        return self


class MeteringSettings(_Model):
    # The gpu_metering DAG's schedule (cron or preset); each run reads the window it covers.
    schedule: str = Field(default="*/5 * * * *", min_length=1)
    connect_timeout_s: float = Field(default=3.0, gt=0)
    read_timeout_s: float = Field(default=10.0, gt=0)
    retries: int = Field(default=2, ge=0, le=10)
    # The largest exporter page or Prometheus answer read; a bigger one is refused with an error.
    max_body_mib: float = Field(default=16, gt=0, le=1024)
    # Prometheus sources: one reading per GPU every step_s within each run's window.
    prometheus_step_s: int = Field(default=60, gt=0)
    # The local stand-in exporter's power model (W at 0 % and 100 % use of a slot).
    local_idle_w: float = Field(default=60.0, ge=0)
    local_busy_w: float = Field(default=400.0, gt=0)
    # Per cluster; a local cluster without an entry is read from its slots (source: local).
    clusters: dict[str, MeteringCluster] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _power_model(self) -> MeteringSettings:
        if self.local_idle_w > self.local_busy_w:
            raise ValueError(f"local_idle_w {self.local_idle_w} is above local_busy_w {self.local_busy_w}")
        return self


class PipelineConfig(_Model):
    defaults: DefaultsSettings = DefaultsSettings()
    admission: AdmissionSettings = AdmissionSettings()
    training: TrainingSettings = TrainingSettings()
    data: DataSettings = DataSettings()
    serving: ServingSettings = ServingSettings()
    placement: PlacementSettings = PlacementSettings()
    staging: StagingConfig = StagingConfig()
    metering: MeteringSettings = MeteringSettings()


# --- the estate ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estate:
    config_dir: Path
    clusters: dict[str, Cluster]
    projects: dict[str, Project]
    teams: dict[str, Team]
    gpu_types: dict[str, GpuType]
    pipeline: PipelineConfig
    datasets: Catalogue
    models: Registry

    @property
    def private_clusters(self) -> list[Cluster]:
        return [c for c in self.clusters.values() if c.is_private]

    @property
    def public_clusters(self) -> list[Cluster]:
        return [c for c in self.clusters.values() if not c.is_private]

    def queue_of(self, team: str) -> str:
        """The team's queue on Kubernetes gang schedulers (Volcano queue, Kueue LocalQueue)."""
        return self.teams[team].queue or team

    def offered_gpu_models(self) -> list[str]:
        return sorted({m for c in self.clusters.values() for m in c.gpu_models})

    def known_areas(self) -> list[str]:
        """Every region and jurisdiction of the estate's clusters."""
        return sorted({a for c in self.clusters.values() for a in c.areas})

    def file_roots(self, home: Path) -> list[Path]:
        """pipeline.yaml data.file_roots as absolute, resolved folders."""
        return [(Path(r) if Path(r).is_absolute() else home / r).resolve() for r in self.pipeline.data.file_roots]


_M = TypeVar("_M", bound=BaseModel)

_cache_lock = threading.Lock()
_cache: dict[Path, tuple[tuple, Estate]] = {}


def load_estate(config_dir: Path, *, use_cache: bool = True) -> Estate:
    """Parse and cross-check the estate files in ``config_dir``.

    Cached per folder and keyed by the files' mtimes and sizes, so a DAG parse loop re-reads only
    after someone edits the YAML.
    """
    config_dir = Path(config_dir).resolve()
    files = [config_dir / n for n in (CLUSTERS_FILE, PROJECTS_FILE, PIPELINE_FILE, DATASETS_FILE, MODELS_FILE)]
    for f in files[:3]:
        if not f.is_file():
            raise ConfigError(f"{f}: file not found; the estate needs {', '.join(p.name for p in files[:3])}")
    # An estate that only meters or allocates may have no catalogue or registry: no dataset or model
    # is known then, and admission says so.
    stamp = tuple((st.st_mtime_ns, st.st_size) if (st := _stat(f)) else None for f in files)
    if use_cache:
        with _cache_lock:
            hit = _cache.get(config_dir)
        if hit and hit[0] == stamp:
            return hit[1]
    estate = _parse(config_dir, *files)
    with _cache_lock:
        _cache[config_dir] = (stamp, estate)
    return estate


def _stat(path: Path):
    try:
        return path.stat()
    except FileNotFoundError:
        return None


def _parse(config_dir: Path, clusters_path: Path, projects_path: Path, pipeline_path: Path, datasets_path: Path,
           models_path: Path) -> Estate:
    from hybridflow.catalogue import parse_catalogue
    from hybridflow.registry import parse_registry

    clusters_file = _validate(ClustersFile, clusters_path)
    projects_file = _validate(ProjectsFile, projects_path)
    pipeline = _validate(PipelineConfig, pipeline_path, allow_empty=True)
    for name, cluster in clusters_file.clusters.items():
        cluster._name = name

    problems = _check_clusters(clusters_path, clusters_file, projects_file)
    problems += _check_projects(projects_path, projects_file)
    problems += _check_metering(pipeline_path, pipeline.metering, clusters_file)
    problems += _check_serving(pipeline_path, pipeline.serving, clusters_file)
    if problems:
        raise ConfigError("invalid estate config:\n" + "\n".join(f"  - {p}" for p in problems))
    areas = {a for c in clusters_file.clusters.values() for a in c.areas}
    catalogue = parse_catalogue(datasets_path, areas)
    registry = parse_registry(models_path, catalogue.datasets, projects_file.projects)
    model = pipeline.defaults.model
    if model is not None and models_path.is_file() and model not in registry.models:
        raise ConfigError(f"{pipeline_path}: defaults.model: {model!r} is not in {MODELS_FILE}; use one of: "
                          f"{', '.join(sorted(registry.models))}")
    return Estate(
        config_dir=config_dir,
        clusters=dict(clusters_file.clusters),
        projects=dict(projects_file.projects),
        teams=dict(projects_file.teams),
        gpu_types=dict(projects_file.gpu_types),
        pipeline=pipeline,
        datasets=catalogue,
        models=registry,
    )


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys: plain YAML silently keeps the last one."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}; keep only one", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _read_yaml(path: Path, allow_empty: bool) -> dict:
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}; fix the syntax at the line shown") from exc
    if data is None and allow_empty:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    return data


def _validate(model: type[_M], path: Path, allow_empty: bool = False) -> _M:
    data = _read_yaml(path, allow_empty)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        lines = [_describe(path, model, err) for err in exc.errors()]
        raise ConfigError(f"invalid {path.name}:\n" + "\n".join(f"  - {line}" for line in lines)) from None


def key_path(loc: tuple[Any, ...]) -> str:
    """``('clusters', 'a', 'node_pools', 0, 'gpus')`` -> ``clusters.a.node_pools[0].gpus``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "[key]":
            out += " (the key itself)"
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _describe(path: Path, model: type[BaseModel], err: dict[str, Any]) -> str:
    loc = tuple(err["loc"])
    where = f"{path}: {key_path(loc)}"
    kind = err["type"]
    if kind == "missing":
        return f"{where}: required key is missing; add `{loc[-1]}: <value>`"
    if kind == "extra_forbidden":
        allowed = _allowed_keys(model, loc[:-1])
        hint = f"; allowed keys here: {', '.join(allowed)}" if allowed else ""
        return f"{where}: unknown key; remove it or fix its spelling{hint}"
    value = err.get("input")
    shown = "" if isinstance(value, dict | list) else f" (got {value!r})"
    fix = "rename the key" if loc and loc[-1] == "[key]" else f"change the value in {path.name}"
    return f"{where}: {err['msg']}{shown}; {fix}"


def _allowed_keys(model: Any, loc: tuple[Any, ...]) -> list[str]:
    """Walk the model's annotations along ``loc`` to list the keys the YAML may use there."""
    current: Any = model
    for part in loc:
        current = _unwrap(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(part) if isinstance(part, str) else None
            if field is None:
                return []
            current = field.annotation
        elif get_origin(current) in (dict, list):
            current = get_args(current)[-1]
        else:
            return []
    current = _unwrap(current)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def _unwrap(tp: Any) -> Any:
    # Optional[X] / X | None / Annotated[X, ...] -> X, so the walk can continue into X.
    origin = get_origin(tp)
    if origin is Annotated:
        return _unwrap(get_args(tp)[0])
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return _unwrap(args[0]) if len(args) == 1 else tp
    return tp


def _check_clusters(path: Path, cf: ClustersFile, pf: ProjectsFile) -> list[str]:
    problems: list[str] = []
    gpu_names = ", ".join(sorted(pf.gpu_types))

    def bad(keys: str, msg: str) -> None:
        problems.append(f"{path}: {keys}: {msg}")

    for name, c in cf.clusters.items():
        at = f"clusters.{name}"
        if not _NAME_RE.match(name):
            bad(at, "cluster names use lowercase letters, numbers and '-' (they become pool and label names)")
        if c.backend == "kubernetes":
            for i, pool in enumerate(c.node_pools):
                for key, value in pool.node_labels.items():
                    if not _LABEL_KEY_RE.match(key) or not _LABEL_VALUE_RE.match(value):
                        bad(
                            f"{at}.node_pools[{i}].node_labels.{key}",
                            "not a valid Kubernetes label (key [prefix/]name, value up to 63 of "
                            "[A-Za-z0-9._-] starting and ending alphanumeric); fix the label",
                        )
            if not c.conn_id:
                bad(
                    f"{at}.conn_id", "backend kubernetes needs conn_id: the Airflow Connection of the cluster"
                )
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
        else:
            for key in ("conn_id", "scheduler", "namespace", "image", "scratch_claim"):
                if getattr(c, key) is not None:
                    bad(
                        f"{at}.{key}",
                        "only used with backend: kubernetes; remove it or set backend: kubernetes",
                    )
        if c.location == "public" and c.cache is None:
            bad(f"{at}.cache", "a public cluster needs cache: {conn_id, bucket} to stage data into")
        problems.extend(f"{path}: {p}" for p in _check_checkpoint_places(at, c))

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
            if pool.node_labels and c.backend != "kubernetes":
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
    if not any(c.location == "private" for c in cf.clusters.values()):
        bad(
            "clusters",
            "no cluster has location: private; add at least one (restricted data may only run there)",
        )
    # One missing price is reported once even when several pools need it.
    return list(dict.fromkeys(problems))


def _check_checkpoint_places(at: str, c: Cluster) -> list[str]:
    problems: list[str] = []
    primary, replica = c.checkpoint_places
    for key, place in (("checkpoint_store", primary), ("checkpoint_replica", replica)):
        if c.backend == "kubernetes" and place == "private":
            problems.append(
                f"{at}.{key}: the pods of a kubernetes cluster cannot reach private storage; use 'cache' "
                "(the cluster's bucket) or 'scratch' (its scratch_claim volume)"
            )
        elif place == "cache" and c.cache is None:
            problems.append(f"{at}.{key}: 'cache' needs a cache: {{conn_id, bucket}}; add one or use 'private'")
        elif place == "cache" and c.is_private and c.backend == "local":
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
    if c.backend == "kubernetes" and "scratch" in (primary, replica):
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
    elif c.backend == "kubernetes" and c.scratch_claim is not None:
        problems.append(f"{at}.scratch_claim: only used when a checkpoint place is 'scratch'; remove it")
    if c.scratch_dir is not None and "scratch" not in (primary, replica):
        problems.append(
            f"{at}.scratch_dir: only used when checkpoint_store or checkpoint_replica is 'scratch'; "
            "remove it or set checkpoint_replica: scratch"
        )
    return problems


def _check_serving(path: Path, serving: ServingSettings, cf: ClustersFile) -> list[str]:
    k8s = serving.kubernetes
    if k8s is None:
        return []
    at = f"{path}: serving.kubernetes"
    cluster = cf.clusters.get(k8s.cluster)
    if cluster is None or cluster.backend != "kubernetes" or not cluster.is_private:
        fit = ", ".join(n for n, c in cf.clusters.items() if c.backend == "kubernetes" and c.is_private) or "none"
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
        elif source.source == "local" and cluster.backend != "local":
            problems.append(
                f"{at}.source: 'local' reads the local backend's slots, but {name} has backend "
                f"{cluster.backend!r}; use 'exporters' or 'prometheus'"
            )
    return problems
