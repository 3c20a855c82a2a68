"""Private capacity kept for work that may run only there: while such work waits on a private cluster
or is expected there (the ledger saw some admitted there lately), a run that a public cluster would
take leaves the kept GPUs free, and the rule says why per candidate."""

from __future__ import annotations

import dataclasses
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from tests.unit.test_local_backend import _in_thread
from tests.unit.test_local_backend import fake_worker as fake_worker  # noqa: PLC0414 - the fixture
from tests.unit.test_placement import SPOT, candidate, custom_estate

from hybridflow.admission import admit
from hybridflow.backends.base import ClusterLoad
from hybridflow.backends.local import LocalSlotPool
from hybridflow.config import load_estate
from hybridflow.errors import ConfigError
from hybridflow.placement import choose_cluster
from hybridflow.placement.reserve import last_private_only_arrivals, private_only, reservations
from hybridflow.placement.rules import place
from hybridflow.settings import REPO_ROOT


@pytest.fixture(scope="module")
def estate():
    return load_estate(REPO_ROOT / "config", use_cache=False)


@pytest.fixture
def run_for(estate, seeded_private: Path):
    return lambda estate_=None, **params: admit(params, estate_ or estate, seeded_private)


@pytest.fixture
def no_moves(tmp_path):
    """The shipped estate with placement.reservation.move_budget 0: interruptible runs are never moved,
    so they leave the kept GPUs free too (cloud-east's A100s, the only public ones, are spot only)."""
    def never(clusters: dict, projects: dict, pipeline: dict) -> None:
        pipeline["placement"]["reservation"] = {"move_budget": 0}

    return custom_estate(tmp_path, never)


def _loads(estate, **private_only_queued) -> dict:
    return {name: ClusterLoad(name, c.total_gpus, private_only_queued=private_only_queued.get(name.replace("-", "_"), 0))
            for name, c in estate.clusters.items()}


def test_a_run_that_may_run_public_leaves_the_kept_gpus_to_restricted_work_waiting_there(no_moves, run_for) -> None:
    estate = no_moves
    kept = reservations(estate, _loads(estate, onprem_a=2), {})
    assert kept["onprem-a"].kept == 4 and "2 GPUs of work that may run only on private clusters wait" in kept["onprem-a"].why
    d = choose_cluster(run_for(estate, **SPOT), estate, {}, reservations=kept)
    assert d.cluster == "cloud-east"  # private first by the spill rule, but its GPUs are kept
    why = candidate(d, "onprem-a")["rules"]["reservation"]
    assert "4 of 4 GPUs are kept for work that may run only on private clusters" in why
    assert "this run may run on cloud-east" in why and "placement.reservation.share" in why
    assert not candidate(d, "onprem-a")["eligible"]
    # The run's page says so, next to the other rules.
    from hybridflow.ui.runs import render_placement

    page = render_placement(d.to_xcom())
    assert "4 of 4 GPUs are kept for work that may run only on private clusters" in page
    # Without the reservation the same run goes private first.
    assert choose_cluster(run_for(estate, **SPOT), estate, {}).cluster == "onprem-a"


def test_an_interruptible_run_may_use_the_kept_gpus_since_it_can_be_moved_off(estate, run_for) -> None:
    kept = reservations(estate, _loads(estate, onprem_a=2), {})
    assert kept["onprem-a"].move_budget == 1
    d = choose_cluster(run_for(**SPOT), estate, {}, reservations=kept)
    assert d.cluster == "onprem-a" and candidate(d, "onprem-a")["rules"]["reservation"] == "pass"


def test_work_that_may_run_only_on_private_clusters_is_never_turned_away(estate, run_for) -> None:
    kept = reservations(estate, _loads(estate, onprem_a=2), {})
    restricted = run_for(classification="restricted", **SPOT)
    assert private_only(restricted, estate)
    d = choose_cluster(restricted, estate, {}, reservations=kept)
    assert d.cluster == "onprem-a" and candidate(d, "onprem-a")["rules"]["reservation"] == "pass"
    # A run no public cluster would take (cloud-east's A100s are spot only) keeps its private cluster too.
    on_demand = run_for()
    assert not private_only(on_demand, estate)
    assert choose_cluster(on_demand, estate, {}, reservations=kept).cluster == "onprem-a"
    # So does a run that asked for private clusters: it queues there like restricted work.
    assert choose_cluster(run_for(cluster_preference="private", **SPOT), estate, {},
                          reservations=kept).cluster == "onprem-a"


def test_a_share_below_one_leaves_the_rest_to_anyone(tmp_path, run_for) -> None:
    def half(clusters: dict, projects: dict, pipeline: dict) -> None:
        pipeline["placement"]["reservation"] = {"share": 0.5, "move_budget": 0}

    estate = custom_estate(tmp_path, half)
    kept = reservations(estate, _loads(estate, onprem_a=2), {})
    assert kept["onprem-a"].kept == 2
    assert choose_cluster(run_for(estate, workers=2, **SPOT), estate, {}, reservations=kept).cluster == "onprem-a"
    assert choose_cluster(run_for(estate, workers=2, **SPOT), estate, {"onprem-a": 1},
                          reservations=kept).cluster == "cloud-east"


def test_work_admitted_lately_is_expected_and_keeps_the_gpus_from_the_ledger(run_for, tmp_path, monkeypatch) -> None:
    from hybridflow.ledger.queue_waits import record_queue_wait

    def a_day(clusters: dict, projects: dict, pipeline: dict) -> None:
        pipeline["placement"]["reservation"] = {"move_budget": 0, "expect_within_h": 24}

    estate = custom_estate(tmp_path, a_day)
    monkeypatch.setenv("HYBRIDFLOW_LEDGER_URL", f"sqlite:///{tmp_path / 'ledger.db'}")
    now = datetime.now(UTC)
    assert last_private_only_arrivals(estate) == {}
    record_queue_wait("r-old", "try-1", "onprem-a", 2, "normal", now - timedelta(hours=30),
                      now - timedelta(hours=29), "admitted", private_only=True)
    record_queue_wait("r-internal", "try-1", "onprem-a", 2, "normal", now - timedelta(hours=1),
                      now - timedelta(minutes=50), "admitted")
    assert last_private_only_arrivals(estate) == {}  # 30 h ago is past expect_within_h 24; the other may run public
    loads = _loads(estate)
    assert place(run_for(estate, **SPOT), estate, loads).cluster == "onprem-a"
    record_queue_wait("r-new", "try-1", "onprem-a", 2, "normal", now - timedelta(hours=2),
                      now - timedelta(hours=1), "admitted", private_only=True)
    assert set(last_private_only_arrivals(estate)) == {"onprem-a"}
    d = place(run_for(estate, **SPOT), estate, loads)
    assert d.cluster == "cloud-east"
    assert "is expected (some was admitted here 2.0 h ago" in candidate(d, "onprem-a")["rules"]["reservation"]


def test_no_ledger_yet_is_no_expectation_and_is_not_created_by_placing(estate, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HYBRIDFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HYBRIDFLOW_LEDGER_URL", raising=False)
    assert last_private_only_arrivals(estate) == {}
    assert not (tmp_path / "home" / "ledger").exists()


def test_a_waiting_ticket_says_whether_its_gang_may_run_only_on_private_clusters(tmp_path) -> None:
    pool = LocalSlotPool(tmp_path, "onprem-a", 4)
    assert pool.try_acquire("holder", 4)
    assert not pool.try_acquire("restricted", 2, queue=True, private_only=True)
    assert not pool.try_acquire("internal", 1, queue=True)
    pool.keep_ticket("deferred", 1, since=0.0, keep_s=60, private_only=True)
    load = pool.load()
    assert load.queued == 4 and load.private_only_queued == 3


@pytest.mark.parametrize(("reservation", "key"), [
    ({"share": 1.5}, "share"), ({"share": -0.1}, "share"), ({"expect_within_h": -1}, "expect_within_h"),
    ({"shares": 0.5}, "shares"),
])
def test_a_reservation_out_of_range_is_refused_naming_the_key(tmp_path, reservation: dict, key: str) -> None:
    def bad(clusters: dict, projects: dict, pipeline: dict) -> None:
        pipeline["placement"]["reservation"] = reservation

    with pytest.raises(ConfigError) as info:
        custom_estate(tmp_path, bad)
    assert f"placement.reservation.{key}" in str(info.value)


def _gang(name: str, worker, *, seconds: float = 30, private_only: bool = False, movable: bool = False):
    from hybridflow.backends.base import GangJob

    return GangJob(name=name, workers=2, spec={}, env=worker(seconds),
                   labels={"team": "vision", "priority": "normal", "private_only": str(private_only).lower(),
                           "movable": str(movable).lower()})


def test_work_that_may_run_only_here_moves_a_movable_gang_which_checkpoints_first(tmp_path, fake_worker) -> None:
    from hybridflow.backends.errors import GangMoved
    from hybridflow.backends.local import LocalGangBackend

    backend = LocalGangBackend(tmp_path / "state", "onprem-a", 2, grace_s=5, poll_s=0.05)
    movable = backend.submit(_gang("train-internal", fake_worker, movable=True))
    while backend.poll(movable).phase != "running":
        time.sleep(0.05)
    restricted = _in_thread(lambda: backend.run(_gang("train-restricted", fake_worker, seconds=0.5, private_only=True),
                                                admission_timeout_s=20, log=lambda _: None))
    status = _poll_until_end(backend, movable)
    assert status.phase == "preempted" and "making room on onprem-a for gang train-restricted" in status.message
    assert isinstance(movable.state.error, GangMoved) and "which may run only on private clusters" in \
        movable.state.error.reason
    thread, out = restricted
    thread.join(timeout=30)
    assert "error" not in out and out["result"].exit_codes == [0, 0]


def test_a_gang_that_is_not_movable_is_never_moved(tmp_path, fake_worker) -> None:
    from hybridflow.backends.errors import GangNotAdmitted
    from hybridflow.backends.local import LocalGangBackend

    backend = LocalGangBackend(tmp_path / "state", "onprem-a", 2, grace_s=5, poll_s=0.05)
    pinned = backend.submit(_gang("train-on-demand", fake_worker, movable=False))
    try:
        while backend.poll(pinned).phase != "running":
            time.sleep(0.05)
        with pytest.raises(GangNotAdmitted):
            backend.run(_gang("train-restricted", fake_worker, seconds=0.5, private_only=True),
                        admission_timeout_s=1.5, log=lambda _: None)
        assert backend.poll(pinned).phase == "running"
        assert backend.admission(_gang("train-restricted", fake_worker, private_only=True)) is None
    finally:
        backend.close(pinned)


def _poll_until_end(backend, handle, polls: int = 400):
    for _ in range(polls):
        status = backend.poll(handle)
        if status.terminal:
            return status
        time.sleep(0.05)
    raise AssertionError("the gang did not end")


def test_on_a_kubernetes_private_cluster_interruptible_runs_use_the_kept_gpus_too(tmp_path, run_for,
                                                                                 monkeypatch) -> None:
    """Its backend moves a gang off too (its scheduler stops the job after the checkpoint), so an
    interruptible run may use the kept GPUs there; with no move budget it may not."""
    def kubernetes(clusters: dict, projects: dict, pipeline: dict) -> None:
        clusters["clusters"]["onprem-a"].update(
            backend="kubernetes", conn_id="k8s_onprem", scheduler="volcano", image="registry.example/trainer:1",
            cache={"conn_id": "onprem_cache", "bucket": "onprem-cache"}, checkpoint_store="cache",
            checkpoint_replica="scratch", scratch_claim="onprem-scratch", scratch_dir="/scratch")
        clusters["clusters"]["onprem-a"]["node_pools"][0]["node_labels"] = {"hybridflow.io/pool": "a100"}

    from hybridflow import conncheck

    monkeypatch.setattr(conncheck, "probe", lambda cluster, timeout_s: None)  # its Connection answers
    estate = custom_estate(tmp_path, kubernetes)
    kept = reservations(estate, _loads(estate, onprem_a=2), {})
    assert kept["onprem-a"].move_budget == 1
    d = choose_cluster(run_for(estate, **SPOT), estate, {}, reservations=kept)
    assert d.cluster == "onprem-a" and candidate(d, "onprem-a")["rules"]["reservation"] == "pass"
    spent = {"onprem-a": dataclasses.replace(kept["onprem-a"], move_budget=0)}  # as with move_budget: 0
    d = choose_cluster(run_for(estate, **SPOT), estate, {}, reservations=spent)
    assert d.cluster == "cloud-east" and "GPUs are kept" in candidate(d, "onprem-a")["rules"]["reservation"]
