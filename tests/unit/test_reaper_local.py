"""The reaper on a local cluster: a gang whose task ended is stopped for good (its launcher fails
with GangStopped instead of relaunching it) and a stale slot holding is given back, while a live
run's gang keeps running; dry-run lists the same and changes nothing."""

from __future__ import annotations

import json
import signal
import time
from datetime import UTC, datetime
from pathlib import Path

from tests.unit.test_local_backend import _in_thread, _wait_for, fake_worker  # noqa: F401 - fixture

from hybridflow.backends.base import GangJob
from hybridflow.backends.errors import GangStopped
from hybridflow.backends.local import LocalGangBackend
from hybridflow.reaper.gangs import GangFinder
from hybridflow.reaper.liveness import ALIVE, ENDED
from hybridflow.reaper.states import Judgement
from hybridflow.reaper.sweep import sweep


def _owner(run_id: str) -> dict[str, str]:
    return {"dag_id": "hybrid_training", "run_id": run_id, "task_id": "train", "try_number": "1"}


def _handles_sigterm(backend: LocalGangBackend, name: str) -> bool:
    """Every worker of gang ``name`` has its SIGTERM handler installed (it checkpoints and exits 75)."""
    record = json.loads((backend.job_dir(name) / "running.json").read_text())
    for worker in record["workers"]:
        status = Path(f"/proc/{worker['pid']}/status").read_text()
        caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
        if not caught & (1 << (signal.SIGTERM - 1)):
            return False
    return True


class RunStates:
    def __init__(self, verdicts):
        self.verdicts = verdicts

    def judge(self, owner):
        return Judgement(self.verdicts[owner.run_id], None, owner.run_id)


def test_local_gangs_and_holdings_of_ended_runs_are_released_and_live_ones_kept(tmp_path, fake_worker):  # noqa: F811
    backend = LocalGangBackend(tmp_path / "state", "onprem-a", capacity=4, grace_s=2, poll_s=0.05)
    runs = {name: _in_thread(lambda name=name: backend.run(
        GangJob(name=f"train-{name}", workers=1, spec={}, env=fake_worker(30), owner=_owner(name)),
        admission_timeout_s=10, log=lambda _: None)) for name in ("done", "live")}
    try:
        _wait_for(lambda: {g["name"] for g in backend.running_gangs()} == {"train-done", "train-live"})
        _wait_for(lambda: _handles_sigterm(backend, "train-done"))
        assert backend.admit_step(GangJob(name="train-held", workers=1, spec={}, owner=_owner("held")))
        finder = GangFinder(backend)
        states = RunStates({"done": ENDED, "live": ALIVE, "held": ENDED})
        now = datetime.now(UTC)

        dry = sweep([finder], states, dry_run=lambda _: True, now=now, clock=lambda: now)
        assert sorted((r.leftover.kind, r.leftover.name) for r in dry.releases) == [
            ("local-gang", "train-done"), ("slot-holding", "train-held")]
        assert not any(r.released for r in dry.releases) and dry.kept == 1
        assert len(backend.running_gangs()) == 2 and "train-held" in backend.pool.holdings()

        done = sweep([finder], states, dry_run=lambda _: False, now=now, clock=lambda: now)
        assert all(r.released and r.leftover.gpus == 1 for r in done.releases) and done.kept == 1
        thread, out = runs["done"]
        thread.join(10)
        assert isinstance(out.get("error"), GangStopped), out  # stopped for good, not relaunched
        assert [g["name"] for g in backend.running_gangs()] == ["train-live"]
        assert set(backend.pool.holdings()) == {"train-live"}
        again = sweep([finder], states, dry_run=lambda _: False, now=now, clock=lambda: now)
        assert again.releases == [] and again.kept == 1  # a second sweep finds nothing more to do
    finally:
        backend.cancel("train-live")
        for thread, _ in runs.values():
            thread.join(10)
        backend.pool.release("train-held")


def test_a_gang_without_an_owner_is_kept(tmp_path, fake_worker):  # noqa: F811
    backend = LocalGangBackend(tmp_path / "state", "onprem-a", capacity=2, grace_s=2, poll_s=0.05)
    thread, _ = _in_thread(lambda: backend.run(GangJob(name="by-hand", workers=1, spec={}, env=fake_worker(30)),
                                               admission_timeout_s=10, log=lambda _: None))
    try:
        _wait_for(lambda: backend.running_gangs())
        now = datetime.now(UTC)
        done = sweep([GangFinder(backend)], RunStates({}), dry_run=lambda _: False, now=now, clock=lambda: now)
        assert done.releases == [] and done.kept == 1
        time.sleep(0.1)
        assert backend.running_gangs()
    finally:
        backend.cancel("by-hand")
        thread.join(10)


def test_queue_tickets_of_ended_runs_are_withdrawn_and_live_ones_kept(tmp_path):
    """A gang's ticket keeps its place in the queue while its task waits (in the task or in the
    triggerer); one left by a task that ended holds back every gang behind it, even in an empty pool."""
    backend = LocalGangBackend(tmp_path / "state", "onprem-a", capacity=4)
    assert backend.pool.try_acquire("busy", 4)
    for run_id in ("done", "live"):
        assert not backend.admit_step(GangJob(name=f"train-{run_id}", workers=4, spec={}, owner=_owner(run_id)))
    backend.pool.release("busy")
    small = GangJob(name="train-small", workers=1, spec={})
    assert not backend.pool.try_acquire(small.name, small.workers)  # the pool is empty, yet it waits
    finder = GangFinder(backend)
    states = RunStates({"done": ENDED, "live": ALIVE})
    now = datetime.now(UTC)

    dry = sweep([finder], states, dry_run=lambda _: True, now=now, clock=lambda: now)
    assert [(r.leftover.kind, r.leftover.name, r.leftover.gpus) for r in dry.releases] == [
        ("queue-ticket", "train-done", 0)]
    assert dry.kept == 1 and set(backend.pool.waiting()) == {"train-done", "train-live"}

    done = sweep([finder], states, dry_run=lambda _: False, now=now, clock=lambda: now)
    assert [r.released for r in done.releases] == [True]
    assert set(backend.pool.waiting()) == {"train-live"}
    again = sweep([finder], states, dry_run=lambda _: False, now=now, clock=lambda: now)
    assert again.releases == [] and again.kept == 1
    finder.release(done.releases[0].leftover)  # withdrawn twice: harmless
    assert set(backend.pool.waiting()) == {"train-live"}
