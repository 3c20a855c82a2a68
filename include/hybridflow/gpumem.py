"""Will the model fit? GPU memory for training, estimated before any GPU is asked for.

Per parameter, training holds:

- weights, in the training precision (4 bytes fp32, 2 bytes bf16/fp16);
- gradients, in the same precision;
- optimizer state: with half-precision weights an fp32 master copy (4 bytes), plus the optimizer's
  own fp32 state: momentum for SGD with momentum (4 bytes), first and second moments for AdamW
  (8 bytes). AdamW in bf16 is therefore 4 + 8 = 12 bytes per parameter.

Sharding (ZeRO stages, or FSDP for stage 3) splits state across the gang's GPUs: stage 1 the
optimizer state, stage 2 also the gradients, stage 3 also the weights. What is left of a GPU after
the model state (``headroom``, default 20 %) is for activations and workspace, which depend on
batch size and sequence length and are not estimated here.

The worked example: 8B parameters, bf16, AdamW = 16 GB weights + 16 GB gradients + 96 GB
optimizer state = 128 GB, which no single 80 GB GPU holds; with ZeRO-1 over 8 GPUs each holds
16 + 16 + 12 = 44 GB.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

Precision = Literal["fp32", "bf16", "fp16"]
Optimizer = Literal["sgd", "sgd_momentum", "adamw"]
Sharding = Literal["none", "zero1", "zero2", "zero3"]

PRECISION_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
OPTIMIZER_STATE_BYTES: dict[str, int] = {"sgd": 0, "sgd_momentum": 4, "adamw": 8}
SHARDINGS: tuple[Sharding, ...] = ("none", "zero1", "zero2", "zero3")
GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class TrainSetting:
    """How a run trains: the ``precision``, ``optimizer`` and ``sharding`` Params. Admission estimates
    GPU memory from it, and the gang's ranks train with it (``training`` in the job spec, the helpers
    of :mod:`hybridflow.training.parallel`): one object, so the estimate and the run cannot disagree."""

    precision: Precision = "fp32"
    optimizer: Optimizer = "sgd_momentum"
    sharding: Sharding = "none"

    @classmethod
    def from_dict(cls, body: Mapping[str, Any] | None) -> TrainSetting:
        """The job spec's ``training`` block (absent: the Params' defaults); an unknown key or value is
        an error naming it and what is allowed."""
        body = dict(body or {})
        unknown = sorted(set(body) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"training setting has unknown keys {unknown}; known keys are precision, optimizer, sharding")
        allowed = {"precision": tuple(PRECISION_BYTES), "optimizer": tuple(OPTIMIZER_STATE_BYTES),
                   "sharding": SHARDINGS}
        for key, values in allowed.items():
            if key in body and body[key] not in values:
                raise ValueError(f"training setting {key}={body[key]!r} is not one of {', '.join(values)}")
        return cls(**body)

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class MemoryEstimate:
    params: int
    precision: str
    optimizer: str
    sharding: str
    workers: int
    gpu_memory_bytes: int
    headroom: float
    weights: float  # bytes, whole model
    gradients: float
    optimizer_state: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer_state

    @property
    def per_gpu(self) -> float:
        return per_gpu_bytes(self.weights, self.gradients, self.optimizer_state, self.sharding, self.workers)

    @property
    def usable_per_gpu(self) -> float:
        return self.gpu_memory_bytes * (1.0 - self.headroom)

    @property
    def fits(self) -> bool:
        return self.per_gpu <= self.usable_per_gpu

    def min_workers(self, sharding: str | None = None, limit: int = 4096) -> int | None:
        """The smallest gang that fits with ``sharding`` (this estimate's by default), or None."""
        s = sharding or self.sharding
        for n in range(1, limit + 1):
            if per_gpu_bytes(self.weights, self.gradients, self.optimizer_state, s, n) <= self.usable_per_gpu:
                return n
            if s == "none":
                return None  # without sharding every GPU holds everything: more GPUs do not help
        return None

    def explain(self) -> str:
        master = " incl. fp32 master copy" if self.precision != "fp32" and self.optimizer_state else ""
        return (
            f"{self.params / 1e9:.3g}B parameters in {self.precision} with {self.optimizer}: weights "
            f"{self.weights / GB:.1f} GB + gradients {self.gradients / GB:.1f} GB + optimizer state "
            f"{self.optimizer_state / GB:.1f} GB{master} = {self.total / GB:.1f} GB; sharding {self.sharding} "
            f"over {self.workers} GPU(s) puts {self.per_gpu / GB:.1f} GB on each, of "
            f"{self.usable_per_gpu / GB:.1f} GB usable ({self.gpu_memory_bytes / GIB:.0f} GiB GPU, "
            f"{self.headroom:.0%} kept for activations)"
        )


def per_gpu_bytes(weights: float, grads: float, opt: float, sharding: str, n: int) -> float:
    if sharding == "none":
        return weights + grads + opt
    if sharding == "zero1":
        return weights + grads + opt / n
    if sharding == "zero2":
        return weights + (grads + opt) / n
    if sharding == "zero3":
        return (weights + grads + opt) / n
    raise ValueError(f"unknown sharding {sharding!r}; use one of {', '.join(SHARDINGS)}")


def estimate_for(params: int, setting: TrainSetting, *, workers: int, gpu_memory_gib: float,
                 headroom: float = 0.2) -> MemoryEstimate:
    """:func:`estimate` for a run's :class:`TrainSetting`."""
    return estimate(params, precision=setting.precision, optimizer=setting.optimizer, sharding=setting.sharding,
                    workers=workers, gpu_memory_gib=gpu_memory_gib, headroom=headroom)


def estimate(
    params: int,
    *,
    precision: str,
    optimizer: str,
    sharding: str,
    workers: int,
    gpu_memory_gib: float,
    headroom: float = 0.2,
) -> MemoryEstimate:
    if params < 0:
        raise ValueError("params must not be negative")
    width = PRECISION_BYTES[precision]
    master = 4 if width < 4 else 0
    return MemoryEstimate(
        params=params,
        precision=precision,
        optimizer=optimizer,
        sharding=sharding,
        workers=workers,
        gpu_memory_bytes=int(gpu_memory_gib * GIB),
        headroom=headroom,
        weights=float(params * width),
        gradients=float(params * width),
        optimizer_state=float(params * (master + OPTIMIZER_STATE_BYTES[optimizer])),
    )
