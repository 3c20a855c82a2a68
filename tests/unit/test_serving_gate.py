"""The gate and the canary step judged on given figures: each failing bar named with both figures."""

from __future__ import annotations

from hybridflow.config.pipeline import GateSettings
from hybridflow.serving.gate import judge_gate, judge_step
from hybridflow.serving.loadtest import Figures

GATE = GateSettings(p99_ms=250, min_rps=50, max_error_rate=0.0, max_p99_regression=0.5)


def figs(requests=1000, failures=0, rps=200.0, p50=10.0, p99=40.0) -> Figures:
    return Figures(requests=requests, failures=failures, error_rate=failures / requests if requests else 0.0,
                   rps=rps, p50_ms=p50, p99_ms=p99)


def test_a_version_within_every_bar_passes_with_or_without_a_serving_version():
    assert judge_gate(figs(), figs(p99=30.0), GATE) == []
    assert judge_gate(figs(), None, GATE) == []


def test_each_failed_bar_is_named_with_its_setting_and_both_figures():
    reasons = judge_gate(figs(p99=312.4, rps=31.5, failures=20), figs(p99=120.0, rps=180.0), GATE)
    assert len(reasons) == 4
    p99, rps, errors, regression = reasons
    assert p99 == ("p99 312.4 ms is above the gate's 250 ms (serving.gate.p99_ms); "
                   "the serving version's is 120.0 ms")
    assert "31.5 requests/s is below the gate's 50 requests/s (serving.gate.min_rps)" in rps and rps.endswith("the serving version's is 180.0 requests/s")
    assert "2.00 % (20 of 1000 requests failed)" in errors and "serving.gate.max_error_rate" in errors
    assert "0.00 % (0 of 1000" in errors  # the serving version's
    assert "312.4 ms is 160 % above the serving version's 120.0 ms" in regression
    assert "50 % more, 180.0 ms (serving.gate.max_p99_regression)" in regression


def test_the_regression_bar_is_relative_to_the_serving_version():
    # 200 ms is under the absolute bar, but 2.5x the serving version's 80 ms.
    [reason] = judge_gate(figs(p99=200.0), figs(p99=80.0), GATE)
    assert "serving.gate.max_p99_regression" in reason
    assert judge_gate(figs(p99=119.0), figs(p99=80.0), GATE) == []
    # Sub-millisecond p99s are compared as 1 ms: 0.4 ms -> 1.2 ms is noise, not a regression.
    assert judge_gate(figs(p99=1.2), figs(p99=0.4), GATE) == []


def test_a_version_that_answered_nothing_fails_the_gate():
    [reason] = judge_gate(figs(requests=0, rps=0.0, p50=0.0, p99=0.0), figs(), GATE)
    assert "answered no request" in reason


def test_a_canary_step_passes_when_it_matches_the_stable_version():
    assert judge_step(figs(requests=40, rps=13.0), figs(requests=360, rps=120.0), GATE) == []


def test_a_canary_may_fail_as_often_as_stable_but_not_more():
    gate = GATE.model_copy(update={"max_error_rate": 0.01})
    assert judge_step(figs(failures=20), figs(failures=30), gate) == []  # 2 % <= stable's 3 %
    [reason] = judge_step(figs(failures=50), figs(failures=30), gate)
    assert "5.00 % (50 of 1000 requests failed) is above 3.00 %" in reason
    assert "serving.gate.max_error_rate" in reason and "stable version's is 3.00 %" in reason
    [reason] = judge_step(figs(failures=20), None, gate)  # no stable figures: the gate's own bar
    assert "is above 1.00 %" in reason


def test_a_slow_canary_fails_its_step_on_either_p99_bar():
    [absolute] = judge_step(figs(p99=300.0), figs(p99=280.0), GATE)
    assert "the canary's p99 300.0 ms is above the gate's 250 ms (serving.gate.p99_ms)" in absolute
    [relative] = judge_step(figs(p99=100.0), figs(p99=50.0), GATE)
    assert "stable version's 50.0 ms" in relative and "serving.gate.max_p99_regression" in relative


def test_a_canary_without_traffic_in_its_window_fails_its_step():
    [reason] = judge_step(figs(requests=0, rps=0.0), figs(), GATE)
    assert "no request" in reason and "serving.canary.window_s" in reason
