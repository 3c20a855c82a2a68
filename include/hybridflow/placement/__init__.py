"""Where a run trains and where its data and checkpoints live.

- :mod:`~hybridflow.placement.decide`: the one entry: where a run trains, where a waiting gang
  moves, which clusters a run may use;
- :mod:`~hybridflow.placement.rules`: the rules that choose the cluster and node pool (pure: the
  estate and usage numbers in, a decision out);
- :mod:`~hybridflow.placement.decision`: that decision (:class:`PlacementDecision`), its XCom form and
  its explanation;
- :mod:`~hybridflow.placement.loads`: what the rules decide on, read now: each cluster's load from its
  gang backend, GPUs held per team, expected waits from the ledger; placing a waiting gang again;
- :mod:`~hybridflow.placement.stage`: the run's data where the chosen cluster reads it;
- :mod:`~hybridflow.placement.places`: a cluster's cache bucket, scratch filesystem and a run's
  checkpoint places on it.
"""

from __future__ import annotations

from hybridflow.placement.decision import PlacementDecision
from hybridflow.placement.rules import RULES, choose_cluster, place, private_pressure

__all__ = ["RULES", "PlacementDecision", "choose_cluster", "place", "private_pressure"]
