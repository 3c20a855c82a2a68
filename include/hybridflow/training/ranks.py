"""Where a rank sits in its gang, read from the environment its launcher gave it.

Every launcher sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``: the local backend
directly, Volcano's pytorch plugin on a Volcano Job, the manifest (completion index and headless
Service) on a Kueue Job. The rest of what ``torchrun`` gives its workers is filled in here when the
launcher left it out, and exported, so training code written for ``torchrun`` finds the same
variables: ``LOCAL_RANK`` (0), ``LOCAL_WORLD_SIZE`` (1: one rank per pod), and ``GROUP_RANK`` /
``NODE_RANK`` (which machine: ``RANK // LOCAL_WORLD_SIZE``, ranks being numbered machine by machine).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass

from hybridflow.errors import GangError


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int
    master_addr: str | None
    master_port: str | None

    def exports(self) -> dict[str, str]:
        """The ``torchrun``-compatible variables, as strings."""
        out = {"RANK": self.rank, "WORLD_SIZE": self.world_size, "LOCAL_RANK": self.local_rank,
               "LOCAL_WORLD_SIZE": self.local_world_size, "GROUP_RANK": self.group_rank,
               "NODE_RANK": self.group_rank, "MASTER_ADDR": self.master_addr, "MASTER_PORT": self.master_port}
        return {k: str(v) for k, v in out.items() if v is not None}


def _number(env: MutableMapping[str, str], key: str, default: int | None) -> int:
    raw = (env.get(key) or "").strip()
    if not raw:
        if default is None:
            raise GangError(f"{key} is not set: the launcher must give every rank {key}")
        return default
    try:
        return int(raw)
    except ValueError:
        raise GangError(f"{key}={raw!r} is not an integer; the launcher must set it to a whole number") from None


def read_rank_env(env: MutableMapping[str, str] | None = None) -> RankEnv:
    """The rank's place in the gang from ``env`` (default ``os.environ``), checked for consistency."""
    env = os.environ if env is None else env
    world_size = _number(env, "WORLD_SIZE", 1)
    rank = _number(env, "RANK", 0)
    if world_size < 1 or not 0 <= rank < world_size:
        raise GangError(f"RANK={rank} WORLD_SIZE={world_size}: RANK must be in 0..WORLD_SIZE-1")
    local_world_size = _number(env, "LOCAL_WORLD_SIZE", 1)
    local_rank = _number(env, "LOCAL_RANK", 0)
    if local_world_size < 1 or not 0 <= local_rank < local_world_size:
        raise GangError(f"LOCAL_RANK={local_rank} LOCAL_WORLD_SIZE={local_world_size}: LOCAL_RANK must be in "
                        "0..LOCAL_WORLD_SIZE-1 (set LOCAL_WORLD_SIZE to the ranks started on this machine)")
    group_rank = _number(env, "GROUP_RANK", _number(env, "NODE_RANK", rank // local_world_size))
    master_addr, master_port = env.get("MASTER_ADDR") or None, env.get("MASTER_PORT") or None
    if world_size > 1 and not (master_addr and master_port):
        missing = [k for k, v in (("MASTER_ADDR", master_addr), ("MASTER_PORT", master_port)) if not v]
        raise GangError(f"{' and '.join(missing)} not set in a gang of {world_size}: the launcher must say where "
                        "rank 0 listens (Volcano's pytorch plugin, or the Kueue Job's headless Service)")
    return RankEnv(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size,
                   group_rank=group_rank, master_addr=master_addr, master_port=master_port)
