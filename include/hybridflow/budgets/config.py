"""``config/budgets.yaml``: a USD budget per project per month, validated against the estate.

A problem raises :class:`~hybridflow.errors.ConfigError` naming the file, the key path and the fix,
like the rest of the estate description (``hybridflow.config``).
"""

from __future__ import annotations

import re
from datetime import date
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hybridflow.config import Estate, _validate
from hybridflow.errors import ConfigError

BUDGETS_FILE = "budgets.yaml"
FREEZE_AT = 1.0  # a project is frozen once it has spent its whole budget
_PERIOD_RE = re.compile(r"^\d{4}-(0[1-9]|1[0-2])$")


def period_of(day: date) -> str:
    """The budget period (calendar month, ``YYYY-MM``) that ``day`` falls in."""
    return f"{day.year:04d}-{day.month:02d}"


def period_end(period: str) -> date:
    """The first day after ``period``: when a freeze for that month lifts by itself."""
    year, month = int(period[:4]), int(period[5:7])
    return date(year + month // 12, month % 12 + 1, 1)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ProjectBudget(_Model):
    monthly_usd: float = Field(gt=0)
    months: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)

    @field_validator("months")
    @classmethod
    def _months_are_periods(cls, value: dict[str, float]) -> dict[str, float]:
        bad = [k for k in value if not _PERIOD_RE.match(str(k))]
        if bad:
            raise ValueError(f"month keys are YYYY-MM, e.g. \"2026-12\"; fix {', '.join(map(repr, bad))}")
        return value


class BudgetsConfig(_Model):
    # Shares of the budget at which a notification goes out (once each per project and month).
    notify_at: list[Annotated[float, Field(gt=0, lt=FREEZE_AT)]] = Field(default_factory=lambda: [0.8])
    webhook_conn_id: str = Field(default="hybridflow_budget_webhook", min_length=1)
    projects: dict[str, ProjectBudget] = Field(default_factory=dict)

    @field_validator("notify_at")
    @classmethod
    def _sorted_unique(cls, value: list[float]) -> list[float]:
        return sorted(set(value))

    def budget_for(self, project: str, period: str) -> float | None:
        """USD budget of ``project`` for ``period``; None if the project has no budget."""
        b = self.projects.get(project)
        if b is None:
            return None
        return b.months.get(period, b.monthly_usd)


def load_budgets(config_dir: Path, estate: Estate) -> BudgetsConfig:
    """Parse ``budgets.yaml`` in ``config_dir``; a missing file means no project has a budget."""
    path = Path(config_dir) / BUDGETS_FILE
    if not path.is_file():
        return BudgetsConfig()
    cfg = _validate(BudgetsConfig, path, allow_empty=True)
    unknown = sorted(set(cfg.projects) - set(estate.projects))
    if unknown:
        raise ConfigError(
            f"invalid {BUDGETS_FILE}:\n"
            + "\n".join(
                f"  - {path}: projects.{name}: unknown project {name!r}; use one of "
                f"{', '.join(sorted(estate.projects))} or add it to projects.yaml"
                for name in unknown
            )
        )
    return cfg
