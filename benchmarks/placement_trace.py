"""Placement on a real trace: replay GPU tasks over one private cluster and one elastic public pool.

    .venv/bin/python benchmarks/placement_trace.py [POD_CSV] [NODE_CSV] [--private-gpus 24] ...

Every task of the pod list with GPUs that the real cluster scheduled becomes a gang run (its
``num_gpu`` workers) arriving at ``creation_time`` and running ``deletion_time - scheduled_time``
seconds. A seeded share of runs carries restricted data, another share is interruptible (and allows
spot). The estate is written as ordinary ``config/`` files and loaded with ``load_estate``; our policy
is the product's own :func:`hybridflow.placement.choose_cluster` on every arrival (and again, with
the private cluster excluded, when a gang waits longer than the admission timeout: the train task's
failover). Baselines: always-private FIFO, always-public on-demand, cheapest-first.

Cost: the private cluster is owned, so it costs its on-prem rate for every GPU over the whole replay,
busy or idle; public GPU-hours cost their on-demand or spot price from the pricing CSV.
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
from dataclasses import dataclass, field
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "include"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.reference: the in-repo reference data

from tests.reference import PRICE_TABLE, TRACE_DIR  # noqa: E402

from hybridflow.admission import AdmittedRun  # noqa: E402
from hybridflow.config import Estate, load_estate  # noqa: E402
from hybridflow.errors import PlacementError  # noqa: E402
from hybridflow.placement import choose_cluster  # noqa: E402

DEFAULT_PODS = TRACE_DIR / "openb_pod_list_default.csv"
DEFAULT_NODES = TRACE_DIR / "openb_node_list_gpu_node.csv"
DEFAULT_PRICES = PRICE_TABLE
PRIVATE, PUBLIC = "private-dc", "public-cloud"
GPU = "A100-80GB"  # the trace's tasks ask for any GPU type (gpu_spec is empty): one model here
PRIORITY_RANK = {"critical": 0, "normal": 1, "batch": 2}


@dataclass
class Job:
    name: str
    gpus: int
    arrival: float
    duration: float
    priority: str
    restricted: bool
    interruptible: bool
    run: AdmittedRun | None = None
    start: float | None = None
    where: str | None = None  # "private", "spot" or "on_demand"
    failed_over: bool = False


@dataclass
class Result:
    policy: str
    jobs: list[Job]
    private_gpus: int
    end: float
    notes: dict = field(default_factory=dict)

    def delays(self) -> list[float]:
        return [j.start - j.arrival for j in self.jobs]


# -- inputs ------------------------------------------------------------------------------------------
def read_jobs(path: Path, restricted_share: float, interruptible_share: float, seed: int) -> tuple[list[Job], dict]:
    rng = random.Random(seed)
    jobs, skipped = [], {"no_gpu": 0, "never_scheduled": 0}
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            gpus = int(row["num_gpu"] or 0)
            if gpus <= 0:
                skipped["no_gpu"] += 1
                continue
            if not row["scheduled_time"] or not row["deletion_time"]:
                skipped["never_scheduled"] += 1  # pending in the real cluster: no run time to replay
                continue
            # Draw both flags for every task, so changing one share does not reshuffle the other.
            r_restricted, r_interruptible = rng.random(), rng.random()
            jobs.append(
                Job(
                    name=row["name"],
                    gpus=gpus,
                    arrival=float(row["creation_time"]),
                    duration=max(float(row["deletion_time"]) - float(row["scheduled_time"]), 1.0),
                    priority="batch" if row["qos"] == "BE" else "normal",
                    restricted=r_restricted < restricted_share,
                    interruptible=r_interruptible < interruptible_share,
                )
            )
    jobs.sort(key=lambda j: (j.arrival, j.name))
    return jobs, skipped


def private_nodes(path: Path, target_gpus: int) -> tuple[int, int, list[str]]:
    """Whole nodes from the node list, in file order, until the private cluster has ``target_gpus``."""
    gpus, nodes, models = 0, 0, set()
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            if gpus >= target_gpus:
                break
            if int(row["gpu"] or 0) > 0:
                gpus += int(row["gpu"])
                nodes += 1
                models.add(row["model"])
    if gpus < target_gpus:
        raise SystemExit(f"{path}: the node list has only {gpus} GPUs; lower --private-gpus")
    return gpus, nodes, sorted(models)


def public_prices(path: Path, provider: str, model: str, memory_gb: str, region: str) -> tuple[float, float]:
    """(on-demand, spot) USD per GPU-hour: the on-demand list price and the median spot zone price."""
    on_demand, spot = [], []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            if (row["provider"], row["gpu_model"], row["gpu_memory_gb"], row["region"]) != (
                provider, model, memory_gb, region,
            ) or not row["usd_per_gpu_hour"]:
                continue
            (on_demand if row["pricing_tier"] == "on_demand" else spot).append(float(row["usd_per_gpu_hour"]))
    if not on_demand or not spot:
        raise SystemExit(f"{path}: no on_demand and spot rows for {provider} {model} {memory_gb} GB in {region}")
    return statistics.median(on_demand), statistics.median(spot)


def write_estate(folder: Path, private_gpus: int, onprem: float, on_demand: float, spot: float,
                 spill_threshold: float, admission_timeout_s: int) -> Estate:
    """The benchmark's estate as the same three config files a deployment uses."""
    clusters = {
        "clusters": {
            PRIVATE: {
                "location": "private", "region": "dc-1",
                "node_pools": [{"name": "trace-nodes", "gpu_model": GPU, "gpu_memory_gib": 80, "gpus": private_gpus}],
                "prices": {"onprem": onprem},
            },
            PUBLIC: {
                "location": "public", "region": "us-east-1",
                "node_pools": [  # elastic: more GPUs than the trace ever asks for at once
                    {"name": "on-demand", "gpu_model": GPU, "gpu_memory_gib": 80, "gpus": 100_000},
                    {"name": "spot", "gpu_model": GPU, "gpu_memory_gib": 80, "gpus": 100_000, "spot": True},
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
        "training": {"gang_admission_timeout_s": admission_timeout_s},
    }
    for name, doc in (("clusters.yaml", clusters), ("projects.yaml", projects), ("pipeline.yaml", pipeline)):
        (folder / name).write_text(yaml.safe_dump(doc, sort_keys=False))
    return load_estate(folder, use_cache=False)


def as_run(job: Job) -> AdmittedRun:
    return AdmittedRun(
        project="trace", team="trace", model="trace", dataset="trace", dataset_location="-", workers=job.gpus,
        gpu_type=GPU, classification="restricted" if job.restricted else "internal", priority=job.priority,
        interruptible=job.interruptible, spot_allowed=job.interruptible, checkpoint_every_steps=1,
    )


# -- the replay ----------------------------------------------------------------------------------------
class Replay:
    """Discrete events over one private cluster (a queue in priority then arrival order; the head
    blocks, as in the local backend) and an elastic public pool (no wait)."""

    def __init__(self, jobs: list[Job], private_gpus: int) -> None:
        self.jobs = [Job(**{k: getattr(j, k) for k in ("name", "gpus", "arrival", "duration", "priority",
                                                           "restricted", "interruptible", "run")}) for j in jobs]
        self.cap = private_gpus
        self.used = 0
        self.queue: list[tuple[tuple, Job]] = []
        self.events: list[tuple[float, int, str, Job]] = []
        self.seq = 0
        self.now = 0.0
        self.end = 0.0

    def push(self, t: float, kind: str, job: Job) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, job))

    def start(self, job: Job, where: str) -> None:
        job.start, job.where = self.now, where
        self.end = max(self.end, self.now + job.duration)
        if where == "private":
            self.used += job.gpus
            self.push(self.now + job.duration, "finish", job)

    def enqueue(self, job: Job, order: tuple) -> None:
        heapq.heappush(self.queue, (order, job))
        self.drain()

    def drain(self) -> None:
        while self.queue and self.queue[0][1].gpus <= self.cap - self.used:
            _, job = heapq.heappop(self.queue)
            self.start(job, "private")

    def queued_gpus(self) -> int:
        return sum(j.gpus for _, j in self.queue)

    def withdraw(self, job: Job) -> bool:
        for i, (_, j) in enumerate(self.queue):
            if j is job:
                self.queue.pop(i)
                heapq.heapify(self.queue)
                self.drain()  # the head may have been blocking smaller gangs behind it
                return True
        return False

    def run(self, on_arrival, on_timeout=None) -> None:
        for job in self.jobs:
            self.push(job.arrival, "arrive", job)
        while self.events:
            self.now, _, kind, job = heapq.heappop(self.events)
            if kind == "arrive":
                on_arrival(self, job)
            elif kind == "finish":
                self.used -= job.gpus
                self.drain()
            elif kind == "timeout" and job.start is None and on_timeout is not None:
                on_timeout(self, job)


def ours(jobs: list[Job], estate: Estate) -> Result:
    cap = estate.clusters[PRIVATE].total_gpus
    timeout = estate.pipeline.training.gang_admission_timeout_s

    def place(sim: Replay, job: Job, exclude: dict | None = None) -> None:
        decision = choose_cluster(job.run, estate, {PRIVATE: sim.used}, queued_gpus={PRIVATE: sim.queued_gpus()},
                                  exclude=exclude or {})
        if decision.cluster == PRIVATE:
            sim.enqueue(job, (PRIORITY_RANK[job.priority], job.arrival, job.name))
            if job.start is None:
                sim.push(sim.now + timeout, "timeout", job)
        else:
            sim.start(job, "spot" if decision.spot else "on_demand")

    def failover(sim: Replay, job: Job) -> None:
        try:
            decision = choose_cluster(job.run, estate, {PRIVATE: sim.used}, queued_gpus={PRIVATE: sim.queued_gpus()},
                                      exclude={PRIVATE: f"gang not admitted within {timeout} s"})
        except PlacementError:
            return  # restricted: no other eligible cluster, it keeps its place in the private queue
        if sim.withdraw(job):
            job.failed_over = True
            sim.start(job, "spot" if decision.spot else "on_demand")

    sim = Replay(jobs, cap)
    sim.run(place, failover)
    return Result("ours (choose_cluster)", sim.jobs, cap, sim.end,
                  {"failovers": sum(j.failed_over for j in sim.jobs)})


def private_fifo(jobs: list[Job], cap: int) -> Result:
    sim = Replay(jobs, cap)
    sim.run(lambda s, j: s.enqueue(j, (j.arrival, j.name)))
    return Result("always-private FIFO", sim.jobs, cap, sim.end)


def public_on_demand(jobs: list[Job], cap: int) -> Result:
    sim = Replay(jobs, cap)
    sim.run(lambda s, j: s.start(j, "on_demand"))
    return Result("always-public on-demand", sim.jobs, cap, sim.end)


def cheapest_first(jobs: list[Job], cap: int) -> Result:
    """The private cluster is already paid for (marginal cost 0) when it has room; otherwise the
    cheapest public pool, spot, whatever the data or the run's tolerance for reclaims."""
    def arrive(sim: Replay, job: Job) -> None:
        if job.gpus <= sim.cap - sim.used:
            sim.start(job, "private")
        else:
            sim.start(job, "spot")

    sim = Replay(jobs, cap)
    sim.run(arrive)
    return Result("cheapest-first", sim.jobs, cap, sim.end)


# -- report ------------------------------------------------------------------------------------------
def metrics(r: Result, start: float, onprem: float, on_demand: float, spot: float) -> dict:
    """Each policy pays for the private cluster from the first arrival until its own last finish."""
    horizon = r.end - start
    delays = r.delays()
    rate = {"on_demand": on_demand, "spot": spot}
    public_usd = sum(j.gpus * j.duration / 3600 * rate[j.where] for j in r.jobs if j.where != "private")
    private_usd = r.private_gpus * horizon / 3600 * onprem
    busy = sum(j.gpus * j.duration for j in r.jobs if j.where == "private")
    return {
        "policy": r.policy,
        "total_usd": private_usd + public_usd,
        "public_usd": public_usd,
        "mean_wait_s": statistics.fmean(delays),
        "p95_wait_s": statistics.quantiles(delays, n=20, method="inclusive")[-1],
        "private_util": busy / (r.private_gpus * horizon),
        "public_share": sum(j.where != "private" for j in r.jobs) / len(r.jobs),
        "violations": sum(j.restricted and j.where != "private" for j in r.jobs),
        "spot_misuse": sum(j.where == "spot" and not j.interruptible for j in r.jobs),
        **r.notes,
    }


def table(rows: list[dict]) -> str:
    base = rows[0]

    def ratio(v: float, b: float) -> str:
        return "-" if b == 0 else f"{v / b:.2f}x"

    head = ("| policy | total cost USD | vs ours | public spend USD | mean wait s | vs ours | p95 wait s | "
            "private util | public share | sovereignty violations | non-interruptible on spot |")
    lines = [head, "|" + "---|" * 11]
    for m in rows:
        lines.append(
            f"| {m['policy']} | {m['total_usd']:,.0f} | {ratio(m['total_usd'], base['total_usd'])} | "
            f"{m['public_usd']:,.0f} | {m['mean_wait_s']:,.0f} | {ratio(m['mean_wait_s'], base['mean_wait_s'])} | "
            f"{m['p95_wait_s']:,.0f} | {m['private_util']:.1%} | {m['public_share']:.1%} | {m['violations']} | "
            f"{m['spot_misuse']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pods", nargs="?", type=Path, default=DEFAULT_PODS, help="pod list CSV (openb format)")
    ap.add_argument("nodes", nargs="?", type=Path, default=DEFAULT_NODES, help="node list CSV (openb format)")
    ap.add_argument("--prices", type=Path, default=DEFAULT_PRICES)
    ap.add_argument("--private-gpus", type=int, default=24, help="private cluster size (whole nodes, file order)")
    ap.add_argument("--restricted-share", type=float, default=0.3)
    ap.add_argument("--interruptible-share", type=float, default=0.4)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--spill-threshold", type=float, default=0.7)
    ap.add_argument("--admission-timeout-s", type=int, default=120)
    ap.add_argument("--onprem-usd", type=float, default=1.20, help="owned GPU-hour, as config/clusters.yaml")
    ap.add_argument("--provider", default="aws")
    ap.add_argument("--price-gpu", default="A100")
    ap.add_argument("--price-memory-gb", default="80")
    ap.add_argument("--price-region", default="us-east-1")
    args = ap.parse_args(argv)
    for name in ("restricted_share", "interruptible_share", "spill_threshold"):
        if not 0 <= getattr(args, name) <= 1:
            ap.error(f"--{name.replace('_', '-')} must be between 0 and 1, got {getattr(args, name)}")
    if args.private_gpus < 1 or args.admission_timeout_s < 1:
        ap.error("--private-gpus and --admission-timeout-s must be at least 1")
    for path in (args.pods, args.nodes, args.prices):
        if not path.is_file():
            ap.error(f"{path}: no such file")

    t0 = time.monotonic()
    jobs, skipped = read_jobs(args.pods, args.restricted_share, args.interruptible_share, args.seed)
    if not jobs:
        raise SystemExit(f"{args.pods}: no task with GPUs and a run time")
    cap, nodes, models = private_nodes(args.nodes, args.private_gpus)
    on_demand, spot = public_prices(args.prices, args.provider, args.price_gpu, args.price_memory_gb, args.price_region)
    with tempfile.TemporaryDirectory() as tmp:
        estate = write_estate(Path(tmp), cap, args.onprem_usd, on_demand, spot, args.spill_threshold,
                              args.admission_timeout_s)
    for job in jobs:
        job.run = as_run(job)
    results = [ours(jobs, estate), private_fifo(jobs, cap), public_on_demand(jobs, cap), cheapest_first(jobs, cap)]
    first = min(j.arrival for j in jobs)
    horizon = max(r.end for r in results) - first
    rows = [metrics(r, first, args.onprem_usd, on_demand, spot) for r in results]
    seconds = time.monotonic() - t0

    print(f"trace {args.pods.name}: {len(jobs)} GPU runs replayed ({skipped['no_gpu']} without GPUs, "
          f"{skipped['never_scheduled']} never scheduled, skipped); "
          f"{sum(j.restricted for j in jobs)} restricted, {sum(j.interruptible for j in jobs)} interruptible "
          f"(seed {args.seed}); longest replay {horizon / 86400:.1f} days")
    print(f"private: {cap} GPUs on {nodes} nodes of {args.nodes.name} ({', '.join(models)}), {args.onprem_usd:.2f} "
          f"USD/GPU-hour owned; public: {args.provider} {args.price_gpu} {args.price_memory_gb} GB {args.price_region} "
          f"on-demand {on_demand:.4f}, spot {spot:.4f} USD/GPU-hour (median of zones), elastic")
    print(f"ours: spill_threshold {args.spill_threshold}, admission timeout {args.admission_timeout_s} s, "
          f"{rows[0]['failovers']} failovers to public")
    print(table(rows))
    print(f"replay took {seconds:.1f} s")
    return rows


if __name__ == "__main__":
    main()
