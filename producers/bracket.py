"""The producer's side of the weight-update bracket, and aborting its requests on engines.

The trainer (``strawq.collector.trainer.bracket``) writes ``pause-<v>``, waits for an ack from
every live producer, swaps the weights and writes ``resume-<v>``. An ack promises that nothing of
this producer's still generates with the old weights, so when ``Control.state()`` shows a
pause this producer has not acknowledged, it stops claiming, aborts its own requests on
every worker, waits until every in-flight ``/generate`` came back with its tokens (an
aborted reply carries all of them), completes the groups whose samples are all final,
yields the others as partial groups, then ``Control.ack``s. It resumes claiming when
``resume-<v>`` appears. With ``timing.hold_through_pause`` it yields nothing: the unfinished
groups keep their leases, their state made durable in one journal record
(``GroupHalts.hold_all``), and the ack counts them (``held``); they continue at the resume.

Aborts name **exact rids**: SGLang 0.5.23 drops an ``/abort_request`` whose rid is not an
exact live rid, so a prefix aborts nothing. The runner records every rid in flight
(``GroupRunner.live_rids``); "this producer's requests" (``<producer>/``) or "this lease's"
(``<producer>/<task>.g<gen>/``) is a selection of that set, and each selected rid is sent
as it is, to every worker, repeated every ``abort_poll_s`` until the requests returned (a
request that reached the engine after an abort round is caught by the next one). A request
that has not come back after ``abort_deadline_s`` is cancelled and reported (a warning, and
``EngineAborter.lost_requests``); its sample resumes from its last applied segment.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from strawq.errors import StrawqError
from strawq.producers.engine_client import EngineClient
from strawq.producers.engine_errors import EngineError
from strawq.weights.control import Control, ControlState

log = logging.getLogger(__name__)


class EngineAborter:
    """Aborts requests by exact rid on every worker: best effort, and always bounded."""

    def __init__(self, client: Callable[[], EngineClient | None], producer_id: str, *,
                 poll_s: float, deadline_s: float, clock: Callable[[], float],
                 live_rids: Callable[[], Iterable[str]] = tuple) -> None:
        #: the producer's engine client, None while it is not running
        self.client = client
        self.producer_id = producer_id
        self.poll_s = poll_s
        self.deadline_s = deadline_s
        self.clock = clock
        #: every rid of this producer's requests in flight now (the runner's record)
        self.live_rids = live_rids
        #: requests cancelled because they did not come back before the deadline
        self.lost_requests = 0
        self._background: set[asyncio.Task[None]] = set()

    def matching(self, prefix: str) -> list[str]:
        """The live rids under ``prefix`` (a selection made here: SGLang has none). A
        ``prefix`` that does not end with ``/`` is a rid itself and is always included: a
        request whose call failed is no longer recorded but may still run on an engine."""
        found = {r for r in self.live_rids() if r.startswith(prefix)}
        if prefix and not prefix.endswith("/"):
            found.add(prefix)
        return sorted(found)

    async def abort_prefix(self, prefix: str) -> None:
        """Abort every live rid under ``prefix``, each by its exact rid."""
        await self.abort_rids(self.matching(prefix))

    async def abort_rids(self, rids: Iterable[str]) -> None:
        """Best effort, bounded: a dead or hung worker must not stall the bracket."""
        client = self.client()
        rids = list(rids)
        if client is None or not rids:
            return
        bound = max(1.0, 2 * self.poll_s)

        async def one(rid: str, url: str) -> None:
            try:
                await asyncio.wait_for(client.abort(rid=rid, url=url), bound)
            except (EngineError, asyncio.TimeoutError, ValueError) as exc:
                log.debug("abort %s on %s failed: %s", rid, url, exc)

        await asyncio.gather(*(one(r, u) for r in rids for u in client.worker_urls))

    def abort_soon(self, prefix: str) -> None:
        """``abort_prefix`` without waiting for it (from code that must not block); the
        task is kept referenced until it ends, so the loop cannot drop it half-way. The rids
        are chosen now: a caller that just cancelled its sample tasks still finds them."""
        task = asyncio.create_task(self.abort_rids(self.matching(prefix)))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def abort_until_returned(self, pending: set[asyncio.Task[None]], prefix: str,
                                   why: str, *, deadline_s: float | None = None) -> None:
        """Abort ``prefix`` on every worker until the ``pending`` tasks (generate calls) all
        returned; past ``deadline_s`` (default: the aborter's) they are cancelled and their
        last segment is lost."""
        wait_s = self.deadline_s if deadline_s is None else deadline_s
        deadline = self.clock() + wait_s
        while pending:
            await self.abort_prefix(prefix)
            left = deadline - self.clock()
            if left <= 0:
                self.lost_requests += len(pending)
                log.warning("producer %s (%s): %d requests (%s) did not come back %.1fs "
                            "after the abort; cancelling them: their samples resume from "
                            "their last applied segment, the tokens of this one are lost",
                            self.producer_id, why, len(pending),
                            ", ".join(self.matching(prefix)[:8]) or "-", wait_s)
                for t in pending:
                    t.cancel()
                await asyncio.wait(pending, timeout=5.0)
                return
            _, pending = await asyncio.wait(pending, timeout=min(self.poll_s, left))


class PauseBracket:
    """Watches ``control/`` and acknowledges each pause once every held group is back.

    The producer supplies what the bracket cannot know: how to read ``control/`` off the
    event loop (``io``), how to park its groups (``park``, returns the partials yielded),
    and how many groups it holds and leases it failed to hand back (``held``,
    ``unreturned``; an ack with unreturned leases would be a lie, so it waits), and how many
    it keeps through the pause, durable in its journal (``kept``: the ack's ``held``).
    """

    def __init__(self, control: Control, producer_id: str, *, poll_s: float,
                 clock: Callable[[], float],
                 io: Callable[[Callable[[], Any]], Awaitable[Any]],
                 park: Callable[[str], Awaitable[int]], held: Callable[[], int],
                 unreturned: Callable[[], int], kept: Callable[[], int] = lambda: 0,
                 holds: bool = False) -> None:
        self.control = control
        self.producer_id = producer_id
        self.poll_s = poll_s
        self.clock = clock
        self._io = io
        self._park = park
        self._held = held
        self._unreturned = unreturned
        #: leases kept through the pause, their state durable (``GroupHalts.hold_all``)
        self._kept = kept
        #: ``park`` holds the groups (``timing.hold_through_pause``): what the log says
        self.holds = holds
        #: a pause is seen and not yet resumed: claim nothing, start no generation
        self.pausing = False
        self.acked_version = 0
        self._last_poll = -math.inf
        #: "has control/ changed?" (a ``DirProbe``): while not pausing, a poll reads
        #: ``control/`` only when it says so — one stat instead of a listing per poll
        self.probe: Callable[[], bool] | None = None

    def poll_soon(self) -> None:
        """``control/`` changed (an inotify wake-up): read it at the next ``poll``."""
        self._last_poll = -math.inf

    async def poll(self, *, force: bool = False) -> bool:
        """Read ``control/`` if ``poll_s`` has passed and act on it; True when this call
        acknowledged a pause. ``force``: list it now, whatever the probe says (a stat may
        be served from an attribute cache up to its TTL old)."""
        now = self.clock()
        if not force and now - self._last_poll < self.poll_s:
            return False
        self._last_poll = now
        if not force and self.probe is not None and not self.pausing and not self.probe():
            return False
        try:
            st: ControlState = await self._io(self.control.state)
        except StrawqError as exc:
            log.warning("producer %s cannot read control/: %s", self.producer_id, exc)
            return False
        if st.paused:
            return await self._pause(st.pause_version)
        if self.pausing:
            self.pausing = False
            log.info("producer %s resumes (version %d live)", self.producer_id,
                     st.resume_version)
        return False

    async def _pause(self, version: int) -> bool:
        if self.acked_version == version:
            return False
        if not self.pausing:
            log.info("producer %s: pause for version %d; %s %d groups",
                     self.producer_id, version, "holding" if self.holds else "parking",
                     self._held())
        self.pausing = True
        partials = await self._park("pause")
        if self._unreturned():
            log.warning("producer %s still holds %d leases it could not hand back; "
                        "not acknowledging the pause yet", self.producer_id,
                        self._unreturned())
            return False
        held = self._kept()  # groups kept through the pause (``hold_all``), else 0
        await self._io(lambda: self.control.ack(version, self.producer_id,
                                                 partials=partials, held=held))
        self.acked_version = version
        log.info("producer %s acknowledged pause %d (%d partial groups, %d held)",
                 self.producer_id, version, partials, held)
        return True
