"""A placement decision: the cluster and node pool chosen for a run, why, every cluster's assessment
and the clusters the run already moved away from; what the placement step hands on in XCom."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


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
    # price_per_gpu_hour, load, queued, score ([preference tier, load share, price]; lower wins; None if
    # ineligible), rules ({rule: "pass" or why it failed}) and reasons (why it was rejected, lost or won).
    candidates: list[dict[str, Any]] = field(default_factory=list)
    # Clusters tried before this one for the same run: [{"cluster", "reason"}] (failover history).
    failovers: list[dict[str, str]] = field(default_factory=list)
    # When it was decided (epoch; 0: not recorded): a checkpoint committed on another cluster after it
    # means an earlier try of the train task moved the run (hybridflow.training.failover.resume_placement).
    decided_at: float = 0.0

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
        ]
        if self.failovers:
            lines.append("failed over from:")
            lines.extend(f"  - {f['cluster']}: {f['reason']}" for f in self.failovers)
        lines.append("candidates:")
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
