"""Turn checkpoints on the producer side: when a held group is saved between turns.

A ``TurnSaver`` belongs to one held group (``ActiveGroup.turns``). The generate context
calls ``boundary`` at every turn boundary (a turn ended, a tool result arrived) *before*
the sample's next piece of work, so a sample that ends there saves nothing, and
``before_tool`` before a tool that is not idempotent runs (its journal entry must be
durable before its effect can happen). ``ToolsConfig.checkpoint_every_*`` sets the cadence.
The record, its fencing and its cleanup are ``strawq.turns``.

A save snapshots the whole group synchronously on the event loop (``GroupRun.to_group``,
every sample's trajectory and environment snapshot included), then publishes it on the
I/O thread; saves of one group are serialised, and a boundary whose state a save already
covers saves nothing more.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from strawq.turns import TurnLog

if TYPE_CHECKING:
    from strawq.producers.group import GroupRun
    from strawq.producers.meter import StatsBook
    from strawq.producers.offload import Offload
    from strawq.producers.producer_config import ToolsConfig

log = logging.getLogger(__name__)


class TurnSaver:
    """Saves one held group's turn checkpoints at the configured cadence."""

    def __init__(self, turn_log: TurnLog, cfg: ToolsConfig, io: Offload, book: StatsBook,
                 producer: str, clock: Any = time.monotonic) -> None:
        self.log = turn_log
        self.cfg = cfg
        self.io = io
        self.book = book
        self.producer = producer
        self.clock = clock
        self._lock = asyncio.Lock()
        self._boundaries = 0
        self._requested = 0
        self._saved = 0
        self._tokens_at_save = -1
        self._saved_at = clock()

    def _due(self, run: GroupRun) -> bool:
        c = self.cfg
        tokens = sum(s.response_length for s in run.samples)
        if self._tokens_at_save < 0:
            self._tokens_at_save = tokens
        return bool((c.checkpoint_every_turns and self._boundaries >= c.checkpoint_every_turns)
                    or (c.checkpoint_every_tokens
                        and tokens - self._tokens_at_save >= c.checkpoint_every_tokens)
                    or (c.checkpoint_every_s
                        and self.clock() - self._saved_at >= c.checkpoint_every_s))

    async def boundary(self, run: GroupRun, version: int, *, force: bool = False) -> bool:
        """A turn boundary of one of the group's samples: save when the cadence says so
        (``force``: always). True when a save covering this state was written."""
        self._boundaries += 1
        if not force and not self._due(run):
            return False
        self._requested += 1
        mine = self._requested
        async with self._lock:
            if self._saved >= mine:
                return True  # a save made while this one waited covers it
            self._saved = self._requested
            group = self.snapshot(run, version)
            self._boundaries = 0
            self._tokens_at_save = sum(s.response_length for s in run.samples)
            self._saved_at = self.clock()
            t0 = time.monotonic()
            await self.io.call(self.log.save, group)  # LeaseLost propagates: fenced
            self.book.bump("turn_checkpoints")
            self.book.hop("turn_checkpoint", time.monotonic() - t0)
            return True

    def snapshot(self, run: GroupRun, version: int) -> Any:
        """The group as a partial record (environment snapshots included: ``to_group``
        takes them), built now, on the event loop: one consistent state."""
        return run.to_group(producer=self.producer, version_hint=version, partial=True,
                            trajectories=True)


__all__ = ["TurnSaver"]
