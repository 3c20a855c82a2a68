"""The numbers a local deploy goes by: the gate before any traffic moves, and each canary window.

The gate load-tests the new version's server directly and then the serving version's, with the same
``serving.gate`` settings, and judges the two side by side (:func:`hybridflow.serving.gate.judge_gate`).
A canary window drives ``serving.canary.concurrency`` users through the gateway for ``window_s``; the
gateway answers with the version it forwarded to, so the load test's figures come back per version
and the canary is judged against the stable version over the same window
(:func:`hybridflow.serving.gate.judge_step`). Everything here returns plain dicts for the deploy's
outcome and writes the figures to the task log.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybridflow.serving.processes import Log, say

if TYPE_CHECKING:
    from hybridflow.config.pipeline import CanarySettings, GateSettings

ALL = "all"  # the load test's key for every request
UNKNOWN = "?"  # its key for failures no version can be told for
WINDOW_TRIES = 3  # a window in which the canary drew no request is driven again, this many times at most
_ROWS = (("requests", "requests", "{:d}"), ("failures", "failures", "{:d}"), ("error rate", "error_rate", "{:.2%}"),
         ("requests/s", "rps", "{:.1f}"), ("p50 ms", "p50_ms", "{:.1f}"), ("p99 ms", "p99_ms", "{:.1f}"))


def load_test(base_url: str, endpoint: str, rows: list[list[Any]], *, concurrency: int, duration_s: float,
              log: Log = None) -> dict[str, Any]:
    """:func:`hybridflow.serving.loadtest.load_test`, imported when a deploy first measures."""
    from hybridflow.serving.loadtest import load_test as run

    return run(base_url, endpoint, rows, concurrency=concurrency, duration_s=duration_s, log=log)


def _judge(name: str, *args: Any) -> list[str]:
    from hybridflow.serving import gate

    return list(getattr(gate, name)(*args))


def figs(figures: Any) -> dict[str, Any] | None:
    return None if figures is None else figures.as_dict()


def side_by_side(title: str, columns: list[tuple[str, Any]]) -> str:
    """A small table of load-test figures, one column per (label, Figures or None)."""
    width = max(12, *(len(label) + 2 for label, _ in columns))
    lines = [f"{title}:", f"  {'':<12}" + "".join(f"{label:>{width}}" for label, _ in columns)]
    for name, attr, fmt in _ROWS:
        cells = ["-" if f is None else fmt.format(getattr(f, attr)) for _, f in columns]
        lines.append(f"  {name:<12}" + "".join(f"{cell:>{width}}" for cell in cells))
    return "\n".join(lines)


def run_gate(new_url: str, serving_url: str | None, endpoint: str, rows: list[list[Any]], gate: GateSettings, *,
             version: str, serving_version: str | None, log: Log = None) -> tuple[dict[str, Any], Any, Any]:
    """Load-test the new version, then the serving one (None: nothing healthy serves), one after the
    other with the same settings; (the gate's outcome, new figures, serving figures)."""
    def measure(url: str) -> Any:
        return load_test(url, endpoint, rows, concurrency=gate.concurrency, duration_s=gate.duration_s)[ALL]

    new = measure(new_url)
    serving = measure(serving_url) if serving_url else None
    reasons = _judge("judge_gate", new, serving, gate)
    columns = [(f"new {version}", new)] + ([(f"serving {serving_version}", serving)] if serving_url else [])
    say(log, side_by_side(f"{endpoint} gate ({gate.concurrency} users for {gate.duration_s:g} s each; "
                          f"{'passed' if not reasons else 'failed: ' + '; '.join(reasons)})", columns))
    outcome = {"new": figs(new), "serving": figs(serving), "bars": gate.model_dump(), "passed": not reasons,
               "reasons": reasons}
    return outcome, new, serving


def run_window(gateway_url: str, endpoint: str, rows: list[list[Any]], canary: CanarySettings, gate: GateSettings,
               *, percent: int, version: str, stable_version: str | None, stable_before: Any = None,
               log: Log = None) -> tuple[dict[str, Any], Any]:
    """One window of traffic through the gateway with ``percent`` on the canary ``version``; judged
    against the stable version's figures of the same window, or ``stable_before`` when the stable
    version took no traffic (after promotion). (The step's outcome, the stable figures it used.)"""
    for _ in range(WINDOW_TRIES):
        per_version = load_test(gateway_url, endpoint, rows, concurrency=canary.concurrency,
                                duration_s=canary.window_s)
        if per_version.get(version) is not None:
            break
    canary_figs = per_version.get(version)
    stable = per_version.get(stable_version) if stable_version and percent < 100 else None
    stable = stable if stable is not None else stable_before
    if canary_figs is None:
        reasons = [f"version {version} answered no request in {WINDOW_TRIES} windows of {canary.window_s:g} s at "
                   f"{percent} %; lengthen serving.canary.window_s or raise serving.canary.concurrency"]
    else:
        reasons = _judge("judge_step", canary_figs, stable, gate)
    lost = per_version.get(UNKNOWN)
    label = "after promotion" if percent >= 100 else f"canary at {percent} %"
    say(log, side_by_side(
        f"{endpoint} {label} ({canary.concurrency} users through the gateway for {canary.window_s:g} s; "
        f"{'passed' if not reasons else 'failed: ' + '; '.join(reasons)})"
        + (f"; {lost.failures} failed requests named no version" if lost is not None else ""),
        [(f"canary {version}", canary_figs), (f"stable {stable_version}", stable)]))
    step = {"percent": percent, "canary": figs(canary_figs), "stable": figs(stable), "passed": not reasons,
            "reasons": reasons}
    return step, stable
