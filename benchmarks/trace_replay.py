"""The replay behind benchmarks/placement_trace.py: a trace of the openb format read into gang runs,
the estate written as ordinary ``config/`` files, the event loop, and the baselines and the lower
bound run over the same arrivals ("ours", the product's rules, is in ``replay_ours``). See that
script's docstring for the model."""

from __future__ import annotations

import csv
import heapq
import random
import statistics
import sys
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "include"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.reference: the in-repo reference data

from tests.reference import PRICE_TABLE, TRACE_DIR  # noqa: E402

from hybridflow.config import Estate, load_estate  # noqa: E402
from hybridflow.ledger.queue_waits import QueueWait  # noqa: E402
from hybridflow.request import AdmittedRun  # noqa: E402
from hybridflow.waits import parse_duration  # noqa: E402

DEFAULT_PODS = TRACE_DIR / "openb_pod_list_default.csv"
DEFAULT_NODES = TRACE_DIR / "openb_node_list_gpu_node.csv"
DEFAULT_PRICES = PRICE_TABLE
PRIVATE, PUBLIC = "private-dc", "public-cloud"
PRIVATE_AREA = "eu"  # the private cluster's jurisdiction; region-limited runs may only go there
GPU = "A100-80GB"  # the trace's tasks ask for any GPU type (gpu_spec is empty): one model here
PUBLIC_POOL_GPUS = 100_000  # per public pool: more than the trace ever asks for at once (elastic)
PRIORITY_RANK = {"critical": 0, "normal": 1, "batch": 2}  # as hybridflow.backends.local
POD_COLUMNS = ("num_gpu", "creation_time", "scheduled_time", "deletion_time")
NODE_COLUMNS = ("gpu",)
PRICE_COLUMNS = ("provider", "gpu_model", "gpu_memory_gb", "region", "pricing_tier", "usd_per_gpu_hour")


class TraceError(Exception):
    """An input file the replay cannot use; main turns it into a usage error."""


@dataclass
class Job:
    name: str
    gpus: int
    arrival: float
    duration: float
    priority: str
    restricted: bool
    interruptible: bool
    region_limited: bool = False
    start_by: str | None = None
    run: AdmittedRun | None = None

    @property
    def bound(self) -> bool:
        """Must stay private: restricted data, or a region the public pool is not in."""
        return self.restricted or self.region_limited


class Rec:
    """One job's fate under one policy."""

    __slots__ = ("job", "start", "where", "waiting", "moves", "gave_up_at", "refused", "stuck", "finish_at",
                 "segments", "lost_s", "since")

    def __init__(self, job: Job) -> None:
        self.job = job
        self.start: float | None = None
        self.where: str | None = None  # "private", "spot" or "on_demand"
        self.waiting = False  # holds a ticket in the private queue
        self.moves = 0
        self.gave_up_at: float | None = None
        self.refused = False  # no cluster could take it at all
        self.stuck = False  # no other cluster can ever take it: rechecks would only repeat the answer
        self.finish_at: float | None = None  # when it ends where it runs now
        self.segments: list[tuple[str, float]] = []  # (where, seconds) it ran: one, or two after a move
        self.lost_s = 0.0  # run time done again after its moves
        self.since = 0.0  # when it started where it runs now

    @property
    def in_time(self) -> bool:
        """Started within its start_by (False for a run without one)."""
        start_by = self.job.start_by
        return (start_by is not None and self.start is not None
                and self.start - self.job.arrival <= parse_duration(start_by))

    @property
    def wait(self) -> float | None:
        if self.start is not None:
            return self.start - self.job.arrival
        if self.gave_up_at is not None:  # what it waited before giving up: a floor on its real wait
            return self.gave_up_at - self.job.arrival
        return None


@dataclass
class Result:
    policy: str
    recs: list[Rec]
    private_gpus: int
    end: float
    notes: dict = field(default_factory=dict)


# -- inputs ------------------------------------------------------------------------------------------
@contextmanager
def _rows(path: Path, required: tuple[str, ...], what: str) -> Iterator[csv.DictReader]:
    """The file's rows, once its header is known to hold the columns the replay reads."""
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in required if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{path}: not a {what}: missing column(s) {', '.join(missing)} "
                             f"(needs {', '.join(required)})")
        yield reader


def _number(row: dict, column: str, path: Path, line: int) -> float:
    try:
        return float(row[column])
    except (TypeError, ValueError):
        raise TraceError(f"{path}: line {line}: {column} {row[column]!r} is not a number") from None


def read_jobs(path: Path, *, restricted_share: float, interruptible_share: float, region_share: float,
              start_by_share: float, start_by: str, seed: int) -> tuple[list[Job], dict]:
    # Restricted and interruptible come from one stream, region and deadline from another, each
    # drawn for every task: changing one share never reshuffles the other labels.
    rng, rng2 = random.Random(seed), random.Random(f"{seed}/region-deadline")
    jobs, skipped = [], {"no_gpu": 0, "never_scheduled": 0}
    with _rows(path, POD_COLUMNS, "pod list (openb format)") as reader:
        for line, row in enumerate(reader, start=2):
            gpus = int(_number(row, "num_gpu", path, line)) if row["num_gpu"] else 0
            if gpus <= 0:
                skipped["no_gpu"] += 1
                continue
            if not row["scheduled_time"] or not row["deletion_time"]:
                skipped["never_scheduled"] += 1  # pending in the real cluster: no run time to replay
                continue
            r_restricted, r_interruptible = rng.random(), rng.random()
            r_region, r_deadline = rng2.random(), rng2.random()
            run_s = _number(row, "deletion_time", path, line) - _number(row, "scheduled_time", path, line)
            jobs.append(Job(
                name=row.get("name") or f"line-{line}",
                gpus=gpus,
                arrival=_number(row, "creation_time", path, line),
                duration=max(run_s, 1.0),
                priority="batch" if row.get("qos") == "BE" else "normal",
                restricted=r_restricted < restricted_share,
                interruptible=r_interruptible < interruptible_share,
                region_limited=r_region < region_share,
                start_by=start_by if r_deadline < start_by_share else None,
            ))
    jobs.sort(key=lambda j: (j.arrival, j.name))
    return jobs, skipped


def private_nodes(path: Path, target_gpus: int) -> tuple[int, int, list[str]]:
    """Whole nodes from the node list, in file order, until the private cluster has ``target_gpus``."""
    gpus, nodes, models = 0, 0, set()
    with _rows(path, NODE_COLUMNS, "node list (openb format)") as reader:
        for line, row in enumerate(reader, start=2):
            if gpus >= target_gpus:
                break
            n = int(_number(row, "gpu", path, line)) if row["gpu"] else 0
            if n > 0:
                gpus += n
                nodes += 1
                models.add(row.get("model") or "?")
    if gpus < target_gpus:
        raise TraceError(f"{path}: the node list has only {gpus} GPUs; lower --private-gpus")
    return gpus, nodes, sorted(models)


def public_prices(path: Path, provider: str, model: str, memory_gb: str, region: str) -> tuple[float, float]:
    """(on-demand, spot) USD per GPU-hour: the on-demand list price and the median spot zone price."""
    on_demand, spot = [], []
    with _rows(path, PRICE_COLUMNS, "price table") as reader:
        for row in reader:
            if (row["provider"], row["gpu_model"], row["gpu_memory_gb"], row["region"]) != (
                provider, model, memory_gb, region,
            ) or not row["usd_per_gpu_hour"]:
                continue
            (on_demand if row["pricing_tier"] == "on_demand" else spot).append(float(row["usd_per_gpu_hour"]))
    if not on_demand or not spot:
        raise TraceError(f"{path}: no on_demand and spot rows for {provider} {model} {memory_gb} GB in {region}")
    return statistics.median(on_demand), statistics.median(spot)


def write_estate(folder: Path, private_gpus: int, onprem: float, on_demand: float, spot: float, *,
                 spill_threshold: float, admission_timeout_s: int, max_queue_wait_s: int) -> Estate:
    """The benchmark's estate as the same three config files a deployment uses."""
    pool = {"gpu_model": GPU, "gpu_memory_gib": 80}
    clusters = {
        "clusters": {
            PRIVATE: {
                "location": "private", "region": "dc-1", "jurisdiction": PRIVATE_AREA,
                "node_pools": [{"name": "trace-nodes", **pool, "gpus": private_gpus}],
                "prices": {"onprem": onprem},
            },
            PUBLIC: {
                "location": "public", "region": "us-east-1", "jurisdiction": "us",
                "node_pools": [
                    {"name": "on-demand", **pool, "gpus": PUBLIC_POOL_GPUS},
                    {"name": "spot", **pool, "gpus": PUBLIC_POOL_GPUS, "spot": True},
                ],
                "prices": {"on_demand": on_demand, "spot": spot},
                "cache": {"conn_id": "trace_cache", "bucket": "trace-cache"},
                "checkpoint_store": "cache",
            },
        }
    }
    projects = {
        "gpu_types": {GPU: {"memory_gib": 80}},
        "teams": {"trace": {}},
        "projects": {"trace": {"team": "trace", "max_workers": 64}},
    }
    pipeline = {
        "placement": {"spill_threshold": spill_threshold, "spill_counts_queue": True},
        "training": {"gang_admission_timeout_s": admission_timeout_s, "max_queue_wait_s": max_queue_wait_s},
    }
    for name, doc in (("clusters.yaml", clusters), ("projects.yaml", projects), ("pipeline.yaml", pipeline)):
        (folder / name).write_text(yaml.safe_dump(doc, sort_keys=False))
    return load_estate(folder, use_cache=False)


def as_run(job: Job) -> AdmittedRun:
    return AdmittedRun(
        project="trace", team="trace", model="trace", dataset="trace", dataset_location="-", workers=job.gpus,
        gpu_type=GPU, classification="restricted" if job.restricted else "internal", priority=job.priority,
        regions=[PRIVATE_AREA] if job.region_limited else None, interruptible=job.interruptible,
        spot_allowed=job.interruptible, start_by=job.start_by, checkpoint_every_steps=1,
    )


# -- the replay ----------------------------------------------------------------------------------------
FINISH, GIVE_UP, RECHECK, ARRIVE = range(4)  # same instant: free GPUs first, arrivals last


class Replay:
    """Discrete events over one private cluster and an elastic public pool (never a wait).

    The private queue keeps tickets in a heap by ``key``; withdrawn tickets stay in it, marked, and
    are dropped when they reach the top. Admission is the local slot pool's: the top ticket starts
    when it fits, nothing overtakes it (the head blocks)."""

    def __init__(self, jobs: list[Job], private_gpus: int, *, record_history: bool = False) -> None:
        self.recs = [Rec(j) for j in jobs]
        self.cap = private_gpus
        self.used = self.queued = self.public_used = 0
        self.bound_queued = 0  # GPUs of waiting runs that may run only on the private cluster
        self.last_bound_arrival: float | None = None  # the newest admitted one's arrival (the ledger's queued_at)
        self.queue: list[tuple[tuple, int, Rec]] = []
        self.events: list[tuple[float, int, int, Rec]] = []
        self.seq = 0
        self.now = 0.0
        self.end = 0.0
        self.record_history = record_history
        self.history: deque[QueueWait] = deque()  # admitted waits, in admission order (as the ledger)
        self.running_private: dict[int, Rec] = {}  # by id: what runs on the private cluster now
        self.make_room = None  # (sim, head rec) -> None: may move gangs off to fit the queue's head

    def push(self, t: float, kind: int, rec: Rec) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, kind, self.seq, rec))

    def has_room(self, gpus: int) -> bool:
        return self.queued == 0 and self.used + gpus <= self.cap

    def start(self, rec: Rec, where: str, seconds: float | None = None) -> None:
        """``rec`` starts running ``where`` now, for ``seconds`` (default: its whole duration)."""
        job = rec.job
        seconds = job.duration if seconds is None else seconds
        if rec.start is None:
            rec.start = self.now
        rec.where, rec.since, rec.finish_at = where, self.now, self.now + seconds
        rec.segments.append((where, seconds))
        self.end = max(self.end, self.now + seconds)
        if where == "private":
            self.used += job.gpus
            self.running_private[id(rec)] = rec
            if job.bound:
                self.last_bound_arrival = max(self.last_bound_arrival or job.arrival, job.arrival)
        else:
            self.public_used += job.gpus
        self.push(self.now + seconds, FINISH, rec)
        if self.record_history and len(rec.segments) == 1:
            # The train task records every admission, the wait counted from when the run first
            # queued (a moved gang's wait includes its time in the private queue).
            self.history.append(QueueWait(PRIVATE if where == "private" else PUBLIC, job.gpus,
                                          self.now - job.arrival, _ts(job.arrival)))

    def enqueue(self, rec: Rec, key: tuple) -> None:
        if rec.job.gpus > self.cap:
            rec.refused = True  # could never be admitted: a queue would block behind it forever
            return
        self.seq += 1
        heapq.heappush(self.queue, (key, self.seq, rec))
        rec.waiting = True
        self.queued += rec.job.gpus
        self.bound_queued += rec.job.gpus if rec.job.bound else 0
        self.drain()

    def drain(self) -> None:
        while self.queue:
            rec = self.queue[0][2]
            if not rec.waiting:
                heapq.heappop(self.queue)
                continue
            if rec.job.gpus > self.cap - self.used and self.make_room is not None:
                self.make_room(self, rec)
            if rec.job.gpus > self.cap - self.used:
                return
            heapq.heappop(self.queue)
            rec.waiting = False
            self.queued -= rec.job.gpus
            self.bound_queued -= rec.job.gpus if rec.job.bound else 0
            self.start(rec, "private")

    def stop_private(self, rec: Rec, lost_s: float) -> float:
        """Stop ``rec`` on the private cluster now (moved off after a checkpoint); the run time it has
        left, plus ``lost_s`` done again."""
        left = rec.finish_at - self.now + lost_s
        ran = self.now - rec.since
        where, _ = rec.segments.pop()
        rec.segments.append((where, ran))
        rec.finish_at = None
        rec.lost_s += lost_s
        self.used -= rec.job.gpus
        self.running_private.pop(id(rec), None)
        return left

    def withdraw(self, rec: Rec) -> None:
        rec.waiting = False
        self.queued -= rec.job.gpus
        self.bound_queued -= rec.job.gpus if rec.job.bound else 0
        self.drain()  # it may have been the blocked head

    def run(self, on_arrival, on_recheck=None, on_give_up=None) -> None:
        for rec in self.recs:
            self.push(rec.job.arrival, ARRIVE, rec)
        while self.events:
            self.now, kind, _, rec = heapq.heappop(self.events)
            if kind == ARRIVE:
                on_arrival(self, rec)
            elif kind == FINISH:
                if self.now != rec.finish_at:
                    continue  # it was moved: it ends elsewhere, later
                rec.finish_at = None
                if rec.where == "private":
                    self.used -= rec.job.gpus
                    self.running_private.pop(id(rec), None)
                    self.drain()
                else:
                    self.public_used -= rec.job.gpus
            elif rec.waiting and kind == RECHECK and on_recheck is not None:
                on_recheck(self, rec)
            elif rec.waiting and kind == GIVE_UP and on_give_up is not None:
                on_give_up(self, rec)

    def window(self, days: int) -> list[QueueWait]:
        """The admitted waits queued in the last ``days`` days, as queue_wait_history reads them."""
        cutoff = _ts(self.now) - timedelta(days=days)
        while self.history and self.history[0].queued_at < cutoff:
            self.history.popleft()  # also older than any later cutoff
        return [w for w in self.history if w.queued_at >= cutoff]


def _ts(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def pool_order(rec: Rec, now: float) -> tuple:
    return (PRIORITY_RANK[rec.job.priority], now)


def private_fifo(jobs: list[Job], cap: int) -> Result:
    sim = Replay(jobs, cap)
    sim.run(lambda s, r: s.enqueue(r, (r.job.arrival,)))
    return Result("always-private FIFO", sim.recs, cap, sim.end)


def public_on_demand(jobs: list[Job], cap: int) -> Result:
    sim = Replay(jobs, cap)
    sim.run(lambda s, r: s.start(r, "on_demand"))
    return Result("always-public on-demand", sim.recs, cap, sim.end)


def cheapest_first(jobs: list[Job], cap: int) -> Result:
    """The private cluster is already paid for (marginal cost 0) when it has room; otherwise the
    cheapest public pool, spot, whatever the data, its region or the run's tolerance for reclaims."""
    def arrive(sim: Replay, rec: Rec) -> None:
        sim.start(rec, "private" if sim.has_room(rec.job.gpus) else "spot")

    sim = Replay(jobs, cap)
    sim.run(arrive)
    return Result("cheapest-first", sim.recs, cap, sim.end)


def greedy(jobs: list[Job], cap: int) -> Result:
    """Keeps the rules, no foresight: runs bound to private wait in its FIFO; any other run takes the
    private cluster if it would be admitted right now (free GPUs, nobody queued ahead: the pool lets
    nobody overtake), else the cheapest public pool it may use (spot only for interruptible runs)."""
    def arrive(sim: Replay, rec: Rec) -> None:
        job = rec.job
        if job.bound:
            sim.enqueue(rec, (job.arrival,))
        elif sim.has_room(job.gpus):
            sim.start(rec, "private")
        else:
            sim.start(rec, "spot" if job.interruptible else "on_demand")

    sim = Replay(jobs, cap)
    sim.run(arrive)
    return Result("greedy (rule-respecting)", sim.recs, cap, sim.end)


def bound_alone(jobs: list[Job], cap: int, give_up_after: float | None, order: str = "pool") -> Result:
    """The runs bound to private alone on the private cluster, under the same queue rules as ours
    (``pool`` order: priority then arrival, the head blocks; giving up after ``give_up_after``):
    their waits with nobody else competing for the GPUs. ``arrival`` order is plain FIFO."""
    def arrive(sim: Replay, rec: Rec) -> None:
        sim.enqueue(rec, pool_order(rec, sim.now) if order == "pool" else (rec.job.arrival,))
        if rec.waiting and give_up_after is not None:
            sim.push(sim.now + give_up_after, GIVE_UP, rec)

    def give_up(sim: Replay, rec: Rec) -> None:
        sim.withdraw(rec)
        rec.gave_up_at = sim.now

    sim = Replay([j for j in jobs if j.bound], cap)
    sim.run(arrive, on_give_up=give_up)
    return Result(f"lower bound: restricted* alone ({'pool order' if order == 'pool' else 'FIFO'})",
                  sim.recs, cap, sim.end, {"partial": True})


# -- report ------------------------------------------------------------------------------------------
