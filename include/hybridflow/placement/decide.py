"""The one entry to placement: every question of where a run goes is asked here.

- :func:`decide`: where the run trains now (the placement step), or, with ``leaving``, where a gang
  that waited too long moves (the train task after an admission window): every cluster's load read
  now, the expected waits of a run with ``start_by``, then the rules (:mod:`~hybridflow.placement.rules`);
- :func:`eligible`: the clusters the rules could choose for the run whatever their load (admission
  probes their Connections before anything is staged).

The decision travels as the XCom of the task that asked; the run's ``placement.json`` is the copy its
page shows and that a retried train task resumes a move from (:mod:`hybridflow.training.failover`).
"""

from __future__ import annotations

from collections.abc import Mapping

from hybridflow.config import Cluster, Estate
from hybridflow.errors import PlacementError
from hybridflow.placement.decision import PlacementDecision
from hybridflow.placement.loads import cluster_loads, wait_estimates
from hybridflow.placement.rules import choose_cluster, place
from hybridflow.placement.takeover import current
from hybridflow.request import AdmittedRun
from hybridflow.settings import Settings


def decide(run: AdmittedRun, estate: Estate, settings: Settings, *,
           leaving: Mapping[str, str] | None = None) -> PlacementDecision:
    """Place ``run``. ``leaving`` (cluster -> why) names the clusters its gang moves away from: they are
    ruled out, and only a cluster that would admit the gang now is chosen (PlacementError when none
    would: the gang keeps its place). A run the takeover holds raises ``PlacementHeld``."""
    loads = cluster_loads(estate, settings)
    if leaving:
        return place(run, estate, loads, exclude=dict(leaving), require_room=True)
    return place(run, estate, loads, waits=wait_estimates(run, estate, loads))


def eligible(run: AdmittedRun, estate: Estate) -> list[Cluster]:
    """The clusters the rules could choose for ``run`` whatever their load (none: placement itself
    explains why no cluster fits, or the takeover holds the run). Clusters declared down are left
    out as placement leaves them out."""
    try:
        decision = choose_cluster(run, estate, {}, takeover=current(estate))
    except PlacementError:
        return []
    return [estate.clusters[c["cluster"]] for c in decision.candidates if c["eligible"]]
