"""Which device and process-group backend a rank uses, and what it tells training code about its gang.

No GPU here: CUDA is reported present or absent by patching torch at its boundary
(``torch.cuda.is_available`` / ``device_count`` / ``get_device_name`` / ``set_device``), and the
worker's ``init_process_group`` is replaced by one that records its arguments and stops the rank."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import torch.distributed as dist
from tests.support.jobs import job_spec

from hybridflow.backends.base import GangJob
from hybridflow.backends.local import _gang_env
from hybridflow.errors import GangError
from hybridflow.training import worker
from hybridflow.training.device import DeviceUnavailable, choose_device
from hybridflow.training.ranks import read_rank_env


@pytest.fixture
def cuda(monkeypatch):
    """CUDA as this test says: ``cuda(n)`` reports n visible devices (0: CUDA unavailable)."""
    bound: list[int] = []

    def report(n: int, *, build: str | None = "12.8") -> list[int]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: f"NVIDIA H100 80GB HBM3 #{i}")
        monkeypatch.setattr(torch.cuda, "set_device", bound.append)
        monkeypatch.setattr(torch.version, "cuda", build)
        return bound

    return report


def test_a_rank_binds_the_gpu_of_its_local_rank_and_the_gang_uses_nccl(cuda):
    bound = cuda(4)
    choice = choose_device({"HYBRIDFLOW_DEVICE": "cuda", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"})
    assert (choice.device, choice.backend, choice.name) == ("cuda:2", "nccl", "NVIDIA H100 80GB HBM3 #2")
    assert bound == [2]
    assert choice.record() == {"device": "cuda:2", "backend": "nccl", "device_name": "NVIDIA H100 80GB HBM3 #2"}


def test_unset_device_uses_cuda_where_there_is_one_per_local_rank(cuda):
    cuda(2)
    assert choose_device({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}).device == "cuda:1"


@pytest.mark.parametrize(("visible", "env"), [
    (0, {}),  # no CUDA: the CPU machine of the embedded default
    (1, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}),  # too few GPUs for the ranks here: all ranks on CPU
    (8, {"HYBRIDFLOW_DEVICE": "cpu"}),  # asked for CPU
])
def test_cpu_and_gloo_where_cuda_is_not_asked_for_and_not_enough(cuda, visible, env):
    bound = cuda(visible)
    choice = choose_device(env)
    assert (choice.device, choice.backend, choice.name) == ("cpu", "gloo", "cpu")
    assert bound == []


def test_a_gang_given_gpus_fails_when_cuda_is_unavailable_naming_the_cause(cuda):
    cuda(0)
    with pytest.raises(DeviceUnavailable) as info:
        choose_device({"HYBRIDFLOW_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": "0"})
    message = str(info.value)
    assert "HYBRIDFLOW_DEVICE=cuda" in message and "CUDA_VISIBLE_DEVICES='0'" in message
    assert "NVIDIA driver and device plugin" in message


def test_a_gang_given_gpus_on_a_cpu_only_torch_build_names_the_image(cuda):
    cuda(0, build=None)
    with pytest.raises(DeviceUnavailable, match="CPU-only build: use a training image with a CUDA build"):
        choose_device({"HYBRIDFLOW_DEVICE": "cuda"})


def test_a_gang_given_gpus_fails_when_fewer_are_visible_than_local_ranks(cuda):
    cuda(1)
    with pytest.raises(DeviceUnavailable, match="2 local ranks need a GPU each but 1 is visible"):
        choose_device({"HYBRIDFLOW_DEVICE": "cuda", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"})


def test_an_unknown_device_setting_is_refused_naming_the_variable():
    with pytest.raises(GangError, match="HYBRIDFLOW_DEVICE='gpu' is not one of auto, cpu, cuda"):
        choose_device({"HYBRIDFLOW_DEVICE": "gpu"})


# -- the worker --------------------------------------------------------------------------------
class Joined(Exception):
    """Raised by the stand-in init_process_group: the rank got as far as joining the gang."""


@pytest.fixture
def one_rank(tmp_path, monkeypatch, digits_dataset):
    """A rank's environment and job.json; returns (spec path, the init_process_group calls)."""
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps(job_spec(digits_dataset, tmp_path / "ckpt")))
    for key in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.setenv(key, "")  # restored after the test, whatever the worker exports
        monkeypatch.delenv(key)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    calls: list[dict] = []

    def init(backend, **kw):
        calls.append({"backend": backend, **kw})
        raise Joined

    monkeypatch.setattr(dist, "init_process_group", init)
    monkeypatch.setattr(worker.Preemption, "install", lambda self: None)  # keep pytest's own SIGTERM handling
    return spec, calls


def test_the_worker_joins_with_nccl_on_its_gpu_when_given_gpus(one_rank, cuda, monkeypatch):
    spec, calls = one_rank
    cuda(1)
    monkeypatch.setenv("HYBRIDFLOW_DEVICE", "cuda")
    assert worker.main(["--spec", str(spec)]) == 1  # stopped by the stand-in at the join
    assert [(c["backend"], c["device_id"]) for c in calls] == [("nccl", torch.device("cuda:0"))]


def test_the_worker_joins_with_gloo_on_cpu(one_rank, cuda, monkeypatch):
    spec, calls = one_rank
    cuda(0)
    monkeypatch.setenv("HYBRIDFLOW_DEVICE", "cpu")
    assert worker.main(["--spec", str(spec)]) == 1
    assert [(c["backend"], c["device_id"]) for c in calls] == [("gloo", None)]


def test_a_worker_given_gpus_it_cannot_see_fails_before_joining_the_gang(one_rank, cuda, monkeypatch, caplog):
    spec, calls = one_rank
    cuda(0)
    monkeypatch.setenv("HYBRIDFLOW_DEVICE", "cuda")
    with caplog.at_level(logging.ERROR, logger="hybridflow.training.worker"):
        assert worker.main(["--spec", str(spec)]) == 1
    assert calls == []  # never joined: no peer waits in a collective, no step ran
    assert "the job was given GPUs but local rank 0 cannot use any" in caplog.text


def test_the_worker_exports_torchrun_variables_to_training_code(one_rank, cuda, monkeypatch):
    spec, _ = one_rank
    cuda(0)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    worker.main(["--spec", str(spec)])
    assert {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                       "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
        "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}


# -- the rank's place in the gang ---------------------------------------------------------------
def test_one_rank_per_pod_is_its_own_node():
    place = read_rank_env({"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "g-0.g", "MASTER_PORT": "23456"})
    assert (place.local_rank, place.local_world_size, place.group_rank) == (0, 1, 3)


@pytest.mark.parametrize(("env", "expected"), [
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "MASTER_ADDR not set in a gang of 2"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK must be in 0..WORLD_SIZE-1"),
    ({"LOCAL_RANK": "1"}, "LOCAL_RANK must be in 0..LOCAL_WORLD_SIZE-1"),
    ({"RANK": "one"}, "RANK='one' is not an integer"),
])
def test_an_inconsistent_launch_environment_is_refused_naming_the_variable(env, expected):
    with pytest.raises(GangError, match=expected):
        read_rank_env(env)


def test_local_gangs_train_on_cpu_unless_this_machine_says_cuda(monkeypatch):
    job = GangJob(name="g", workers=3, spec={})
    monkeypatch.delenv("HYBRIDFLOW_DEVICE", raising=False)
    env = _gang_env(job, 1234)
    assert (env["HYBRIDFLOW_DEVICE"], env["LOCAL_WORLD_SIZE"]) == ("cpu", "3")
    monkeypatch.setenv("HYBRIDFLOW_DEVICE", "cuda")
    assert _gang_env(job, 1234)["HYBRIDFLOW_DEVICE"] == "cuda"
