"""Local gang backend without training: slot admission, reclaiming, process supervision."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hybridflow.backends.local import (
    GangJob,
    LocalGangBackend,
    LocalSlotPool,
    _die_with_parent,
    pid_alive,
)
from hybridflow.errors import GangError


def _wait_for(predicate, timeout=10.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def test_gang_is_all_or_nothing(tmp_path):
    pool = LocalSlotPool(tmp_path, "onprem-a", capacity=4)
    assert pool.try_acquire("job-a", 3)
    assert not pool.try_acquire("job-b", 2)  # only 1 free: no partial grant
    assert pool.usage() == 3
    assert "job-b" not in pool.holdings()
    assert pool.try_acquire("job-c", 1)
    assert pool.usage() == 4
    pool.release("job-a")
    assert pool.try_acquire("job-b", 2)
    assert pool.usage() == 3


def test_reacquire_same_job_is_idempotent(tmp_path):
    pool = LocalSlotPool(tmp_path, "c", capacity=4)
    assert pool.try_acquire("job", 3)
    assert pool.try_acquire("job", 3)
    assert pool.usage() == 3
    pool.release("job")
    pool.release("job")  # releasing twice is harmless
    assert pool.usage() == 0


def test_gang_larger_than_cluster_is_refused(tmp_path):
    pool = LocalSlotPool(tmp_path, "c", capacity=2)
    with pytest.raises(GangError, match="needs 3 slots but cluster 'c' has only 2"):
        pool.try_acquire("big", 3)


def test_pools_of_different_clusters_are_independent(tmp_path):
    a, b = LocalSlotPool(tmp_path, "a", 2), LocalSlotPool(tmp_path, "b", 2)
    assert a.try_acquire("x", 2) and b.try_acquire("y", 2)


def test_dead_holders_are_reclaimed(tmp_path):
    pool = LocalSlotPool(tmp_path, "c", capacity=2)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert pool.try_acquire("crashed-launcher", 2, pid=dead.pid)
    assert pool.try_acquire("next", 2)  # the dead holder's slots came back
    assert set(pool.holdings()) == {"next"}


def test_zombie_holder_is_reclaimed(tmp_path):
    pool = LocalSlotPool(tmp_path, "c", capacity=1)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        assert pool.try_acquire("zombie", 1, pid=child.pid)
        assert _wait_for(lambda: not pid_alive(child.pid))  # exited but not yet reaped
        assert pool.try_acquire("next", 1)
    finally:
        child.wait()


def test_reused_pid_does_not_keep_slots(tmp_path):
    pool = LocalSlotPool(tmp_path, "c", capacity=1)
    assert pool.try_acquire("old", 1)
    # Pretend the holder was an earlier process that happened to have our pid.
    state = json.loads(pool.path.read_text())
    state["holdings"]["old"]["pid_start"] = -1
    pool.path.write_text(json.dumps(state))
    assert pool.try_acquire("new", 1)


def _churn(state_dir: str, name: str, capacity: int, counter, violations, rounds: int) -> None:
    pool = LocalSlotPool(Path(state_dir), "shared", capacity)
    rng = random.Random(name)
    for _ in range(rounds):
        n = rng.randint(1, capacity)
        if pool.try_acquire(name, n):
            with counter.get_lock():
                counter.value += n
                if counter.value > capacity:
                    violations.value += 1
            time.sleep(0.002)
            with counter.get_lock():
                counter.value -= n
            pool.release(name)


def test_concurrent_processes_never_exceed_capacity(tmp_path):
    ctx = multiprocessing.get_context("fork")
    counter, violations = ctx.Value("i", 0), ctx.Value("i", 0)
    procs = [
        ctx.Process(target=_churn, args=(str(tmp_path), f"job-{i}", 3, counter, violations, 40))
        for i in range(4)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert violations.value == 0
    assert LocalSlotPool(tmp_path, "shared", 3).usage() == 0


def test_concurrent_threads_never_exceed_capacity(tmp_path):
    # flock on a fresh open() excludes threads of one process too.
    lock = threading.Lock()
    counter = type("C", (), {"value": 0, "get_lock": lambda self: lock})()
    violations = type("V", (), {"value": 0})()
    threads = [
        threading.Thread(target=_churn, args=(str(tmp_path), f"t-{i}", 3, counter, violations, 40))
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert violations.value == 0


def test_gang_not_admitted_within_timeout(tmp_path):
    backend = LocalGangBackend(tmp_path, "onprem-a", capacity=2)
    assert backend.pool.try_acquire("someone-else", 1)
    job = GangJob(name="train-run-1", workers=2, spec={}, env={"HYBRIDFLOW_STORE_SECRET_KEY": "s3cret"})
    lines: list[str] = []
    started = time.monotonic()
    with pytest.raises(GangError, match="not admitted within 0.5s"):
        backend.run(job, admission_timeout_s=0.5, log=lines.append)
    assert time.monotonic() - started < 5
    assert set(backend.pool.holdings()) == {"someone-else"}
    assert not (tmp_path / "jobs" / "train-run-1").exists()  # nothing was started
    assert not any("s3cret" in line for line in lines)


def test_a_gang_s_status_says_waiting_running_or_gone(tmp_path, monkeypatch):
    import hybridflow.backends.local as local

    backend = LocalGangBackend(tmp_path, "onprem-a", capacity=2)
    assert backend.pool.try_acquire("someone-else", 2)
    assert backend.status("train-r1").phase == "missing"
    assert not backend.pool.try_acquire("train-r1", 2, queue=True)
    assert backend.status("train-r1").phase == "pending"  # its ticket waits in the queue
    backend.pool.withdraw("train-r1")
    # A worker of the gang, as its launcher records it (the worker module on its command line).
    monkeypatch.setattr(local, "WORKER_MODULE", "hf_status_probe")
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "hf_status_probe"])
    try:
        record = backend.job_dir("train-r1") / "running.json"
        record.parent.mkdir(parents=True)
        record.write_text(json.dumps({"workers": [{"pid": worker.pid}]}))
        assert _wait_for(lambda: backend.status("train-r1").phase == "running")
    finally:
        worker.kill()
        worker.wait()
    assert backend.status("train-r1").phase == "missing"  # how it ended is its launcher's to say


def test_cancel_unknown_job_is_a_no_op(tmp_path):
    assert LocalGangBackend(tmp_path, "c", 1).cancel("nothing-here") is False


_LAUNCHER = """
import subprocess, sys, time
from hybridflow.backends.local import _die_with_parent
import os
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         preexec_fn=_die_with_parent(os.getpid()))
print(child.pid, flush=True)
time.sleep(60)
"""


def test_children_die_with_a_killed_launcher():
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(launcher.stdout.readline())
        assert pid_alive(child_pid)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        assert _wait_for(lambda: not pid_alive(child_pid)), "worker outlived its launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_preexec_kills_child_if_parent_already_gone():
    # A parent pid that is not ours: the child must not run unsupervised.
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        preexec_fn=_die_with_parent(os.getpid() + 10**6),
    )
    assert child.wait(timeout=60) == -signal.SIGTERM


@pytest.mark.parametrize("launcher_state", ["ignored", "blocked"])
def test_preexec_death_signal_works_when_launcher_ignores_sigterm(launcher_state):
    # A launcher started by a runner that ignores or blocks SIGTERM passes that on through exec.
    previous = signal.getsignal(signal.SIGTERM)
    try:
        if launcher_state == "ignored":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        else:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"],
            preexec_fn=_die_with_parent(os.getpid() + 10**6),
        )
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        signal.signal(signal.SIGTERM, previous)
    try:
        assert child.wait(timeout=30) == -signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_terminate_escalates_to_sigkill(tmp_path):
    backend = LocalGangBackend(tmp_path, "c", 1, grace_s=0.5)
    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert stubborn.stdout.readline().strip() == "ready"
    started = time.monotonic()
    backend._terminate([stubborn])
    assert stubborn.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("name", ["", "..", "a/b"])
def test_job_names_cannot_escape_the_state_dir(tmp_path, name):
    backend = LocalGangBackend(tmp_path, "c", 1)
    with pytest.raises(GangError, match="cannot name a folder"):
        backend.run(GangJob(name=name, workers=1, spec={}), admission_timeout_s=0.1)
    assert backend.pool.usage() == 0


def test_run_accepts_a_logger(tmp_path, caplog):
    import logging

    backend = LocalGangBackend(tmp_path, "c", 1)
    backend.pool.try_acquire("other", 1)
    with caplog.at_level(logging.INFO), pytest.raises(GangError, match="not admitted"):
        backend.run(
            GangJob(name="j", workers=1, spec={}), admission_timeout_s=0.2, log=logging.getLogger("op")
        )
    assert "waiting for 1 free slots" in caplog.text


# -- queue order, team caps, preemption ----------------------------------------------------------
def test_waiting_gangs_are_served_by_priority_then_arrival(tmp_path):
    pool = LocalSlotPool(tmp_path, "c", capacity=2)
    assert pool.try_acquire("running", 2)
    assert not pool.try_acquire("batch-early", 1, priority="batch", queue=True)
    assert not pool.try_acquire("normal-later", 1, priority="normal", queue=True)
    assert pool.queued() == 2
    pool.release("running")
    assert not pool.try_acquire("batch-early", 1, priority="batch", queue=True)  # normal is ahead
    assert pool.try_acquire("normal-later", 1, priority="normal", queue=True)
    assert pool.try_acquire("batch-early", 1, priority="batch", queue=True)
    assert pool.waiting() == {} and pool.usage() == 2


def test_small_gang_does_not_overtake_a_waiting_big_one(tmp_path):
    pool = LocalSlotPool(tmp_path, "c", capacity=4)
    assert pool.try_acquire("running", 3)
    assert not pool.try_acquire("big", 2, queue=True)
    assert not pool.try_acquire("small", 1, queue=True)  # 1 slot is free, but big waits first
    pool.withdraw("big")
    assert pool.try_acquire("small", 1)


def test_team_cap_counts_what_the_team_holds_on_kubernetes_clusters(tmp_path):
    pool = LocalSlotPool(tmp_path, "a", 4)
    # 2 GPUs held on a Kubernetes cluster (its scheduler's count) plus 2 here would pass a cap of 3.
    assert not pool.try_acquire("x-1", 2, team="x", team_cap=3, team_outside=2, queue=True)
    assert pool.standing("x-1").over_team_cap
    assert pool.try_acquire("x-1", 2, team="x", team_cap=3, team_outside=1)


def test_a_deferred_task_s_ticket_keeps_its_place_until_its_deadline_and_reads_change_nothing(tmp_path):
    pool = LocalSlotPool(tmp_path, "a", 2)
    assert pool.try_acquire("busy", 2)
    since = time.time() - 500  # it queued long ago, before its task deferred
    assert not pool.try_acquire("late", 1, queue=True)
    pool.keep_ticket("early", 1, since=since, keep_s=0.5)  # no process of its own while deferred
    assert [w[0] for w in pool.load().waiting] == ["early", "late"]  # its place survives the hand-over
    pool.release("busy")
    before = pool.path.read_text()
    assert pool.admissible("early", 1) and not pool.admissible("late", 2)  # what its trigger asks
    assert pool.path.read_text() == before and pool.holdings() == {}  # asking took nothing
    assert not pool.try_acquire("late", 1, queue=True)  # the kept ticket still ranks ahead
    assert pool.try_acquire("early", 1, queue=True)  # the resumed task takes the slots itself
    assert "early" not in pool.waiting()
    pool.release("early")
    pool.keep_ticket("early", 1, since=since, keep_s=0.2)
    time.sleep(0.3)
    assert "early" not in pool.waiting()  # a task that never came back: its ticket lapsed
    assert pool.try_acquire("late", 1, queue=True)


def test_team_cap_spans_clusters_and_does_not_block_other_teams(tmp_path):
    a, b = LocalSlotPool(tmp_path, "a", 4), LocalSlotPool(tmp_path, "b", 4)
    assert a.try_acquire("x-1", 2, team="x", team_cap=3)
    assert not b.try_acquire("x-2", 2, team="x", team_cap=3, queue=True)  # 2 + 2 > 3 across clusters
    assert b.waiting()["x-2"]["over_cap"] is True
    assert b.try_acquire("y-1", 1, team="y", team_cap=3)  # a capped ticket does not hold others back
    assert b.try_acquire("x-3", 1, team="x", team_cap=3)  # 2 + 1 fits the cap
    a.release("x-1")
    assert b.try_acquire("x-2", 2, team="x", team_cap=3, queue=True)


def test_dead_launchers_tickets_are_dropped(tmp_path):
    pool = LocalSlotPool(tmp_path, "c", capacity=1)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert pool.try_acquire("holder", 1)
    assert not pool.try_acquire("gone", 1, pid=dead.pid, priority="critical", queue=True)
    pool.release("holder")
    assert pool.try_acquire("next", 1)  # the dead launcher's critical ticket does not block


_FAKE_WORKER = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))  # checkpointed stop, like the real worker
deadline = time.monotonic() + float(os.environ.get("FAKE_SECONDS", "60"))
while time.monotonic() < deadline:
    time.sleep(0.05)
"""


@pytest.fixture
def fake_worker(tmp_path, monkeypatch):
    """Gang workers that sleep FAKE_SECONDS and exit 0, or exit 75 on SIGTERM, instead of training."""
    import hybridflow.backends.local as local

    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "fake_gang_worker.py").write_text(_FAKE_WORKER)
    monkeypatch.setattr(local, "WORKER_MODULE", "fake_gang_worker")
    return lambda seconds: {"PYTHONPATH": str(modules), "FAKE_SECONDS": str(seconds)}


def _in_thread(fn):
    out: dict = {}

    def target():
        try:
            out["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc
        out["done"] = time.monotonic()

    t = threading.Thread(target=target)
    t.start()
    return t, out


def test_two_competing_gangs_both_finish_without_deadlock(tmp_path, fake_worker):
    from hybridflow.backends.local import GangResult

    backend = LocalGangBackend(tmp_path / "state", "c", capacity=4, grace_s=2, poll_s=0.05)
    runs = [
        _in_thread(lambda n=n: backend.run(
            GangJob(name=f"gang-{n}", workers=3, spec={}, env=fake_worker(0.5)), admission_timeout_s=20, log=lambda _: None))
        for n in range(2)
    ]
    for t, _ in runs:
        t.join(30)
    assert all(isinstance(out.get("result"), GangResult) for _, out in runs), [out.get("error") for _, out in runs]
    assert backend.pool.usage() == 0 and backend.pool.waiting() == {}


def test_critical_gang_preempts_batch_work(tmp_path, fake_worker):
    from hybridflow.backends.local import GangNotAdmitted, GangPreempted

    backend = LocalGangBackend(tmp_path / "state", "c", capacity=2, grace_s=5, poll_s=0.05)
    batch = GangJob(name="batch-gang", workers=2, spec={}, env=fake_worker(60), labels={"priority": "batch"})
    t_batch, batch_out = _in_thread(lambda: backend.run(batch, admission_timeout_s=5, log=lambda _: None))
    assert _wait_for(lambda: backend.running_gangs(), timeout=10)
    # A normal gang waits (and times out) rather than preempting.
    with pytest.raises(GangNotAdmitted) as info:
        backend.run(GangJob(name="normal-gang", workers=1, spec={}, env=fake_worker(0)), admission_timeout_s=0.5,
                    log=lambda _: None)
    assert info.value.cluster == "c"
    lines: list[str] = []
    critical = GangJob(name="critical-gang", workers=2, spec={}, env=fake_worker(0.2), labels={"priority": "critical"})
    result = backend.run(critical, admission_timeout_s=20, log=lines.append)
    t_batch.join(20)
    assert isinstance(batch_out.get("error"), GangPreempted), batch_out
    assert batch_out["error"].exit_code == 75  # the batch workers checkpointed and stopped
    assert result.exit_codes == [0, 0]
    assert any("preempting batch gang batch-gang (2 slots)" in line for line in lines)
    assert backend.pool.usage() == 0


def test_critical_gang_does_not_preempt_when_disabled_or_not_enough(tmp_path, fake_worker):
    from hybridflow.backends.local import GangNotAdmitted

    backend = LocalGangBackend(tmp_path / "state", "c", capacity=2, grace_s=5, poll_s=0.05,
                               critical_preempts_batch=False)
    batch = GangJob(name="batch-gang", workers=2, spec={}, env=fake_worker(60), labels={"priority": "batch"})
    t_batch, batch_out = _in_thread(lambda: backend.run(batch, admission_timeout_s=5, log=lambda _: None))
    try:
        assert _wait_for(lambda: backend.running_gangs(), timeout=10)
        with pytest.raises(GangNotAdmitted):
            backend.run(GangJob(name="crit", workers=2, spec={}, labels={"priority": "critical"}),
                        admission_timeout_s=0.5, log=lambda _: None)
        assert [g["name"] for g in backend.running_gangs()] == ["batch-gang"]
    finally:
        backend.cancel("batch-gang")
        t_batch.join(20)


def test_gang_held_by_its_team_cap_says_so(tmp_path):
    from hybridflow.backends.local import GangNotAdmitted

    backend = LocalGangBackend(tmp_path, "c", capacity=4)
    assert LocalSlotPool(tmp_path, "other", 4).try_acquire("team-run", 3, team="x", team_cap=4)
    job = GangJob(name="j", workers=2, spec={}, labels={"team": "x", "priority": "batch"}, team_cap=4)
    with pytest.raises(GangNotAdmitted) as info:
        backend.run(job, admission_timeout_s=0.3, log=lambda _: None)
    assert info.value.over_team_cap and "holds its gpu_cap of 4 GPUs" in str(info.value)
    assert backend.pool.waiting() == {} and backend.pool.usage() == 0
