"""Wait estimates for start_by placement (room now, unknown load, too little history, the quantile of
waits of gangs of about the same size) and the start_by durations."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from hybridflow.backends.base import ClusterLoad
from hybridflow.ledger.queue_waits import QueueWait
from hybridflow.waits import WaitEstimate, estimate_waits, format_duration, parse_duration, quantile_of

AT = datetime(2026, 12, 1, tzinfo=UTC)
KW = dict(quantile=0.8, min_samples=5, days=30)


def waits(cluster: str, gpus: int, *seconds: float) -> list[QueueWait]:
    return [QueueWait(cluster, gpus, s, AT) for s in seconds]


def busy(cluster: str) -> ClusterLoad:
    return ClusterLoad(cluster=cluster, capacity=16, used=16, queued=8)


def test_a_cluster_with_room_and_no_queue_starts_now_whatever_its_history():
    loads = {"onprem-a": ClusterLoad(cluster="onprem-a", capacity=16, used=10)}
    est = estimate_waits(waits("onprem-a", 4, *[3600] * 10), loads, 4, **KW)
    assert est == {"onprem-a": WaitEstimate("onprem-a", 0.0, "room now: 6 of 16 GPUs free, nobody queued")}


def test_free_gpus_behind_a_queue_are_not_room():
    # Six free GPUs, but a gang is queued ahead: the history decides (here: too little of it).
    loads = {"onprem-a": ClusterLoad(cluster="onprem-a", capacity=16, used=10, queued=2)}
    est = estimate_waits([], loads, 4, **KW)["onprem-a"]
    assert est.seconds is None and est.basis.startswith("no history")


def test_an_unreachable_cluster_has_no_estimate_and_says_its_load_is_unknown():
    loads = {"cloud-east": ClusterLoad.unknown("cloud-east", 32, "API server timed out after 5 s")}
    est = estimate_waits(waits("cloud-east", 4, *[60] * 10), loads, 4, **KW)["cloud-east"]
    assert est.seconds is None and est.samples == 0
    assert est.basis == "load of cloud-east unknown (API server timed out after 5 s): its wait cannot be estimated"


def test_too_few_waits_of_gangs_of_about_that_size_is_no_estimate():
    history = [*waits("onprem-a", 4, 60, 120, 180, 240), *waits("onprem-a", 1, 5, 5, 5),
               *waits("onprem-b", 4, 9, 9, 9)]
    est = estimate_waits(history, {"onprem-a": busy("onprem-a")}, 4, **KW)["onprem-a"]
    assert est == WaitEstimate(
        "onprem-a", None, "no history: only 4 waits of 2-8 GPU gangs on onprem-a in the last 30 days (needs 5)",
        samples=4)


def test_the_quantile_of_waits_of_half_to_twice_the_size_on_that_cluster():
    history = [
        # In the window for 5 GPUs (3-10): ten waits of 1..10 min.
        *waits("onprem-a", 3, 60, 120, 180), *waits("onprem-a", 5, 240, 300, 360, 420),
        *waits("onprem-a", 10, 480, 540, 600),
        # Outside it: smaller and larger gangs, and another cluster.
        *waits("onprem-a", 2, 99_999), *waits("onprem-a", 11, 99_999), *waits("onprem-b", 5, *[1] * 10),
    ]
    loads = {"onprem-a": busy("onprem-a"), "onprem-b": busy("onprem-b")}
    est = estimate_waits(history, loads, 5, **KW)
    # p80 of 60..600: rank 0.8 * 9 = 7.2, between 480 and 540.
    assert est["onprem-a"] == WaitEstimate(
        "onprem-a", pytest.approx(492.0), "p80 of 10 waits of 3-10 GPU gangs on onprem-a in the last 30 days: 8 min",
        samples=10)
    assert est["onprem-b"].seconds == 1.0 and est["onprem-b"].samples == 10


def test_every_cluster_of_the_loads_gets_an_estimate_and_others_in_the_history_none():
    loads = {"onprem-a": ClusterLoad(cluster="onprem-a", capacity=8), "cloud-east": busy("cloud-east")}
    est = estimate_waits(waits("onprem-z", 2, *[60] * 10), loads, 2, quantile=0.5, min_samples=1, days=7)
    assert set(est) == {"onprem-a", "cloud-east"}
    assert est["cloud-east"].basis == "no history: only 0 waits of 1-4 GPU gangs on cloud-east in the last 7 days (needs 1)"


def test_a_one_gpu_gang_compares_with_one_and_two_gpu_gangs():
    history = waits("onprem-a", 1, 10, 20) + waits("onprem-a", 2, 30) + waits("onprem-a", 3, 1000)
    est = estimate_waits(history, {"onprem-a": busy("onprem-a")}, 1, quantile=0.95, min_samples=3, days=30)
    assert est["onprem-a"].samples == 3 and est["onprem-a"].seconds == pytest.approx(29.0)
    assert est["onprem-a"].basis.startswith("p95 of 3 waits of 1-2 GPU gangs on onprem-a")


@pytest.mark.parametrize("bad", [dict(gpus=0), dict(quantile=0), dict(quantile=1.5), dict(min_samples=0)])
def test_estimates_refuse_arguments_that_make_no_sense(bad):
    args = dict(gpus=4, **KW) | bad
    with pytest.raises(ValueError):
        estimate_waits([], {}, args.pop("gpus"), **args)


def test_quantile_interpolates_between_ranks():
    assert quantile_of([5.0], 0.8) == 5.0
    assert quantile_of([40, 10, 30, 20], 0.5) == 25.0
    assert quantile_of([10, 20, 30, 40], 1.0) == 40.0
    assert quantile_of([10, 20, 30, 40], 0.0) == 10.0
    assert quantile_of([0, 100], 0.8) == pytest.approx(80.0)
    with pytest.raises(ValueError):
        quantile_of([], 0.5)


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0 s"), (45.4, "45 s"), (59.7, "1 min"), (840, "14 min"), (3599, "1 h"), (3600, "1 h"),
    (5400, "1 h 30 min"), (30 * 3600, "30 h"),
])
def test_durations_read_as_seconds_minutes_or_hours(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize(("text", "seconds"), [
    ("90s", 90), ("45m", 2700), ("2h", 7200), ("1h30m", 5400), ("1h 30m", 5400), ("1d", 86_400),
    ("1d2h", 93_600), ("2H", 7200), ("1.5h", 5400), (" 30m ", 1800), ("1h0m5s", 3605),
    (90, 90), (1.5, 1.5), ("600", 600), ("0.5", 0.5),
    ("PT2H", 7200), ("P1DT2H", 93_600), ("PT1M", 60), ("pt30m", 1800), ("P1W", 7 * 86_400),
])
def test_start_by_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", [
    "", "  ", "soon", "2 hours", "1h30", "30m1h", "h", "-2h", "-PT2H", "0", "0s", "PT0S", -5, 0, True, None,
    "nan", "inf", "P1M", "P1Y", "P", "2026-12-01T10:00", "1:30:00",
])
def test_anything_else_is_refused_naming_what_is_accepted(text):
    with pytest.raises(ValueError, match=r"start_by must be a positive duration such as 2h, 90m, 1h30m or PT2H; got"):
        parse_duration(text)
