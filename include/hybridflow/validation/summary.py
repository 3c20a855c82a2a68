"""The summary of one dataset's validation: per-split counts, failure lines and report paths."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Enough failure lines to act on in a task log; the JSON reports have all of them.
MAX_FAILURE_LINES = 15


@dataclass
class ValidationSummary:
    dataset: str
    passed: bool
    splits: dict[str, dict[str, int]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    reports: dict[str, Path] = field(default_factory=dict)
    elapsed_s: float = 0.0

    def to_xcom(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "passed": self.passed,
            "splits": {s: dict(v) for s, v in self.splits.items()},
            "failures": list(self.failures),
            "reports": {k: str(p) for k, p in self.reports.items()},
            "elapsed_s": round(self.elapsed_s, 3),
        }

    def render(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        lines = [f"Data validation {verdict} for {self.dataset} ({self.elapsed_s:.1f} s)"]
        for split, stats in self.splits.items():
            lines.append(
                f"  {split}: {stats['rows']} rows, {stats['expectations']} expectations, {stats['failed']} failed"
            )
        if self.failures:
            shown = self.failures[:MAX_FAILURE_LINES]
            lines.append(f"Failures ({len(self.failures)}):")
            lines.extend(f"  - {line}" for line in shown)
            if len(self.failures) > len(shown):
                lines.append(f"  ... and {len(self.failures) - len(shown)} more")
        if self.reports:
            lines.append("Full reports:")
            lines.extend(f"  {name}: {path}" for name, path in self.reports.items())
        return "\n".join(lines)
