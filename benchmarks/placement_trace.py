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
up. Private capacity is kept for runs bound to it as the product keeps it (``placement.reservation``:
while one waits there or one was admitted there within ``expect_within_h``, a run that could run
public and could not be moved leaves the kept GPUs free); a bound run at the head of the private queue
moves the newest interruptible runs off to a public pool (at most ``move_budget`` times each), each
charged one ``interruptible_checkpoint_every_s`` of run time done again (``replay_ours``). ``--spread
1-10`` replays those seeds too and prints each target's spread. Baselines: always-private FIFO,
always-public on-demand, cheapest-first (breaks the rules), a rule-respecting greedy, and the
restricted runs alone on the private cluster (the lower bound of their waits).

Cost: the private cluster is owned, so it costs its on-prem rate for every GPU from the first arrival
to the policy's last finish, busy or idle; public GPU-hours cost their on-demand or spot price. The
cost target prices runs that gave up (never run) at what they would have paid.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # trace_replay, also when loaded by path

from replay_clairvoyant import clairvoyant_cost  # noqa: E402
from replay_ours import ours  # noqa: E402
from trace_replay import (  # noqa: E402
    DEFAULT_NODES,
    DEFAULT_PODS,
    DEFAULT_PRICES,
    PRIVATE_AREA,
    Job,
    Rec,
    Result,
    TraceError,
    as_run,
    bound_alone,
    cheapest_first,
    greedy,
    private_fifo,
    private_nodes,
    public_on_demand,
    public_prices,
    read_jobs,
    write_estate,
)

from hybridflow.waits import parse_duration  # noqa: E402

__all__ = ["Job", "Report", "greedy", "main"]


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
        out.update(total_usd=None, public_usd=None, private_util=None, public_share=None, total_with_gave_up_usd=None,
                   lost_gpu_hours=None)
        return out
    horizon = max(r.end - start, 1.0)
    rate = {"on_demand": on_demand, "spot": spot}
    segments = [(x.job.gpus, where, seconds) for x in recs for where, seconds in x.segments]
    public_usd = sum(gpus * seconds / 3600 * rate[where] for gpus, where, seconds in segments if where in rate)
    busy = sum(gpus * seconds for gpus, where, seconds in segments if where == "private")
    started = [x for x in recs if x.start is not None]
    total = r.private_gpus * horizon / 3600 * onprem + public_usd
    # A run that gave up never ran, so it is not in the cost above: priced at what it would have paid
    # (owned GPU-hours on the private cluster for a run bound there, else on-demand).
    never_run = sum(x.job.gpus * x.job.duration / 3600 * (onprem if x.job.bound else on_demand)
                    for x in recs if x.gave_up_at is not None)
    out.update(
        total_usd=total, public_usd=public_usd, total_with_gave_up_usd=total + never_run,
        private_util=busy / (r.private_gpus * horizon),
        public_share=sum(x.where != "private" for x in started) / max(len(started), 1),
        lost_gpu_hours=sum(x.job.gpus * x.lost_s for x in recs) / 3600,
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
    lb, cost = bound_row["bound_mean_s"] or 0.0, greedy_row["total_with_gave_up_usd"]
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
        {"target": "total cost, runs that gave up priced in", "goal": f"<= 1.1x greedy ({cost:,.0f} USD)",
         "measured": f"{ours_row['total_with_gave_up_usd']:,.0f} USD "
                     f"({_ratio(ours_row['total_with_gave_up_usd'], cost)})",
         "met": ours_row["total_with_gave_up_usd"] <= 1.1 * cost},
        {"target": "runs that give up", "goal": f"<= the lower bound's ({bound_row['gave_up']})",
         "measured": str(ours_row["gave_up"]), "met": ours_row["gave_up"] <= bound_row["gave_up"]},
    ]


@dataclass
class Report:
    rows: list[dict]
    targets: list[dict]
    jobs: list[Job]
    clairvoyant_x: float | None = None  # replay_clairvoyant's cost over the greedy's


def _share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def _seeds(text: str) -> list[int]:
    first, _, last = text.partition("-")
    try:
        seeds = list(range(int(first), int(last or first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not FIRST-LAST, e.g. 1-10") from None
    if not seeds:
        raise argparse.ArgumentTypeError(f"{text!r} names no seed")
    return seeds


def spread(argv: list[str], seeds: list[int]) -> list[dict]:
    """Each seed's replay (printed output dropped) as its targets' figures, and a table of them."""
    import contextlib
    import io

    rows = []
    for seed in seeds:
        with contextlib.redirect_stdout(io.StringIO()):
            report = main([*argv, "--seed", str(seed)])
        ours_row, greedy_row, bound_row = report.rows[0], report.rows[4], report.rows[5]
        lb = bound_row["bound_mean_s"] or 0.0
        rows.append({
            "seed": seed, "violations": ours_row["violations"] + ours_row["region_violations"],
            "restricted_s": ours_row["bound_mean_s"] or 0.0, "lower_bound_s": lb,
            "restricted_x": (ours_row["bound_mean_s"] or 0.0) / lb if lb else None,
            "unrestricted_s": ours_row["free_mean_s"] or 0.0,
            "cost_x": ours_row["total_with_gave_up_usd"] / greedy_row["total_with_gave_up_usd"],
            "gave_up": ours_row["gave_up"], "gave_up_bound": bound_row["gave_up"],
            "moves": ours_row["moves"], "lost_gpu_hours": ours_row["lost_gpu_hours"],
            "clairvoyant_x": report.clairvoyant_x,
            "met": all(g["met"] for g in report.targets), "missed": [g["target"] for g in report.targets if not g["met"]],
        })
    return rows


def spread_table(rows: list[dict]) -> str:
    lines = ["| seed | violations | restricted* mean wait s (lower bound) | vs lower bound | unrestricted mean wait s "
             "| cost vs greedy | clairvoyant vs greedy | gave up (lower bound) | moves | GPU-hours done again | targets |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        x = "-" if r["restricted_x"] is None else f"{r['restricted_x']:.2f}x"
        lines.append(f"| {r['seed']} | {r['violations']} | {r['restricted_s']:,.0f} ({r['lower_bound_s']:,.0f}) | {x} "
                     f"| {r['unrestricted_s']:,.1f} | {r['cost_x']:.2f}x | {r['clairvoyant_x']:.2f}x "
                     f"| {r['gave_up']} ({r['gave_up_bound']}) "
                     f"| {r['moves']} | {r['lost_gpu_hours']:,.1f} | "
                     f"{'all met' if r['met'] else 'missed: ' + ', '.join(r['missed'])} |")
    known = [r["restricted_x"] for r in rows if r["restricted_x"] is not None]
    costs = [r["cost_x"] for r in rows]
    lines.append(f"spread over {len(rows)} seeds: restricted* {min(known, default=0):.2f}x..{max(known, default=0):.2f}x "
                 f"of the lower bound (median {statistics.median(known) if known else 0:.2f}x), cost "
                 f"{min(costs):.2f}x..{max(costs):.2f}x greedy (median {statistics.median(costs):.2f}x); every "
                 f"target met on {sum(r['met'] for r in rows)} of {len(rows)} seeds; the clairvoyant reference "
                 f"costs {statistics.median(r['clairvoyant_x'] for r in rows):.2f}x greedy (median) and is within "
                 f"1.1x on {sum(r['clairvoyant_x'] <= 1.1 for r in rows)} of {len(rows)}")
    return "\n".join(lines)


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
    ap.add_argument("--spread", type=_seeds, default=None, metavar="FIRST-LAST",
                    help="also replay these seeds (e.g. 1-10) and print the spread of the targets over them")
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
          f"max_queue_wait_s {args.max_queue_wait_s}; {ours_row['moves']} moves to public "
          f"({sum(len(x.segments) > 1 for x in results[0].recs)} to make room, {ours_row['lost_gpu_hours']:,.1f} "
          f"GPU-hours done again), {len(gave_up)} gave up "
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
    clairvoyant_x = clairvoyant_cost(jobs, results[5], onprem=args.onprem_usd, on_demand=on_demand,
                                     spot=spot) / greedy_row["total_with_gave_up_usd"]
    print(f"clairvoyant reference (knows every arrival and run time; restricted* at the lower bound, unrestricted "
          f"never waits; replay_clairvoyant): {clairvoyant_x:.2f}x greedy's cost")
    print(f"replay took {seconds:.1f} s")
    if args.spread:
        rest = [a for a in (sys.argv[1:] if argv is None else argv)]
        rest = _without(rest, ("--spread", "--seed"))
        print(spread_table(spread(rest, args.spread)))
    return Report(rows, goals, jobs, clairvoyant_x)


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` less ``options`` and their values (``--opt v`` or ``--opt=v``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif not arg.startswith(tuple(f"{o}=" for o in options)):
            out.append(arg)
    return out


if __name__ == "__main__":
    main()
