"""Placement while clusters are declared down (:mod:`hybridflow.fencing`).

- ``fenced``: a cluster declared down takes no new placements (recorded on every cluster while any
  is down);
- while a ``role: primary`` cluster is down the estate is in takeover:

  - ``role`` (on ``dr`` clusters): critical runs may use the disaster-recovery pool, whatever its
    ``dr.peacetime`` says; normal and batch runs may not;
  - ``takeover`` (on every cluster): batch runs are paused;
  - the disaster-recovery pool counts as private capacity in place of the primaries down, so a
    critical ``local_first`` run goes there first;

- a run no cluster can take is *held* (:class:`PlacementHeld`) rather than refused when the
  takeover is why: ``paused`` for a batch run, ``waiting`` when a cluster down would take it once
  it is up (the usual :class:`~hybridflow.errors.PlacementError` otherwise).

Pure: the clusters down come in as a mapping; :func:`current` reads them from the fence file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hybridflow.errors import PlacementError

# Rules that say "not now" rather than "never": a run failing only these on a cluster down waits for it.
_TRANSIENT = frozenset({"fenced", "reachable", "room"})


@dataclass(frozen=True)
class Takeover:
    """The clusters declared down (``{cluster: record}``) and the primaries among them."""

    down: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    primaries_down: tuple[str, ...] = ()

    @classmethod
    def of(cls, estate: Any, down: Mapping[str, Mapping[str, Any]]) -> Takeover:
        known = {n: dict(r) for n, r in down.items() if n in estate.clusters}
        return cls(known, tuple(sorted(n for n in known if estate.clusters[n].role == "primary")))

    @property
    def active(self) -> bool:
        return bool(self.primaries_down)

    def describe(self) -> str:
        """``primary onprem-a declared down: power loss`` (every primary down, with its reason)."""
        return "; ".join(f"primary {n} declared down: {self.down[n].get('reason') or 'no reason kept'}"
                         for n in self.primaries_down)


def current(estate: Any, state_dir: Any = None) -> Takeover:
    """The takeover as the fence file says now."""
    from hybridflow.fencing import down_clusters, state_path

    return Takeover.of(estate, down_clusters(state_path(state_dir)))


def fenced_verdict(t: Takeover, cluster: Any) -> str | None:
    record = t.down.get(cluster.name)
    if record is None:
        return None
    return (f"declared down at {record.get('declared_at')} by {record.get('by')}: {record.get('reason')}; it takes "
            f"no new placements until `hybridflow cluster up {cluster.name}`")


def role_verdict(t: Takeover, cluster: Any, priority: str) -> str | None:
    """Whether a ``dr`` cluster takes a run of ``priority``: in takeover, critical runs only; else
    what ``dr.peacetime`` names."""
    if t.active:
        if priority == "critical":
            return None
        wait = "they wait for the primary or for capacity elsewhere" if priority == "normal" else "they are paused"
        return (f"role dr, takeover ({t.describe()}): the disaster-recovery pool serves critical runs only; "
                f"{priority} runs are not placed there, {wait}")
    if cluster.peacetime_allows(priority):
        return None
    allowed = " and ".join(f"{p} runs" for p in cluster.dr.peacetime) if cluster.dr and cluster.dr.peacetime else "no runs"
    return (f"role dr: only {allowed} in peacetime (dr.peacetime in clusters.yaml); the run is "
            f"priority={priority}")


def takeover_verdict(t: Takeover, priority: str) -> str | None:
    if t.active and priority == "batch":
        ups = " and ".join(f"`hybridflow cluster up {n}`" for n in t.primaries_down)
        return f"estate in takeover ({t.describe()}): batch runs are paused until failback ({ups})"
    return None


def dr_winner_reason(t: Takeover, cluster: Any, priority: str) -> str:
    if t.active:
        return (f"takeover ({t.describe()}): {priority} runs go to the disaster-recovery pool {cluster.name}")
    return (f"role dr: {priority} runs may use the disaster-recovery pool {cluster.name} in peacetime "
            "(dr.peacetime)")


def counts_as_private(t: Takeover, cluster: Any) -> bool:
    """Whether the cluster's GPUs are part of the private capacity the spill threshold measures."""
    if not cluster.is_private or cluster.name in t.down:
        return False
    return t.active or not cluster.is_dr


def private_pressure(estate: Any, used: Mapping[str, int], queued: Mapping[str, int],
                     takeover: Takeover | None = None) -> float:
    """Share of private GPU capacity in use (plus queued, if ``placement.spill_counts_queue``); the
    disaster-recovery pool (role dr) is part of it only in a takeover, clusters declared down never."""
    takeover = takeover or Takeover()
    private = [c for c in estate.private_clusters if counts_as_private(takeover, c)]
    cap = sum(c.total_gpus for c in private)
    if not cap:
        return 1.0
    count_queue = estate.pipeline.placement.spill_counts_queue
    busy = sum(used.get(c.name, 0) + (queued.get(c.name, 0) if count_queue else 0) for c in private)
    return busy / cap


class PlacementHeld(PlacementError):
    """No cluster can take the run now because of the takeover: ``state`` ``paused`` (a batch run) or
    ``waiting`` (for ``waits_for``, clusters down that would take it once up). ``candidates`` is
    every cluster's verdict, as in a decision."""

    def __init__(self, message: str, *, state: str, waits_for: Sequence[str], reason: str,
                 candidates: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.state = state
        self.waits_for = list(waits_for)
        self.reason = reason
        self.candidates = candidates

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "waits_for": self.waits_for, "reason": self.reason,
                "candidates": self.candidates}


def held_error(t: Takeover, priority: str, candidates: list[dict[str, Any]], refused: PlacementError) -> PlacementError:
    """:class:`PlacementHeld` when the takeover is why no cluster takes the run, else ``refused``."""
    pause = takeover_verdict(t, priority)
    if pause is not None:
        return PlacementHeld(f"paused: {pause}\n{refused}", state="paused", waits_for=list(t.primaries_down),
                             reason=pause, candidates=candidates)
    waits_for = [c["cluster"] for c in candidates if c["cluster"] in t.down
                 and {k for k, v in c["rules"].items() if v != "pass"} <= _TRANSIENT]
    if not waits_for:
        return refused
    ups = " or ".join(f"`hybridflow cluster up {n}`" for n in waits_for)
    why = (f"{' and '.join(waits_for)} would take the run but {'is' if len(waits_for) == 1 else 'are'} declared "
           f"down, and no cluster still up can take it now: it waits for failback ({ups}) or for capacity "
           "elsewhere")
    if t.active and priority == "normal":
        why += "; normal runs are not placed on the disaster-recovery pool during a takeover"
    return PlacementHeld(f"waiting: {why}\n{refused}", state="waiting", waits_for=waits_for, reason=why,
                         candidates=candidates)
