"""A clairvoyant reference for the placement targets: what a placement that knew every run's arrival
and run time in advance could cost while keeping restricted* runs exactly at their lower bound and
never letting an unrestricted run wait. No online placement (the product's or any other) can know
that much, so where even this reference costs more than 1.1x the greedy, the cost target and the
restricted* wait target cannot both be met on that trace.

The restricted* runs keep the lower bound's schedule (alone on the private cluster). The GPUs they
leave idle, minute by minute, go to unrestricted work that starts on arrival:
- runs that cannot be interrupted need their GPUs for their whole run: they are packed into the idle
  GPUs largest first (GPU-hours), knowing every run, and the others go on-demand;
- interruptible runs may be moved any number of times at no cost: each idle GPU-minute left takes
  one of their GPU-minutes, the rest run on spot.
The private cluster costs its owned rate from the first arrival to the last finish, as in the replay.
Largest-first packing is a heuristic (optimal packing is NP-hard), so this is a reference, not a
proof; it favours the reference in every other respect (free and unlimited moves, perfect knowledge).
"""

from __future__ import annotations

import math

import numpy as np
from trace_replay import Job, Result

_MINUTE = 60.0


def clairvoyant_cost(jobs: list[Job], lower_bound: Result, *, onprem: float, on_demand: float,
                     spot: float) -> float:
    """Total cost in USD, runs that gave up in the lower bound priced in at the owned rate (as the
    cost target prices them)."""
    cap = lower_bound.private_gpus
    first = min(j.arrival for j in jobs)
    ends = [j.arrival + j.duration for j in jobs if not j.bound]
    ends += [r.start + r.job.duration for r in lower_bound.recs if r.start is not None]
    last = max(ends, default=first)
    minutes = int(math.ceil((last - first) / _MINUTE)) + 1

    def span(start: float, seconds: float) -> slice:
        return slice(int((start - first) // _MINUTE), int(math.ceil((start + seconds - first) / _MINUTE)))

    idle = np.full(minutes, cap, dtype=np.int64)
    for rec in lower_bound.recs:
        if rec.start is not None:
            idle[span(rec.start, rec.job.duration)] -= rec.job.gpus
    public = 0.0
    fixed = sorted((j for j in jobs if not j.bound and not j.interruptible), key=lambda j: -j.gpus * j.duration)
    for job in fixed:
        window = idle[span(job.arrival, job.duration)]
        if window.size and window.min() >= job.gpus:
            window -= job.gpus  # a view: the GPUs are taken for the whole run
        else:
            public += job.gpus * job.duration / 3600 * on_demand
    wanted = np.zeros(minutes, dtype=np.int64)
    movable = [j for j in jobs if not j.bound and j.interruptible]
    for job in movable:
        wanted[span(job.arrival, job.duration)] += job.gpus
    private_s = np.minimum(wanted, np.maximum(idle, 0)).sum() * _MINUTE  # GPU-seconds they get privately
    on_spot_s = max(sum(j.gpus * j.duration for j in movable) - private_s, 0.0)
    public += on_spot_s / 3600 * spot
    never_run = sum(r.job.gpus * r.job.duration / 3600 * onprem for r in lower_bound.recs if r.gave_up_at is not None)
    return cap * (last - first) / 3600 * onprem + public + never_run
