"""Admission's look at the Kubernetes clusters a run may be placed on.

The clusters a run may use are those placement could choose for it by the rules that need no load
reading (sovereignty, region, cluster_preference, GPU model, spot, gang size, price ceiling, and
the clusters declared down: :func:`hybridflow.placement.decide.eligible`). For
each of them with backend kubernetes, its Connection must exist, its kubeconfig must load through
the provider's ``KubernetesHook``, and the API server must answer one authenticated list of the
cluster's gang jobs (Volcano Jobs or batch Jobs, limit 1) within ``placement.cluster_read_timeout_s``
(per try: the client tries a failed connection up to four times).

A cluster that fails is one placement would never choose (its load reads as unknown), so the run is
refused only when no cluster it may use is left; otherwise each failure is a warning in the task
log and placement leaves that cluster out. Messages name the cluster, the Connection, what is wrong
and the fix; never the kubeconfig's contents.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from hybridflow.backends import ConnectionProblem, probe_connection
from hybridflow.errors import AdmissionError

if TYPE_CHECKING:
    from hybridflow.config import Estate
    from hybridflow.request import AdmittedRun

log = logging.getLogger(__name__)

__all__ = ["ConnectionProblem", "check_connections", "probe"]

# The one probe of a cluster's Connection, chosen by its backend (module attribute: tests stand in for it).
probe = probe_connection


def check_connections(run: AdmittedRun, estate: Estate) -> list[ConnectionProblem]:
    """Probe the Connection of every kubernetes cluster ``run`` may use. Returns the problems found
    (each logged as a warning); raises :class:`AdmissionError` when they leave the run no cluster."""
    if not any(c.runs_pods for c in estate.clusters.values()):
        return []
    from hybridflow.placement.decide import eligible

    clusters = eligible(run, estate)
    timeout_s = estate.pipeline.placement.cluster_read_timeout_s
    problems = [p for c in clusters if c.runs_pods and (p := probe(c, timeout_s)) is not None]
    if problems and len(problems) == len(clusters):
        field = f"clusters.{problems[0].cluster}.conn_id" if len(problems) == 1 else "clusters"
        listed = "\n".join(f"  - {p}" for p in problems)
        raise AdmissionError(field, "no cluster this run may use can be reached, so placement would have nowhere to "
                             f"put it:\n{listed}\nFix the Connection, or trigger with Params that allow other "
                             "clusters")
    for p in problems:
        log.warning("%s. Placement leaves the cluster out of this run until its Connection answers", p)
    return problems
