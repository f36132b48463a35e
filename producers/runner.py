"""Running one leased group: build or resume its samples, generate, reward, filter, settle.

For each lease the ``GroupRunner`` starts one group task::

    load (I/O thread): current version, saved partial or prompt ids
      (a partial past the η bound: HandBack.regenerate | HandBack.drop, per the policy the
       collector published, strawq.tasks.eta; under ``train`` it is resumed and counted)
      -> GroupRun (fresh G samples, or rebuilt from the partial)
      -> one sample task per unfinished sample: acquire a trajectory (SlotPool),
         generate segment by segment until final, release it, reward it
      -> settle:  all final    -> filter -> HandBack.complete | HandBack.drop
                  parked       -> HandBack.yield_partial (prefixes kept, no attempt spent)
                  engine gone  -> HandBack.yield_partial + claim back-off
                  rejected     -> HandBack.fail(retryable=True)
                  misconfigured -> HandBack.refuse: the task back untouched, this
                                  producer stops (``MisconfiguredProducer``)
                  abandoned    -> HandBack.release (heartbeats failed; fenced: if the grantor
                                  expired it first, the task is pending already)

**Segments** (``strawq.producers.engine_turn``). Each segment is one
:func:`~strawq.producers.sample_step.step_sample` on the producer's guarded client (budget,
payload, reply check, tokens applied). A segment cut by its deadline
(``ClientConfig.generate_timeout_s``) comes back aborted with its tokens and resumes at once
from the longer prefix.

**Live rids** (``strawq.producers.held``). Every wire rid of a ``/generate`` in flight — a
client's retry (``<rid>~retry<n>``) included — is recorded in its group's ``live_rids``
while it is in flight; ``GroupRunner.live_rids()`` is the producer's full set, so an abort
(the bracket, a stop, a sibling's failure) names each one exactly
(``strawq.producers.bracket``).

**This producer's configuration, not the task.** A task that the producer cannot run for a
reason of its own — a text or chat prompt without a tokenizer (or a chat prompt with a
plain text tokenizer), an engine refusing its API key, a reward plugin raising
``ConfigError`` or ``ImportError`` — is handed back, never dropped: a misconfigured node
must not burn the queue faster than the healthy ones generate. A task bad in itself (a
prompt the tokenizer cannot encode, bad row overrides) still fails for good (``bad_task``).

**A sample's hard failure** (an engine rejection, retries spent) stops its siblings by
aborting their requests on the engine, not by cancelling them: their replies come back
with every token generated so far, applied before the group settles (``fail``, or a
partial when the engine is unreachable).

rids are ``<producer>/<task>.g<gen>/<sample>.<n>``: the ``/`` after each part keeps one
producer's (or one lease's) prefix from matching another's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from strawq.errors import LeaseLost
from strawq.producers.bracket import EngineAborter
from strawq.producers.claim_gate import FaultBackoff
from strawq.producers.engine_client import EngineClient
from strawq.producers.engine_errors import EngineUnavailable
from strawq.producers.engine_turn import EngineTurns
from strawq.producers.generate import (
    DEFAULT_GENERATE,
    GenerateFn,
    Halted,
    load_generate,
    run_plugin,
)
from strawq.producers.group import GroupRun, TaskError
from strawq.producers.group_load import GroupLoader, PastEta
from strawq.producers.handback import HandBack, MisconfiguredProducer
from strawq.producers.held import ActiveGroup, GroupHalts, GroupTable
from strawq.producers.meter import StatsBook
from strawq.producers.offload import Offload
from strawq.producers.producer_config import ProducerConfig, ToolsConfig
from strawq.producers.sample import SampleError
from strawq.producers.scoring import GroupScorer
from strawq.producers.slots import SlotPool
from strawq.producers.turn_saver import TurnCheckpoints, TurnSaver
from strawq.tasks.queue import Lease, RunQueue

log = logging.getLogger(__name__)

#: tool calls left running at a pause that a producer remembers (``GroupRunner.detach``)
DETACHED_MAX = 1024


class GroupHost:
    """One group as its generate plugin's context reaches it (``generate.SampleHost``):
    the runner's engine turns, halts, tool threads and counters, bound to the group."""

    def __init__(self, runner: GroupRunner, active: ActiveGroup) -> None:
        self._runner = runner
        self._a = active

    @property
    def run(self) -> GroupRun | None:
        return self._a.run

    @property
    def tools(self) -> ToolsConfig:
        return self._runner.config.tools

    @property
    def context_length(self) -> int | None:
        return self._runner.config.engine.generation.context_length

    @property
    def turns(self) -> TurnSaver | None:
        return self._a.turns

    @property
    def abandoned(self) -> bool:
        return self._a.abandoned

    def halted(self) -> bool:
        return self._runner.halted(self._a)

    def check_halted(self) -> None:
        if self._runner.halted(self._a):
            raise Halted()

    async def generate_turn(self, i: int) -> str:
        return await self._runner.generate_turn(self._a, i)

    def lose_lease(self, keep: int) -> None:
        self._a.abandoned = True
        self._runner.stop_samples(self._a, keep=keep, cancel=True)

    def drop_group(self, reason: str, message: str, keep: int) -> None:
        self._a.drop = (reason, message)
        self._runner.stop_samples(self._a, keep=keep)

    def take_detached(self, key: str) -> asyncio.Future[Any] | None:
        return self._runner.detached.pop(key, None)

    def detach(self, key: str, task: asyncio.Future[Any]) -> None:
        self._runner.detach(key, task)

    def offload(self, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        return self._runner.rewards.call(fn, *args)

    def bump(self, counter: str, n: int = 1) -> None:
        self._runner.book.bump(counter, n)

    def hop(self, name: str, seconds: float) -> None:
        self._runner.book.hop(name, seconds)


class GroupRunner:
    """Runs every group its producer holds, on the producer's event loop.

    Its parts: the held groups (``held.GroupTable``) and how their samples stop
    (``held.GroupHalts``), loading a group (``group_load``), engine turns and prefix
    warming (``engine_turn.EngineTurns``), turn checkpoints (``turn_saver.TurnCheckpoints``),
    scoring (``scoring.GroupScorer``), the engine-fault back-off (``claim_gate.FaultBackoff``);
    a producer passes the ones it shares, else the runner builds its own."""

    def __init__(self, config: ProducerConfig, *, producer_id: str, queue: RunQueue,
                 group_size: int, client: Callable[[], EngineClient], pool: SlotPool,
                 handback: HandBack, book: StatsBook, io: Offload, rewards: Offload,
                 aborter: EngineAborter, pausing: Callable[[], bool],
                 clock: Callable[[], float] = time.monotonic,
                 kick: Callable[[], None] = lambda: None, table: GroupTable | None = None,
                 halts: GroupHalts | None = None, backoff: FaultBackoff | None = None) -> None:
        self.config = config
        self.producer_id = producer_id
        self.queue = queue
        self.group_size = group_size
        self.generate_fn: GenerateFn = load_generate(config.plugins.generate,
                                                     config.plugins.generate_args)
        #: the group before its first request: version, prefixes or prompt, η, parameters
        self.loader = GroupLoader(config, queue=queue, group_size=group_size, book=book)
        #: told the run's version each group load read (the guard: never route a group
        #: released at a version by an older view of the run)
        self.saw_version: Callable[[int], None] | None = None
        self.tokenizer = self.loader.tokenizer
        #: after a sample's end: teacher, reward; after the group's: the filter
        self.scorer = GroupScorer(config, threads=rewards, book=book, tokenizer=self.tokenizer)
        self.pool = pool
        self.handback = handback
        self.book = book
        self.io = io
        self.rewards = rewards
        self.aborter = aborter
        self._pausing = pausing
        self.clock = clock
        self._kick = kick
        if table is None:
            table = halts.table if halts is not None else GroupTable()
        self.table = table
        #: lease key -> the group working on it
        self.groups: dict[str, ActiveGroup] = self.table.groups
        self.halts = halts if halts is not None else GroupHalts(
            self.table, producer_id=producer_id, pool=pool, aborter=aborter, book=book)
        #: engine faults in a row and the claim back-off they set
        self.backoff = backoff if backoff is not None else FaultBackoff(config.engine.backoff_s,
                                                                        clock)
        self.turns = EngineTurns(config.engine, producer_id=producer_id, client=client,
                                 halts=self.halts, book=book, clock=clock)
        #: turn checkpoints (``strawq.tasks.turns``): on for a multi-turn generate plugin
        self.checkpoints = TurnCheckpoints(
            config.tools.checkpointing
            and (config.plugins.generate or DEFAULT_GENERATE) != DEFAULT_GENERATE,
            queue=queue, tools=config.tools, io=io, book=book, producer_id=producer_id,
            logs=handback.turn_logs)
        #: tool calls left running at a pause, by idempotency key (``call_tool``)
        self.detached: dict[str, asyncio.Future[Any]] = {}
        #: the run's version read at the resume of a pause that held the groups, by its
        #: number (``GroupTable.holds``): one read for every group it held
        self._resume_reads: dict[int, asyncio.Task[int]] = {}

    @property
    def checkpointing(self) -> bool:
        return self.checkpoints.on

    @property
    def eos_ids(self) -> frozenset[int] | None:
        """The model's EOS ids (``Producer.run`` resolves them at start, strawq.producers.eos)."""
        return self.turns.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: frozenset[int] | None) -> None:
        self.turns.eos_ids = ids

    @property
    def backoff_until(self) -> float:
        """No claims before this time (engine faults back off exponentially)."""
        return self.backoff.until

    @property
    def engine_faults_in_row(self) -> int:
        """Groups handed back after an engine fault since the last one finished: while
        above 0 the producer claims only once a probe reaches an engine."""
        return self.backoff.in_row

    def back_off(self) -> float:
        """One more engine fault in a row (``FaultBackoff.back_off``); returns the delay."""
        return self.backoff.back_off()

    def detach(self, key: str, task: asyncio.Future[Any]) -> None:
        """Keep a tool call running past its sample's halt; the oldest finished ones
        are forgotten past ``DETACHED_MAX`` (their tasks resumed elsewhere)."""
        self.detached[key] = task
        while len(self.detached) > DETACHED_MAX:
            old = next((k for k, t in self.detached.items() if t.done()), None)
            if old is None:
                break
            self.detached.pop(old)

    def live_rids(self) -> set[str]:
        """Every rid of this producer's requests in flight now."""
        return self.table.live_rids()

    def start(self, lease: Lease) -> ActiveGroup:
        a = ActiveGroup(lease, claimed_at=self.clock())
        # claimed as a pause that holds the groups began: held as they are
        a.holding = self.table.holding and self._pausing()
        self.groups[lease.key] = a
        self.pool.set_demand(a.hold, self.group_size)
        self.book.bump("groups_claimed")
        a.task = asyncio.create_task(self._run_group(a), name=f"group-{lease.task_id}")
        return a

    # -- stopping samples (``held.GroupHalts``) ----------------------------------------------
    async def park_all(self, why: str) -> int:
        """Stop every held group and hand it back; returns how many were yielded."""
        return await self.halts.park_all(why)

    def abandon_all(self) -> None:
        """Stop work on every lease without persisting anything (the grantor re-queues)."""
        self.halts.abandon_all()

    def stop_samples(self, a: ActiveGroup, keep: int | None = None, *,
                     cancel: bool = False) -> None:
        """Stop the group's other samples (``GroupHalts.stop_samples``)."""
        self.halts.stop_samples(a, keep, cancel=cancel)

    def halted(self, a: ActiveGroup) -> bool:
        """The group's samples must stop (parked, given up, failed, dropped, pausing)."""
        return (a.parking or a.abandoned or a.fault is not None or a.drop is not None
                or self._pausing())

    async def generate_turn(self, a: ActiveGroup, i: int) -> str:
        """Generate sample ``i`` until the engine ends the turn (``EngineTurns.turn``)."""
        return await self.turns.turn(a, i, lambda: self.halted(a))

    # -- one group -----------------------------------------------------------------------------
    async def _run_group(self, a: ActiveGroup) -> None:
        lease = a.lease
        try:
            try:
                try:
                    a.turns, checkpoint = await self.checkpoints.open(lease)
                except LeaseLost as exc:
                    self.book.bump("leases_lost")
                    log.warning("task %s: %s", lease.task_id, exc)
                    return
                version, partial, prompt = await self.io.call(self.loader.load, lease,
                                                              checkpoint)
                run = self.loader.build(lease, partial, prompt)
                run.want_extras(self.config.record.extras, self.config.record.routed_experts_shape)
            except PastEta as past:
                await self.loader.past_eta(lease, past, self.handback)
                return
            except MisconfiguredProducer as exc:
                await self.handback.refuse(lease, exc)
                return
            except (TaskError, SampleError) as exc:
                log.error("task %s cannot run: %s", lease.task_id, exc)
                await self.handback.fail(lease, "bad_task", str(exc), retryable=False)
                return
            a.run, a.version = run, version
            if self.saw_version is not None:
                self.saw_version(version)
            todo = run.unfinished()
            self.pool.set_demand(a.hold, len(todo))  # a partial needs only its unfinished
            a.loaded = True
            if not self.table.loading() and self.pool.claimable_groups():
                self._kick()  # the last of a claim's groups loaded: claim what they left free
            if not (a.parking or a.abandoned):
                await self.turns.warm(run, todo)
            if not (a.parking or a.abandoned):
                await self._run_samples(a, todo)
            while self._holds(a):  # a pause holds the group (``hold_all``)
                if not await self._hold(a):
                    return  # handed back: past the η bound after the update
                if a.parking or a.abandoned:
                    break
                await self._run_samples(a, run.unfinished())
            await self._settle(a, a.version)
        except Exception:  # noqa: BLE001 - a bug must not kill the loop or lose the task
            log.exception("producer %s: unexpected error on task %s", self.producer_id,
                          lease.task_id)
            await self.handback.release(lease)
        finally:
            self.pool.close(a.hold)
            self.groups.pop(lease.key, None)
            self.checkpoints.close(lease)
            self._kick()

    async def _run_samples(self, a: ActiveGroup, todo: list[int]) -> None:
        a.sample_tasks = {i: asyncio.create_task(self._run_sample(a, i)) for i in todo}
        if a.sample_tasks:
            await asyncio.wait(list(a.sample_tasks.values()))

    # -- holding through a pause (``timing.hold_through_pause``) ------------------------------
    def _holds(self, a: ActiveGroup) -> bool:
        """The group's samples stopped for a pause that holds it, and nothing else ends it
        (parked, given up, failed, dropped, or all final: it settles)."""
        run = a.run
        return (a.holding and run is not None and not run.all_final
                and not (a.parking or a.abandoned or a.fault is not None or a.drop is not None))

    async def _hold(self, a: ActiveGroup) -> bool:
        """Wait, lease and state kept, until the pause is resumed (or the group is parked or
        given up: False is never returned for those, the caller settles them); then apply
        the η bound as a claim of its prefix would. False: it was handed back (past η)."""
        run = a.run
        assert run is not None
        # its unfinished samples keep their trajectories' place: no claim after the resume
        # takes the slots it holds (its samples released them as they stopped)
        self.pool.set_demand(a.hold, len(run.unfinished()))
        pause = self.table.holds
        a.held = True
        try:
            while self._pausing() and not (a.parking or a.abandoned):
                await asyncio.sleep(self.config.timing.control_poll_s)
        finally:
            a.held = False
        a.holding = False
        if a.parking or a.abandoned:
            return True
        version = await self._version_after(pause)
        oldest = run.oldest_version()
        if oldest is not None:
            action = await self.io.call(self.loader.eta_action, a.lease, version, oldest)
            if action in ("regenerate", "drop"):
                await self.loader.past_eta(a.lease, PastEta(action, version), self.handback,
                                           oldest=oldest)
                return False
        a.version = version
        if self.saw_version is not None:
            self.saw_version(version)
        return True

    async def _version_after(self, pause: int) -> int:
        """The run's version once pause number ``pause`` was resumed: read once for every
        group it held."""
        task = self._resume_reads.get(pause)
        if task is None:
            task = asyncio.ensure_future(self.io.call(self.queue.current_version))
            self._resume_reads = {pause: task}  # an older pause's read is not needed again
        return await asyncio.shield(task)

    async def _run_sample(self, a: ActiveGroup, i: int) -> None:
        run = a.run
        if run is None:
            return
        freed = False
        if not await self.pool.acquire(a.hold, lambda: self.halted(a)):
            return
        try:
            try:
                await run_plugin(self.generate_fn, GroupHost(self, a), i, a.version)
            except Halted:
                return
            self.pool.release(a.hold)
            freed = True
            a.final_at = self.clock()
            self.book.bump("samples_finished")
            if i not in run.failures:
                try:
                    await self.scorer.score(run, i)
                except MisconfiguredProducer as exc:
                    a.fault = exc
                    self.stop_samples(a, keep=i)
        finally:
            if not freed:
                self.pool.release(a.hold)

    # -- settling --------------------------------------------------------------------------
    async def _settle(self, a: ActiveGroup, version: int) -> None:
        run = a.run
        if run is None:
            return
        if a.abandoned:
            self.book.bump("leases_lost")
            log.warning("task %s abandoned (heartbeats failing); handed back", run.task_id)
            # Hand it back, fenced by its generation: once this producer's heartbeats move
            # again, the grantor would keep the lease alive and the task would wait forever.
            # A release the storage refuses stays an orphan, retried; one the grantor beat
            # (it expired the lease first) is a lost lease, and the task is pending anyway.
            await self.handback.release(a.lease)
            return
        if isinstance(a.fault, MisconfiguredProducer):
            await self.handback.refuse(a.lease, a.fault)
            return
        if a.drop is not None and not a.parking:
            await self.handback.drop(a.lease, a.drop[0], a.drop[1][:500], run.to_group(
                producer=self.producer_id, version_hint=version, partial=False).summary())
            return
        if run.all_final:
            try:
                await self.scorer.score_missing(run)
            except MisconfiguredProducer as exc:
                await self.handback.refuse(a.lease, exc)
                return
            await self._finish(run, version)
            if a.final_at is not None:
                self.book.hop("final_to_ready", self.clock() - a.final_at)
            return
        fault = a.fault
        if fault is not None and not isinstance(fault, EngineUnavailable) and not a.parking:
            await self.handback.fail(a.lease, "engine_rejected", str(fault)[:500])
            return
        if fault is not None:
            delay = self.backoff.back_off()
            log.warning("task %s handed back as partial after an engine fault: %s "
                        "(claiming again in %.1fs once an engine answers)", run.task_id,
                        fault, delay)
        group = run.to_group(producer=self.producer_id, version_hint=version, partial=True)
        await self.handback.yield_partial(a.lease, group)

    async def _finish(self, run: GroupRun, version: int) -> None:
        self.backoff.reset()
        reason, message = self.scorer.drop_reason(run)
        group = run.to_group(producer=self.producer_id, version_hint=version, partial=False,
                             mask_offpolicy=self.config.record.mask_offpolicy_in_partial_rollout)
        if reason is not None:
            await self.handback.drop(run.lease, reason, message or f"filter: {reason}",
                                     group.summary())
        else:
            await self.handback.complete(run.lease, group)


__all__ = ["DETACHED_MAX", "ActiveGroup", "GroupHost", "GroupRunner"]
