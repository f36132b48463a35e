"""Running one leased group: build or resume its samples, generate, reward, filter, settle.

For each lease the ``GroupRunner`` starts one group task::

    load (I/O thread): current version, saved partial or prompt ids
      (a partial past the η bound: HandBack.regenerate | HandBack.drop, per the policy the
       collector published, strawq.eta; under ``train`` it is resumed and counted)
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

**Segments.** Each segment is one :func:`~strawq.producers.sample_step.step_sample` on the
producer's guarded client (budget, payload, reply check, tokens applied). A segment cut
by its deadline (``ClientConfig.generate_timeout_s``) comes back aborted with its tokens
and resumes at once from the longer prefix.

**Live rids.** Every wire rid of a ``/generate`` in flight — a client's retry
(``<rid>~retry<n>``) included — is recorded in its group's ``live_rids`` while it is in
flight; ``GroupRunner.live_rids()`` is the producer's full set, so an abort (the bracket,
a stop, a sibling's failure) names each one exactly (``strawq.producers.bracket``).

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
from dataclasses import dataclass, field
from typing import Any

from strawq.errors import LeaseLost
from strawq.groups import GroupData
from strawq.queue import Lease, RunQueue
from strawq.turns import TurnLog, warm_up

from strawq.producers.bracket import EngineAborter
from strawq.producers.engine_client import EngineClient, warm_prefix
from strawq.producers.engine_errors import EngineAuthError, EngineError, EngineUnavailable
from strawq.producers.engine_versions import NoFreshEngine, StaleEngine
from strawq.producers.extras_protocol import ExtrasMismatch
from strawq.producers.generate import (DEFAULT_GENERATE, GenerateFn, Halted, SampleFailed,
                                       load_generate, run_plugin)
from strawq.producers.group import GroupRun, TaskError
from strawq.producers.group_load import GroupLoader, PastEta
from strawq.producers.handback import HandBack, MisconfiguredProducer
from strawq.producers.meter import StatsBook
from strawq.producers.offload import Offload
from strawq.producers.producer_config import ProducerConfig, ToolsConfig
from strawq.producers.sample import SampleError, SampleStatus
from strawq.producers.sample_step import step_sample
from strawq.producers.scoring import GroupScorer
from strawq.producers.slots import SlotHold, SlotPool
from strawq.producers.turn_saver import TurnSaver

log = logging.getLogger(__name__)

#: tool calls left running at a pause that a producer remembers (``GroupRunner.detach``)
DETACHED_MAX = 1024


@dataclass(eq=False)
class ActiveGroup:
    """A lease the producer holds, and the tasks working on it."""

    lease: Lease
    hold: SlotHold = field(default_factory=SlotHold)
    run: GroupRun | None = None
    task: asyncio.Task[None] | None = None
    sample_tasks: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    #: rids of this lease's ``/generate`` requests in flight now
    live_rids: set[str] = field(default_factory=set)
    parking: bool = False
    abandoned: bool = False
    fault: BaseException | None = None
    #: hop timing (the producer's clock): claimed, first request sent, last sample final
    claimed_at: float = 0.0
    generating: bool = False
    final_at: float | None = None
    #: the queue's version when the group was loaded (appended tokens before any turn)
    version: int = 0
    #: (reason, message): the generate plugin asked to drop the group (``tools.on_failure``)
    drop: tuple[str, str] | None = None
    #: turn checkpoints of this lease (``strawq.producers.turn_saver``), None when off
    turns: TurnSaver | None = None


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
    """Runs every group its producer holds, on the producer's event loop."""

    def __init__(self, config: ProducerConfig, *, producer_id: str, queue: RunQueue,
                 group_size: int, client: Callable[[], EngineClient], pool: SlotPool,
                 handback: HandBack, book: StatsBook, io: Offload, rewards: Offload,
                 aborter: EngineAborter, pausing: Callable[[], bool],
                 clock: Callable[[], float] = time.monotonic,
                 kick: Callable[[], None] = lambda: None) -> None:
        self.config = config
        self.producer_id = producer_id
        self.queue = queue
        self.group_size = group_size
        self.generate_fn: GenerateFn = load_generate(config.plugins.generate,
                                                     config.plugins.generate_args)
        #: the group before its first request: version, prefixes or prompt, η, parameters
        self.loader = GroupLoader(config, queue=queue, group_size=group_size, book=book)
        self.tokenizer = self.loader.tokenizer
        #: after a sample's end: teacher, reward; after the group's: the filter
        self.scorer = GroupScorer(config, threads=rewards, book=book, tokenizer=self.tokenizer)
        self._client = client
        self.pool = pool
        self.handback = handback
        self.book = book
        self.io = io
        self.rewards = rewards
        self.aborter = aborter
        self._pausing = pausing
        self.clock = clock
        self._kick = kick
        #: lease key -> the group working on it
        self.groups: dict[str, ActiveGroup] = {}
        #: no claims before this time (engine faults back off exponentially)
        self.backoff_until = 0.0
        self._faults_in_row = 0
        #: the model's EOS ids (``Producer.run`` resolves them at start, strawq.producers.eos)
        self.eos_ids: frozenset[int] | None = None
        #: siblings of a failed sample being aborted until they returned
        self._halting: set[asyncio.Task[None]] = set()
        #: turn checkpoints (``strawq.turns``): on for a multi-turn generate plugin
        self.checkpointing = config.tools.checkpointing and (
            config.plugins.generate or DEFAULT_GENERATE) != DEFAULT_GENERATE
        #: tool calls left running at a pause, by idempotency key (``call_tool``)
        self.detached: dict[str, asyncio.Future[Any]] = {}
        if self.checkpointing:  # the first encode loads pyarrow: not inside the first turn
            warm_up()

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
        return {rid for a in self.groups.values() for rid in a.live_rids}

    def start(self, lease: Lease) -> ActiveGroup:
        a = ActiveGroup(lease, claimed_at=self.clock())
        self.groups[lease.key] = a
        self.pool.set_demand(a.hold, self.group_size)
        self.book.bump("groups_claimed")
        a.task = asyncio.create_task(self._run_group(a), name=f"group-{lease.task_id}")
        return a

    # -- parking (bracket, stop), giving up (heartbeats failing) -----------------------------
    async def park_all(self, why: str) -> int:
        """Stop every held group and hand it back; returns how many were yielded."""
        actives = list(self.groups.values())
        if not actives:
            return 0
        before = self.book.get("groups_yielded")
        for a in actives:
            a.parking = True
        self.pool.wake_all()
        pending = {t for a in actives for t in a.sample_tasks.values() if not t.done()}
        await self.aborter.abort_until_returned(pending, f"{self.producer_id}/", why)
        await asyncio.gather(*(a.task for a in actives if a.task is not None),
                             return_exceptions=True)
        return self.book.get("groups_yielded") - before

    def abandon_all(self) -> None:
        """Stop work on every lease without persisting anything (the grantor re-queues)."""
        self.pool.wake_all()
        for a in list(self.groups.values()):
            if not a.abandoned:
                a.abandoned = True
                self.stop_samples(a, cancel=True)

    def stop_samples(self, a: ActiveGroup, keep: int | None = None, *,
                     cancel: bool = False) -> None:
        """Stop the group's other samples (all but ``keep``, the caller), which must already
        see the group halted (``a.fault`` / ``a.drop`` / ``a.abandoned`` set).

        Their requests are aborted on the engines until they came back (each reply carries
        the tokens generated so far, applied to its sample; past ``abort_deadline_s`` the
        aborter cancels them). ``cancel`` (a lease given up, nothing to persist) cancels the
        tasks at once instead."""
        self.pool.wake_all()  # siblings waiting for a trajectory see the halt
        others = {t for j, t in a.sample_tasks.items() if j != keep and not t.done()}
        prefix = a.run.rid_prefix(self.producer_id) if a.run is not None else None
        if cancel or prefix is None:
            for t in others:
                t.cancel()
            if prefix is not None:
                self.aborter.abort_soon(prefix)
            return
        task = asyncio.create_task(self.aborter.abort_until_returned(
            others, prefix, f"a sample of task {a.lease.task_id} failed"))
        self._halting.add(task)
        task.add_done_callback(self._halting.discard)

    # -- one group -----------------------------------------------------------------------------
    async def _turn_checkpoint(self, a: ActiveGroup) -> GroupData | None:
        """Fence the task's older holders and load their last turn checkpoint (None when
        there is none or turn checkpoints are off); ``LeaseLost`` when a newer one holds
        it."""
        if not self.checkpointing:
            return None
        turn_log = TurnLog(self.queue.storage, a.lease.name)
        self.handback.turn_logs[a.lease.key] = turn_log
        a.turns = TurnSaver(turn_log, self.config.tools, self.io, self.book, self.producer_id)
        try:
            ck = await self.io.call(turn_log.load)
        except LeaseLost:
            raise
        except Exception as exc:  # noqa: BLE001 - storage trouble: the update-level partial
            log.warning("task %s: its turn checkpoints cannot be read (%s); resuming from "
                        "its partial record", a.lease.task_id, exc)
            return None
        if ck is None:
            return None
        self.book.bump("turn_checkpoints_loaded")
        log.info("task %s: resuming from the turn checkpoint of generation %d", a.lease.task_id,
                 ck.gen)
        return ck.group

    async def _run_group(self, a: ActiveGroup) -> None:
        lease = a.lease
        try:
            try:
                try:
                    checkpoint = await self._turn_checkpoint(a)
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
            todo = run.unfinished()
            self.pool.set_demand(a.hold, len(todo))  # a partial needs only its unfinished
            if (self.config.engine.generation.warm_prefix and len(todo) > 1
                    and not (a.parking or a.abandoned)
                    and all(run.samples[i].response_length == 0 for i in todo)):
                await self._warm_prefix(run, a.lease.gen)
            if not (a.parking or a.abandoned):
                for i in todo:
                    a.sample_tasks[i] = asyncio.create_task(self._run_sample(a, i))
                if a.sample_tasks:
                    await asyncio.wait(list(a.sample_tasks.values()))
            await self._settle(a, version)
        except Exception:  # noqa: BLE001 - a bug must not kill the loop or lose the task
            log.exception("producer %s: unexpected error on task %s", self.producer_id,
                          lease.task_id)
            await self.handback.release(lease)
        finally:
            self.pool.close(a.hold)
            self.groups.pop(lease.key, None)
            self.handback.turn_logs.pop(lease.key, None)
            self._kick()

    async def _warm_prefix(self, run: GroupRun, gen: int) -> None:
        """The group's prompt prefilled once before its samples (``GenerationConfig.warm_prefix``),
        under the group's rid prefix, so cache-aware routing sends it where they go."""
        rid = f"{run.rid_prefix(self.producer_id)}warm.0"
        try:
            await warm_prefix(self._client(), run.samples[0].prompt_ids.tolist(), rid=rid)
            self.book.bump("prefix_warmups")
        except (EngineError, SampleError, ValueError) as exc:
            log.info("task %s: prefix warm-up failed (%s); the samples go ahead", run.task_id,
                     exc)

    def halted(self, a: ActiveGroup) -> bool:
        """The group's samples must stop (parked, given up, failed, dropped, pausing)."""
        return (a.parking or a.abandoned or a.fault is not None or a.drop is not None
                or self._pausing())

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

    async def generate_turn(self, a: ActiveGroup, i: int) -> str:
        """Generate sample ``i`` segment by segment until the engine ends the turn; returns
        its finish type (``stop`` / ``length``). Raises :class:`Halted` when the sample must
        stop (parking, pausing, lease lost, an engine fault that gave up)."""
        run = a.run
        if run is None:
            raise Halted()
        s = run.samples[i]
        failures = 0
        context_length = self.config.engine.generation.context_length
        while not s.is_final:
            if self.halted(a):
                raise Halted()
            rid = run.next_rid(self.producer_id, i)
            a.live_rids.add(rid)  # the client adds each wire rid it sends (retries too)
            if not a.generating:
                a.generating = True
                self.book.hop("claim_to_generate", self.clock() - a.claimed_at)
            try:
                res = await step_sample(self._client(), s, rid=rid,
                                        context_length=context_length, eos_ids=self.eos_ids,
                                        live=a.live_rids)
            except StaleEngine:
                continue  # tokens of the wrong weights discarded; re-issued in rotation
            except NoFreshEngine:  # every engine stale: wait for the trainer's push
                await asyncio.sleep(self.config.engine.backoff_s)
                continue
            except EngineAuthError as exc:  # this producer's key: no task can run on it
                a.fault = MisconfiguredProducer(f"task {run.task_id}: {exc}",
                                                key="engine.client.api_key")
                self.stop_samples(a, keep=i)
                raise Halted() from None
            except ExtrasMismatch as exc:  # misaligned per-token extras: this sample fails
                self.book.bump("engine_faults")
                raise SampleFailed(f"engine protocol error: {exc}") from None
            except (EngineError, SampleError) as exc:
                failures += 1
                self.book.bump("engine_faults")
                if isinstance(exc, SampleError) or failures > self.config.engine.sample_retries:
                    log.warning("task %s sample %d: giving up after %d failures: %s",
                                run.task_id, i, failures, exc)
                    a.fault = exc
                    self.stop_samples(a, keep=i)
                    raise Halted() from None
                log.info("task %s sample %d: %s; retry %d/%d", run.task_id, i, exc,
                         failures, self.config.engine.sample_retries)
                if isinstance(exc, EngineUnavailable):  # maybe still running somewhere
                    self.aborter.abort_soon(rid)
                await asyncio.sleep(self.config.engine.backoff_s * failures)
                continue
            finally:
                a.live_rids.discard(rid)
            if res is None:
                continue
            run.texts[i] += res.text
            self.book.bump("tokens_generated", len(res.output_ids))
            if res.deadline_abort:  # cut at the segment deadline: resume from its tokens
                self.book.bump("segment_deadlines")
            elif res.is_abort and not self.halted(a):
                # Aborted by someone else (an operator, an engine-side pause): resume.
                self.book.bump("unexpected_aborts")
                await asyncio.sleep(min(0.05 * run.requests[i], 1.0))
        return "stop" if s.status is SampleStatus.COMPLETED else "length"

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
            delay = self.back_off()
            log.warning("task %s handed back as partial after an engine fault: %s "
                        "(claiming again in %.1fs once an engine answers)", run.task_id,
                        fault, delay)
        group = run.to_group(producer=self.producer_id, version_hint=version, partial=True)
        await self.handback.yield_partial(a.lease, group)

    @property
    def engine_faults_in_row(self) -> int:
        """Groups handed back after an engine fault since the last one finished: while
        above 0 the producer claims only once a probe reaches an engine."""
        return self._faults_in_row

    def back_off(self) -> float:
        """One more engine fault in a row: no claims for ``backoff_s`` doubled per fault,
        at most 16 times; returns the delay."""
        self._faults_in_row += 1
        delay: float = self.config.engine.backoff_s * min(2 ** (self._faults_in_row - 1), 16)
        self.backoff_until = max(self.backoff_until, self.clock() + delay)
        return delay

    async def _finish(self, run: GroupRun, version: int) -> None:
        self._faults_in_row = 0
        reason, message = self.scorer.drop_reason(run)
        group = run.to_group(producer=self.producer_id, version_hint=version, partial=False,
                             mask_offpolicy=self.config.record.mask_offpolicy_in_partial_rollout)
        if reason is not None:
            await self.handback.drop(run.lease, reason, message or f"filter: {reason}",
                                     group.summary())
        else:
            await self.handback.complete(run.lease, group)
