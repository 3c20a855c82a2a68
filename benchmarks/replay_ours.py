""""ours" in the trace replay: what the product does at each event of benchmarks/placement_trace.py's
model. A run is placed on arrival by :func:`hybridflow.placement.choose_cluster` with the GPUs in use
and queued, the private capacity kept for runs bound to it (:func:`hybridflow.placement.reserve.reservations`
from the queue and the newest bound admission, as the ledger holds it) and, for a run with
``start_by``, the waits :func:`hybridflow.waits.estimate_waits` expects from the replay's own history;
a run waiting on the private cluster looks for room elsewhere every admission window and gives up
at ``max_queue_wait_s``; a bound run at the head of the private queue moves interruptible runs off to
make room, as the local backend does."""

from __future__ import annotations

from trace_replay import (
    GIVE_UP,
    PRIVATE,
    PUBLIC,
    RECHECK,
    Job,
    Rec,
    Replay,
    Result,
    _ts,
    pool_order,
)

from hybridflow.backends.base import ClusterLoad
from hybridflow.config import Estate
from hybridflow.errors import PlacementError
from hybridflow.placement import choose_cluster
from hybridflow.placement.reserve import reservations
from hybridflow.waits import estimate_waits

# Rules whose verdict can change with load. A waiting gang that every other cluster refuses by some
# other rule (sovereignty, region, excluded...) gets the same answer at every recheck: skip them.
LOAD_RULES = frozenset({"room", "reachable", "reservation"})


def _stuck(err: PlacementError) -> bool:
    """Every cluster fails a rule that no change of load can lift (sovereignty, region, excluded...)."""
    candidates = getattr(err, "candidates", None)
    if not candidates:
        return False
    return all(any(v != "pass" and k not in LOAD_RULES for k, v in c["rules"].items()) for c in candidates)


class Ours:
    """The product's placement, queue and making-room rules over one :class:`Replay`."""

    def __init__(self, estate: Estate) -> None:
        self.estate = estate
        self.cap = estate.clusters[PRIVATE].total_gpus
        self.public_cap = estate.clusters[PUBLIC].total_gpus
        self.training, self.placement = estate.pipeline.training, estate.pipeline.placement
        self.timeout = self.training.gang_admission_timeout_s
        # The first look comes after one admission window (the backend blocks that long), then the
        # triggerer gives up at max_queue_wait_s.
        self.give_up_after = max(self.timeout, self.training.max_queue_wait_s)
        self.moved_why = {PRIVATE: f"gang not admitted within {self.timeout} s"}
        self.budget = self.placement.reservation.move_budget
        # A moved gang commits a checkpoint on SIGTERM before it stops; charged here as a whole
        # checkpoint interval done again (the most a move may cost), on the cluster it moves to.
        self.lost_s = self.training.interruptible_checkpoint_every_s
        self.room_why = {PRIVATE: "making room for work that may run only on private clusters"}

    def usage(self, sim: Replay) -> tuple[dict, dict]:
        return {PRIVATE: sim.used, PUBLIC: sim.public_used}, {PRIVATE: sim.queued}

    def kept(self, sim: Replay, rec: Rec) -> dict | None:
        """The private capacity kept for runs bound to it, as placement.reserve reads it in the product:
        the live queue's private-only GPUs and the newest private-only admission (the ledger's)."""
        if rec.job.bound:
            return None
        loads = {PRIVATE: ClusterLoad(PRIVATE, self.cap, used=sim.used, queued=sim.queued,
                                      private_only_queued=sim.bound_queued),
                 PUBLIC: ClusterLoad(PUBLIC, self.public_cap, used=sim.public_used)}
        arrivals = {} if sim.last_bound_arrival is None else {PRIVATE: _ts(sim.last_bound_arrival)}
        return reservations(self.estate, loads, arrivals, now=_ts(sim.now))

    def start_on(self, sim: Replay, rec: Rec, decision, seconds: float | None = None) -> None:
        sim.start(rec, "private" if decision.location == "private" else "spot" if decision.spot else "on_demand",
                  seconds)

    def arrive(self, sim: Replay, rec: Rec) -> None:
        used, queued = self.usage(sim)
        waits = None
        if rec.job.start_by is not None:
            cfg = self.placement
            loads = {PRIVATE: ClusterLoad(PRIVATE, self.cap, used=sim.used, queued=sim.queued),
                     PUBLIC: ClusterLoad(PUBLIC, self.public_cap, used=sim.public_used)}
            waits = estimate_waits(sim.window(cfg.wait_history_days), loads, rec.job.gpus, quantile=cfg.wait_quantile,
                                   min_samples=cfg.wait_min_samples, days=cfg.wait_history_days)
        try:
            decision = choose_cluster(rec.job.run, self.estate, used, queued_gpus=queued, waits=waits,
                                      reservations=self.kept(sim, rec))
        except PlacementError:
            rec.refused = True
            return
        if decision.cluster != PRIVATE:
            self.start_on(sim, rec, decision)
            return
        sim.enqueue(rec, pool_order(rec, sim.now))
        if rec.waiting:
            sim.push(sim.now + self.timeout, RECHECK, rec)
            sim.push(sim.now + self.give_up_after, GIVE_UP, rec)

    def recheck(self, sim: Replay, rec: Rec) -> None:
        if rec.stuck:
            return
        used, queued = self.usage(sim)
        try:
            decision = choose_cluster(rec.job.run, self.estate, used, queued_gpus=queued, exclude=self.moved_why,
                                      require_room=True, reservations=self.kept(sim, rec))
        except PlacementError as err:
            rec.stuck = _stuck(err)
            if not rec.stuck:
                sim.push(sim.now + self.timeout, RECHECK, rec)  # keeps its place, looks again next window
            return
        sim.withdraw(rec)
        rec.moves += 1
        self.start_on(sim, rec, decision)

    def give_up(self, sim: Replay, rec: Rec) -> None:
        sim.withdraw(rec)
        rec.gave_up_at = sim.now

    def make_room(self, sim: Replay, head: Rec) -> None:
        """As the local backend's _make_room: the queue's head may run only here and does not fit, so
        the newest movable gangs (interruptible, may run public, moved fewer than move_budget times)
        are checkpointed and moved off, if that is enough; each one's task places it again."""
        if not head.job.bound:
            return
        movable = sorted((r for r in sim.running_private.values()
                          if r.job.interruptible and not r.job.bound and r.moves < self.budget),
                         key=lambda r: -r.since)
        free = sim.cap - sim.used
        if free + sum(r.job.gpus for r in movable) < head.job.gpus:
            return
        for victim in movable:
            if free >= head.job.gpus:
                break
            left = sim.stop_private(victim, self.lost_s)
            free += victim.job.gpus
            victim.moves += 1
            used, queued = self.usage(sim)
            decision = choose_cluster(victim.job.run, self.estate, used, queued_gpus=queued, exclude=self.room_why,
                                      require_room=True)
            self.start_on(sim, victim, decision, left)


def ours(jobs: list[Job], estate: Estate) -> Result:
    policy = Ours(estate)
    sim = Replay(jobs, policy.cap, record_history=True)
    sim.make_room = policy.make_room if policy.budget > 0 else None
    sim.run(policy.arrive, policy.recheck, policy.give_up)
    return Result("ours", sim.recs, policy.cap, sim.end)
