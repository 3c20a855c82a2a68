"""What a frozen project cannot do: admit refuses its normal and batch runs (critical ones need an
explicit override), and its running interruptible gangs checkpoint and stop."""

from __future__ import annotations

import logging
from datetime import UTC, date, datetime
from pathlib import Path

from hybridflow.budgets.config import load_budgets, period_of
from hybridflow.budgets.store import BudgetStore
from hybridflow.config import Cluster, Estate
from hybridflow.errors import AdmissionError
from hybridflow.ledger.engine import LEDGER_URL_ENV, ledger_url  # noqa: F401 (decided in one place)

log = logging.getLogger(__name__)


def default_store() -> BudgetStore | None:
    """The ledger's budget store; None while no SQLite ledger file exists yet (nothing was ever
    allocated, so nothing can be frozen). Opening it never creates the file."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    from hybridflow.settings import get_settings

    url = make_url(ledger_url(get_settings().home))
    if url.get_backend_name() == "sqlite" and url.database and not Path(url.database).is_file():
        return None
    return BudgetStore(create_engine(url))


def refuse_if_frozen(
    project: str,
    priority: str,
    override: str,
    estate: Estate,
    *,
    store: BudgetStore | None = None,
    today: date | None = None,
) -> None:
    """Raise :class:`AdmissionError` if ``project`` is frozen this month, unless the run is critical
    and carries a ``budget_override`` reason. A budget raised in budgets.yaml since the freeze lets
    runs in at once, before the nightly evaluation records the lift."""
    store = store or default_store()
    if store is None or not store.has_schema():  # never evaluated: nothing can be frozen
        return
    period = period_of(today or datetime.now(UTC).date())
    state = store.get(project, period)
    if state is None or not state.frozen:
        return
    budget = load_budgets(estate.config_dir, estate).budget_for(project, period)
    if budget is None or state.spend_usd < budget:
        return
    if priority == "critical" and override.strip():
        return
    if priority == "critical":
        raise AdmissionError(
            "budget_override",
            f"{state.reason}. A critical run may still start: set budget_override to the reason "
            "(it is kept in the run record)",
        )
    raise AdmissionError(
        "priority",
        f"{state.reason}. Until then {priority} runs of this project are refused; only a critical run "
        "with budget_override set may start",
    )


def stop_interruptible_gangs(project: str, reason: str, estate: Estate, state_dir: Path) -> list[str]:
    """Stop the project's running interruptible, non-critical gangs on every cluster: each commits a
    final checkpoint and exits, and its train task fails with ``reason`` (no relaunch).

    Local gangs get SIGTERM and are named as they are; Kubernetes gang jobs are annotated, then
    deleted with their pods, and named ``<cluster>/<job>``. A Kubernetes cluster that cannot be
    reached is logged and skipped (the next evaluation tries again): the freeze is recorded already
    and the other clusters are still handled."""
    from hybridflow.backends.local import LocalGangBackend

    grace = estate.pipeline.training.preemption_grace_s
    stopped = []
    for cluster in estate.clusters.values():
        if cluster.backend == "kubernetes":
            stopped += _stop_kubernetes_gangs(cluster, project, reason)
            continue
        if cluster.backend != "local":
            continue
        backend = LocalGangBackend(state_dir, cluster.name, cluster.total_gpus, grace_s=grace)
        for gang in backend.running_gangs():
            labels = gang["labels"]
            if (labels.get("project") == project and labels.get("interruptible") == "true"
                    and labels.get("priority") != "critical" and backend.stop(gang["name"], reason)):
                stopped.append(gang["name"])
    return stopped


def _stop_kubernetes_gangs(cluster: Cluster, project: str, reason: str) -> list[str]:
    from hybridflow.backends.k8s.backend import KubernetesGangBackend

    # The same choice as for local gangs, made by the API server from the manifests' labels.
    selector = (f"hybridflow.io/project={project},hybridflow.io/interruptible=true,"
                "hybridflow.io/priority!=critical")
    stopped: list[str] = []
    try:
        backend = KubernetesGangBackend(cluster, image="")  # listing and deleting need no image
        for name in backend.list_gangs(selector):
            if backend.stop(name, reason):
                stopped.append(f"{cluster.name}/{name}")
    except Exception as exc:  # unreachable API, expired credentials, ...: one cluster must not stop the rest
        log.warning("budget freeze of %s: could not stop its gangs on kubernetes cluster %s (%s: %s)%s; "
                    "the next budget evaluation tries again", project, cluster.name, type(exc).__name__, exc,
                    f", stopped so far: {', '.join(stopped)}" if stopped else "")
    for name in stopped:
        log.info("budget freeze of %s: stopped gang %s", project, name)
    return stopped
