"""Two Airflow instances sharing a cluster never reap each other's gangs: each gang carries the
identity of the instance that made it (``HYBRIDFLOW_INSTANCE``, else derived from the metadata
database), and a sweep judges only its own instance's gangs. Another instance's, and those naming
none (made before identities were recorded), are left alone and reported with the fix."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from tests.support.reaper_states import RunStates, train_owner

from hybridflow.backends.base import GangJob, instance_identity
from hybridflow.backends.local import LocalGangBackend
from hybridflow.errors import ConfigError
from hybridflow.reaper.base import Finder, Leftover, Owner
from hybridflow.reaper.gangs import GangFinder
from hybridflow.reaper.liveness import ENDED
from hybridflow.reaper.serial import sweep_from_dict, sweep_to_dict
from hybridflow.reaper.sweep import sweep
from hybridflow.reaper.task import record

MINE, OTHER = "airflow-here", "airflow-there"
NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def test_the_instance_is_the_setting_else_the_execution_api_its_workers_report_to(monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_INSTANCE", "prod-eu")
    assert instance_identity() == "prod-eu"
    monkeypatch.delenv("HYBRIDFLOW_INSTANCE")
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTION_API_SERVER_URL", "http://airflow-a:8080/execution/")
    derived = instance_identity()
    assert derived.startswith("airflow-") and len(derived) == len("airflow-") + 12
    # Every worker of the deployment agrees, whatever the case of the host or a trailing slash.
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTION_API_SERVER_URL", "http://Airflow-A:8080/execution")
    assert instance_identity() == derived
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTION_API_SERVER_URL", "http://airflow-b:8080/execution/")
    assert instance_identity() != derived  # another deployment's API server
    # Unset, it is Airflow's own default: [api] base_url + /execution/.
    monkeypatch.delenv("AIRFLOW__CORE__EXECUTION_API_SERVER_URL")
    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "http://airflow-b:8080")
    assert instance_identity() != derived


def test_a_task_process_without_database_access_gets_the_same_instance(monkeypatch):
    """Airflow 3 replaces the metadata database's URL in every task process (the train task labels
    gangs there, the reaper task judges them there) with one that names no database."""
    monkeypatch.delenv("HYBRIDFLOW_INSTANCE", raising=False)
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTION_API_SERVER_URL", "http://airflow-a:8080/execution/")
    outside = instance_identity()
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "airflow-db-not-allowed:///")
    monkeypatch.setenv("AIRFLOW__CORE__SQL_ALCHEMY_CONN", "airflow-db-not-allowed:///")
    assert instance_identity() == outside


@pytest.mark.parametrize("value", ["prod eu", "-prod", "x" * 64, "prod/eu"])
def test_an_instance_that_cannot_be_a_label_value_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("HYBRIDFLOW_INSTANCE", value)
    with pytest.raises(ConfigError, match=r"^HYBRIDFLOW_INSTANCE=.* cannot name an Airflow instance on a gang .*"
                                          r"use at most 63 letters, digits"):
        instance_identity()


class ListFinder(Finder):
    place = "a"

    def __init__(self, leftovers):
        self.leftovers, self.released = leftovers, []

    def find(self, now):
        return list(self.leftovers)

    def release(self, leftover):
        self.released.append(leftover.name)


def test_a_sweep_reports_what_it_may_not_judge_and_never_touches_it(monkeypatch):
    owner = Owner("hybrid_training", "done", "train", 1)
    theirs = Leftover("a", "gang-job", "g-theirs", owner=Owner("hybrid_training", "not-in-this-db", "train", 1),
                      skip="was made by Airflow instance airflow-there, not by this one (airflow-here)")
    finder = ListFinder([Leftover("a", "gang-job", "g-mine", owner=owner), theirs])
    done = sweep([finder], RunStates({"done": ENDED}), dry_run=lambda _: False, now=NOW, clock=lambda: NOW, key="k")
    assert finder.released == ["g-mine"] and done.kept == 0  # the other one was never judged (no verdict for it)
    assert [(lo.name, lo.skip) for lo in done.skipped] == [("g-theirs", theirs.skip)]
    body = sweep_to_dict(done)
    assert body["skipped"] == [{"place": "a", "kind": "gang-job", "name": "g-theirs", "skip": theirs.skip}]
    assert sweep_to_dict(sweep_from_dict(body)) == body
    monkeypatch.setattr("hybridflow.reaper.records.record_sweep", lambda sweep, key: None)
    assert record(body)["other_instances"] == 1


def _hold(backend, monkeypatch, name: str, instance: str, *, queue: bool = False) -> None:
    monkeypatch.setenv("HYBRIDFLOW_INSTANCE", instance)
    admitted = backend.admit_step(GangJob(name=name, workers=2 if queue else 1, spec={}, owner=train_owner(name)))
    assert admitted is not queue


def test_a_local_sweep_releases_only_its_own_instance_s_gangs(tmp_path, monkeypatch):
    backend = LocalGangBackend(tmp_path / "state", "onprem-a", capacity=4)
    _hold(backend, monkeypatch, "train-mine", MINE)
    _hold(backend, monkeypatch, "train-theirs", OTHER)
    _hold(backend, monkeypatch, "train-legacy", MINE)
    _hold(backend, monkeypatch, "train-theirs-queued", OTHER, queue=True)
    legacy = backend.owner_path("train-legacy")
    legacy.write_text(json.dumps(train_owner("train-legacy")))  # as written before instances were recorded
    assert json.loads(backend.owner_path("train-theirs").read_text()) == {**train_owner("train-theirs"),
                                                                           "instance": OTHER}
    monkeypatch.setenv("HYBRIDFLOW_INSTANCE", MINE)
    finder = GangFinder(backend)
    states = RunStates(dict.fromkeys(("train-mine", "train-theirs", "train-legacy", "train-theirs-queued"), ENDED))

    done = sweep([finder], states, dry_run=lambda _: False, now=NOW, clock=lambda: NOW)
    assert [(r.leftover.name, r.released) for r in done.releases] == [("train-mine", True)]
    skipped = {lo.name: lo.skip for lo in done.skipped}
    assert skipped == {
        "train-theirs": "was made by Airflow instance airflow-there, not by this one (airflow-here): that "
                        "instance's reaper judges it",
        "train-theirs-queued": skipped["train-theirs"],
        "train-legacy": "names no Airflow instance (made before instances were recorded, or by hand); add "
                        f'"instance": "airflow-here" to {legacy} for this instance\'s reaper to judge it'}
    assert set(backend.pool.holdings()) == {"train-theirs", "train-legacy"}
    assert set(backend.pool.waiting()) == {"train-theirs-queued"}

    # The fix it names hands the old gang to this instance.
    legacy.write_text(json.dumps({**train_owner("train-legacy"), "instance": MINE}))
    again = sweep([finder], states, dry_run=lambda _: False, now=NOW, clock=lambda: NOW)
    assert [r.leftover.name for r in again.releases] == ["train-legacy"] and len(again.skipped) == 2
    assert set(backend.pool.holdings()) == {"train-theirs"}
