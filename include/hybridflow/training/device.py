"""Which device a rank trains on, and which process-group backend the gang uses.

A rank binds ``cuda:<LOCAL_RANK>`` and the gang talks NCCL when this process sees a CUDA device for
every local rank; otherwise it trains on CPU with gloo. ``CUDA_VISIBLE_DEVICES`` (or, in a pod, the
device plugin's assignment) decides what "visible" means: with N visible devices, local rank i uses
the i-th of them.

``HYBRIDFLOW_DEVICE`` says what the launcher asked for:

- ``cuda``: the job was given GPUs (a Kubernetes pod that requests ``nvidia.com/gpu``, or a local
  cluster set up to train on this machine's GPUs). A rank that cannot use one fails at start, before
  joining the gang, naming the cause: a CPU-only node would otherwise train slowly on CPU while the
  GPUs it is billed for sit idle.
- ``cpu``: CPU and gloo even where CUDA is available (the local backend's default).
- ``auto`` or unset: CUDA when there is a device for every local rank, else CPU (for a plain
  ``torchrun`` launch). Ranks on one machine see the same devices, so they choose alike; a
  multi-machine launcher should say ``cuda`` or ``cpu``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridflow.errors import GangError

DEVICE_ENV = "HYBRIDFLOW_DEVICE"
DEVICE_CHOICES = ("auto", "cpu", "cuda")


class DeviceUnavailable(GangError):
    """The job asked for GPUs this rank cannot use (no driver, no CUDA build, too few visible)."""


@dataclass(frozen=True)
class DeviceChoice:
    """Where one rank trains: ``device`` is what ``ctx.device`` holds (``"cuda:0"`` or ``"cpu"``)."""

    device: str
    backend: str  # torch.distributed backend: "nccl" with CUDA, "gloo" on CPU
    name: str  # the GPU's name, or "cpu"
    local_rank: int
    requested: str  # HYBRIDFLOW_DEVICE as given: auto, cpu or cuda

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def record(self) -> dict[str, Any]:
        """The fields the task log and the run record carry."""
        return {"device": self.device, "backend": self.backend, "device_name": self.name}


def _int_env(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key, "")
    try:
        value = int(raw) if raw.strip() else default
    except ValueError:
        raise GangError(f"{key}={raw!r} is not an integer; the launcher must set it to a whole number") from None
    if value < 0:
        raise GangError(f"{key}={raw!r} must be >= 0")
    return value


def choose_device(env: Mapping[str, str], torch: Any = None) -> DeviceChoice:
    """The device and backend for the rank described by ``env`` (``HYBRIDFLOW_DEVICE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``CUDA_VISIBLE_DEVICES``). Binds the CUDA device when it chooses one.
    ``torch`` is the module to ask (tests pass a stand-in)."""
    if torch is None:
        import torch
    requested = (env.get(DEVICE_ENV) or "auto").strip().lower()
    if requested not in DEVICE_CHOICES:
        raise GangError(f"{DEVICE_ENV}={env.get(DEVICE_ENV)!r} is not one of {', '.join(DEVICE_CHOICES)}; "
                        "set cuda where the job was given GPUs, cpu to train on CPU")
    local_rank = _int_env(env, "LOCAL_RANK", 0)
    local_ranks = max(_int_env(env, "LOCAL_WORLD_SIZE", 1), local_rank + 1)
    cpu = DeviceChoice(device="cpu", backend="gloo", name="cpu", local_rank=local_rank, requested=requested)
    if requested == "cpu":
        return cpu
    available = bool(torch.cuda.is_available())
    visible = int(torch.cuda.device_count()) if available else 0
    if requested == "cuda":
        shown = env.get("CUDA_VISIBLE_DEVICES")
        where = f"CUDA_VISIBLE_DEVICES={shown!r}" if shown is not None else "CUDA_VISIBLE_DEVICES unset"
        if not available:
            build = getattr(getattr(torch, "version", None), "cuda", None)
            cause = ("this torch is a CPU-only build: use a training image with a CUDA build of torch"
                     if build is None else
                     f"no CUDA device is usable (torch built for CUDA {build}, {where}): check the node's "
                     "NVIDIA driver and device plugin, and that the pod got the GPUs it requested")
            raise DeviceUnavailable(f"{DEVICE_ENV}=cuda: the job was given GPUs but local rank {local_rank} "
                                    f"cannot use any; {cause}")
        if visible < local_ranks:
            raise DeviceUnavailable(
                f"{DEVICE_ENV}=cuda: {local_ranks} local ranks need a GPU each but {visible} "
                f"{'is' if visible == 1 else 'are'} visible ({where}); start at most {visible} ranks per "
                "node, or give each node as many GPUs as it runs ranks")
    elif not available or visible < local_ranks:
        return cpu
    torch.cuda.set_device(local_rank)
    return DeviceChoice(device=f"cuda:{local_rank}", backend="nccl", name=str(torch.cuda.get_device_name(local_rank)),
                        local_rank=local_rank, requested=requested)
