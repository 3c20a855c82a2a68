"""The one entry to placement: every question of where a run goes is asked here.

- :func:`decide`: where the run trains now (the placement step), or, with ``leaving``, where a gang
  that waited too long moves (the train task after an admission window): every cluster's load read
  now, the expected waits of a run with ``start_by``, then the rules (:mod:`~hybridflow.placement.rules`);
- :func:`eligible`: the clusters the rules could choose for the run whatever their load (admission
  probes their Connections before anything is staged).

The decision travels as the XCom of the task that asked, and only there; the run's ``placement.json``
is what its page shows, never read back. A retried train task finds a move an earlier try made from
the run's checkpoints (:func:`hybridflow.training.failover.resume_placement`).
"""

from __future__ import annotations

import dataclasses
import time
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
           leaving: Mapping[str, str] | None = None, resume_on: tuple[str, str] | None = None) -> PlacementDecision:
    """Place ``run``. ``leaving`` (cluster -> why) names the clusters its gang moves away from: they are
    ruled out, and only a cluster that would admit the gang now is chosen (PlacementError when none
    would: the gang keeps its place). ``resume_on`` (cluster, why) places the run on that cluster only,
    where its work is, if the rules still allow it there (PlacementError otherwise). A run the takeover
    holds raises ``PlacementHeld``."""
    loads = cluster_loads(estate, settings)
    if resume_on:
        target, why = resume_on
        others = {name: f"the run resumes on {target}: {why}" for name in estate.clusters if name != target}
        decision = place(run, estate, loads, exclude=others)
    elif leaving:
        decision = place(run, estate, loads, exclude=dict(leaving), require_room=True)
    else:
        decision = place(run, estate, loads, waits=wait_estimates(run, estate, loads))
    return dataclasses.replace(decision, decided_at=round(time.time(), 3))


def eligible(run: AdmittedRun, estate: Estate) -> list[Cluster]:
    """The clusters the rules could choose for ``run`` whatever their load (none: placement itself
    explains why no cluster fits, or the takeover holds the run). Clusters declared down are left
    out as placement leaves them out."""
    try:
        decision = choose_cluster(run, estate, {}, takeover=current(estate))
    except PlacementError:
        return []
    return [estate.clusters[c["cluster"]] for c in decision.candidates if c["eligible"]]
