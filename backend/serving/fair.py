"""Fairness between keys, as the scheduler decides it (pure, and clock-free but for the boundary's time that travels
in the events): who gets the next free slot, and how many blocks a key computed in the last hour.

The queue is fair between keys: a free slot goes to the key served least recently (a key never served, or not since
its sessions all ended, first), to its oldest waiting session; a key at its `sessions` cap (its parked worlds count) is
passed over until one of its own sessions ends. So one key's many waiting sessions do not starve another key's one.
Without keys every session has the same (empty) name and the queue is first come, first served.
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from .sessions import SharedSession

HOUR_S = 3600.0


def at_cap(s: SharedSession, holding: Counter[str]) -> bool:
    cap = s.principal.quota.sessions
    return cap is not None and holding[s.user] >= cap


def fair_order(waiting: list[SharedSession], live: list[SharedSession], last_served: dict[str, int], free: int,
               whole_queue: bool = False, parked: Iterable[SharedSession] = ()) -> list[SharedSession]:
    """Who of the waiting sessions (arrival order) gets the `free` slots now (a capped key's wait for its own).
    whole_queue: the whole queue in the order it gets slots if nothing else arrives, the slots of `live` freeing in
    their order (the round robin's: the best guess without a clock), then the parked ones' caps. `last_served`: each
    key's last turn. `parked`: worlds off their slot, which count against their key's sessions as `live` ones do."""
    arrival = {s.id: n for n, s in enumerate(waiting)}
    queues: dict[str, deque[SharedSession]] = {}
    for s in waiting:
        queues.setdefault(s.user, deque()).append(s)
    holding = Counter(s.user for s in (*live, *parked))
    releases, parked_ends = deque(live), deque(parked)
    served, turn = dict(last_served), max(last_served.values(), default=0)
    order: list[SharedSession] = []
    while queues:
        eligible = [name for name, q in queues.items() if not at_cap(q[0], holding)]
        if free > 0 and eligible:
            name = min(eligible, key=lambda n: (served.get(n, -1), arrival[queues[n][0].id]))
            s = queues[name].popleft()
            order.append(s)
            releases.append(s)
            holding[name] += 1
            free -= 1
            turn += 1
            served[name] = turn
            if not queues[name]:
                del queues[name]
        elif whole_queue and releases:
            holding[releases.popleft().user] -= 1
            free += 1
        elif whole_queue and parked_ends:  # a parked world ends at last: its key's cap, no slot
            holding[parked_ends.popleft().user] -= 1
        else:
            break
    return order


@dataclass
class HourlyUsage:
    """Blocks computed per key name over the last hour of boundary time (the events' clock, the same on every
    rank), for the keys with a blocks_per_hour limit."""

    entries: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)  # name -> (boundary time, blocks)

    def used(self, name: str, now: float) -> int:
        entries = self.entries.get(name)
        if not entries:
            return 0
        while entries and entries[0][0] <= now - HOUR_S:
            entries.popleft()
        return sum(n for _, n in entries)

    def add(self, name: str, now: float, blocks: int = 1) -> None:
        entries = self.entries.setdefault(name, deque())
        if entries and entries[-1][0] == now:
            entries[-1] = (now, entries[-1][1] + blocks)
        else:
            entries.append((now, blocks))

    def retry_after_s(self, name: str, limit: int, now: float) -> float:
        """When the key may compute a block again: its oldest blocks age out of the hour until it is below limit."""
        over = self.used(name, now) - limit + 1
        for at, blocks in self.entries.get(name, ()):
            over -= blocks
            if over <= 0:
                return max(0.0, at + HOUR_S - now)
        return 0.0

    def forget(self, names: Iterable[str], now: float) -> None:
        """Drop the keys whose hour holds nothing (their ledger would only grow the table)."""
        for name in list(names):
            if not self.used(name, now):
                self.entries.pop(name, None)
