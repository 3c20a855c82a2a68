"""Every gang backend keeps one contract: submit a gang, poll its handle until it ends; a waiting gang
reports its place in the queue, a failed one says why. The local backend runs real worker processes;
the Kubernetes backend runs against the simulated cluster (the real control plane: tests/k8s_real)."""

from __future__ import annotations

import time

import pytest
from tests.support.k8s_sim import SimCluster, install
from tests.unit.test_k8s_backend import _backend, _job
from tests.unit.test_local_backend import fake_worker  # noqa: F401 - the fixture

from hybridflow.backends.base import FAILED, PENDING, PREEMPTED, RUNNING, SUCCEEDED, GangBackend, GangJob
from hybridflow.backends.local import LocalGangBackend


class LocalGangs:
    """Local gangs of two workers on a two-slot cluster, taken by another gang or not."""

    def __init__(self, tmp_path, worker) -> None:
        self.backend = LocalGangBackend(tmp_path / "state", "onprem-a", 2, grace_s=5, poll_s=0.05)
        self.worker = worker

    def job(self, name: str = "contract", seconds: float = 0.3, extra_env: dict | None = None) -> GangJob:
        return GangJob(name=name, workers=2, spec={}, env={**self.worker(seconds), **(extra_env or {})},
                       labels={"team": "vision", "priority": "normal"})

    def take_the_cluster(self) -> None:
        assert self.backend.pool.try_acquire("someone-else", 2)

    def free_the_cluster(self) -> None:
        self.backend.pool.release("someone-else")

    def advance(self) -> None:
        time.sleep(0.1)

    def fail_a_rank(self, handle) -> None:
        record = self.backend._record_path(handle.name).read_text()
        import json
        import os
        import signal

        os.kill(json.loads(record)["workers"][1]["pid"], signal.SIGKILL)

    def succeed(self, handle) -> None:
        pass  # the fake workers exit 0 after their seconds


class KubernetesGangs:
    """Gangs of six workers on a simulated Volcano cluster whose pool has eight GPUs."""

    def __init__(self, sim: SimCluster) -> None:
        self.sim = sim
        self.backend = _backend("volcano", max_retry=3)

    def job(self, name: str = "contract", seconds: float = 0.3, extra_env: dict | None = None) -> GangJob:
        return _job(6, run_id=name)

    def take_the_cluster(self) -> None:
        other = _job(4, run_id="someone-else")
        self.backend.submit(other, pool="h100", queue="vision")
        self.sim.run(2)
        self.other = other

    def free_the_cluster(self) -> None:
        self.backend.delete(self.other.name)

    def advance(self) -> None:
        self.sim.step()

    def fail_a_rank(self, handle) -> None:
        self.sim.fail_pod(self.sim.pod_names(handle.name)[1], exit_code=3)

    def succeed(self, handle) -> None:
        if self.sim.pod_names(handle.name):
            self.sim.succeed(handle.name)


@pytest.fixture(params=["local", "kubernetes"])
def gangs(request, tmp_path, monkeypatch):
    if request.param == "local":
        return LocalGangs(tmp_path, request.getfixturevalue("fake_worker"))
    sim = SimCluster({"h100-1": {"gpus": 4, "labels": {"hybridflow.io/pool": "h100"}},
                      "h100-2": {"gpus": 4, "labels": {"hybridflow.io/pool": "h100"}}})
    install(monkeypatch, sim)
    return KubernetesGangs(sim)


def _poll_until(gangs, handle, phases, *, act=None, polls: int = 200):
    seen = []
    for _ in range(polls):
        status = gangs.backend.poll(handle)
        seen.append(status.phase)
        if status.phase in phases:
            return status, seen
        if act is not None and status.phase == RUNNING:
            act(handle)
        gangs.advance()
    raise AssertionError(f"still {seen[-5:]} after {polls} polls, waiting for {phases}")


def test_both_backends_keep_the_whole_contract():
    for name in ("submit", "poll", "run", "cancel", "stop", "load", "find_gangs", "status", "remnants", "clear"):
        assert getattr(GangBackend, name).__isabstractmethod__, name
    for name in ("supervised_by_task", "reads_private_storage"):  # declared capabilities
        assert isinstance(getattr(GangBackend, name), property)


def test_a_waiting_gang_reports_its_place_then_runs_once_admitted_and_succeeds(gangs):
    gangs.take_the_cluster()
    job = gangs.job()
    handle = gangs.backend.submit(job, pool="h100", queue="vision")
    assert handle.name == job.name and handle.created and not handle.admitted
    status = gangs.backend.poll(handle)
    assert status.phase == PENDING and not status.terminal
    assert status.standing.position == 1 and status.standing.cluster == gangs.backend.cluster_name
    assert "position 1 in the queue" in status.message
    gangs.free_the_cluster()
    status, seen = _poll_until(gangs, handle, {SUCCEEDED, FAILED}, act=gangs.succeed)
    assert status.phase == SUCCEEDED and status.terminal and RUNNING in seen
    assert gangs.backend.load().used == 0  # an ended gang holds nothing


def test_a_failed_rank_ends_the_gang_failed_naming_the_rank(gangs):
    handle = gangs.backend.submit(gangs.job(seconds=30), pool="h100", queue="vision")
    status, _ = _poll_until(gangs, handle, {RUNNING})
    gangs.fail_a_rank(handle)
    status, _ = _poll_until(gangs, handle, {FAILED, SUCCEEDED, PREEMPTED})
    assert status.phase == FAILED and status.terminal and "rank 1" in status.message


def test_a_local_handle_read_from_another_process_reports_what_the_cluster_shows(tmp_path, fake_worker):  # noqa: F811
    import dataclasses

    gangs = LocalGangs(tmp_path, fake_worker)
    handle = gangs.backend.submit(gangs.job(seconds=30))
    try:
        _poll_until(gangs, handle, {RUNNING})
        elsewhere = dataclasses.replace(handle, state=None)  # the launch stays with the submitting thread
        assert gangs.backend.poll(elsewhere).phase == RUNNING
    finally:
        gangs.backend.close(handle)
    assert gangs.backend.poll(dataclasses.replace(handle, state=None)).phase == "missing"
    assert gangs.backend.load().used == 0
