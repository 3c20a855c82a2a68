"""``clusters.yaml``: clusters, their node pools, prices, caches and checkpoint places."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, model_validator

from hybridflow.config.base import _Model
from hybridflow.config.units import Rate

PricingClass = Literal["onprem", "on_demand", "reserved", "spot"]
# NCCL_SOCKET_IFNAME: interface name prefixes, comma-separated; a leading "^" excludes them, "="
# makes the names exact (e.g. "eth0", "^docker,lo", "=ib0"). Linux names are at most 15 characters.
NCCL_IFNAME_RE = re.compile(r"^\^?=?[A-Za-z0-9_.-]{1,15}(,[A-Za-z0-9_.-]{1,15})*$")


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


# What a cluster is for: primary (the main platform), elastic (capacity rented to absorb peaks) or dr
# (the disaster-recovery pool, kept for a takeover when a primary is down).
ClusterRole = Literal["primary", "elastic", "dr"]
RunPriority = Literal["critical", "normal", "batch"]


class DrReplicate(_Model):
    """The critical services a takeover must bring back: what the replication DAG keeps on the DR side."""

    # Model gateway endpoints whose served versions are copied (default, empty: every endpoint served).
    endpoints: list[str] = Field(default_factory=list)
    # Catalogue datasets whose validated versions are copied (default, empty: each copied endpoint's
    # model's dataset).
    datasets: list[str] = Field(default_factory=list)


class DrServing(_Model):
    """Kubernetes DR clusters: the inference pool a takeover serves the replicated models from, at
    minimum scale, in the kind and with the image of ``serving.kubernetes``."""

    node_pool: str = Field(min_length=1)  # a node pool of this cluster
    namespace: str = Field(default="hybridflow-serving", min_length=1)
    # PersistentVolumeClaim of the DR cluster's models volume, and where the same volume is mounted on
    # the Airflow workers (the replicated bundle is published there before the pool starts).
    models_claim: str = Field(min_length=1)
    models_dir: str = Field(min_length=1)
    replicas: int = Field(default=1, ge=1, le=100)  # the minimum service
    ready_timeout_s: float = Field(default=600, gt=0)


class DrSettings(_Model):
    """What a ``role: dr`` cluster must offer in a takeover, and the work it may take meanwhile."""

    # GPUs the pool must hold to run the minimum service in a takeover (at most what its pools hold).
    min_gpus: int = Field(gt=0)
    # Run priorities placement may send here while no cluster is down, so the pool is used every day.
    peacetime: list[RunPriority] = Field(default_factory=list)
    # A dr cluster on a public location must say why that is acceptable (restricted data never moves there).
    public_reason: str | None = Field(default=None, min_length=1)
    # What replication keeps on this cluster ahead of need (default: everything served).
    replicate: DrReplicate = Field(default_factory=DrReplicate)
    # backend kubernetes only: where a takeover serves when serving.target is kubernetes or kserve.
    serving: DrServing | None = None


class Cluster(_Model):
    location: Literal["private", "public"]
    # Default: primary for private clusters, elastic for public ones.
    role: ClusterRole = "primary"
    dr: DrSettings | None = None  # role dr only
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
    # kubernetes only: the network interface(s) NCCL uses between a gang's pods (NCCL_SOCKET_IFNAME in
    # every worker's environment), e.g. "eth0" or "^lo,docker"; unset, NCCL picks one itself.
    nccl_socket_ifname: str | None = None
    node_pools: list[NodePool] = Field(min_length=1)
    prices: dict[PricingClass, Annotated[float, Field(ge=0)]]
    # USD per GiB held for a month in the cluster's cache (or DR store), and per GiB transferred to or
    # from it (staged into it, replicated into it, served out of it): the project quotas' cost.
    storage_usd_per_gib_month: float = Field(default=0.0, ge=0)
    egress_usd_per_gib: float = Field(default=0.0, ge=0)
    cache: CacheConfig | None = None
    # The latest checkpoints are kept in two places: the worker commits to checkpoint_store first,
    # then replicates to checkpoint_replica (default: private storage, or scratch if the primary is
    # private storage).
    checkpoint_store: CheckpointPlace = "private"
    checkpoint_replica: CheckpointPlace | None = None
    # The cluster's scratch filesystem: absolute, or relative to HYBRIDFLOW_HOME (default scratch/<cluster>).
    scratch_dir: str | None = Field(default=None, min_length=1)
    # Byte rate all uploads into the cluster's cache bucket share (staging, DR replication, checkpoint
    # commits; checkpoints first), with its unit: "200 MB/s". None: only pipeline.yaml bandwidth caps.
    upload_cap: Rate | None = None

    _name: str = PrivateAttr(default="")
    _bandwidth: Any = PrivateAttr(default=None)  # pipeline.yaml bandwidth (BandwidthSettings), set on load

    @model_validator(mode="before")
    @classmethod
    def _default_role(cls, data: Any) -> Any:
        if isinstance(data, dict) and "role" not in data and data.get("location") == "public":
            return {**data, "role": "elastic"}
        return data

    # What a backend kind offers, declared here once: code outside config/ and backends/ asks these
    # (or the cluster's GangBackend) instead of naming a backend.
    @property
    def runs_pods(self) -> bool:
        """Its gangs run as pods through the cluster's API: a Connection, a namespace, an image, claims
        for scratch and models, node labels; nothing of them is on the Airflow worker's machine."""
        return self.backend == "kubernetes"

    @property
    def on_this_machine(self) -> bool:
        """Its gangs run as processes of the Airflow worker's machine: its scratch folder and slots are here."""
        return self.backend == "local"

    @property
    def is_dr(self) -> bool:
        return self.role == "dr"

    def peacetime_allows(self, priority: str) -> bool:
        """Whether a run of ``priority`` may be placed here while no cluster is down."""
        return not self.is_dr or (self.dr is not None and priority in self.dr.peacetime)

    @property
    def name(self) -> str:
        return self._name

    def endpoint_cap(self, endpoint: str) -> float | None:
        """pipeline.yaml's cap on uploads to ``endpoint`` (bytes/s), or None."""
        return None if self._bandwidth is None else self._bandwidth.cap_of(endpoint)

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
