"""The queue for a slot, as its clients and the metrics see it: how long each waiting session waits, estimated
from measured block times, and the group's counts. For clients and operators only: no plan depends on a clock."""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from .settings import ServingSettings
from .scheduler import Scheduler
from .sessions import WAITING, SharedSession

UNKNOWN_WAIT_S = -1.0  # no block measured yet since the model loaded
UNMEASURED_RETRY_S = 5.0  # a full queue's retry hint before any block was measured
MAX_RETRY_S = 60.0  # a refused client is asked back at least this often: slots may free sooner than estimated


def retry_after_s(wait_s: float) -> float:
    """A full queue's retry hint from the estimated wait of the place behind its last (UNKNOWN_WAIT_S: none yet)."""
    return min(wait_s, MAX_RETRY_S) if wait_s > 0 else UNMEASURED_RETRY_S


class Average:
    """A moving average of measured seconds (a batch's wall time; an open-ended session's life)."""

    def __init__(self, weight: float = 0.3) -> None:
        self.weight = weight
        self.value: float | None = None

    def observe(self, seconds: float) -> None:
        self.value = seconds if self.value is None else (1 - self.weight) * self.value + self.weight * seconds


@dataclass
class Clocks:
    """What the queue's estimates are made of, measured on this rank."""

    batch: Average = field(default_factory=Average)  # one batch's wall time (its forwards, the exchanges)
    life: Average = field(default_factory=Average)  # an open-ended steered session's life, from its opening


def slot_waits(held_s: list[float], free: int, queued_s: list[float]) -> list[float]:
    """When each waiting session gets a slot (seconds from now), in queue order: the slots' holders release them
    after `held_s` (`free` slots are free now), and each waiting session, once it has a slot, holds it for its own
    entry of `queued_s`."""
    slots = [0.0] * free + list(held_s)
    heapq.heapify(slots)
    waits = []
    for duration in queued_s:
        start = heapq.heappop(slots)
        waits.append(start)
        heapq.heappush(slots, start + duration)
    return waits


def queue_waits(scheduler: Scheduler, clocks: Clocks, opened_s: dict[str, float], now: float,
               extra: int = 0) -> list[float]:
    """The estimated wait of each session in `scheduler`'s queue, and of `extra` more behind it (a refused
    session's retry time); UNKNOWN_WAIT_S each until a batch was timed. `opened_s`: when each live session was
    opened here. A session with a set length holds its slot for its blocks left; an open-ended one for the
    measured life of those that ended (before any: session_idle_timeout_s), less its age."""
    settings = scheduler.settings
    waiting = scheduler.waiting()
    if clocks.batch.value is None:
        return [UNKNOWN_WAIT_S] * (len(waiting) + extra)
    live = [s for s in scheduler.table.values() if s.holds_slot]
    # A slot's session runs one block every round: each batch serves max_batch sessions of those that hold one.
    round_s = clocks.batch.value * max(1, math.ceil(len(live) / settings.max_batch))
    life_s = clocks.life.value if clocks.life.value is not None else settings.session_idle_timeout_s

    def hold_s(s: SharedSession, age_s: float) -> float:
        if s.num_blocks:
            return max(0, s.num_blocks - s.computed) * round_s
        return max(round_s, min(life_s, settings.max_session_s) - age_s)

    held = [hold_s(s, now - opened_s.get(s.id, now)) for s in live]
    queued = [hold_s(s, 0.0) for s in waiting] + [round_s] * extra
    return slot_waits(held, max(0, settings.max_sessions - len(live)), queued)


@dataclass(frozen=True)
class QueueCounts:
    """The group's sessions by status (the same on every rank), for the metrics port: a parked or returning world
    counts as parked alone; one its client ended, its queued steps to run, as ending."""

    pending: int  # WAITING_SEAT, WAITING_SLOT
    active: int  # RUNNING, PARKING
    ending: int  # its client ended it (on a slot or waiting for one)
    waiting: int  # the queue's length (a session whose client ended it before its slot waits too)
    free_slots: int
    waited_s: list[float] = field(default_factory=list)  # this rank's sessions that left the queue since the last
    parked: int = 0  # worlds parked off their slot (docs/serving.md, "Parking")

    @classmethod
    def of(cls, scheduler: Scheduler, settings: ServingSettings, waited_s: list[float]) -> QueueCounts:
        table = list(scheduler.table.values())
        on = [s for s in table if not s.in_park and s.ending is None]
        holding = sum(s.holds_slot for s in table)
        return cls(sum(s.status in WAITING for s in on), sum(s.holds_slot for s in on),
                   sum(not s.in_park and s.ending is not None for s in table), len(scheduler.waiting()),
                   max(0, settings.max_sessions - holding), waited_s, sum(s.in_park for s in table))
