"""What a frozen project cannot do: admit refuses its normal and batch runs (critical ones need an
explicit override), and its running interruptible gangs checkpoint and stop."""

from __future__ import annotations

import logging
from datetime import UTC, date, datetime
from pathlib import Path

from hybridflow.budgets.config import load_budgets, period_of
from hybridflow.budgets.store import BudgetStore
from hybridflow.config import Estate
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

    Every backend chooses them by the gangs' labels (on Kubernetes the API server does, from the
    manifests' labels) and stops them its own way: local gangs get SIGTERM, Kubernetes gang jobs are
    annotated, then deleted with their pods. Local gangs are named as they are, others
    ``<cluster>/<job>``. A cluster that cannot be reached is logged and skipped (the next evaluation
    tries again): the freeze is recorded already and the other clusters are still handled."""
    from hybridflow.backends import gang_backend

    stopped: list[str] = []
    for cluster in estate.clusters.values():
        done: list[str] = []
        try:
            backend = gang_backend(cluster, estate, state_dir)
            prefix = "" if backend.supervised_by_task else f"{cluster.name}/"
            for name in backend.find_gangs({"project": project, "interruptible": "true"},
                                           not_labels={"priority": "critical"}):
                if backend.stop(name, reason):
                    done.append(prefix + name)
        except Exception as exc:  # unreachable API, expired credentials, ...: one cluster must not stop the rest
            log.warning("budget freeze of %s: could not stop its gangs on cluster %s (%s: %s)%s; the next budget "
                        "evaluation tries again", project, cluster.name, type(exc).__name__, exc,
                        f", stopped so far: {', '.join(done)}" if done else "")
        for name in done:
            log.info("budget freeze of %s: stopped gang %s", project, name)
        stopped += done
    return stopped
