"""Turn checkpoints on the producer side: when a held group is saved between turns.

A ``TurnSaver`` belongs to one held group (``ActiveGroup.turns``). The generate context
calls ``boundary`` at every turn boundary (a turn ended, a tool result arrived) *before*
the sample's next piece of work, so a sample that ends there saves nothing, and
``before_tool`` before a tool that is not idempotent runs (its journal entry must be
durable before its effect can happen). ``ToolsConfig.checkpoint_every_*`` sets the cadence.
The record, its fencing and its cleanup are ``strawq.tasks.turns``. ``TurnCheckpoints`` is the
runner's part that opens a lease's saver and loads its last checkpoint.

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

from strawq.errors import LeaseLost
from strawq.tasks.turns import TurnLog, warm_up

if TYPE_CHECKING:
    from strawq.ondisk.groups import GroupData
    from strawq.producers.group import GroupRun
    from strawq.producers.meter import StatsBook
    from strawq.producers.offload import Offload
    from strawq.producers.producer_config import ToolsConfig
    from strawq.tasks.queue import Lease, RunQueue

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


class TurnCheckpoints:
    """The runner's turn-checkpoint part: when ``on`` (a multi-turn generate plugin with
    ``tools.checkpointing``), each lease gets a ``TurnSaver`` and resumes from its last turn
    checkpoint; ``logs`` (the hand-back's, by lease key) cleans them up with the task."""

    def __init__(self, on: bool, *, queue: RunQueue, tools: ToolsConfig, io: Offload,
                 book: StatsBook, producer_id: str, logs: dict[str, TurnLog]) -> None:
        self.on = on
        self.queue = queue
        self.tools = tools
        self.io = io
        self.book = book
        self.producer_id = producer_id
        self.logs = logs
        if on:  # the first encode loads pyarrow: not inside the first turn
            warm_up()

    async def open(self, lease: Lease) -> tuple[TurnSaver | None, GroupData | None]:
        """The lease's saver and its last turn checkpoint (None, None when off; a None
        checkpoint when there is none or it cannot be read). Fences the task's older
        holders: ``LeaseLost`` when a newer one holds it."""
        if not self.on:
            return None, None
        turn_log = TurnLog(self.queue.storage, lease.name)
        self.logs[lease.key] = turn_log
        saver = TurnSaver(turn_log, self.tools, self.io, self.book, self.producer_id)
        try:
            ck = await self.io.call(turn_log.load)
        except LeaseLost:
            raise
        except Exception as exc:  # noqa: BLE001 - storage trouble: the update-level partial
            log.warning("task %s: its turn checkpoints cannot be read (%s); resuming from "
                        "its partial record", lease.task_id, exc)
            return saver, None
        if ck is None:
            return saver, None
        self.book.bump("turn_checkpoints_loaded")
        log.info("task %s: resuming from the turn checkpoint of generation %d", lease.task_id,
                 ck.gen)
        return saver, ck.group

    def close(self, lease: Lease) -> None:
        """The lease is no longer held."""
        self.logs.pop(lease.key, None)
