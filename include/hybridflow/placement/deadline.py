"""Placement by deadline: a run with ``start_by`` goes to the cheapest cluster expected to start it in
time (each eligible cluster's wait estimated by :mod:`hybridflow.waits`), else the soonest known."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from hybridflow.request import AdmittedRun
from hybridflow.waits import WaitEstimate, format_duration

if TYPE_CHECKING:
    from hybridflow.placement.rules import _Candidate


def wait_text(wait: WaitEstimate) -> str:
    return "unknown" if wait.seconds is None else format_duration(wait.seconds)


def by_deadline(run: AdmittedRun, eligible: list[_Candidate],
               waits: Mapping[str, WaitEstimate] | None) -> tuple[list[_Candidate], list[str]] | None:
    """Eligible clusters in deadline order with the reasons, or None when no cluster has an estimate
    (the usual rules decide). Expected in time: cheapest first; else soonest known first."""
    if not waits:
        return None
    start_by = float(run.start_by_s)
    for cand in eligible:
        cand.wait = waits.get(cand.cluster.name) or WaitEstimate(cand.cluster.name, None, "no estimate")
    estimates = [f"{c.cluster.name}: expected wait {wait_text(c.wait)} ({c.wait.basis})" for c in eligible]
    known = [c for c in eligible if c.wait.seconds is not None]
    if not known:
        return None
    in_time = [c for c in known if c.wait.seconds <= start_by]
    head = f"start_by {format_duration(start_by)}"
    if in_time:
        first = sorted(in_time, key=lambda c: (c.price, c.key()))
        why = [f"{head}: {first[0].cluster.name} is the cheapest cluster expected to start in time "
               f"({first[0].price:.2f} USD/GPU-hour)"]
    else:
        first = sorted(known, key=lambda c: (c.wait.seconds, c.price, c.key()))
        why = [f"{head}: no cluster is expected to start in time; {first[0].cluster.name} is expected to start soonest"]
    rest = [c for c in eligible if c not in first]
    return first + rest, why + [f"estimate: {e}" for e in estimates]
