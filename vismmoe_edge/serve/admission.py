"""Who gets a queue slot when the queue is full: first come, first served across retries.

A bounded queue answers 429 when full. Clients that honour Retry-After come back, but so do new arrivals, and
whoever happens to arrive just as a slot frees takes it: an unlucky client can be refused for minutes. So a
refused request gets a ticket (keyed by its client and body, which a retry repeats), tickets are served in
order, and a free slot is held for the oldest ticket until it comes back or its ticket expires. Held slots never
starve the worker: once fewer than a quarter of the slots are taken, anyone is admitted. Retry-After is the
expected time until the slot for that ticket frees: the running job's remaining time plus one median service time
per slot ahead of it (a little less, so that the client is back before its slot is).
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

SERVICE_SAMPLES = 32  # recent service times behind the median
DEFAULT_SERVICE_S = 1.0  # before anything has been served
MIN_SAMPLES = 3  # fewer service times than this: the wait is unknown, so ask for a retry within a second
EARLY = 0.9  # Retry-After as a share of the expected wait: a client back early keeps its place


@dataclass
class Ticket:
    expires: float  # time.monotonic()


class ServiceTimes:
    """Seconds per request (start of work to reply) of the last few requests."""

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=SERVICE_SAMPLES)

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)

    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else DEFAULT_SERVICE_S


class Admission:
    """Queue-slot decisions for the worker; the caller holds the lock that guards the queue."""

    def __init__(self, capacity: int, max_tickets: int = 1024, clock=time.monotonic) -> None:
        self.capacity = capacity
        self.low_water = max(1, capacity // 4)  # fewer waiting than this: admit anyone, the worker must not idle
        self.max_tickets = max_tickets
        self.clock = clock
        self.tickets: OrderedDict[str, Ticket] = OrderedDict()  # oldest first
        self.times = ServiceTimes()

    def expected_wait(self, slots_ahead: int, running_elapsed: float | None) -> float:
        """Seconds until `slots_ahead` more queue slots have freed (one frees each time a job finishes)."""
        median = self.times.median()
        first = max(0.05 * median, median - running_elapsed) if running_elapsed is not None else median
        return first + max(0, slots_ahead - 1) * median

    def decide(self, key: str, waiting: int, running_elapsed: float | None) -> float | None:
        """None: admit now. Otherwise the seconds the client should wait before retrying."""
        now = self.clock()
        for stale in [k for k, t in self.tickets.items() if t.expires < now]:
            del self.tickets[stale]
        free = self.capacity - waiting
        order = list(self.tickets)
        rank = order.index(key) if key in self.tickets else None
        their_turn = (rank is not None and rank < free) or (rank is None and len(order) < free)
        if free > 0 and (their_turn or waiting < self.low_water):
            self.tickets.pop(key, None)
            return None
        if rank is None:
            rank = len(order)
            if rank >= self.max_tickets:  # too many clients waiting to keep track of: no place held
                return self.expected_wait(rank + 1 - free, running_elapsed)
            self.tickets[key] = Ticket(0.0)
        wait = EARLY * self.expected_wait(rank + 1 - max(free, 0), running_elapsed)
        if len(self.times.samples) < MIN_SAMPLES:
            wait = min(wait, 1.0)  # a guess would send the last clients away for far too long (a cold start)
        grace = max(5.0, 2 * self.times.median())  # a client that does not come back by then loses its place
        self.tickets[key].expires = now + wait + grace
        return wait

    @property
    def held(self) -> int:
        return len(self.tickets)


def client_key(peer: str, body: bytes) -> str:
    """What identifies a retry: the same client sending the same body."""
    return hashlib.sha256(peer.encode() + b"\0" + body).hexdigest()
