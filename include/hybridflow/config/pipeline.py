"""``pipeline.yaml``: pipeline-wide settings (training, admission, data, serving, placement, staging,
metering, reaper)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from hybridflow.config.base import _Model
from hybridflow.config.units import Rate


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
    # A Kubernetes API that does not answer (or answers 429/5xx) is retried this long during the
    # wait before the train task fails saying so; the gang itself keeps running.
    kubernetes_api_outage_s: float = Field(default=300, gt=0, le=86_400)


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
    # deployment: a stable and a canary Deployment behind a Service; kserve: one
    # serving.kserve.io/v1beta1 InferenceService whose canaryTrafficPercent moves through serving.canary.
    kind: Literal["deployment", "kserve"] = "deployment"


class ModelServerSettings(_Model):
    """The model server of every version (``python -m hybridflow.serving.server``, KServe's ModelServer)."""

    # Dynamic batching: concurrent requests are run through the model together, up to this many
    # instances, waiting at most this long for more to arrive once batches fill up (a lighter load
    # never waits).
    max_batch_size: int = Field(default=32, ge=1, le=4096)
    max_batch_wait_ms: float = Field(default=5, ge=0, le=1000)
    max_instances: int = Field(default=1024, ge=1, le=100_000)  # per request
    max_body_mib: float = Field(default=8, gt=0, le=1024)  # per request; bigger bodies get 413 unread
    # A request (reading its body, waiting for its batch, answering) that takes longer is cut off.
    request_timeout_s: float = Field(default=10, gt=0, le=600)


class GateSettings(_Model):
    """What a new version must show under load before any traffic moves to it."""

    p99_ms: float = Field(default=250, gt=0)  # p99 latency under the load test, at most
    min_rps: float = Field(default=50, gt=0)  # requests per second, at least
    max_error_rate: float = Field(default=0.0, ge=0, le=1)  # failed requests / requests, at most
    # The new version's p99 may exceed the serving version's (measured in the same deploy) by at most
    # this share: 0.5 = 50 % slower.
    max_p99_regression: float = Field(default=0.5, ge=0)
    concurrency: int = Field(default=8, ge=1, le=1024)  # simultaneous users of the load test
    duration_s: float = Field(default=5, gt=0, le=3600)  # how long the load test runs


class CanarySettings(_Model):
    """Traffic moves to a new version in these steps; each is held for ``window_s`` while the
    canary's error rate and p99 are compared with the stable version's."""

    steps: list[int] = Field(default_factory=lambda: [10, 50, 100], min_length=1)
    window_s: float = Field(default=3, gt=0, le=3600)
    # During each window the deployer sends this many concurrent requests through the endpoint, so a
    # step is judged on traffic even when no client is calling.
    concurrency: int = Field(default=4, ge=1, le=1024)

    @model_validator(mode="after")
    def _steps_climb_to_100(self) -> CanarySettings:
        if any(not 0 < s <= 100 for s in self.steps) or self.steps != sorted(set(self.steps)) or self.steps[-1] != 100:
            raise ValueError(f"steps {self.steps}: use rising percentages in 1..100 that end at 100, e.g. [10, 50, 100]")
        return self


# Every deploy target's name: config checks ``serving.target`` against these without importing
# serving (which sits above config); ``hybridflow.serving.DEPLOY_TARGETS`` maps each to its class.
DEPLOY_TARGET_NAMES = ("kserve", "kubernetes", "local")


class ServingSettings(_Model):
    # The model gateway on 127.0.0.1: every model's endpoint is /v1/models/<endpoint>:predict on it.
    port: int = Field(default=8790, ge=1, le=65535)
    # None: serve on this machine (blue/green behind 127.0.0.1:port); else roll out on Kubernetes.
    kubernetes: KubernetesServing | None = None
    # The deploy target by name (DEPLOY_TARGET_NAMES); None: kubernetes when the
    # section above is there, else local.
    target: str | None = None
    server: ModelServerSettings = Field(default_factory=ModelServerSettings)
    gate: GateSettings = Field(default_factory=GateSettings)
    canary: CanarySettings = Field(default_factory=CanarySettings)
    # Inference cost: what one serving slot (a model server process on this machine, or one replica's
    # GPU share on Kubernetes) costs per hour, for the nightly allocation.
    slot_price_per_hour: float = Field(default=0.0, ge=0)


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


class BandwidthSettings(_Model):
    """Byte-rate caps on uploads into object stores (pipeline.yaml ``bandwidth``), which staging,
    DR replication and checkpoint commits share (checkpoints first); a cluster's own cap on its
    cache bucket is clusters.yaml ``upload_cap``. Rates carry their unit: "200 MB/s"."""

    # Per endpoint: a cache Connection's endpoint_url, or aws:<region> for AWS's own endpoint.
    endpoints: dict[str, Rate] = Field(default_factory=dict)
    # Every endpoint without an entry above (None: no cap).
    default: Rate | None = None

    def cap_of(self, endpoint: str) -> float | None:
        """Bytes per second uploads to ``endpoint`` may take, or None."""
        wanted = endpoint.strip().rstrip("/").lower()
        for name, rate in self.endpoints.items():
            if name.strip().rstrip("/").lower() == wanted:
                return rate
        return self.default


class ReservationSettings(_Model):
    """Private capacity kept for work that may run only on private clusters (hybridflow.placement.reserve)."""

    # Share of each private cluster's GPUs that a run which may run public leaves free while such work
    # waits there or is expected (0: nothing is kept).
    share: float = Field(default=1.0, ge=0, le=1)
    # Such work is expected on a cluster when some was admitted there within this many hours (ledger).
    expect_within_h: float = Field(default=720, ge=0, le=24 * 365)
    # Making room: an interruptible run that may run public may use the kept GPUs; when such work then
    # waits behind it, it is checkpointed and moved to a public cluster, at most this many times per
    # run (0: never moved, so interruptible runs leave the kept GPUs free too).
    move_budget: int = Field(default=1, ge=0)


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
    reservation: ReservationSettings = Field(default_factory=ReservationSettings)


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


class ReaperCluster(_Model):
    """One cluster's overrides of the reaper's settings."""

    dry_run: bool | None = None  # None: the reaper-wide dry_run


class ReaperSettings(_Model):
    """The resource_reaper DAG: what it may release, and how often it looks."""

    # Its schedule: a preset ("@hourly") or cron.
    schedule: str = Field(default="@hourly", min_length=1)
    # Dry-run lists what would be released and changes nothing; per cluster under clusters.<name>.
    dry_run: bool = True
    clusters: dict[str, ReaperCluster] = Field(default_factory=dict)
    # An unfinished multipart upload older than this many hours is abandoned.
    multipart_max_age_h: float = Field(default=24, gt=0)
    # A finished run's scratch folder is kept this many hours after the run ended.
    scratch_keep_h: float = Field(default=24, ge=0)

    def dry_run_for(self, place: str) -> bool:
        """Whether the reaper only lists what it finds in ``place`` (a cluster, or a store named by its cluster)."""
        override = self.clusters.get(place)
        return self.dry_run if override is None or override.dry_run is None else override.dry_run


class PipelineConfig(_Model):
    defaults: DefaultsSettings = DefaultsSettings()
    admission: AdmissionSettings = AdmissionSettings()
    training: TrainingSettings = TrainingSettings()
    data: DataSettings = DataSettings()
    serving: ServingSettings = ServingSettings()
    placement: PlacementSettings = PlacementSettings()
    staging: StagingConfig = StagingConfig()
    bandwidth: BandwidthSettings = BandwidthSettings()
    metering: MeteringSettings = MeteringSettings()
    reaper: ReaperSettings = ReaperSettings()
