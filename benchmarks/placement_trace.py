"""Placement on a real trace: replay GPU tasks over one private cluster and one elastic public pool.

    .venv/bin/python benchmarks/placement_trace.py [POD_CSV] [NODE_CSV] [--prices CSV] [--private-gpus 24] ...

Every task of the pod list (openb format) with GPUs that the real cluster scheduled becomes a gang run
(its ``num_gpu`` workers) arriving at ``creation_time`` and running ``deletion_time - scheduled_time``
seconds. Seeded shares of runs carry restricted data, are interruptible (and allow spot), are limited
to a region the public pool is not in, or have a ``start_by`` deadline. The estate is written as
ordinary ``config/`` files and loaded with ``load_estate``.

"ours" is what the product does: on arrival :func:`hybridflow.placement.choose_cluster` with the GPUs
in use and queued (and, for a run with ``start_by``, :func:`hybridflow.waits.estimate_waits` over the
replay's own history of admitted waits); a run placed on the private cluster queues there in the local
slot pool's order (priority, then arrival; the head blocks); every ``gang_admission_timeout_s`` while
it waits, ``choose_cluster`` again with the private cluster excluded and ``require_room=True``: it
moves if another cluster would admit it now, else keeps its place; after ``max_queue_wait_s`` it gives
up. Baselines: always-private FIFO, always-public on-demand, cheapest-first (breaks the rules), a
rule-respecting greedy, and the restricted runs alone on the private cluster (the lower bound of their
waits).

Cost: the private cluster is owned, so it costs its on-prem rate for every GPU from the first arrival
to the policy's last finish, busy or idle; public GPU-hours cost their on-demand or spot price.
"""

from __future__ import annotations

import argparse
import csv
import heapq
import random
import statistics
import sys
import tempfile
import time
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

from hybridflow.admission import AdmittedRun  # noqa: E402
from hybridflow.backends.base import ClusterLoad  # noqa: E402
from hybridflow.config import Estate, load_estate  # noqa: E402
from hybridflow.errors import PlacementError  # noqa: E402
from hybridflow.placement import choose_cluster  # noqa: E402
from hybridflow.waits import estimate_waits, parse_duration  # noqa: E402

try:
    from hybridflow.ledger.queue_waits import QueueWait
except ImportError:  # the ledger's module is optional here: estimate_waits reads only these four fields

    @dataclass(frozen=True)
    class QueueWait:  # type: ignore[no-redef]
        cluster: str
        gpus: int
        wait_s: float
        queued_at: datetime


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
# Rules whose verdict can change with load. A waiting gang that every other cluster refuses by some
# other rule (sovereignty, region, excluded...) gets the same answer at every recheck: skip them.
LOAD_RULES = frozenset({"room", "reachable"})


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

    __slots__ = ("job", "start", "where", "waiting", "moves", "gave_up_at", "refused", "stuck")

    def __init__(self, job: Job) -> None:
        self.job = job
        self.start: float | None = None
        self.where: str | None = None  # "private", "spot" or "on_demand"
        self.waiting = False  # holds a ticket in the private queue
        self.moves = 0
        self.gave_up_at: float | None = None
        self.refused = False  # no cluster could take it at all
        self.stuck = False  # no other cluster can ever take it: rechecks would only repeat the answer

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
        self.queue: list[tuple[tuple, int, Rec]] = []
        self.events: list[tuple[float, int, int, Rec]] = []
        self.seq = 0
        self.now = 0.0
        self.end = 0.0
        self.record_history = record_history
        self.history: deque[QueueWait] = deque()  # admitted waits, in admission order (as the ledger)

    def push(self, t: float, kind: int, rec: Rec) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, kind, self.seq, rec))

    def has_room(self, gpus: int) -> bool:
        return self.queued == 0 and self.used + gpus <= self.cap

    def start(self, rec: Rec, where: str) -> None:
        job = rec.job
        rec.start, rec.where = self.now, where
        self.end = max(self.end, self.now + job.duration)
        if where == "private":
            self.used += job.gpus
        else:
            self.public_used += job.gpus
        self.push(self.now + job.duration, FINISH, rec)
        if self.record_history:
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
        self.drain()

    def drain(self) -> None:
        while self.queue:
            rec = self.queue[0][2]
            if not rec.waiting:
                heapq.heappop(self.queue)
                continue
            if rec.job.gpus > self.cap - self.used:
                return
            heapq.heappop(self.queue)
            rec.waiting = False
            self.queued -= rec.job.gpus
            self.start(rec, "private")

    def withdraw(self, rec: Rec) -> None:
        rec.waiting = False
        self.queued -= rec.job.gpus
        self.drain()  # it may have been the blocked head

    def run(self, on_arrival, on_recheck=None, on_give_up=None) -> None:
        for rec in self.recs:
            self.push(rec.job.arrival, ARRIVE, rec)
        while self.events:
            self.now, kind, _, rec = heapq.heappop(self.events)
            if kind == ARRIVE:
                on_arrival(self, rec)
            elif kind == FINISH:
                if rec.where == "private":
                    self.used -= rec.job.gpus
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


def _stuck(err: PlacementError) -> bool:
    """Every cluster fails a rule that no change of load can lift (sovereignty, region, excluded...)."""
    candidates = getattr(err, "candidates", None)
    if not candidates:
        return False
    return all(any(v != "pass" and k not in LOAD_RULES for k, v in c["rules"].items()) for c in candidates)


def ours(jobs: list[Job], estate: Estate) -> Result:
    cap = estate.clusters[PRIVATE].total_gpus
    public_cap = estate.clusters[PUBLIC].total_gpus
    training, placement = estate.pipeline.training, estate.pipeline.placement
    timeout = training.gang_admission_timeout_s
    # The first look comes after one admission window (the backend blocks that long), then the
    # triggerer gives up at max_queue_wait_s.
    give_up_after = max(timeout, training.max_queue_wait_s)
    moved_why = {PRIVATE: f"gang not admitted within {timeout} s"}

    def usage(sim: Replay) -> tuple[dict, dict]:
        return {PRIVATE: sim.used, PUBLIC: sim.public_used}, {PRIVATE: sim.queued}

    def start_on(sim: Replay, rec: Rec, decision) -> None:
        sim.start(rec, "private" if decision.location == "private" else "spot" if decision.spot else "on_demand")

    def arrive(sim: Replay, rec: Rec) -> None:
        used, queued = usage(sim)
        waits = None
        if rec.job.start_by is not None:
            loads = {PRIVATE: ClusterLoad(PRIVATE, cap, used=sim.used, queued=sim.queued),
                     PUBLIC: ClusterLoad(PUBLIC, public_cap, used=sim.public_used)}
            waits = estimate_waits(sim.window(placement.wait_history_days), loads, rec.job.gpus,
                                   quantile=placement.wait_quantile, min_samples=placement.wait_min_samples,
                                   days=placement.wait_history_days)
        try:
            decision = choose_cluster(rec.job.run, estate, used, queued_gpus=queued, waits=waits)
        except PlacementError:
            rec.refused = True
            return
        if decision.cluster != PRIVATE:
            start_on(sim, rec, decision)
            return
        sim.enqueue(rec, pool_order(rec, sim.now))
        if rec.waiting:
            sim.push(sim.now + timeout, RECHECK, rec)
            sim.push(sim.now + give_up_after, GIVE_UP, rec)

    def recheck(sim: Replay, rec: Rec) -> None:
        if rec.stuck:
            return
        used, queued = usage(sim)
        try:
            decision = choose_cluster(rec.job.run, estate, used, queued_gpus=queued, exclude=moved_why,
                                      require_room=True)
        except PlacementError as err:
            rec.stuck = _stuck(err)
            if not rec.stuck:
                sim.push(sim.now + timeout, RECHECK, rec)  # keeps its place, looks again next window
            return
        sim.withdraw(rec)
        rec.moves += 1
        start_on(sim, rec, decision)

    def give_up(sim: Replay, rec: Rec) -> None:
        sim.withdraw(rec)
        rec.gave_up_at = sim.now

    sim = Replay(jobs, cap, record_history=True)
    sim.run(arrive, recheck, give_up)
    return Result("ours", sim.recs, cap, sim.end)


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
def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=20, method="inclusive")[-1]


def metrics(r: Result, start: float, onprem: float, on_demand: float, spot: float) -> dict:
    recs = r.recs
    bound = [x.wait for x in recs if x.job.bound and x.wait is not None]
    free = [x.wait for x in recs if not x.job.bound and x.wait is not None]
    deadline = [x for x in recs if x.job.start_by is not None]
    out = {
        "policy": r.policy,
        "bound_mean_s": _mean(bound), "bound_p95_s": _p95(bound),
        "free_mean_s": _mean(free), "free_p95_s": _p95(free),
        "violations": sum(x.job.restricted and x.where in ("spot", "on_demand") for x in recs),
        "region_violations": sum(x.job.region_limited and x.where in ("spot", "on_demand") for x in recs),
        "spot_misuse": sum(x.where == "spot" and not x.job.interruptible for x in recs),
        "moves": sum(x.moves for x in recs),
        "gave_up": sum(x.gave_up_at is not None for x in recs),
        "refused": sum(x.refused for x in recs),
        "deadline_runs": len(deadline),
        "deadline_in_time": sum(x.in_time for x in deadline),
    }
    if r.notes.get("partial"):  # a subset of the runs: its cost is not comparable
        out.update(total_usd=None, public_usd=None, private_util=None, public_share=None)
        return out
    horizon = max(r.end - start, 1.0)
    rate = {"on_demand": on_demand, "spot": spot}
    public_usd = sum(x.job.gpus * x.job.duration / 3600 * rate[x.where] for x in recs if x.where in rate)
    busy = sum(x.job.gpus * x.job.duration for x in recs if x.where == "private")
    started = [x for x in recs if x.start is not None]
    out.update(
        total_usd=r.private_gpus * horizon / 3600 * onprem + public_usd, public_usd=public_usd,
        private_util=busy / (r.private_gpus * horizon),
        public_share=sum(x.where != "private" for x in started) / max(len(started), 1),
    )
    return out


def _num(v: float | None, fmt: str = "{:,.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def _ratio(v: float | None, base: float | None) -> str:
    return "-" if v is None or not base else f"{v / base:.2f}x"


def table(rows: list[dict], ours_row: dict, greedy_row: dict) -> str:
    cols = ("policy", "total cost USD", "vs ours", "vs greedy", "public spend USD",
            "restricted* mean wait s", "vs ours", "vs greedy", "restricted* p95 wait s",
            "unrestricted mean wait s", "unrestricted p95 wait s", "private util", "public share",
            "sovereignty violations", "region violations", "non-interruptible on spot", "moves", "gave up",
            "deadlines in time")
    lines = ["| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    for m in rows:
        cells = [
            m["policy"], _num(m["total_usd"]), _ratio(m["total_usd"], ours_row["total_usd"]),
            _ratio(m["total_usd"], greedy_row["total_usd"]), _num(m["public_usd"]),
            _num(m["bound_mean_s"]), _ratio(m["bound_mean_s"], ours_row["bound_mean_s"]),
            _ratio(m["bound_mean_s"], greedy_row["bound_mean_s"]), _num(m["bound_p95_s"]),
            _num(m["free_mean_s"]), _num(m["free_p95_s"]), _num(m["private_util"], "{:.1%}"),
            _num(m["public_share"], "{:.1%}"), str(m["violations"]), str(m["region_violations"]),
            str(m["spot_misuse"]), str(m["moves"]), str(m["gave_up"]),
            f"{m['deadline_in_time']}/{m['deadline_runs']}" if m["deadline_runs"] else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(ours_row: dict, greedy_row: dict, bound_row: dict) -> list[dict]:
    """The placement targets, measured on ours. No wait counts as within any bound of a zero wait."""
    lb, cost = bound_row["bound_mean_s"] or 0.0, greedy_row["total_usd"]
    restricted, free = ours_row["bound_mean_s"] or 0.0, ours_row["free_mean_s"] or 0.0
    return [
        {"target": "sovereignty violations", "goal": "0", "measured": str(ours_row["violations"]),
         "met": ours_row["violations"] == 0},
        {"target": "region violations", "goal": "0", "measured": str(ours_row["region_violations"]),
         "met": ours_row["region_violations"] == 0},
        {"target": "restricted* mean wait", "goal": f"<= 1.1x lower bound ({lb:,.0f} s)",
         "measured": f"{restricted:,.0f} s ({_ratio(restricted, lb) if lb else '-'})",
         "met": restricted <= 1.1 * lb},
        {"target": "unrestricted mean wait", "goal": "<= 60 s", "measured": f"{free:,.1f} s", "met": free <= 60},
        {"target": "total cost", "goal": f"<= 1.1x greedy ({cost:,.0f} USD)",
         "measured": f"{ours_row['total_usd']:,.0f} USD ({_ratio(ours_row['total_usd'], cost)})",
         "met": ours_row["total_usd"] <= 1.1 * cost},
    ]


@dataclass
class Report:
    rows: list[dict]
    targets: list[dict]
    jobs: list[Job]


def _share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pods", nargs="?", type=Path, default=DEFAULT_PODS, help="pod list CSV (openb format)")
    ap.add_argument("nodes", nargs="?", type=Path, default=DEFAULT_NODES, help="node list CSV (openb format)")
    ap.add_argument("--prices", type=Path, default=DEFAULT_PRICES, help="price table CSV")
    ap.add_argument("--private-gpus", type=int, default=24, help="private cluster size (whole nodes, file order)")
    ap.add_argument("--restricted-share", type=_share, default=0.3, help="share of runs with restricted data")
    ap.add_argument("--interruptible-share", type=_share, default=0.4, help="share of interruptible runs (spot ok)")
    ap.add_argument("--region-share", type=_share, default=0.1,
                    help=f"share of runs limited to region {PRIVATE_AREA!r} (only the private cluster is there)")
    ap.add_argument("--start-by-share", type=_share, default=0.0, help="share of runs with a start_by deadline")
    ap.add_argument("--start-by", default="30m", help="their start_by (a duration: 30m, 2h, PT1H)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--spill-threshold", type=_share, default=0.7, help="placement.spill_threshold")
    ap.add_argument("--admission-timeout-s", type=int, default=120, help="training.gang_admission_timeout_s")
    ap.add_argument("--max-queue-wait-s", type=int, default=86_400, help="training.max_queue_wait_s")
    ap.add_argument("--onprem-usd", type=float, default=1.20, help="owned GPU-hour, as config/clusters.yaml")
    ap.add_argument("--provider", default="aws")
    ap.add_argument("--price-gpu", default="A100")
    ap.add_argument("--price-memory-gb", default="80")
    ap.add_argument("--price-region", default="us-east-1")
    args = ap.parse_args(argv)
    if args.private_gpus < 1 or args.admission_timeout_s < 1:
        ap.error("--private-gpus and --admission-timeout-s must be at least 1")
    if args.max_queue_wait_s < 0 or args.onprem_usd < 0:
        ap.error("--max-queue-wait-s and --onprem-usd must not be negative")
    try:
        parse_duration(args.start_by)
    except ValueError as exc:
        ap.error(f"--start-by: {exc}")
    for path in (args.pods, args.nodes, args.prices):
        if not path.is_file():
            ap.error(f"{path}: no such file")
    return ap, args


def main(argv: list[str] | None = None) -> Report:
    ap, args = parse_args(argv)
    t0 = time.monotonic()
    try:
        jobs, skipped = read_jobs(args.pods, restricted_share=args.restricted_share,
                                  interruptible_share=args.interruptible_share, region_share=args.region_share,
                                  start_by_share=args.start_by_share, start_by=args.start_by, seed=args.seed)
        if not jobs:
            raise TraceError(f"{args.pods}: no task with GPUs and a run time")
        cap, nodes, models = private_nodes(args.nodes, args.private_gpus)
        on_demand, spot = public_prices(args.prices, args.provider, args.price_gpu, args.price_memory_gb,
                                        args.price_region)
    except TraceError as exc:
        ap.error(str(exc))
    with tempfile.TemporaryDirectory() as tmp:
        estate = write_estate(Path(tmp), cap, args.onprem_usd, on_demand, spot, spill_threshold=args.spill_threshold,
                              admission_timeout_s=args.admission_timeout_s, max_queue_wait_s=args.max_queue_wait_s)
    for job in jobs:
        job.run = as_run(job)
    # As the product: the first look comes after one admission window, the last at max_queue_wait_s.
    give_up_after = max(args.admission_timeout_s, args.max_queue_wait_s)
    t_ours = time.monotonic()
    results = [ours(jobs, estate)]
    t_ours = time.monotonic() - t_ours
    results += [private_fifo(jobs, cap), public_on_demand(jobs, cap), cheapest_first(jobs, cap), greedy(jobs, cap),
                bound_alone(jobs, cap, give_up_after)]
    fifo_bound = bound_alone(jobs, cap, give_up_after, order="arrival")
    first = min(j.arrival for j in jobs)
    rows = [metrics(r, first, args.onprem_usd, on_demand, spot) for r in results]
    ours_row, greedy_row, bound_row = rows[0], rows[4], rows[5]
    goals = targets(ours_row, greedy_row, bound_row)
    seconds = time.monotonic() - t0

    horizon = max(r.end for r in results[:5]) - first
    print(f"trace {args.pods.name}: {len(jobs)} GPU runs replayed ({skipped['no_gpu']} without GPUs, "
          f"{skipped['never_scheduled']} never scheduled, skipped); {sum(j.restricted for j in jobs)} restricted, "
          f"{sum(j.region_limited for j in jobs)} limited to region {PRIVATE_AREA}, "
          f"{sum(j.bound for j in jobs)} bound to private in all; {sum(j.interruptible for j in jobs)} "
          f"interruptible; {sum(j.start_by is not None for j in jobs)} with start_by {args.start_by} "
          f"(seed {args.seed}); longest replay {horizon / 86400:.1f} days")
    print(f"private: {cap} GPUs on {nodes} nodes of {args.nodes.name} ({', '.join(models)}), region dc-1 "
          f"({PRIVATE_AREA}), {args.onprem_usd:.2f} USD/GPU-hour owned; public: {args.provider} {args.price_gpu} "
          f"{args.price_memory_gb} GB {args.price_region} on-demand {on_demand:.4f}, spot {spot:.4f} USD/GPU-hour "
          "(median of zones), elastic")
    gave_up = [x for x in results[0].recs if x.gave_up_at is not None]
    print(f"ours: spill_threshold {args.spill_threshold}, gang_admission_timeout_s {args.admission_timeout_s}, "
          f"max_queue_wait_s {args.max_queue_wait_s}; {ours_row['moves']} moves to public, {len(gave_up)} gave up "
          f"({sum(x.job.gpus * x.job.duration for x in gave_up) / 3600:,.0f} GPU-hours never run, so not in its "
          f"cost), {ours_row['refused']} refused by placement; replayed in {t_ours:.1f} s")
    deadline = [x for x in results[0].recs if x.job.start_by is not None]
    if deadline:
        def in_time(recs: list[Rec]) -> str:
            return f"{sum(x.in_time for x in recs)}/{len(recs)}"

        print(f"ours, start_by {args.start_by}: {in_time(deadline)} started in time "
              f"(restricted* {in_time([x for x in deadline if x.job.bound])}, "
              f"unrestricted {in_time([x for x in deadline if not x.job.bound])})")
    print(table(rows, ours_row, greedy_row))
    print("restricted*: restricted data or limited to a region the public pool is not in (both must stay "
          "private); unrestricted: may run public. A run that gave up counts with the wait it gave up after.")
    fifo_mean = metrics(fifo_bound, first, args.onprem_usd, on_demand, spot)["bound_mean_s"]
    print(f"lower bound in arrival order (FIFO) instead of the pool's order: restricted* mean wait {_num(fifo_mean)} s")
    print("| target | goal | measured | status |\n|---|---|---|---|")
    for g in goals:
        print(f"| {g['target']} | {g['goal']} | {g['measured']} | {'PASS' if g['met'] else 'MISS'} |")
    print(f"replay took {seconds:.1f} s")
    return Report(rows, goals, jobs)


if __name__ == "__main__":
    main()
