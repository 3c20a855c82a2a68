"""The local backend's slot pool: a cluster's GPUs as slots in a JSON file under flock, shared by every
launcher on the machine, with priority-ordered tickets and estate-wide team caps."""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hybridflow.backends.base import ClusterLoad, QueueStanding, standing_in
from hybridflow.backends.local_processes import _start_ticks, pid_alive
from hybridflow.errors import GangError


# Small state files (slot pools, job records), replaced whole so a reader never sees half of one.
def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _atomic_write_json(path: Path, body: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    tmp.write_text(json.dumps(body, indent=2, sort_keys=True))
    tmp.replace(path)


def entry_alive(entry: dict) -> bool:
    """A holding or ticket still stands: its process runs or, for a ticket kept for a deferred task
    (:meth:`LocalSlotPool.keep_ticket`), its deadline has not passed."""
    if entry.get("keep_until") is not None:
        return float(entry["keep_until"]) >= time.time()
    return pid_alive(int(entry.get("pid") or 0), entry.get("pid_start"))


PRIORITY_RANK = {"critical": 0, "normal": 1, "batch": 2}
TEAMS_LOCK = "_teams.lock"


class LocalSlotPool:
    """``capacity`` slots of one cluster, shared across processes via a JSON file under flock.

    flock on a freshly opened file excludes other processes *and* other threads of this process
    (each open is its own lock owner), unlike lockf.

    Gangs that wait leave a ticket (``queue=True``); slots go to tickets in priority then arrival
    order, and a gang never overtakes a ticket ranked ahead of it (no starving a big gang behind
    a stream of small ones). A ticket held back only by its own team's cap does not block others.
    Team caps span every cluster under ``state_dir``: acquires with a cap take one estate-wide lock
    first (always before a cluster lock, so two locks never deadlock), and only acquires raise a
    team's count, so the count read under that lock is exact.
    """

    def __init__(self, state_dir: Path, cluster: str, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"cluster {cluster!r} needs at least one slot, got capacity {capacity}")
        self.cluster = cluster
        self.capacity = capacity
        self.dir = Path(state_dir) / "slots"
        self.path = self.dir / f"{cluster}.json"
        self.lock_path = self.dir / f"{cluster}.lock"

    @contextmanager
    def _flock(self, path: Path) -> Iterator[None]:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(path, "a+") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    @contextmanager
    def _locked(self) -> Iterator[dict]:
        with self._flock(self.lock_path):
            try:
                state = json.loads(self.path.read_text())
            except FileNotFoundError:
                state = {}
            state.setdefault("holdings", {})
            state.setdefault("waiting", {})
            before = json.dumps(state, sort_keys=True)
            self._reclaim_dead(state["holdings"])
            self._reclaim_dead(state["waiting"])
            yield state
            if json.dumps(state, sort_keys=True) != before:
                _atomic_write_json(self.path, state)

    def _reclaim_dead(self, holdings: dict) -> None:
        for name, h in list(holdings.items()):
            if not entry_alive(h):
                del holdings[name]

    def _snapshot(self) -> dict:
        """The pool's state as it stands, its dead entries left out, read under the lock and never
        written: what a waiting gang's trigger asks of the queue changes nothing in it."""
        with self._flock(self.lock_path):
            state = _read_json(self.path) or {}
        state = {"holdings": dict(state.get("holdings") or {}), "waiting": dict(state.get("waiting") or {})}
        self._reclaim_dead(state["holdings"])
        self._reclaim_dead(state["waiting"])
        return state

    def _team_held_elsewhere(self, team: str) -> int:
        """GPUs ``team`` holds on the other clusters' pools (read under the teams lock)."""
        held = 0
        for path in self.dir.glob("*.json"):
            if path == self.path:
                continue
            try:
                holdings = json.loads(path.read_text()).get("holdings", {})
            except (FileNotFoundError, ValueError):
                continue
            held += sum(
                int(h["slots"]) for h in holdings.values()
                if h.get("team") == team and pid_alive(int(h["pid"]), h.get("pid_start"))
            )
        return held

    def try_acquire(
        self,
        job_name: str,
        n: int,
        pid: int | None = None,
        *,
        priority: str = "normal",
        team: str | None = None,
        team_cap: int | None = None,
        queue: bool = False,
        since: float | None = None,
        team_outside: int = 0,
        private_only: bool = False,
        movable: bool = False,
    ) -> bool:
        """Take ``n`` slots for ``job_name`` all at once, or none. Idempotent per job name: taking
        slots the job already holds moves them to ``pid``.

        ``queue=True`` leaves (or refreshes) a ticket when the gang cannot start yet; it is removed
        when the gang is admitted, by :meth:`withdraw`, or when its process dies (a ticket of
        :meth:`keep_ticket` lives by its own deadline instead). ``since`` keeps a gang's place when
        its ticket is written again by another process (a task resumed from its wait).
        """
        self._check(job_name, n, priority)
        pid = os.getpid() if pid is None else pid

        def take(state: dict, elsewhere: int) -> bool:
            ticket = state["waiting"].get(job_name)
            first = ticket["since"] if ticket else (since or time.time())
            admitted, over_cap = self._verdict(state, job_name, n, priority, team, team_cap, elsewhere, first)
            if not admitted:
                if queue:
                    state["waiting"][job_name] = {"slots": n, "priority": priority, "team": team, "over_cap": over_cap,
                                                  "since": first, "pid": pid, "pid_start": _start_ticks(pid),
                                                  "private_only": private_only}
                return False
            state["waiting"].pop(job_name, None)
            mine = state["holdings"].get(job_name)
            state["holdings"][job_name] = {
                "slots": n, "pid": pid, "pid_start": _start_ticks(pid), "priority": priority, "team": team,
                "since": mine["since"] if mine else time.time(),
                "queued_since": mine.get("queued_since", first) if mine else first,
                "movable": movable,  # may be moved to a public cluster to make room (placement.reserve)
            }
            return True

        return self._under_locks(team, team_cap, team_outside, take)

    def keep_ticket(self, job_name: str, n: int, *, since: float, keep_s: float, priority: str = "normal",
                    team: str | None = None, team_cap: int | None = None, team_outside: int = 0,
                    private_only: bool = False) -> None:
        """The gang's ticket while its task waits deferred, kept for ``keep_s`` whatever process wrote
        it (the task writes it again each admission window; a task that is gone stops doing so, and
        the ticket lapses). Never takes slots: the resumed task does (:meth:`try_acquire`)."""
        self._check(job_name, n, priority)

        def keep(state: dict, elsewhere: int) -> bool:
            ticket = state["waiting"].get(job_name)
            first = min(ticket["since"], since) if ticket else since
            _, over_cap = self._verdict(state, job_name, n, priority, team, team_cap, elsewhere, first)
            state["waiting"][job_name] = {"slots": n, "priority": priority, "team": team, "over_cap": over_cap,
                                          "since": first, "pid": None, "keep_until": time.time() + keep_s,
                                          "private_only": private_only}
            return True

        self._under_locks(team, team_cap, team_outside, keep)

    def admissible(self, job_name: str, n: int, *, priority: str = "normal", team: str | None = None,
                   team_cap: int | None = None, team_outside: int = 0) -> bool:
        """Whether :meth:`try_acquire` would admit the gang now, read without changing the pool."""
        self._check(job_name, n, priority)
        elsewhere = (self._team_held_elsewhere(team) + team_outside) if team is not None and team_cap is not None else 0
        state = self._snapshot()
        ticket = state["waiting"].get(job_name)
        first = ticket["since"] if ticket else time.time()
        return self._verdict(state, job_name, n, priority, team, team_cap, elsewhere, first)[0]

    def _check(self, job_name: str, n: int, priority: str) -> None:
        if n < 1:
            raise ValueError(f"a gang needs at least one worker, got {n}")
        if n > self.capacity:
            raise GangError(
                f"gang {job_name!r} needs {n} slots but cluster {self.cluster!r} has only "
                f"{self.capacity}; request at most {self.capacity} workers"
            )
        if priority not in PRIORITY_RANK:
            raise ValueError(f"unknown priority {priority!r}; use one of {', '.join(PRIORITY_RANK)}")

    def _under_locks(self, team: str | None, team_cap: int | None, team_outside: int,
                     change: Callable[[dict, int], bool]) -> bool:
        """``change(state, GPUs the team holds elsewhere)`` under the cluster's lock, and the estate-wide
        teams lock first when a team cap applies (always in that order, so two locks never deadlock)."""
        if team is not None and team_cap is not None:
            with self._flock(self.dir / TEAMS_LOCK):
                elsewhere = self._team_held_elsewhere(team) + team_outside
                with self._locked() as state:
                    return change(state, elsewhere)
        with self._locked() as state:
            return change(state, 0)

    def _verdict(self, state: dict, job_name: str, n: int, priority: str, team: str | None, team_cap: int | None,
                 team_elsewhere: int, since: float) -> tuple[bool, bool]:
        """(admitted now, held by its team's cap): slots go to tickets in priority then arrival order."""
        holdings, waiting = state["holdings"], state["waiting"]
        used = sum(int(h["slots"]) for name, h in holdings.items() if name != job_name)
        over_cap = False
        if team_cap is not None:
            team_here = sum(int(h["slots"]) for name, h in holdings.items() if name != job_name and h.get("team") == team)
            over_cap = team_elsewhere + team_here + n > team_cap
        my_rank = (PRIORITY_RANK[priority], since)
        ahead = [name for name, t in waiting.items() if name != job_name and not t.get("over_cap")
                 and (PRIORITY_RANK.get(t.get("priority"), 1), t["since"]) < my_rank]
        if job_name in holdings:
            return True, over_cap
        return not (over_cap or ahead or used + n > self.capacity), over_cap

    def withdraw(self, job_name: str) -> None:
        """Drop the gang's waiting ticket (it gave up or failed over)."""
        with self._locked() as state:
            state["waiting"].pop(job_name, None)

    def release(self, job_name: str) -> None:
        with self._locked() as state:
            state["holdings"].pop(job_name, None)

    def usage(self) -> int:
        with self._locked() as state:
            return sum(int(h["slots"]) for h in state["holdings"].values())

    def queued(self) -> int:
        """Slots asked for by gangs waiting for admission."""
        with self._locked() as state:
            return sum(int(t["slots"]) for t in state["waiting"].values())

    def holdings(self) -> dict[str, dict]:
        with self._locked() as state:
            return dict(state["holdings"])

    def live_holdings(self) -> dict[str, dict]:
        """The holdings of live holders, read without reclaiming the dead ones (nothing is written)."""
        return self._snapshot()["holdings"]

    def waiting(self) -> dict[str, dict]:
        with self._locked() as state:
            return dict(state["waiting"])

    def load(self) -> ClusterLoad:
        """Held, queued and per-team slots, and the waiting gangs in admission order (a gang held
        only by its team's cap does not block the others: it comes last)."""
        with self._locked() as state:
            holdings, waiting = dict(state["holdings"]), dict(state["waiting"])
        teams: dict[str, int] = {}
        for h in holdings.values():
            if h.get("team"):
                teams[h["team"]] = teams.get(h["team"], 0) + int(h["slots"])
        order = sorted(waiting.items(), key=lambda kv: (bool(kv[1].get("over_cap")),
                                                        PRIORITY_RANK.get(kv[1].get("priority"), 1), kv[1]["since"]))
        return ClusterLoad(
            cluster=self.cluster, capacity=self.capacity, used=sum(int(h["slots"]) for h in holdings.values()),
            queued=sum(int(t["slots"]) for t in waiting.values()), teams=teams,
            waiting=tuple((name, int(t["slots"]), t.get("priority") or "normal", t.get("team")) for name, t in order),
            private_only_queued=sum(int(t["slots"]) for t in waiting.values() if t.get("private_only")),
        )

    def standing(self, job_name: str) -> QueueStanding:
        load = self.load()
        over_cap = bool(self.waiting().get(job_name, {}).get("over_cap"))
        found = standing_in(load, job_name)
        return QueueStanding(found.cluster, found.position, found.gpus_ahead, found.free, found.capacity, over_cap)
