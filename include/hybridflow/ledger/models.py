"""The ledger's tables: what ran (runs, attempts), what the GPUs did (samples), what it cost (prices,
allocations), how long gangs waited for admission (queue_waits), what the resource reaper released
(reaper_sweep, reaper_release), what served (serving_sample) and what serving cost
(inference_allocation, migration 0005), the bytes each project moved and holds (transfer,
quota_usage, quota_notification, migration 0008). Budget state lives in the same database, in
hybridflow.ledger.budget_tables (created by migration 0002)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    metadata = MetaData()


class GpuSampleRow(Base):
    """One GpuSample (hybridflow.metering.records), keyed like GpuSample.key(); ts is naive UTC."""

    __tablename__ = "gpu_sample"
    __table_args__ = (UniqueConstraint("cluster", "node", "gpu_uuid", "mig_key", "ts", name="uq_gpu_sample_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    ts: Mapped[datetime] = mapped_column(DateTime, index=True)
    cluster: Mapped[str] = mapped_column(String(128))
    node: Mapped[str] = mapped_column(String(255))
    gpu_uuid: Mapped[str] = mapped_column(String(128))
    # mig_instance or "": part of the unique key, where NULLs would never collide.
    mig_key: Mapped[str] = mapped_column(String(64), default="")
    gpu_index: Mapped[int | None] = mapped_column(Integer)
    gpu_model: Mapped[str | None] = mapped_column(String(128))
    mig_profile: Mapped[str | None] = mapped_column(String(64))
    mig_instance: Mapped[str | None] = mapped_column(String(64))
    namespace: Mapped[str | None] = mapped_column(String(255))
    pod: Mapped[str | None] = mapped_column(String(255))
    container: Mapped[str | None] = mapped_column(String(255))
    util_pct: Mapped[float | None] = mapped_column(Float)
    mem_used_mib: Mapped[float | None] = mapped_column(Float)
    mem_free_mib: Mapped[float | None] = mapped_column(Float)
    power_w: Mapped[float | None] = mapped_column(Float)
    temp_c: Mapped[float | None] = mapped_column(Float)
    energy_mj: Mapped[float | None] = mapped_column(Float)
    xid: Mapped[int | None] = mapped_column(Integer)
    ecc_sbe: Mapped[int | None] = mapped_column(Integer)
    ecc_dbe: Mapped[int | None] = mapped_column(Integer)
    run_key: Mapped[str | None] = mapped_column(String(255), index=True)


class Run(Base):
    """A pipeline run, from its run record."""

    __tablename__ = "run"

    run_key: Mapped[str] = mapped_column(String(255), primary_key=True)
    project: Mapped[str] = mapped_column(String(128), index=True)
    team: Mapped[str | None] = mapped_column(String(128))
    cluster: Mapped[str | None] = mapped_column(String(128))
    gpu_model: Mapped[str | None] = mapped_column(String(128))
    pricing_class: Mapped[str | None] = mapped_column(String(32))
    price_per_gpu_hour: Mapped[float | None] = mapped_column(Float)
    workers: Mapped[int | None] = mapped_column(Integer)
    priority: Mapped[str | None] = mapped_column(String(32))
    dag_id: Mapped[str | None] = mapped_column(String(255))
    run_id: Mapped[str | None] = mapped_column(String(255))
    gpu_hours: Mapped[float | None] = mapped_column(Float)
    steps_trained: Mapped[int | None] = mapped_column(Integer)
    steps_lost: Mapped[int | None] = mapped_column(Integer)
    budget_override: Mapped[str | None] = mapped_column(Text)
    recorded_at: Mapped[datetime | None] = mapped_column(DateTime)


class Attempt(Base):
    """One try at training a run: every try holds GPUs, whatever its outcome."""

    __tablename__ = "attempt"
    __table_args__ = (UniqueConstraint("run_key", "seq", name="uq_attempt_run_seq"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_key: Mapped[str] = mapped_column(String(255), index=True)
    seq: Mapped[int] = mapped_column(Integer)  # position in the record's attempt list
    try_number: Mapped[int | None] = mapped_column(Integer)
    label: Mapped[str | None] = mapped_column(String(255))
    cluster: Mapped[str | None] = mapped_column(String(128))
    started_at: Mapped[datetime] = mapped_column(DateTime)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime)
    gpus: Mapped[int] = mapped_column(Integer)
    outcome: Mapped[str] = mapped_column(String(32))  # succeeded, failed, preempted, interrupted, stopped, ...
    start_step: Mapped[int | None] = mapped_column(Integer)
    last_step: Mapped[int | None] = mapped_column(Integer)
    # Work done again by the next try: this try's last step minus the step the next one resumed from.
    steps_lost: Mapped[int | None] = mapped_column(Integer)


class Price(Base):
    """Versioned price catalog: the row with the latest valid_from on or before a day applies."""

    __tablename__ = "price"
    __table_args__ = (
        UniqueConstraint("cluster", "pricing_class", "gpu_model", "valid_from", name="uq_price_version"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    cluster: Mapped[str] = mapped_column(String(128))
    pricing_class: Mapped[str] = mapped_column(String(32))
    gpu_model: Mapped[str] = mapped_column(String(128))
    usd_per_gpu_hour: Mapped[float] = mapped_column(Float)
    valid_from: Mapped[str] = mapped_column(String(10))  # ISO date
    source: Mapped[str] = mapped_column(String(255))


class Allocation(Base):
    """One day's GPU use and cost per project, team, cluster, GPU model and pricing class."""

    __tablename__ = "allocation"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    day: Mapped[str] = mapped_column(String(10), index=True)  # ISO date: budgets compare it as a string
    project: Mapped[str] = mapped_column(String(128), index=True)
    team: Mapped[str] = mapped_column(String(128))
    cluster: Mapped[str] = mapped_column(String(128))
    gpu_model: Mapped[str] = mapped_column(String(128))
    pricing_class: Mapped[str] = mapped_column(String(32))
    gpu_hours: Mapped[float] = mapped_column(Float)
    effective_gpu_hours: Mapped[float | None] = mapped_column(Float)
    cost_usd: Mapped[float] = mapped_column(Float)
    waste: Mapped[bool] = mapped_column(Boolean, default=False)
    waste_gpu_hours: Mapped[float] = mapped_column(Float, default=0.0)
    preempted_gpu_hours: Mapped[float] = mapped_column(Float, default=0.0)
    attempts: Mapped[int] = mapped_column(Integer, default=0)


class IdleAllocation(Base):
    """Idle owned capacity of a day, billed to the teams whose guaranteed share it was."""

    __tablename__ = "idle_allocation"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    day: Mapped[str] = mapped_column(String(10), index=True)
    team: Mapped[str] = mapped_column(String(128))  # or "(platform)" for the unguaranteed rest
    cluster: Mapped[str] = mapped_column(String(128))
    gpu_hours: Mapped[float] = mapped_column(Float)
    cost_usd: Mapped[float] = mapped_column(Float)


class QueueWaitRow(Base):
    """One wait of a gang for admission on one cluster (hybridflow.ledger.queue_waits); times are naive UTC.

    A try that fails over waits on each cluster it tries, hence the cluster in the unique key.
    """

    __tablename__ = "queue_waits"
    __table_args__ = (
        UniqueConstraint("run_key", "attempt", "cluster", name="uq_queue_waits_key"),
        # The history placement reads: one cluster's waits of the last days.
        Index("ix_queue_waits_cluster_queued_at", "cluster", "queued_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_key: Mapped[str] = mapped_column(String(255))
    attempt: Mapped[str] = mapped_column(String(255))  # the try's label, e.g. "try-1"
    cluster: Mapped[str] = mapped_column(String(128))
    gpus: Mapped[int] = mapped_column(Integer)  # gang size
    priority: Mapped[str] = mapped_column(String(32))
    queued_at: Mapped[datetime] = mapped_column(DateTime)
    admitted_at: Mapped[datetime | None] = mapped_column(DateTime)
    wait_s: Mapped[float | None] = mapped_column(Float)  # admitted_at - queued_at; None while not admitted
    outcome: Mapped[str] = mapped_column(String(32))  # admitted, moved, gave_up, waiting
    # The gang may run only on private clusters (restricted data, or regions only they are in).
    private_only: Mapped[bool | None] = mapped_column(Boolean, nullable=True)


class ReaperSweepRow(Base):
    """One sweep of the resource reaper (hybridflow.reaper.records); times are naive UTC.

    ``sweep_key`` names the sweep (e.g. its DAG run's data interval): recording a key again replaces
    the sweep and its releases, so a re-run of the same sweep never counts twice.
    """

    __tablename__ = "reaper_sweep"

    sweep_key: Mapped[str] = mapped_column(String(255), primary_key=True)
    started_at: Mapped[datetime] = mapped_column(DateTime, index=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime)
    kept: Mapped[int] = mapped_column(Integer, default=0)  # candidates kept: owner alive or not judged
    errors: Mapped[str | None] = mapped_column(Text)  # JSON {place: why it could not be swept}
    recorded_at: Mapped[datetime] = mapped_column(DateTime)


class ReaperReleaseRow(Base):
    """What a sweep did with one leftover: released it, or (dry-run) only listed it."""

    __tablename__ = "reaper_release"
    __table_args__ = (UniqueConstraint("sweep_key", "place", "kind", "name", name="uq_reaper_release_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    sweep_key: Mapped[str] = mapped_column(String(255))
    place: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(32))
    name: Mapped[str] = mapped_column(String(1024))
    owner_dag_id: Mapped[str | None] = mapped_column(String(255))
    owner_run_id: Mapped[str | None] = mapped_column(String(255))
    owner_task_id: Mapped[str | None] = mapped_column(String(255))
    owner_try: Mapped[int | None] = mapped_column(Integer)
    gpus: Mapped[int] = mapped_column(Integer, default=0)
    gpu_hours: Mapped[float] = mapped_column(Float, default=0.0)
    since: Mapped[datetime | None] = mapped_column(DateTime)
    reason: Mapped[str | None] = mapped_column(Text)
    dry_run: Mapped[bool] = mapped_column(Boolean)
    released: Mapped[bool] = mapped_column(Boolean)
    error: Mapped[str | None] = mapped_column(Text)


class ServingSampleRow(Base):
    """What one model version held while serving during one metering window (hybridflow.metering.serving).

    ``units`` are slots (a model server process on this machine, ``unit`` "slot") or GPUs (replicas x
    GPUs per replica on Kubernetes, ``unit`` "gpu"), ``unit_hours`` what they held within the window.
    A window metered again replaces its rows for that target (cluster), so nothing counts twice.
    """

    __tablename__ = "serving_sample"
    __table_args__ = (
        UniqueConstraint("cluster", "window_start", "endpoint", "version", name="uq_serving_sample_key"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    window_start: Mapped[datetime] = mapped_column(DateTime, index=True)
    window_end: Mapped[datetime] = mapped_column(DateTime)
    cluster: Mapped[str] = mapped_column(String(128))  # "local" for this machine's model servers
    endpoint: Mapped[str] = mapped_column(String(128))
    version: Mapped[str] = mapped_column(String(255), index=True)  # a pipeline deploy's run_key
    model: Mapped[str | None] = mapped_column(String(255))
    unit: Mapped[str] = mapped_column(String(8))  # slot | gpu
    units: Mapped[float] = mapped_column(Float)
    unit_hours: Mapped[float] = mapped_column(Float)
    gpu_model: Mapped[str | None] = mapped_column(String(128))
    pricing_class: Mapped[str | None] = mapped_column(String(32))
    usd_per_unit_hour: Mapped[float] = mapped_column(Float)
    source: Mapped[str] = mapped_column(String(255))  # what was read: a version record, a Deployment, ...


class InferenceAllocation(Base):
    """One day's inference cost per project and model version (and where it served)."""

    __tablename__ = "inference_allocation"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    day: Mapped[str] = mapped_column(String(10), index=True)
    project: Mapped[str] = mapped_column(String(128), index=True)  # "unattributed" for a version of no known run
    team: Mapped[str] = mapped_column(String(128))
    model: Mapped[str] = mapped_column(String(255))
    endpoint: Mapped[str] = mapped_column(String(128))
    version: Mapped[str] = mapped_column(String(255))
    cluster: Mapped[str] = mapped_column(String(128))
    unit: Mapped[str] = mapped_column(String(8))
    unit_hours: Mapped[float] = mapped_column(Float)
    usd_per_unit_hour: Mapped[float] = mapped_column(Float)  # hour-weighted mean of the day's samples
    cost_usd: Mapped[float] = mapped_column(Float)


class DrillRow(Base):
    """One disaster-recovery drill (hybridflow.dr.drills.ledger): its RTO/RPO figures, the targets it
    was judged against, the verdict, and its whole report (JSON). Recording a drill again replaces it."""

    __tablename__ = "dr_drill"

    drill: Mapped[str] = mapped_column(String(255), primary_key=True)
    declared_at: Mapped[datetime | None] = mapped_column(DateTime, index=True)  # naive UTC
    primary_cluster: Mapped[str | None] = mapped_column(String(128))
    dr_cluster: Mapped[str | None] = mapped_column(String(128))
    run_key: Mapped[str | None] = mapped_column(String(255))
    endpoint: Mapped[str | None] = mapped_column(String(128))
    inference_rto_s: Mapped[float | None] = mapped_column(Float)
    training_rto_s: Mapped[float | None] = mapped_column(Float)
    rpo_steps_lost: Mapped[int | None] = mapped_column(Integer)
    rpo_dataset_age_s: Mapped[float | None] = mapped_column(Float)
    target_inference_rto_s: Mapped[float] = mapped_column(Float)
    target_training_rto_s: Mapped[float] = mapped_column(Float)
    target_rpo_steps: Mapped[int | None] = mapped_column(Integer)
    target_dataset_age_s: Mapped[float | None] = mapped_column(Float)
    verdict: Mapped[str] = mapped_column(String(16))  # met | missed
    missed: Mapped[str | None] = mapped_column(Text)  # JSON list of the steps that missed, each named
    report: Mapped[str] = mapped_column(Text)  # the drill's whole report (JSON), as in private storage
    recorded_at: Mapped[datetime] = mapped_column(DateTime)


class TransferRow(Base):
    """Bytes one project moved on one UTC day (hybridflow.ledger.transfers): a dataset staged into a
    cluster's cache, a set replicated into a DR store, a version served out. ``key`` names the
    transfer (e.g. the run, cluster and version staged), so a re-run task records it once."""

    __tablename__ = "transfer"
    __table_args__ = (Index("ix_transfer_project_day", "project", "day"),)

    key: Mapped[str] = mapped_column(String(512), primary_key=True)
    day: Mapped[str] = mapped_column(String(10), index=True)  # ISO date, UTC
    project: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(16))  # staging | replication | serving
    cluster: Mapped[str] = mapped_column(String(128))  # whose cache or store the bytes went to or left
    bytes: Mapped[int] = mapped_column(BigInteger)
    run_key: Mapped[str | None] = mapped_column(String(255))
    # What moved: a dataset's version; an endpoint's model version or a run's checkpoint step (dataset None).
    dataset: Mapped[str | None] = mapped_column(String(255))
    version: Mapped[str | None] = mapped_column(String(255))
    recorded_at: Mapped[datetime] = mapped_column(DateTime)  # naive UTC


class QuotaUsageRow(Base):
    """One project's bytes held and moved as the nightly job counted them for a day, with its quotas
    and the day's cost (hybridflow.budgets.quota_nightly). A day counted again is replaced."""

    __tablename__ = "quota_usage"

    day: Mapped[str] = mapped_column(String(10), primary_key=True)  # ISO date, UTC
    project: Mapped[str] = mapped_column(String(128), primary_key=True)
    storage_bytes: Mapped[int] = mapped_column(BigInteger)
    transfer_bytes_day: Mapped[int] = mapped_column(BigInteger)
    transfer_bytes_month: Mapped[int] = mapped_column(BigInteger)  # the calendar month up to this day
    storage_quota_gib: Mapped[float | None] = mapped_column(Float)
    transfer_quota_gib: Mapped[float | None] = mapped_column(Float)
    storage_usd: Mapped[float] = mapped_column(Float)  # the day's share of a month's storage price
    transfer_usd: Mapped[float] = mapped_column(Float)  # the day's transferred bytes x egress price


class QuotaNotificationRow(Base):
    """A quota threshold's notification, sent once per project, month, quota and share."""

    __tablename__ = "quota_notification"

    project: Mapped[str] = mapped_column(String(128), primary_key=True)
    period: Mapped[str] = mapped_column(String(7), primary_key=True)  # YYYY-MM
    quota: Mapped[str] = mapped_column(String(32), primary_key=True)  # storage_gib | transfer_gib_per_month
    threshold: Mapped[float] = mapped_column(Float, primary_key=True)
    usage_bytes: Mapped[int] = mapped_column(BigInteger)
    quota_gib: Mapped[float] = mapped_column(Float)
    sent_at: Mapped[datetime] = mapped_column(DateTime)  # naive UTC
