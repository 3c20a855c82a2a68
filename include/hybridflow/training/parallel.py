"""The run's precision, optimizer and sharding, applied for the training function (``ctx`` helpers).

A team writes one ``train(ctx)``; the run's Params (:class:`hybridflow.gpumem.TrainSetting`, the same
values admission estimated GPU memory with) decide what the helpers do:

=================  ============================================================================
``ctx.wrap``       sharding ``none`` and ``zero1``: ``DistributedDataParallel``; ``zero2``:
                   FSDP2 ``fully_shard`` keeping the gathered weights from forward to backward
                   (``reshard_after_forward=False``: gradients and optimizer state sharded);
                   ``zero3``: ``fully_shard`` (weights sharded too). The module is moved to
                   ``ctx.device`` first.
``ctx.optimizer``  ``sgd`` (no momentum), ``sgd_momentum`` or ``adamw``; with ``zero1`` wrapped in
                   ``ZeroRedundancyOptimizer`` (each rank keeps its share of the optimizer state).
``ctx.autocast``   ``bf16`` / ``fp16``: ``torch.autocast`` on the rank's device; ``fp32``: nothing.
                   The weights and the optimizer stay fp32 (the master copy the estimate counts).
``ctx.backward``   the loss's backward; with ``fp16`` scaled by a ``GradScaler``, and
``ctx.step``       the optimizer step unscaled and skipped on overflow by that scaler.
``ctx.save_checkpoint`` / ``ctx.restore``
                   ``none`` / ``zero1``: the whole state from rank 0 (``zero1``'s optimizer state
                   gathered there first); ``zero2`` / ``zero3``: every rank its part through
                   ``torch.distributed.checkpoint``. The scaler's state goes with it.
=================  ============================================================================
"""

from __future__ import annotations

import contextlib
from typing import Any

from hybridflow.gpumem import TrainSetting

SHARDED_CHECKPOINTS = ("zero2", "zero3")  # FSDP: no rank holds the whole state


class Parallel:
    """The helpers of one rank: built by the worker from the job spec's ``training`` block."""

    def __init__(self, setting: TrainSetting, device: str, rank: int, world_size: int) -> None:
        self.setting = setting
        self.device = device
        self.rank, self.world_size = rank, world_size
        self.scaler = None
        if setting.precision == "fp16":
            import torch

            # One scaler for DDP and FSDP2 alike: FSDP2's gradients are DTensors, whose unscale
            # reduces "found inf" over the mesh, so every rank skips the same steps.

            self.scaler = torch.amp.GradScaler(self.device_type)

    @property
    def device_type(self) -> str:
        return self.device.split(":", 1)[0]

    @property
    def dtype(self):
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.setting.precision)

    @property
    def sharded_checkpoints(self) -> bool:
        return self.setting.sharding in SHARDED_CHECKPOINTS

    # -- model and optimizer ---------------------------------------------------------------------
    def wrap(self, module):
        """``module`` on the rank's device, replicated (DDP) or sharded (FSDP2) as the run says."""
        import torch

        module = module.to(self.device)
        if self.setting.sharding in SHARDED_CHECKPOINTS:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(self.device_type, (self.world_size,))
            return fully_shard(module, mesh=mesh, reshard_after_forward=self.setting.sharding == "zero3")
        from torch.nn.parallel import DistributedDataParallel

        ids = [torch.device(self.device).index] if self.device_type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids)

    def optimizer(self, module, *, lr: float, momentum: float = 0.9, weight_decay: float = 0.0):
        """The run's optimizer over ``module``'s parameters (``momentum`` only for ``sgd_momentum``)."""
        import torch

        kind = self.setting.optimizer
        if kind == "adamw":
            cls, options = torch.optim.AdamW, {"lr": lr, "weight_decay": weight_decay}
        else:
            cls = torch.optim.SGD
            options = {"lr": lr, "weight_decay": weight_decay,
                       "momentum": momentum if kind == "sgd_momentum" else 0.0}
        params = module.parameters()
        if self.setting.sharding == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(params, optimizer_class=cls, **options)
        return cls(params, **options)

    # -- precision -------------------------------------------------------------------------------
    def autocast(self):
        """The forward pass's precision: a ``torch.autocast`` context, or a no-op for fp32."""
        import torch

        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer) -> None:
        """One optimizer step, then the gradients cleared (with fp16, skipped when they overflowed)."""
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # -- checkpoint state ------------------------------------------------------------------------
    def state(self, module, optimizer) -> dict[str, Any]:
        """The training state as the run's checkpoints hold it (collective with ``zero1`` and FSDP:
        call it on every rank)."""
        if self.sharded_checkpoints:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optim_state = get_state_dict(module, optimizer)
            out = {"model": model_state, "optimizer": optim_state}
        else:
            if self.setting.sharding == "zero1":
                optimizer.consolidate_state_dict(to=0)  # every rank sends its share to rank 0
            # ZeroRedundancyOptimizer answers state_dict() only where it was consolidated (rank 0).
            whole = self.setting.sharding != "zero1" or self.rank == 0
            out = {"model": _unwrapped(module).state_dict(), "optimizer": optimizer.state_dict() if whole else {}}
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        return out

    def load(self, module, optimizer, state: dict[str, Any]) -> None:
        if self.sharded_checkpoints:
            from torch.distributed.checkpoint.state_dict import set_state_dict

            set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        else:
            _unwrapped(module).load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])

    def model_state(self, module) -> dict[str, Any] | None:
        """The whole model's weights on host memory, keyed as the builder's module names them, on rank
        0 (None elsewhere). Collective for FSDP (the shards are gathered)."""
        if self.sharded_checkpoints:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            return full if self.rank == 0 else None
        return _unwrapped(module).state_dict() if self.rank == 0 else None


def _unwrapped(module):
    from torch.nn.parallel import DistributedDataParallel

    return module.module if isinstance(module, DistributedDataParallel) else module
