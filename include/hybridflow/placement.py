"""Choose the cluster a run trains on, and say why.

The estate is one logical pool over labelled clusters. Rules, in order:

1. restricted data runs on private clusters only (admission already refused ``cluster_preference=public``);
2. ``cluster_preference`` private/public keeps only clusters of that location;
3. spot pools only for runs that are interruptible *and* allow spot;
4. the cluster needs one node pool of ``gpu_type`` with at least ``workers`` GPUs: a gang runs in one pool;
5. among eligible clusters: ``auto`` prefers private until the private clusters' used share reaches
   ``placement.spill_threshold`` (pipeline.yaml), then public; ties go to the least loaded, then the
   cheapest, then the name (so the choice is deterministic and a retried task picks the same cluster).

Every candidate keeps its reasons, so the task log and XCom show why the winner won and the others lost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridflow.admission import AdmittedRun
from hybridflow.config import Cluster, Estate, NodePool
from hybridflow.errors import PlacementError


@dataclass(frozen=True)
class PlacementDecision:
    cluster: str
    location: str
    node_pool: str
    pricing_class: str
    price_per_gpu_hour: float
    gpu_model: str
    gpus: int
    spot: bool
    reasons: list[str] = field(default_factory=list)
    # One dict per cluster: cluster, location, eligible, rank, node_pool, pricing_class,
    # price_per_gpu_hour, load, score ([preference tier, load share, price]; lower wins; None if
    # ineligible) and reasons (why it was rejected, lost or won).
    candidates: list[dict[str, Any]] = field(default_factory=list)

    def to_xcom(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_xcom(cls, data: Mapping[str, Any]) -> PlacementDecision:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def explain(self) -> str:
        billing = f"{self.pricing_class} at {self.price_per_gpu_hour:.2f} USD/GPU-hour"
        lines = [
            f"placement: {self.cluster}/{self.node_pool} ({self.location}, {billing}) "
            f"for {self.gpus} x {self.gpu_model}",
            "why:",
            *(f"  - {r}" for r in self.reasons),
            "candidates:",
        ]
        for c in self.candidates:
            if not c["eligible"]:
                status = "ineligible"
            elif c["rank"] == 1:
                status = f"chosen   score={c['score']}"
            else:
                status = f"rank {c['rank']}   score={c['score']}"
            lines.append(f"  * {c['cluster']} ({c['location']}): {status}")
            lines.extend(f"      - {r}" for r in c["reasons"])
        return "\n".join(lines)


@dataclass
class _Candidate:
    cluster: Cluster
    reasons: list[str]
    pool: NodePool | None = None
    tier: int = 0
    load: float = 0.0
    used: int = 0
    rank: int | None = None

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
            "score": [self.tier, round(self.load, 4), self.price] if pool else None,
            "reasons": list(self.reasons),
        }


def choose_cluster(
    run: AdmittedRun,
    estate: Estate,
    used_gpus: Mapping[str, int],
    *,
    exclude: Mapping[str, str] | Collection[str] = (),
) -> PlacementDecision:
    """Pick the cluster and node pool for ``run``.

    ``used_gpus`` maps cluster name to GPUs in use (missing = 0). ``exclude`` names clusters to skip,
    e.g. one that did not admit the gang in time; a mapping gives the reason shown in the log.
    """
    threshold = estate.pipeline.placement.spill_threshold
    excluded = dict(exclude) if isinstance(exclude, Mapping) else dict.fromkeys(exclude, "")
    used = {
        name: min(max(int(used_gpus.get(name, 0) or 0), 0), c.total_gpus)
        for name, c in estate.clusters.items()
    }
    private_cap = sum(c.total_gpus for c in estate.private_clusters)
    private_used = sum(used[c.name] for c in estate.private_clusters)
    share = private_used / private_cap if private_cap else 1.0
    spilling = run.cluster_preference == "auto" and share >= threshold

    candidates = [
        _assess(run, c, used[name], spilling, excluded.get(name) if name in excluded else None)
        for name, c in sorted(estate.clusters.items())
    ]
    eligible = sorted((c for c in candidates if c.eligible), key=_Candidate.key)
    if not eligible:
        err = PlacementError(
            f"no cluster can take {run.workers} x {run.gpu_type} for project {run.project!r} "
            f"(sensitivity={run.sensitivity}, cluster_preference={run.cluster_preference}, "
            f"spot {'allowed' if run.spot_eligible else 'not allowed'}):\n"
            + "\n".join(
                f"  - {c.cluster.name} ({c.cluster.location}): {'; '.join(c.reasons)}" for c in candidates
            )
        )
        err.candidates = [c.as_dict() for c in candidates]  # type: ignore[attr-defined]
        raise err

    winner = eligible[0]
    for rank, cand in enumerate(eligible, start=1):
        cand.rank = rank
        if rank > 1:
            cand.reasons.append(f"ranked {rank}: {_why_lost(cand, winner, share, threshold)}")
    assert winner.pool is not None
    pool = winner.pool
    why = _policy_reason(run, winner, share, threshold, spilling)
    why.append(f"node pool {pool.name} has {pool.gpus} {pool.gpu_model} GPUs for a gang of {run.workers}")
    if pool.spot:
        why.append("spot pool: the run is interruptible and allows spot")
    elif winner.cluster.location == "public":
        why.append("on-demand pool" + ("" if run.spot_eligible else ": the run is not spot-eligible"))
    why.append(
        f"load {winner.used}/{winner.cluster.total_gpus} GPUs in use ({winner.load:.0%}); "
        f"price {winner.cluster.pricing_class(pool)} {winner.price:.2f} USD/GPU-hour"
    )
    why.extend(
        f"chosen over {c.cluster.name}: {_why_lost(c, winner, share, threshold)}" for c in eligible[1:]
    )
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
    )


def _assess(run: AdmittedRun, c: Cluster, used: int, spilling: bool, excluded: str | None) -> _Candidate:
    """Collect every reason the cluster cannot take the run; pick its pool if there is none."""
    reasons: list[str] = []
    if excluded is not None:
        reasons.append(f"excluded{': ' + excluded if excluded else ''}")
    if c.location == "public" and run.must_stay_private:
        reasons.append("restricted data never leaves private clusters")
    if run.cluster_preference in ("private", "public") and c.location != run.cluster_preference:
        reasons.append(f"cluster_preference={run.cluster_preference}")
    fitting: list[NodePool] = []
    model_pools = [p for p in c.node_pools if p.gpu_model == run.gpu_type]
    if not model_pools:
        reasons.append(f"offers no {run.gpu_type} GPUs (has {', '.join(c.gpu_models)})")
    else:
        usable = [p for p in model_pools if not p.spot or run.spot_eligible]
        if not usable:
            reasons.append(
                f"its {run.gpu_type} GPUs are spot only ({', '.join(p.name for p in model_pools)}); "
                "spot needs interruptible=true and spot_allowed=true"
            )
        else:
            fitting = [p for p in usable if p.gpus >= run.workers]
            if not fitting:
                biggest = max(p.gpus for p in usable)
                reasons.append(
                    f"largest usable {run.gpu_type} pool has {biggest} GPUs; the gang needs {run.workers} in one pool"
                )
    cand = _Candidate(cluster=c, reasons=reasons, used=used, load=used / c.total_gpus)
    if reasons:
        return cand
    # Cheapest pool that fits (spot when allowed); more GPUs then name break ties deterministically.
    cand.pool = min(fitting, key=lambda p: (c.price_of(p), -p.gpus, p.name))
    if run.cluster_preference == "auto":
        preferred = "public" if spilling else "private"
        cand.tier = 0 if c.location == preferred else 1
    cand.reasons.append(
        f"eligible: pool {cand.pool.name}, {used}/{c.total_gpus} GPUs in use, "
        f"{c.pricing_class(cand.pool)} {cand.price:.2f} USD/GPU-hour"
    )
    return cand


def _policy_reason(
    run: AdmittedRun, winner: _Candidate, share: float, threshold: float, spilling: bool
) -> list[str]:
    loc = winner.cluster.location
    busy = f"private clusters {share:.0%} in use"
    if run.must_stay_private:
        return ["data is restricted: private clusters only"]
    if run.cluster_preference != "auto":
        return [f"cluster_preference={run.cluster_preference}: {loc} clusters only"]
    if spilling:
        out = [f"auto: {busy} (>= spill threshold {threshold:.0%}), spilling to public"]
    else:
        out = [f"auto: {busy} (< spill threshold {threshold:.0%}), private first"]
    if winner.tier == 1:
        out.append(f"no {'public' if spilling else 'private'} cluster is eligible, so {loc}")
    return out


def _why_lost(cand: _Candidate, winner: _Candidate, share: float, threshold: float) -> str:
    if cand.tier != winner.tier:
        if winner.cluster.location == "private":
            return (
                f"private clusters come first while under the spill threshold ({share:.0%} < {threshold:.0%})"
            )
        return f"spilling to public: private clusters {share:.0%} in use (>= {threshold:.0%})"
    if cand.load != winner.load:
        return f"busier ({cand.load:.0%} vs {winner.load:.0%} of GPUs in use)"
    if cand.price != winner.price:
        return f"dearer ({cand.price:.2f} vs {winner.price:.2f} USD/GPU-hour)"
    return "tied on load and price; name order decides"
