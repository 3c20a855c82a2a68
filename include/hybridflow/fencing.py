"""Clusters declared down: who declared each one, when and why, and every down and up since.

A cluster declared down is fenced: placement gives it no new runs, and while a ``role: primary``
cluster is down the estate is in takeover (the disaster-recovery pool serves critical runs, normal
runs wait, batch runs are paused: :mod:`hybridflow.placement.takeover`). Declaring it up again
(failback) lifts the fence. The record sits below placement and disaster recovery: DR's tasks and
commands write it, placement and the queue waits read it.

The state is one small JSON file, ``<HYBRIDFLOW_HOME>/state/fencing.json``, kept like node health's
cordons (locked while read and written, replaced atomically, each write synced to disk before and
after the rename), so every task, trigger and command on the machine reads the same fence. A fence
file that is empty or cannot be read is an error naming it, never "no cluster is down"::

    {"down": {"<cluster>": {"cluster", "reason", "by", "declared_at", "drain"?}},
     "history": [{"event": "down" | "up", "cluster", "by", "at", ...}, ...]}

Both changes are idempotent: declaring a cluster down that is down already (or up one that is up)
changes nothing and says so. Bad input raises :class:`FencingError` before anything is written.
"""

from __future__ import annotations

import fcntl
import getpass
import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hybridflow.errors import HybridFlowError

STATE_FILE = "fencing.json"
# Failback lifts the fence for placement; serving moves back only through the deploy gate.
SERVING_ON_FAILBACK = ("no endpoint was served on the disaster-recovery side, so none was moved back: serving "
                       "returns to the cluster only through a deploy (its gate and canary steps)")


class FencingError(HybridFlowError):
    """A cluster could not be declared down or up: the argument at fault and the fix are named, and
    nothing was changed."""


@dataclass(frozen=True)
class FenceChange:
    """What one ``declare_down`` / ``lift_fence`` did: ``changed`` False when the cluster was in
    that state already (``record`` is then the standing one)."""

    cluster: str
    state: str  # "down" or "up"
    changed: bool
    record: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"cluster": self.cluster, "state": self.state, "changed": self.changed, "record": dict(self.record)}


def state_path(state_dir: Path | None = None) -> Path:
    """The fence file under ``state_dir`` (default: the settings' state folder)."""
    if state_dir is None:
        from hybridflow.settings import get_settings

        state_dir = get_settings().state_dir
    return Path(state_dir) / STATE_FILE


def _empty() -> dict[str, Any]:
    return {"down": {}, "history": []}


def _unreadable(path: Path, what: str) -> FencingError:
    # An unreadable fence must never read as "no cluster is down": placement would use a fenced cluster.
    return FencingError(
        f"the fence file {path} {what}, so which clusters are declared down is unknown and nothing is placed or "
        "declared until it is repaired: restore it from a backup of the state folder, or, once you know which "
        f"clusters are down, move it aside (mv {path} {path}.bad) and declare those clusters down again "
        "(hybridflow cluster down <cluster> --reason ...)")


def read_fence(path: Path | None = None) -> dict[str, Any]:
    """The fence as last written (``down`` and ``history``); empty when nothing was ever declared
    (no file). A file that is empty, cannot be read or is not a fence raises :class:`FencingError`
    naming it and the fix."""
    path = path or state_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return _empty()
    except (OSError, UnicodeDecodeError) as exc:
        raise _unreadable(path, f"cannot be read ({type(exc).__name__}: {exc})") from exc
    if not text.strip():
        raise _unreadable(path, "is empty (a write cut short, e.g. by a crash or a full disk)")
    try:
        state = json.loads(text)
    except ValueError as exc:
        raise _unreadable(path, f"is not valid JSON ({exc})") from exc
    if not (isinstance(state, dict) and isinstance(state.get("down", {}), dict)
            and isinstance(state.get("history", []), list)):
        raise _unreadable(path, 'is not a fence (expected {"down": {...}, "history": [...]})')
    return {**_empty(), **state}


def down_clusters(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """``{cluster: record}`` of the clusters declared down now."""
    return dict(read_fence(path)["down"])


def _write_durably(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that after a crash or power loss it holds either the old
    fence or the new one, never an empty or partial file: the new bytes reach the disk before the
    rename, and the rename itself before the caller goes on (the folder is synced too)."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


@contextmanager
def _locked(path: Path) -> Iterator[dict[str, Any]]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            state = read_fence(path)
            before = json.dumps(state, sort_keys=True)
            yield state
            if json.dumps(state, sort_keys=True) != before:  # an unchanged fence is not rewritten
                _write_durably(path, json.dumps(state, indent=1, sort_keys=True))
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def estate_or_loaded(estate: Any) -> Any:
    """``estate``, or the one under the settings' config folder when the caller has none."""
    if estate is not None:
        return estate
    from hybridflow.config import load_estate
    from hybridflow.settings import get_settings

    return load_estate(get_settings().config_dir)


def _who(by: str | None) -> str:
    if by and by.strip():
        return by.strip()
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no login name (a container without a passwd entry)
        return "unknown"


def _stamp(now: datetime | None) -> str:
    return (now or datetime.now(UTC)).astimezone(UTC).isoformat(timespec="seconds")


# The longest reason a declaration keeps (the fence file, its history, the Clusters & DR page):
# every way of declaring down (task, CLI, UI form) passes check_down.
REASON_MAX_CHARS = 500


def check_down(estate: Any, cluster: str, reason: str) -> None:
    """Refuse a ``cluster down`` that cannot be right, naming the argument and the fix."""
    names = sorted(estate.clusters)
    dr = [n for n in names if estate.clusters[n].is_dr]
    fenceable = [n for n in names if not estate.clusters[n].is_dr]
    if cluster not in estate.clusters:
        raise FencingError(f"cluster {cluster!r} is not in clusters.yaml; use one of: {', '.join(fenceable)}")
    if estate.clusters[cluster].is_dr:
        raise FencingError(
            f"cluster {cluster!r} is the disaster-recovery pool (role: dr): it takes over when another cluster is "
            f"down and cannot be declared down itself; declare down one of: {', '.join(fenceable)}")
    if not dr:
        raise FencingError(
            "no cluster in clusters.yaml has role: dr, so nothing would take over from a cluster declared down; "
            "add a disaster-recovery pool (role: dr with dr: {min_gpus: N}, docs/placement.md) first")
    if not isinstance(reason, str) or not reason.strip():
        raise FencingError("reason is empty: say why the cluster is declared down (--reason), e.g. "
                           "--reason 'power loss in dc-1'; it is kept with the fence")
    if len(reason) > REASON_MAX_CHARS:
        raise FencingError(f"reason: {len(reason)} characters, over the limit of {REASON_MAX_CHARS}; say why in "
                           "fewer words and keep the details in the incident record")


def declare_down(cluster: str, reason: str, *, by: str | None = None, estate: Any = None,
                 path: Path | None = None, now: datetime | None = None) -> FenceChange:
    """Fence ``cluster``: no new placements there, and takeover while it is a primary. Idempotent:
    a cluster down already keeps its first record (who, when, why) and nothing is written."""
    check_down(estate_or_loaded(estate), cluster, reason)
    with _locked(path or state_path()) as state:
        standing = state["down"].get(cluster)
        if standing is not None:
            return FenceChange(cluster, "down", False, dict(standing))
        record = {"cluster": cluster, "reason": reason.strip(), "by": _who(by), "declared_at": _stamp(now)}
        state["down"][cluster] = record
        state["history"].append({"event": "down", "cluster": cluster, "reason": record["reason"],
                                 "by": record["by"], "at": record["declared_at"]})
        return FenceChange(cluster, "down", True, dict(record))


def record_drain(cluster: str, outcome: Mapping[str, Any], *, path: Path | None = None) -> bool:
    """Keep what draining the cluster did (gangs checkpointed, serving) with its fence record;
    False when the cluster is not down (nothing is written)."""
    with _locked(path or state_path()) as state:
        record = state["down"].get(cluster)
        if record is None:
            return False
        record["drain"] = dict(outcome)
        return True


def lift_fence(cluster: str, serving: dict[str, Any] | None, *, by: str | None = None, path: Path | None = None,
               now: datetime | None = None) -> FenceChange:
    """Record ``cluster`` up again, with what its failback did to serving (``serving``; None: the
    cluster is not in the estate, nothing was tried). Idempotent: a cluster that is not down changes
    nothing, except that a serving failback retried after the fence was lifted is kept in the history.
    The failback itself is :func:`hybridflow.dr.fencing.failback.declare_up`'s, which calls this."""
    with _locked(path or state_path()) as state:
        record = state["down"].pop(cluster, None)
        if record is None:
            if serving is None:
                return FenceChange(cluster, "up", False, {"cluster": cluster})
            event = {"event": "serving failback", "cluster": cluster, "by": _who(by), "at": _stamp(now),
                     "serving": serving}
            state["history"].append(event)  # a retry of the serving failback, the fence lifted already
            return FenceChange(cluster, "up", False, event)
        event = {"event": "up", "cluster": cluster, "by": _who(by), "at": _stamp(now),
                 "down_since": record.get("declared_at"), "down_reason": record.get("reason"),
                 "serving": SERVING_ON_FAILBACK if serving is None else serving}
        state["history"].append(event)
        return FenceChange(cluster, "up", True, event)


def serving_stayed(change: FenceChange) -> list[str]:
    """Why each endpoint still served on the DR side after ``change`` stays there (empty: none)."""
    serving = change.record.get("serving")
    endpoints = serving.get("endpoints", {}) if isinstance(serving, dict) else {}
    return [f"{e}: {o.get('reason')}" for e, o in sorted(endpoints.items()) if o.get("state") == "on dr"]


def fence_status(estate: Any = None, path: Path | None = None) -> dict[str, Any]:
    """Every cluster's state (down with its record, or up), whether the estate is in takeover, and
    the history of declarations: what ``hybridflow cluster status`` prints."""
    estate = estate_or_loaded(estate)
    fence = read_fence(path)
    down = fence["down"]
    clusters = {name: {"role": c.role, "state": "down" if name in down else "up", **({"down": down[name]}
                       if name in down else {})} for name, c in sorted(estate.clusters.items())}
    primaries = sorted(n for n in down if n in estate.clusters and estate.clusters[n].role == "primary")
    return {"takeover": bool(primaries), "primaries_down": primaries,
            "dr_clusters": sorted(n for n, c in estate.clusters.items() if c.is_dr),
            "clusters": clusters, "history": fence["history"]}
