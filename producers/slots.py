"""The producer's slot pool: K group slots, counted in trajectories, claimed eagerly.

A producer holds ``slots`` group slots (its share of K = floor(C*E/G), see
``strawq.producers.budget``), counted as ``slots * G`` trajectories. A claimed group
*demands* G trajectories (a resumed partial only its unfinished samples); each sample
*acquires* one when it starts generating and releases it when its generation ends, so one
long-tail sample never blocks a new claim once enough trajectories are free (verl's
continuous loop). Waiting samples are served FIFO.

Eager claiming (the default) claims a new group as soon as any trajectory is free and no
claimed sample still waits for one, so the engines never idle on slot granularity; strict
claiming only claims whole groups.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from strawq.producers.meter import SlotMeter


@dataclass(eq=False)
class SlotHold:
    """One group's share of the pool."""

    #: trajectories this group's running samples hold
    reserved: int = 0
    #: samples claimed but not yet holding a trajectory (counted against new claims)
    demand: int = 0


class SlotPool:
    """Trajectory slots of one producer. Loop-side methods run on the producer's event
    loop; ``busy``, ``utilisation`` and ``reset_window`` may be read from any thread."""

    def __init__(self, slots: int, group_size: int, *, eager: bool,
                 clock: Callable[[], float] = time.monotonic,
                 kick: Callable[[], None] = lambda: None) -> None:
        self.group_size = group_size
        self.eager = eager
        self._slots = slots
        self._kick = kick
        self._demand = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._lock = threading.Lock()  # guards the meter against cross-thread reads
        self._meter = SlotMeter(clock)
        self._meter.set_capacity(slots * group_size)

    @property
    def slots(self) -> int:
        return self._slots

    @property
    def capacity(self) -> int:
        """Trajectories: slots * G."""
        return self._slots * self.group_size

    @property
    def busy(self) -> int:
        with self._lock:
            return self._meter.busy

    @property
    def demand(self) -> int:
        return self._demand

    def utilisation(self) -> float:
        with self._lock:
            return self._meter.utilisation()

    def reset_window(self) -> None:
        with self._lock:
            self._meter.reset()

    def set_slots(self, n: int) -> None:
        """Fewer slots than busy: nothing is preempted; claims wait until enough end."""
        with self._lock:
            self._slots = n
            self._meter.set_capacity(n * self.group_size)
        self.wake_all()
        self._kick()

    def claimable_groups(self) -> int:
        """Groups the trajectories free now allow to claim (eager or strict)."""
        free = self.capacity - self._meter.busy - self._demand
        if free <= 0:
            return 0
        if self.eager:
            return -(-free // self.group_size)
        return free // self.group_size

    def set_demand(self, hold: SlotHold, n: int) -> None:
        self._demand += n - hold.demand
        hold.demand = n

    async def acquire(self, hold: SlotHold, halted: Callable[[], bool]) -> bool:
        """Wait (FIFO) for a free trajectory; False once ``halted()`` (the group is being
        parked, given up or has failed). Either way one unit of demand is consumed."""
        loop = asyncio.get_running_loop()
        try:
            while self._meter.busy >= self.capacity:
                if halted():
                    return False
                fut: asyncio.Future[None] = loop.create_future()
                self._waiters.append(fut)
                try:
                    await asyncio.wait_for(fut, 0.25)
                except asyncio.TimeoutError:
                    pass
            with self._lock:
                self._meter.add(1)
            hold.reserved += 1
            return True
        finally:
            self.set_demand(hold, hold.demand - 1)

    def release(self, hold: SlotHold, n: int = 1) -> None:
        """Give back ``n`` of the group's trajectories (at most what it holds)."""
        n = min(n, hold.reserved)
        if n <= 0:
            return
        with self._lock:
            self._meter.add(-n)
        hold.reserved -= n
        for _ in range(n):
            self._wake_one()
        self._kick()

    def close(self, hold: SlotHold) -> None:
        """The group left the producer: release everything it holds and demands."""
        self.release(hold, hold.reserved)
        self.set_demand(hold, 0)

    def wake_all(self) -> None:
        """Wake every waiting sample (to re-check its group's state or the capacity)."""
        while self._waiters:
            f = self._waiters.popleft()
            if not f.done():
                f.set_result(None)

    def _wake_one(self) -> None:
        while self._waiters:
            f = self._waiters.popleft()
            if not f.done():
                f.set_result(None)
                return
