"""The numbers a new version must show before, and while, traffic moves to it.

:func:`judge_gate` reads the load test of the new version (and of the serving one, measured in the
same deploy with the same load) against ``serving.gate``; :func:`judge_step` reads one canary step's
window, canary against stable. Both return the reasons the figures fail, each naming the bar (its
setting) and the figures on both sides; an empty list passes.

p99s below :data:`P99_FLOOR_MS` are compared as that floor: under a millisecond the difference
between two versions is timer and scheduling noise, not a regression.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridflow.serving.loadtest import Figures

if TYPE_CHECKING:
    from hybridflow.config import GateSettings

P99_FLOOR_MS = 1.0


def _pct(rate: float) -> str:
    return f"{rate * 100:.2f} %"


def _errors(f: Figures) -> str:
    return f"{_pct(f.error_rate)} ({f.failures} of {f.requests} requests failed)"


def _beside(other: Figures | None, who: str, text: str) -> str:
    return f"; the {who}'s is {text}" if other is not None and other.requests else ""


def _regression(new: Figures, base: Figures, gate: GateSettings, who: str, whose: str) -> list[str]:
    bar = max(base.p99_ms, P99_FLOOR_MS) * (1 + gate.max_p99_regression)
    if not base.requests or new.p99_ms <= bar:
        return []
    more = (new.p99_ms / max(base.p99_ms, P99_FLOOR_MS) - 1) * 100
    return [f"{who} p99 {new.p99_ms:.1f} ms is {more:.0f} % above the {whose}'s {base.p99_ms:.1f} ms; the gate allows "
            f"{gate.max_p99_regression * 100:g} % more, {bar:.1f} ms (serving.gate.max_p99_regression)"]


def judge_gate(new: Figures, serving: Figures | None, gate: GateSettings) -> list[str]:
    """Why the new version's load test fails ``serving.gate`` (empty: it passes)."""
    other = "serving version"
    if not new.requests:
        return [f"the new version answered no request in {gate.duration_s:g} s of load at {gate.concurrency} users "
                f"(serving.gate.duration_s, serving.gate.concurrency): is its server up?"]
    reasons = []
    if new.p99_ms > gate.p99_ms:
        reasons.append(f"p99 {new.p99_ms:.1f} ms is above the gate's {gate.p99_ms:g} ms (serving.gate.p99_ms)"
                       + _beside(serving, other, f"{serving.p99_ms:.1f} ms" if serving else ""))
    if new.rps < gate.min_rps:
        reasons.append(f"throughput {new.rps:.1f} requests/s is below the gate's {gate.min_rps:g} requests/s "
                       f"(serving.gate.min_rps)" + _beside(serving, other, f"{serving.rps:.1f} requests/s" if serving else ""))
    if new.error_rate > gate.max_error_rate:
        reasons.append(f"error rate {_errors(new)} is above the gate's {_pct(gate.max_error_rate)} "
                       f"(serving.gate.max_error_rate)" + _beside(serving, other, _errors(serving) if serving else ""))
    if serving is not None:
        reasons += _regression(new, serving, gate, "the new version's", other)
    return reasons


def judge_step(canary: Figures, stable: Figures | None, gate: GateSettings) -> list[str]:
    """Why one canary step's window fails: the canary's error rate above both ``serving.gate.max_error_rate``
    and the stable version's, or its p99 above ``serving.gate.p99_ms`` or above the stable version's by
    more than ``serving.gate.max_p99_regression`` (empty: the step passes)."""
    if not canary.requests:
        return ["the canary answered no request in the step's window (serving.canary.window_s): "
                "it takes no traffic, or its server is down"]
    reasons = []
    allowed = max(gate.max_error_rate, stable.error_rate if stable is not None and stable.requests else 0.0)
    if canary.error_rate > allowed:
        reasons.append(f"the canary's error rate {_errors(canary)} is above {_pct(allowed)}, the larger of the gate's "
                       f"(serving.gate.max_error_rate) and the stable version's"
                       + _beside(stable, "stable version", _errors(stable) if stable else ""))
    if canary.p99_ms > gate.p99_ms:
        reasons.append(f"the canary's p99 {canary.p99_ms:.1f} ms is above the gate's {gate.p99_ms:g} ms "
                       f"(serving.gate.p99_ms)" + _beside(stable, "stable version",
                                                          f"{stable.p99_ms:.1f} ms" if stable else ""))
    if stable is not None:
        reasons += _regression(canary, stable, gate, "the canary's", "stable version")
    return reasons
