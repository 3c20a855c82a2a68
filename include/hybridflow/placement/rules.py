"""Choose the cluster a run trains on, and say why.

The estate is one logical pool over labelled clusters. Each cluster is assessed by the rules in
:data:`RULES`, in order; every rule a cluster fails is recorded against it (``rules`` per candidate):

1. ``excluded``: a cluster the run already moved away from (gang not admitted in time) is skipped;
   ``reachable``: a cluster whose usage and queue cannot be read right now is never chosen;
   ``fenced``: a cluster declared down takes no new placements (recorded while any cluster is down);
   ``role``: a ``role: dr`` cluster (the disaster-recovery pool) takes only the run priorities its
   ``dr.peacetime`` names, and in a takeover critical runs only; recorded on dr clusters only;
   ``takeover``: while a primary is declared down, batch runs are paused (:mod:`.takeover`);
2. ``sovereignty``: restricted data runs on private clusters only (never switched off); the
   classification is the dataset's own (``datasets.yaml``), raised by the run if it asked;
3. ``region``: a dataset limited to regions or jurisdictions (``regions``) runs only on clusters in
   one of them (region or jurisdiction of ``clusters.yaml``);
4. ``preference``: ``cluster_preference`` private/public keeps only clusters of that location;
5. ``gpu_model``: the cluster needs a node pool of ``gpu_type``;
6. ``spot``: spot pools only for runs that are interruptible *and* allow spot;
7. ``gang_fits``: a gang runs in one pool, so the pool needs ``workers`` GPUs;
8. ``price_ceiling``: the pool costs at most ``max_price_per_gpu_hour`` (0: no ceiling);
   ``reservation``: a private cluster keeping GPUs for work that may run only there (:mod:`.reserve`)
   is refused to a run that may run public once it would pass the GPUs others may use; recorded on
   those clusters only;
9. ``room`` (only when moving a waiting gang, ``require_room``): the gang would be admitted now.

Among eligible clusters, ``auto`` runs follow ``placement_strategy``: ``local_first`` prefers private
clusters until the private share in use (plus queued, when ``placement.spill_counts_queue``) reaches
``placement.spill_threshold``, then spills to public; ``elastic_first`` prefers public capacity.
Ties go to the least loaded (GPUs in use plus queued over capacity: the shortest queue), then the
cheapest, then the name, so a retried task picks the same cluster.

A run with ``start_by`` (a duration) is placed by deadline instead: each eligible cluster's wait is
estimated (:mod:`hybridflow.waits`: room now, else the ledger's history of queue waits there for gangs
of about its size) and the cheapest cluster expected to start in time wins; with no cluster expected
in time the soonest known one wins, and with no estimate at all the rules above decide. The estimate
and its basis are in the explanation either way.

:func:`choose_cluster` takes the estate and usage numbers only (:func:`place` also reads the clusters
declared down), so the trace replay (``benchmarks/placement_trace.py``) drives exactly these rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridflow.backends.base import ClusterLoad
from hybridflow.config import Cluster, Estate, NodePool
from hybridflow.errors import PlacementError
from hybridflow.placement.deadline import by_deadline as _by_deadline
from hybridflow.placement.deadline import wait_text as _wait_text
from hybridflow.placement.decision import PlacementDecision
from hybridflow.placement.reserve import Reservation, last_private_only_arrivals, private_only, reservations
from hybridflow.placement.reserve import verdict as reserve_verdict
from hybridflow.placement.takeover import (
    Takeover,
    current,
    dr_winner_reason,
    fenced_verdict,
    held_error,
    private_pressure,
    role_verdict,
    takeover_verdict,
)
from hybridflow.request import AdmittedRun
from hybridflow.waits import WaitEstimate, format_duration


@dataclass
class _Candidate:
    cluster: Cluster
    reasons: list[str]
    pools: list[NodePool]  # pools still usable; rules narrow it down
    rules: dict[str, str] = field(default_factory=dict)
    pool: NodePool | None = None
    tier: int = 0
    load: float = 0.0
    used: int = 0
    queued: int = 0
    rank: int | None = None
    wait: WaitEstimate | None = None

    @property
    def eligible(self) -> bool:
        return self.pool is not None

    @property
    def price(self) -> float:
        assert self.pool is not None
        return self.cluster.price_of(self.pool)

    def key(self) -> tuple[int, float, float, str]:
        return (self.tier, self.load, self.price, self.cluster.name)

    def as_dict(self) -> dict[str, Any]:
        pool = self.pool
        return {
            "cluster": self.cluster.name,
            "location": self.cluster.location,
            "eligible": self.eligible,
            "rank": self.rank,
            "node_pool": pool.name if pool else None,
            "pricing_class": self.cluster.pricing_class(pool) if pool else None,
            "price_per_gpu_hour": self.price if pool else None,
            "load": round(self.load, 4),
            "queued": self.queued,
            "score": [self.tier, round(self.load, 4), self.price] if pool else None,
            "rules": dict(self.rules),
            "reasons": list(self.reasons),
            "wait_estimate": None if self.wait is None else
            {"seconds": self.wait.seconds, "basis": self.wait.basis, "samples": self.wait.samples},
        }


@dataclass(frozen=True)
class _Context:
    run: AdmittedRun
    excluded: dict[str, str]
    unreachable: Mapping[str, str] = field(default_factory=dict)
    require_room: bool = False
    queues: Mapping[str, frozenset[str] | None] = field(default_factory=dict)
    queue: str = ""
    takeover: Takeover = field(default_factory=Takeover)
    reservations: Mapping[str, Reservation] = field(default_factory=dict)
    public_options: tuple[str, ...] = ()  # public clusters that would take the run (reservation rule)


# -- rules: each returns why the cluster (or all its remaining pools) fails, or None ---------------
def _rule_excluded(ctx: _Context, cand: _Candidate) -> str | None:
    name = cand.cluster.name
    if name in ctx.excluded:
        return "excluded" + (f": {ctx.excluded[name]}" if ctx.excluded[name] else "")
    return None


def _rule_reachable(ctx: _Context, cand: _Candidate) -> str | None:
    name = cand.cluster.name
    if name in ctx.unreachable:
        return f"usage and queue unknown ({ctx.unreachable[name]}): not chosen until the cluster answers"
    return None


def _rule_queue(ctx: _Context, cand: _Candidate) -> str | None:
    existing = ctx.queues.get(cand.cluster.name)
    if existing is not None and ctx.queue not in existing:
        return (f"team {ctx.run.team}'s queue {ctx.queue!r} does not exist on the cluster; create it there or set "
                f"teams.{ctx.run.team}.queue in projects.yaml to one of: {', '.join(sorted(existing)) or 'none'}")
    return None


def _rule_fenced(ctx: _Context, cand: _Candidate) -> str | None:
    return fenced_verdict(ctx.takeover, cand.cluster)


def _rule_role(ctx: _Context, cand: _Candidate) -> str | None:
    return role_verdict(ctx.takeover, cand.cluster, ctx.run.priority)


def _rule_takeover(ctx: _Context, cand: _Candidate) -> str | None:
    return takeover_verdict(ctx.takeover, ctx.run.priority)


def _rule_reservation(ctx: _Context, cand: _Candidate) -> str | None:
    return reserve_verdict(ctx.run, cand.cluster, ctx.reservations.get(cand.cluster.name), cand.used, cand.queued,
                           ctx.public_options)


# Rules recorded only where they concern (a candidate's rules list stays as it was elsewhere).
_ONLY_WHERE: Mapping[str, Callable[[_Context, Cluster], bool]] = {
    "fenced": lambda ctx, c: bool(ctx.takeover.down),
    "role": lambda ctx, c: c.is_dr,
    "takeover": lambda ctx, c: ctx.takeover.active,
    "reservation": lambda ctx, c: c.name in ctx.reservations,
}


def _rule_sovereignty(ctx: _Context, cand: _Candidate) -> str | None:
    if cand.cluster.location == "public" and ctx.run.must_stay_private:
        return f"dataset {ctx.run.dataset} is restricted: restricted data never leaves private clusters"
    return None


def _rule_region(ctx: _Context, cand: _Candidate) -> str | None:
    allowed = ctx.run.regions or []
    if allowed and not set(cand.cluster.areas) & set(allowed):
        return (f"dataset {ctx.run.dataset} may only be processed in {', '.join(allowed)}; the cluster is in "
                f"{' / '.join(cand.cluster.areas)}")
    return None


def _rule_preference(ctx: _Context, cand: _Candidate) -> str | None:
    pref = ctx.run.cluster_preference
    if pref in ("private", "public") and cand.cluster.location != pref:
        return f"cluster_preference={pref}"
    return None


def _rule_gpu_model(ctx: _Context, cand: _Candidate) -> str | None:
    gpu = ctx.run.gpu_type
    cand.pools = [p for p in cand.pools if p.gpu_model == gpu]
    if not cand.pools:
        return f"offers no {gpu} GPUs (has {', '.join(cand.cluster.gpu_models)})"
    return None


def _rule_spot(ctx: _Context, cand: _Candidate) -> str | None:
    usable = [p for p in cand.pools if not p.spot or ctx.run.spot_eligible]
    if cand.pools and not usable:
        names = ", ".join(p.name for p in cand.pools)
        cand.pools = []
        return (
            f"its {ctx.run.gpu_type} GPUs are spot only ({names}); spot needs interruptible=true and "
            "spot_allowed=true"
        )
    cand.pools = usable
    return None


def _rule_gang_fits(ctx: _Context, cand: _Candidate) -> str | None:
    fitting = [p for p in cand.pools if p.gpus >= ctx.run.workers]
    if cand.pools and not fitting:
        biggest = max(p.gpus for p in cand.pools)
        cand.pools = []
        return (
            f"largest usable {ctx.run.gpu_type} pool has {biggest} GPUs; the gang needs "
            f"{ctx.run.workers} in one pool"
        )
    cand.pools = fitting
    return None


def _rule_price_ceiling(ctx: _Context, cand: _Candidate) -> str | None:
    ceiling = ctx.run.max_price_per_gpu_hour
    if not ceiling:
        return None
    cheap = [p for p in cand.pools if cand.cluster.price_of(p) <= ceiling]
    if cand.pools and not cheap:
        lowest = min(cand.cluster.price_of(p) for p in cand.pools)
        cand.pools = []
        return f"cheapest usable pool costs {lowest:.2f} USD/GPU-hour, above max_price_per_gpu_hour={ceiling:g}"
    cand.pools = cheap
    return None


def _rule_room(ctx: _Context, cand: _Candidate) -> str | None:
    if not ctx.require_room or not cand.pools:
        return None
    c, need = cand.cluster, ctx.run.workers
    if cand.queued or cand.used + need > c.total_gpus:
        return (f"no room now: {cand.used}/{c.total_gpus} GPUs in use, {cand.queued} queued; the gang of {need} "
                "would wait here too")
    return None


Rule = Callable[[_Context, _Candidate], "str | None"]
# Order matters only for the story told: every failing rule is recorded, pools narrow as they go.
RULES: tuple[tuple[str, Rule], ...] = (
    ("excluded", _rule_excluded),
    ("reachable", _rule_reachable),
    ("fenced", _rule_fenced),
    ("queue", _rule_queue),
    ("role", _rule_role),
    ("takeover", _rule_takeover),
    ("sovereignty", _rule_sovereignty),
    ("region", _rule_region),
    ("preference", _rule_preference),
    ("gpu_model", _rule_gpu_model),
    ("spot", _rule_spot),
    ("gang_fits", _rule_gang_fits),
    ("price_ceiling", _rule_price_ceiling),
    ("reservation", _rule_reservation),
    ("room", _rule_room),
)


def choose_cluster(
    run: AdmittedRun,
    estate: Estate,
    used_gpus: Mapping[str, int],
    *,
    exclude: Mapping[str, str] | Collection[str] = (),
    queued_gpus: Mapping[str, int] | None = None,
    unreachable: Mapping[str, str] | None = None,
    require_room: bool = False,
    waits: Mapping[str, WaitEstimate] | None = None,
    queues: Mapping[str, frozenset[str] | None] | None = None,
    takeover: Takeover | None = None,
    reservations: Mapping[str, Reservation] | None = None,
) -> PlacementDecision:
    """Pick the cluster and node pool for ``run``.

    ``used_gpus`` maps cluster name to GPUs in use and ``queued_gpus`` to GPUs of gangs waiting for
    admission (missing = 0). ``exclude`` names clusters to skip, e.g. one that did not admit the gang
    in time; a mapping gives the reason shown in the log. ``unreachable`` maps clusters whose load
    could not be read to why (never chosen). ``require_room`` keeps only clusters that would admit
    the gang now (moving a waiting gang). ``waits`` are the clusters' estimated waits, for a run
    with ``start_by``. ``queues`` names the team queues that exist on each cluster (None: not known).
    ``takeover``: the clusters declared down (None: none); a run held by it raises ``PlacementHeld``.
    ``reservations``: the private clusters keeping GPUs for private-only work (:mod:`.reserve`)."""
    settings = estate.pipeline.placement
    threshold = settings.spill_threshold
    excluded = dict(exclude) if isinstance(exclude, Mapping) else dict.fromkeys(exclude, "")
    queued_gpus = queued_gpus or {}
    used = {name: min(max(int(used_gpus.get(name, 0) or 0), 0), c.total_gpus) for name, c in estate.clusters.items()}
    queued = {name: max(int(queued_gpus.get(name, 0) or 0), 0) for name in estate.clusters}
    takeover = takeover or Takeover()
    share = private_pressure(estate, used, queued, takeover)
    strategy = run.placement_strategy
    spilling = run.cluster_preference == "auto" and strategy == "local_first" and share >= threshold

    ctx = _Context(run=run, excluded=excluded, unreachable=dict(unreachable or {}), require_room=require_room,
                   queues=dict(queues or {}), queue=estate.queue_of(run.team) if run.team in estate.teams else "",
                   takeover=takeover, reservations=dict(reservations or {}))
    candidates = [_assess(ctx, c, used[name], queued[name], spilling) for name, c in sorted(estate.clusters.items())]
    public = tuple(c.cluster.name for c in candidates if c.eligible and c.cluster.location == "public")
    # Kept GPUs are refused only to a run another cluster would take now; one that asked for private
    # clusters queues there like work that may run only there.
    if ctx.reservations and public and run.cluster_preference != "private":
        ctx = dataclasses.replace(ctx, public_options=public)
        candidates = [_assess(ctx, c.cluster, c.used, c.queued, spilling) if c.cluster.name in ctx.reservations else c
                      for c in candidates]
    eligible = sorted((c for c in candidates if c.eligible), key=_Candidate.key)
    deadline = _by_deadline(run, eligible, waits) if run.start_by_s and eligible else None
    if deadline is not None:
        eligible = deadline[0]
    if not eligible:
        raise held_error(takeover, run.priority, [c.as_dict() for c in candidates], _no_cluster_error(run, candidates))

    winner = eligible[0]
    for rank, cand in enumerate(eligible, start=1):
        cand.rank = rank
        if rank > 1:
            cand.reasons.append(f"ranked {rank}: {_why_lost(cand, winner, share, threshold, strategy)}")
    assert winner.pool is not None
    pool = winner.pool
    why = deadline[1] if deadline is not None else _policy_reason(run, winner, share, threshold, spilling)
    why += _winner_reasons(run, winner, eligible, share, threshold, strategy, takeover)
    if run.start_by_s and deadline is None:
        why.append(f"start_by {format_duration(run.start_by_s)}: no wait estimate (none was given), placed by the "
                   "rules above")
    winner.reasons.append("chosen")

    return PlacementDecision(
        cluster=winner.cluster.name,
        location=winner.cluster.location,
        node_pool=pool.name,
        pricing_class=winner.cluster.pricing_class(pool),
        price_per_gpu_hour=winner.price,
        gpu_model=pool.gpu_model,
        gpus=run.workers,
        spot=pool.spot,
        reasons=why,
        candidates=[c.as_dict() for c in candidates],
        failovers=[{"cluster": k, "reason": v} for k, v in excluded.items()],
    )


def _no_cluster_error(run: AdmittedRun, candidates: list[_Candidate]) -> PlacementError:
    """Why no cluster can take the run, every cluster's failed rules named (also as ``candidates``)."""
    err = PlacementError(
        f"no cluster can take {run.workers} x {run.gpu_type} for project {run.project!r} "
        f"(dataset {run.dataset} {run.classification}"
        + (f" in {', '.join(run.regions)}" if run.regions else "")
        + f", cluster_preference={run.cluster_preference}, "
        f"spot {'allowed' if run.spot_eligible else 'not allowed'}"
        + (f", max_price_per_gpu_hour={run.max_price_per_gpu_hour:g}" if run.max_price_per_gpu_hour else "")
        + "):\n"
        + "\n".join(f"  - {c.cluster.name} ({c.cluster.location}): {'; '.join(c.reasons)}" for c in candidates)
    )
    err.candidates = [c.as_dict() for c in candidates]  # type: ignore[attr-defined]
    return err


def _winner_reasons(run: AdmittedRun, winner: _Candidate, eligible: list[_Candidate], share: float,
                    threshold: float, strategy: str, takeover: Takeover) -> list[str]:
    """Why the winner's region, pool, pricing and load suit the run, and why it beat each other eligible one."""
    assert winner.pool is not None
    pool = winner.pool
    why: list[str] = []
    if run.regions:
        why.append(f"dataset {run.dataset} stays in {', '.join(run.regions)}: {winner.cluster.name} is in "
                   f"{' / '.join(winner.cluster.areas)}")
    if winner.cluster.is_dr:
        why.append(dr_winner_reason(takeover, winner.cluster, run.priority))
    why.append(f"node pool {pool.name} has {pool.gpus} {pool.gpu_model} GPUs for a gang of {run.workers}")
    if pool.spot:
        why.append("spot pool: the run is interruptible and allows spot")
    elif winner.cluster.location == "public":
        why.append("on-demand pool" + ("" if run.spot_eligible else ": the run is not spot-eligible"))
    if run.max_price_per_gpu_hour:
        why.append(f"within the price ceiling of {run.max_price_per_gpu_hour:g} USD/GPU-hour")
    why.append(
        f"load {winner.used}/{winner.cluster.total_gpus} GPUs in use ({winner.load:.0%} with {winner.queued} queued); "
        f"price {winner.cluster.pricing_class(pool)} {winner.price:.2f} USD/GPU-hour"
    )
    why.extend(
        f"chosen over {c.cluster.name}: {_why_lost(c, winner, share, threshold, strategy)}" for c in eligible[1:]
    )
    return why


def _assess(ctx: _Context, c: Cluster, used: int, queued: int, spilling: bool) -> _Candidate:
    """Run every rule on the cluster, keep each failure; pick its pool if none failed."""
    cand = _Candidate(
        cluster=c, reasons=[], pools=list(c.node_pools), used=used, queued=queued,
        load=(used + queued) / c.total_gpus,
    )
    for name, rule in RULES:
        if name in _ONLY_WHERE and not _ONLY_WHERE[name](ctx, c):
            continue
        why = rule(ctx, cand)
        cand.rules[name] = "pass" if why is None else why
        if why is not None:
            cand.reasons.append(why)
    if cand.reasons:
        return cand
    # Cheapest pool that passed (spot when allowed); more GPUs then name break ties deterministically.
    cand.pool = min(cand.pools, key=lambda p: (c.price_of(p), -p.gpus, p.name))
    run = ctx.run
    if run.cluster_preference == "auto":
        if run.placement_strategy == "elastic_first":
            preferred = "public"
        else:
            preferred = "public" if spilling else "private"
        cand.tier = 0 if c.location == preferred else 1
    cand.reasons.append(
        f"eligible: pool {cand.pool.name}, {used}/{c.total_gpus} GPUs in use, {queued} queued, "
        f"{c.pricing_class(cand.pool)} {cand.price:.2f} USD/GPU-hour"
    )
    return cand


def _policy_reason(run: AdmittedRun, winner: _Candidate, share: float, threshold: float, spilling: bool) -> list[str]:
    loc = winner.cluster.location
    busy = f"private clusters {share:.0%} in use or queued"
    if run.must_stay_private:
        return [f"dataset {run.dataset} is restricted: private clusters only"]
    if run.cluster_preference != "auto":
        return [f"cluster_preference={run.cluster_preference}: {loc} clusters only"]
    if run.placement_strategy == "elastic_first":
        out = ["auto, elastic_first: public capacity first"]
        preferred = "public"
    elif spilling:
        out = [f"auto: {busy} (>= spill threshold {threshold:.0%}), spilling to public"]
        preferred = "public"
    else:
        out = [f"auto: {busy} (< spill threshold {threshold:.0%}), private first"]
        preferred = "private"
    if winner.tier == 1:
        out.append(f"no {preferred} cluster is eligible, so {loc}")
    return out


def _why_lost(cand: _Candidate, winner: _Candidate, share: float, threshold: float, strategy: str) -> str:
    if cand.wait is not None and winner.wait is not None and cand.wait.seconds != winner.wait.seconds:
        return f"start_by: expected wait {_wait_text(cand.wait)} against {_wait_text(winner.wait)}" + (
            f", dearer ({cand.price:.2f} vs {winner.price:.2f} USD/GPU-hour)" if cand.price > winner.price else "")
    if cand.tier != winner.tier:
        if strategy == "elastic_first":
            return "elastic_first: public clusters come first"
        if winner.cluster.location == "private":
            return f"private clusters come first while under the spill threshold ({share:.0%} < {threshold:.0%})"
        return f"spilling to public: private clusters {share:.0%} in use or queued (>= {threshold:.0%})"
    if cand.load != winner.load:
        return f"busier ({cand.load:.0%} vs {winner.load:.0%} of GPUs in use or queued)"
    if cand.price != winner.price:
        return f"dearer ({cand.price:.2f} vs {winner.price:.2f} USD/GPU-hour)"
    return "tied on load and price; name order decides"


def place(run: AdmittedRun, estate: Estate, loads: Mapping[str, ClusterLoad], *,
          exclude: Mapping[str, str] | Collection[str] = (), require_room: bool = False,
          waits: Mapping[str, WaitEstimate] | None = None, takeover: Takeover | None = None) -> PlacementDecision:
    """:func:`choose_cluster` on the clusters' load readings (as :func:`hybridflow.backends.estate_load`
    gives them): usage, queue, reachability and the team queues that exist; the clusters declared
    down are read from the fence (:func:`hybridflow.placement.takeover.current`) unless given."""
    kept = None if private_only(run, estate) else reservations(estate, loads, last_private_only_arrivals(estate))
    return choose_cluster(
        run, estate, {n: ld.used for n, ld in loads.items()}, exclude=exclude,
        queued_gpus={n: ld.queued for n, ld in loads.items()},
        unreachable={n: ld.reason or "no answer" for n, ld in loads.items() if not ld.reachable},
        require_room=require_room, waits=waits, queues={n: ld.queues for n, ld in loads.items()},
        takeover=current(estate) if takeover is None else takeover, reservations=kept,
    )
