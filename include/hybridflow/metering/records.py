"""One per-GPU reading at one instant: what every metering source produces and the ledger stores."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True, slots=True)
class GpuSample:
    """A GPU (or MIG instance) at `ts`, with the pod that held it when the exporter saw one.

    `None` means the source did not report that field (vGPUs have no power or temperature,
    dcgm-exporter 2.x has no model name), never zero. `xid` is the last Xid code (a gauge in
    dcgm-exporter, not a count); `energy_mj` is the counter since boot; ECC counts are totals.
    """

    ts: datetime  # UTC, timezone-aware
    cluster: str
    node: str
    gpu_uuid: str
    gpu_index: int | None
    gpu_model: str | None
    mig_profile: str | None
    mig_instance: str | None
    namespace: str | None
    pod: str | None
    container: str | None
    util_pct: float | None
    mem_used_mib: float | None
    mem_free_mib: float | None
    power_w: float | None
    temp_c: float | None
    energy_mj: float | None
    xid: int | None
    ecc_sbe: int | None
    ecc_dbe: int | None

    def key(self) -> tuple[str, str, str, str, str]:
        """Identity of the reading: the same scrape stored twice has the same key."""
        return (self.cluster, self.node, self.gpu_uuid, self.mig_instance or "", self.ts.isoformat())

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ts"] = self.ts.isoformat()
        return out


@dataclass(frozen=True, slots=True)
class XidCount:
    """An exporter's count of one Xid on one GPU over its own window, as read at `ts`.

    From `DCGM_EXP_XID_ERRORS_COUNT` (or its early name `DCGM_FI_DEV_XID_ERRORS_ACTIVE`): one series
    per Xid seen in the last `window_ms` (the exporter's `--xid-count-window-size`, default 5 min).
    Node health reads these; the ledger does not store them.
    """

    ts: datetime
    cluster: str
    node: str
    gpu_uuid: str
    mig_instance: str | None
    xid: int
    count: int
    window_ms: int | None
