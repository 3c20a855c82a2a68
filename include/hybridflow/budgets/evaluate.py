"""Compare each project's spend for a month with its budget and act: notify at each threshold once,
freeze at 100 % (and stop its running interruptible gangs), lift the freeze when the budget is raised.

Pure of Airflow: the caller hands in the spend source, the notification sender and the gang stopper,
so the nightly task, the CLI and tests drive the same code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime

from hybridflow.budgets.config import FREEZE_AT, BudgetsConfig, period_end
from hybridflow.budgets.store import BudgetStore

Spend = Callable[[str, str], float]  # (project, period) -> USD allocated so far in that period
Send = Callable[[dict], None]  # posts one notification (a JSON-able dict)
StopGangs = Callable[[str, str], list[str]]  # (project, reason) -> names of the gangs stopped


@dataclass
class ProjectOutcome:
    project: str
    period: str
    budget_usd: float
    spend_usd: float
    share: float
    frozen: bool
    notified: list[float] = field(default_factory=list)  # thresholds sent by this evaluation
    stopped: list[str] = field(default_factory=list)
    lifted: bool = False

    def to_xcom(self) -> dict:
        return asdict(self)


def _usd(x: float) -> str:
    return f"{x:,.2f} USD"


def freeze_reason(project: str, period: str, spend: float, budget: float) -> str:
    return (
        f"project {project!r} has spent {_usd(spend)} of its {_usd(budget)} budget for {period} "
        f"({spend / budget:.1%}). To lift the freeze raise projects.{project}.months.\"{period}\" "
        f"(or monthly_usd) in config/budgets.yaml; it lifts by itself on {period_end(period).isoformat()}"
    )


def notification(project: str, period: str, threshold: float, spend: float, budget: float) -> dict:
    return {
        "kind": "budget_threshold",
        "project": project,
        "period": period,
        "threshold": threshold,
        "spend_usd": round(spend, 2),
        "budget_usd": round(budget, 2),
        "text": (
            f"GPU budget: project {project} has spent {_usd(spend)} of {_usd(budget)} for {period} "
            f"({spend / budget:.0%}, threshold {threshold:.0%}). At 100 % its normal and batch runs are refused."
        ),
        "key": f"budget/{project}/{period}/{threshold:g}",
    }


def evaluate_period(
    period: str,
    cfg: BudgetsConfig,
    store: BudgetStore,
    *,
    spend: Spend,
    send: Send,
    stop_gangs: StopGangs,
    at: datetime,
) -> list[ProjectOutcome]:
    """Evaluate every budgeted project for ``period``. Safe to re-run: state is upserted, each
    threshold's notification goes out once per period, stopping gangs already stopped is a no-op."""
    outcomes = []
    for project in sorted(cfg.projects):
        budget = cfg.budget_for(project, period)
        assert budget is not None
        spent = float(spend(project, period))
        share = spent / budget
        out = ProjectOutcome(project, period, budget, round(spent, 6), round(share, 6), share >= FREEZE_AT)
        for threshold in [*cfg.notify_at, FREEZE_AT]:
            if share < threshold:
                continue
            note = notification(project, period, threshold, spent, budget)
            if store.notify_once(project, period, threshold, spend_usd=spent, budget_usd=budget,
                                 send=lambda note=note: send(note), at=at):
                out.notified.append(threshold)
        previous = store.get(project, period)
        if out.frozen:
            reason = freeze_reason(project, period, spent, budget)
            store.record(project, period, budget_usd=budget, spend_usd=spent, frozen=True, reason=reason, at=at)
            out.stopped = stop_gangs(project, reason)
        else:
            lifted = bool(previous and previous.frozen)
            reason = (
                f"lifted: the budget for {period} is now {_usd(budget)}, above the {_usd(spent)} spent"
                if lifted
                else None
            )
            store.record(project, period, budget_usd=budget, spend_usd=spent, frozen=False, reason=reason, at=at)
            out.lifted = lifted
        outcomes.append(out)
    return outcomes
