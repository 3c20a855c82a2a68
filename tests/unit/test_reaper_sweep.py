"""The reaper's judgement and sweep: a thing whose owner is alive in any state is never released, one
whose run or task ended is (or only listed in dry-run), a place that cannot be swept is an error of
the sweep and not of the others, and bad reaper config is refused by name."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from tests.unit.test_config import broken_copy

from hybridflow.config import load_estate
from hybridflow.errors import ConfigError
from hybridflow.reaper.base import Finder, Leftover, Owner
from hybridflow.reaper.liveness import ALIVE, ENDED, NO_TASK_INSTANCE, RUN_GONE, UNKNOWN, UNREAD, verdict
from hybridflow.reaper.serial import sweep_from_dict, sweep_to_dict
from hybridflow.reaper.states import AirflowStates, Judgement
from hybridflow.reaper.sweep import sweep
from hybridflow.settings import REPO_ROOT

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
ALIVE_TASK = [None, "scheduled", "queued", "running", "deferred", "up_for_retry", "up_for_reschedule", "restarting",
              "awaiting_input"]
ENDED_TASK = ["success", "failed", "skipped", "upstream_failed", "removed"]


@pytest.mark.parametrize("run_state", ["queued", "running"])
@pytest.mark.parametrize("task_state", ALIVE_TASK)
def test_a_live_task_of_a_live_run_is_alive(run_state, task_state):
    assert verdict(run_state, task_state) == ALIVE


@pytest.mark.parametrize("task_state", ENDED_TASK)
def test_a_finished_task_has_ended_even_while_its_run_goes_on(task_state):
    assert verdict("running", task_state) == ENDED


@pytest.mark.parametrize("run_state", ["success", "failed", RUN_GONE])
@pytest.mark.parametrize("task_state", [*ALIVE_TASK, *ENDED_TASK])
def test_a_finished_or_vanished_run_has_ended(run_state, task_state):
    assert verdict(run_state, task_state) == ENDED


@pytest.mark.parametrize(("run_state", "task_state"), [
    (UNREAD, None), ("running", UNREAD), ("running", NO_TASK_INSTANCE), ("running", "some_new_state"),
    ("some_new_state", "running"),
])
def test_doubt_is_unknown_and_never_ended(run_state, task_state):
    assert verdict(run_state, task_state) == UNKNOWN


def test_a_whole_run_thing_lives_as_long_as_its_run():
    assert verdict("running", None, whole_run=True) == ALIVE
    assert verdict("success", None, whole_run=True) == ENDED


class FakeTI:
    """The Task SDK calls the reaper makes, over a table of (dag_id, run_id) -> (run state, task states)."""

    def __init__(self, runs: dict, broken: bool = False) -> None:
        self.runs, self.broken, self.calls = runs, broken, 0

    def get_dr_count(self, dag_id, run_ids):
        self.calls += 1
        if self.broken:
            raise ConnectionError("api server gone")
        return int((dag_id, run_ids[0]) in self.runs)

    def get_dagrun_state(self, dag_id, run_id):
        return self.runs[(dag_id, run_id)][0]

    def get_task_states(self, dag_id, run_ids):
        return {run_ids[0]: self.runs[(dag_id, run_ids[0])][1]}


def test_states_are_read_once_per_run_and_unreadable_ones_keep_the_thing():
    ti = FakeTI({("d", "r1"): ("running", {"train": "deferred"}), ("d", "r2"): ("running", {"train": "failed"})})
    states = AirflowStates(ti)
    assert states.judge(Owner("d", "r1", "train", 1)).verdict == ALIVE
    assert states.judge(Owner("d", "r1", "train", 2)).verdict == ALIVE
    assert ti.calls == 1
    assert states.judge(Owner("d", "r2", "train", 1)).verdict == ENDED
    assert states.judge(Owner("d", "gone", "train", 1)).verdict == ENDED
    assert states.judge(Owner("d", "r1", "other", 1)).verdict == UNKNOWN  # no such task instance
    assert AirflowStates(FakeTI({}, broken=True)).judge(Owner("d", "r1", "train")).verdict == UNKNOWN


class ListFinder(Finder):
    def __init__(self, place, leftovers, fail_find=False, fail_release=()):
        self.place, self.leftovers, self.fail_find, self.fail_release = place, leftovers, fail_find, fail_release
        self.released: list[str] = []

    def find(self, now):
        if self.fail_find:
            raise TimeoutError("the API server did not answer")
        return list(self.leftovers)

    def release(self, leftover):
        if leftover.name in self.fail_release:
            raise PermissionError("forbidden")
        self.released.append(leftover.name)


class TableStates:
    def __init__(self, verdicts: dict[str, str]) -> None:
        self.verdicts = verdicts

    def judge(self, owner):
        return Judgement(self.verdicts[owner.run_id], NOW - timedelta(hours=2), owner.run_id)


def _gang(place, name, run_id, gpus=4):
    return Leftover(place, "local-gang", name, owner=Owner("hybrid_training", run_id, "train", 1), gpus=gpus,
                    since=NOW - timedelta(hours=10))


def test_sweep_releases_only_what_ended_lists_in_dry_run_and_survives_a_broken_place():
    live = ListFinder("a", [_gang("a", "g-live", "live"), _gang("a", "g-doubt", "doubt"), _gang("a", "g-done", "done"),
                            Leftover("a", "gang-pod", "stray", reason="its gang job is gone"),
                            Leftover("a", "gang-secret", "no-owner")])
    dry = ListFinder("b", [_gang("b", "g-done-b", "done")])
    broken = ListFinder("c", [], fail_find=True)
    failing = ListFinder("d", [_gang("d", "g-stuck", "done")], fail_release={"g-stuck"})
    states = TableStates({"live": ALIVE, "doubt": UNKNOWN, "done": ENDED})
    done = sweep([live, dry, broken, failing], states, dry_run=lambda place: place == "b", now=NOW,
                 clock=lambda: NOW, key="k")
    assert sorted(live.released) == ["g-done", "stray"] and dry.released == [] and failing.released == []
    assert done.kept == 3  # live, doubt, and the Secret without an owner or a reason
    by_name = {r.leftover.name: r for r in done.releases}
    assert by_name["g-done"].released and by_name["g-done"].gpu_hours == pytest.approx(8.0)  # 4 GPUs x 2 h since end
    assert by_name["g-done-b"].dry_run and not by_name["g-done-b"].released
    assert by_name["g-stuck"].error.startswith("PermissionError") and not by_name["g-stuck"].released
    assert list(done.errors) == ["c"] and "did not answer" in done.errors["c"]
    assert sweep_to_dict(sweep_from_dict(sweep_to_dict(done))) == sweep_to_dict(done)


def test_reaper_config_refuses_an_unknown_cluster_and_a_negative_age(tmp_path):
    def unknown(data):
        data["reaper"] = {"clusters": {"onprem-z": {"dry_run": False}}}

    with pytest.raises(ConfigError) as info:
        load_estate(broken_copy(tmp_path / "a", "pipeline.yaml", unknown), use_cache=False)
    assert "reaper.clusters.onprem-z: no such cluster in clusters.yaml" in str(info.value)
    assert "onprem-a" in str(info.value)
    for key in ("multipart_max_age_h", "scratch_keep_h"):
        def negative(data, key=key):
            data["reaper"] = {key: -1}

        with pytest.raises(ConfigError) as info:
            load_estate(broken_copy(tmp_path / key, "pipeline.yaml", negative), use_cache=False)
        assert f"reaper.{key}: Input should be greater than" in str(info.value)
        assert "(got -1); change the value in pipeline.yaml" in str(info.value)


def test_dry_run_is_per_cluster(tmp_path):
    def mutate(data):
        data["reaper"] = {"dry_run": True, "clusters": {"onprem-a": {"dry_run": False}}}

    reaper = load_estate(broken_copy(tmp_path, "pipeline.yaml", mutate), use_cache=False).pipeline.reaper
    assert not reaper.dry_run_for("onprem-a") and reaper.dry_run_for("cloud-east")
    shipped = load_estate(REPO_ROOT / "config").pipeline.reaper
    assert shipped.schedule == "@hourly" and all(shipped.dry_run_for(c) for c in ("onprem-a", "cloud-east"))
