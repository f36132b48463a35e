"""The producer: one per node, claiming groups and handing them back, on one event loop.

One ``Producer`` per node (``strawq.producers.placement`` pins it there as a Ray actor), a
plain class composed of parts that each do one thing::

    main loop ── poll control/ (PauseBracket) ── claim while SlotPool allows ──┐
        │                                                                      │
        ├─ GroupRunner (strawq.producers.runner): one task per lease — samples,
        │     rewards, filter, settle — each trajectory taken from the SlotPool
        │     (strawq.producers.slots), every in-flight rid in its group's live_rids
        ├─ HandBack (strawq.producers.handback): complete / yield_partial / drop /
        │     fail / release, LeaseLost and storage trouble handled there
        └─ Heartbeat (strawq.producers.heartbeat): RunQueue.heartbeat every interval

Its parts are built in order, each handed the narrow callables it needs of those built
before: the held groups (``strawq.producers.held``: the table every abort reads, the halts
that stop samples), the engine client's slot (``engine_versions.ClientSlot``), the bracket,
the version guard, the runner, the claim gate, the wake-up and idle state
(``strawq.producers.wake``) and the incarnation fence (``strawq.producers.incarnation``).

The queue (``RunQueue``, any storage backend) and the engine client (``EngineClient``:
``SGLangClient`` or anything of that shape) are injected; ``Producer(config)`` (or
``Producer.from_config``) builds both from the ``ProducerConfig`` — the queue on POSIX
storage at ``run_dir`` with the producer id as writer id, the client on ``workers`` /
``router_url`` when ``run()`` starts (and closes it when ``run()`` returns).

**Heartbeat**: when no beat succeeded for ``lease_timeout_s - margin`` the producer stops
work on every lease (aborts their requests, persists nothing: the grantor will re-queue
them) and claims nothing until a beat succeeds again.

**Bracket** (``strawq.producers.bracket``): on a pause this producer has not acknowledged,
it stops claiming, aborts its requests, completes or yields every held group, then acks;
it claims again once the pause is resumed. With ``timing.hold_through_pause`` it keeps the
unfinished groups' leases instead (one journal record makes them durable) and continues
them at the resume.

**Engines on the right weights** (``strawq.producers.engine_versions``): a reply from an
engine on a version other than the run's (outside a bracket) is discarded and re-issued;
the engine leaves the rotation, is noted under ``engines/`` for the trainer's repair, and
comes back when a probe finds it on the run's version. Every engine is probed at start and
after each bracket; with every engine out, the producer claims nothing. After a group was
handed back for an engine fault (an engine down, a partition: ``EngineUnavailable``), the
producer claims again only once a probe reaches an engine. The guard wraps
whatever client the producer runs on (``GuardedClient``), built or injected alike.

**Its own configuration** (``MisconfiguredProducer``, ``strawq.producers.handback``): a
producer that cannot run a task for a reason of its own configuration (no tokenizer for
a text or chat prompt, the engine refusing its API key, a reward plugin missing here)
hands the task back untouched and stops: it claims nothing more, hands back every held
group as on a stop, and ``run()`` raises the error, which names the key to fix. It stops
rather than stays up refusing: a stopped producer is seen (its process exits 1, its Ray
actor fails, ``strawq status`` shows its heartbeat still), while one that idles with a
moving heartbeat looks healthy; and the fix needs a restart anyway. Before its first
claim it looks at the first queued task, so a producer that could not run the run's
prompts refuses at start without claiming one.

**EOS ids** (``strawq.producers.eos``): resolved once at start, from the configuration,
the engine, the tokenizer or the model's config files; a producer that finds none refuses
to start (unless ``ignore_eos``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable

from strawq.errors import ConfigError, StorageError
from strawq.ondisk.names import validate_id
from strawq.producers.bracket import EngineAborter, PauseBracket
from strawq.producers.claim_gate import (
    ClaimGate,
    FaultBackoff,
    check_engine_versions,
    check_first_task,
)
from strawq.producers.engine_client import EngineClient
from strawq.producers.engine_versions import ClientSlot, VersionGuard
from strawq.producers.rolling import RollingPull, attestation
from strawq.producers.eos import resolve_eos_ids
from strawq.producers.handback import HandBack, MisconfiguredProducer
from strawq.producers.heartbeat import Heartbeat
from strawq.producers.held import GroupHalts, GroupTable
from strawq.producers.incarnation import Incarnation, IncarnationFence, ProducerSuperseded
from strawq.producers.journal_flush import JournalFlush
from strawq.producers.meter import ProducerStats, StatsBook
from strawq.producers.offload import Offload
from strawq.producers.producer_config import ProducerConfig, new_producer_id
from strawq.producers.runner import GroupRunner
from strawq.producers.sglang_client import SGLangClient
from strawq.producers.slots import SlotPool
from strawq.producers.wake import Claims, Wakeup, run_finished
from strawq.storage import PosixStorage
from strawq.tasks.eta import PolicyCache
from strawq.tasks.queue import RunQueue
from strawq.weights.control import Control
from strawq.weights.engine_weights import EngineWeights
from strawq.weights.publish import WeightStore

log = logging.getLogger(__name__)


def open_queue(config: ProducerConfig, producer_id: str) -> RunQueue:
    """The run's queue on POSIX storage at ``config.run_dir``; writer id = producer id (the
    grantor cleans a silent producer's tmp files by it); fsync as the run says."""
    queue = RunQueue.open(PosixStorage(config.run_dir, writer_id=producer_id))
    if not queue.config.fsync:
        queue = RunQueue(PosixStorage(config.run_dir, writer_id=producer_id, fsync=False),
                         queue.config)
    return queue


def make_client(config: ProducerConfig) -> SGLangClient:
    """The SGLang client of ``config.engine`` (its workers or router, and client settings)."""
    engine = config.engine
    return SGLangClient(engine.workers, router_url=engine.router_url, config=engine.client)


def call_in_loop(loop: asyncio.AbstractEventLoop | None, fn: Callable[[], None]) -> None:
    """Run ``fn`` on ``loop`` (the producer's, running): now when called on it or when it
    is not running, else soon from its thread."""
    if loop is None or not loop.is_running():
        fn()
        return
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        fn()
    else:
        loop.call_soon_threadsafe(fn)


class Producer:
    """Claims groups from one run's queue and generates them on SGLang-protocol engines.

    ``await producer.run()`` works until ``request_stop()``; then it parks every held group
    (yields it as a partial, or completes it) and returns. ``set_slots`` and ``stats`` may
    be called from any thread.
    """

    def __init__(self, config: ProducerConfig, *, queue: RunQueue | None = None,
                 client: EngineClient | None = None, node_id: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.producer_id = pid = validate_id(config.producer_id or new_producer_id(),
                                             "producer id")
        self.node_id = node_id
        self.clock = clock
        self.queue = queue if queue is not None else open_queue(config, self.producer_id)
        self.control = Control(self.queue.storage)
        qc = self.queue.config
        self.group_size = qc.group_size  # G is held once, in the run's QueueConfig
        self.lease_timeout_s = qc.lease_timeout_s
        timing = config.timing
        margin = qc.heartbeat_interval_s if timing.lease_margin_s is None else \
            timing.lease_margin_s
        self._book = book = StatsBook(ProducerStats(producer_id=pid, node_id=node_id,
                                                    slots=config.budget.slots,
                                                    group_size=self.group_size))
        self._io = Offload(config.threads.io, f"{pid}-io")
        self._rewards = Offload(config.threads.reward, f"{pid}-reward")
        self._heartbeat = Heartbeat(self.queue, pid, interval_s=qc.heartbeat_interval_s,
                                    give_up_after_s=max(qc.lease_timeout_s - margin,
                                                        qc.heartbeat_interval_s),
                                    idle_interval_s=qc.lease_timeout_s, clock=clock)
        #: what wakes the main loop; drained and idle state
        self._wakeup = Wakeup(self.queue.storage, pid, timing=timing,
                              heartbeat=self._heartbeat, book=book, clock=clock)
        self.pool = SlotPool(config.budget.slots, self.group_size, eager=config.budget.eager_claim,
                             clock=clock, kick=self._wakeup.kick)
        self.handback = handback = HandBack(self.queue, self._io, book)
        #: the engine client (built in run() unless injected), raw and behind the guard
        self._slot = ClientSlot(client, functools.partial(make_client, config))
        table = GroupTable()
        self._aborter = EngineAborter(self._slot.raw, pid, poll_s=timing.abort_poll_s,
                                      deadline_s=timing.abort_deadline_s, clock=clock,
                                      live_rids=table.live_rids)
        halts = GroupHalts(table, producer_id=pid, pool=self.pool, aborter=self._aborter,
                           book=book)
        self._bracket = bracket = PauseBracket(
            self.control, pid, poll_s=timing.control_poll_s, clock=clock, io=self._io.call,
            park=self._pause_groups, held=table.__len__, unreturned=lambda: len(handback.orphans),
            kept=table.held)
        #: a bracket was just resumed and the engines are being probed: held groups wait
        self._probing_after_resume = False
        #: engines on weights other than the run's version: out of rotation, noted for
        #: the trainer in engines/, probed until they hold the run's version again
        self.guard = VersionGuard(pid, client=self._slot.raw,
                                  current_version=self.queue.current_version,
                                  notes=EngineWeights(self.queue.storage), io=self._io.call,
                                  pausing=lambda: bracket.pausing, book=book,
                                  probe_s=max(0.2, 5 * timing.control_poll_s), clock=clock)
        # a cache of its own: the guard's first read (before a collector published its
        # policy) must not hold a None in the claim-time check's cache (RunQueue.eta_policy)
        self._eta_policy = PolicyCache(self.queue.storage)
        self.guard.eta_reader = self._eta
        #: rolling weight updates: this producer's engines pull published versions in waves;
        #: after each load the engine is attested against the version's fingerprint (when
        #: the trainer published one) before it serves
        self.rolling = RollingPull(pid, store=WeightStore(self.queue.storage),
                                   client=self._slot.raw, guard=self.guard, io=self._io.call,
                                   book=book, clock=clock, poll_s=timing.control_poll_s,
                                   after_load=attestation(
                                       self.queue.storage, self._io.call,
                                       api_key=config.engine.client.admin_api_key
                                       or config.engine.client.api_key),
                                   cache_dir=config.engine.weights_cache_dir)
        backoff = FaultBackoff(config.engine.backoff_s, clock)
        self.runner = GroupRunner(config, producer_id=pid, queue=self.queue,
                                  group_size=self.group_size, client=self._slot.guarded,
                                  pool=self.pool, handback=handback, book=book, io=self._io,
                                  rewards=self._rewards, aborter=self._aborter,
                                  pausing=self._groups_wait, clock=clock,
                                  kick=self._wakeup.kick, table=table, halts=halts,
                                  backoff=backoff)
        self.runner.saw_version = self.guard.saw_version
        #: the in-flight journal (``strawq.producers.journal_flush``): None when off (or
        #: when turn checkpoints hold a multi-turn plugin's state)
        self.journal: JournalFlush | None = None
        if timing.journaling and not self.runner.checkpointing:
            self.journal = handback.journal = JournalFlush(
                timing, table=table, queue=self.queue, io=self._io, book=book,
                producer_id=pid, clock=clock)
            if not config.engine.client.stream:
                log.info("producer %s: the journal holds what arrived; unstreamed, a segment's "
                         "tokens arrive when it ends (engine.client.stream=true makes them "
                         "durable within the window: docs/producers.md)", pid)
        if timing.hold_through_pause is True and self.journal is None:
            raise ConfigError("ProducerConfig.timing.hold_through_pause needs the in-flight "
                              "journal, which a producer with turn checkpoints (a multi-turn "
                              "generate plugin, tools.checkpoint_every_*) does not keep: "
                              "set tools checkpointing off or hold_through_pause=false")
        # None (the default): hold whenever the journal is kept, park otherwise
        bracket.holds = self.journal is not None and timing.hold_through_pause is not False
        self._journal_task: asyncio.Task[None] | None = None
        #: whether, and how many groups, this producer may claim now
        self.gate = ClaimGate(producer_id=pid, run_dir=config.run_dir, handback=handback,
                              bracket=bracket, heartbeat=self._heartbeat, backoff=backoff,
                              guard=self.guard, pool=self.pool, book=book,
                              loading=table.loading, clock=clock)
        #: this process's incarnation of its id (``strawq.producers.incarnation``)
        self.incarnation = Incarnation(self.queue, pid)
        self._fence = IncarnationFence(self.incarnation, io=self._io.call,
                                       interval_s=qc.heartbeat_interval_s, clock=clock)
        self._claims = Claims(self.queue, pid, io=self._io, gate=self.gate, wakeup=self._wakeup,
                              start=self.runner.start, fenced=self._fenced, clock=clock)
        self._stopping = False
        self._cpu0 = time.process_time()
        self._t0 = clock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.running = False

    @classmethod
    def from_config(cls, config: ProducerConfig, *, node_id: str | None = None,
                    clock: Callable[[], float] = time.monotonic) -> Producer:
        """The queue and the engine client built from ``config`` (what the Ray actor, the
        demo and the lab use)."""
        return cls(config, node_id=node_id, clock=clock)

    # -- public controls (any thread) --------------------------------------------------------
    @property
    def client(self) -> EngineClient:
        """The engine client the runner generates on: the configured or injected one,
        behind this producer's version guard."""
        return self._slot.guarded()

    @property
    def superseded(self) -> str | None:
        """Why a newer incarnation of this id stopped this one (None: it was not)."""
        return self._fence.superseded

    @property
    def slots(self) -> int:
        return self.pool.slots

    def set_slots(self, n: int) -> None:
        """Change this producer's group slots. Fewer slots than busy: no new claims until
        enough groups finish (running samples are never preempted)."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"slots must be an int >= 0, got {n!r}")
        call_in_loop(self._loop, lambda: self.pool.set_slots(n))

    @property
    def stop_abort_s(self) -> float:
        """How long a stop waits for its aborted requests to come back with their tokens:
        ``timing.abort_deadline_s``, at most half of ``timing.grace_period_s`` (the other
        half is the hand-back's)."""
        timing = self.config.timing
        return min(timing.abort_deadline_s, timing.grace_period_s / 2)

    def request_stop(self) -> None:
        """Ask ``run()`` to park every held group and return."""
        def stop() -> None:
            self._stopping = True
            self._wakeup.kick()
        call_in_loop(self._loop, stop)

    def live_rids(self) -> set[str]:
        """The rids of every ``/generate`` this producer has in flight now."""
        return self.runner.live_rids()

    def stats(self) -> ProducerStats:
        s = self._book.snapshot()
        s.slots = self.pool.slots
        s.busy_trajectories = self.pool.busy
        s.slot_utilisation = self.pool.utilisation()
        s.wall_s = self.clock() - self._t0
        s.cpu_s = time.process_time() - self._cpu0
        s.paused = self._bracket.pausing
        s.engines_stale = len(self.guard.stale)
        s.waiting_for_weights = self.guard.waiting
        s.heartbeat_failing = self._heartbeat.failing
        s.idle = self._heartbeat.idle
        s.cpu_s_per_group = s.cpu_s / s.groups_done if s.groups_done else None
        return s

    def reset_stats_window(self) -> None:
        """Start a fresh utilisation / CPU window (benchmarks)."""
        self.pool.reset_window()
        self._cpu0 = time.process_time()
        self._t0 = self.clock()

    # -- run ---------------------------------------------------------------------------------
    async def run(self) -> None:
        """Work until ``request_stop()``; then hand back every held group and return."""
        if self.running:
            raise RuntimeError(f"producer {self.producer_id} is already running")
        self.running = True
        self._loop = asyncio.get_running_loop()
        pid = self.producer_id
        self._wakeup.open(self._loop, self._bracket)
        self._io.start()
        self._heartbeat.start()
        self._rewards.start()
        raw = self._slot.open(self.guard)
        hb: asyncio.Task[None] | None = None
        try:
            await check_first_task(self.queue, self._io, self.runner.loader, pid)
            await self.client.start()
            self.runner.eos_ids = await resolve_eos_ids(
                raw, configured=self.config.engine.generation.eos_token_ids,
                tokenizer=self.runner.tokenizer,
                ignore_eos=self.config.sampler_params().ignore_eos, who=f"producer {pid}")
            await check_engine_versions(raw, self.guard, pid)
            await self.rolling.start()
            # before the first claim: leases under this id are an earlier process's
            await self._io.call(self.incarnation.begin)
            if self.journal is not None:
                self.journal.open(self.incarnation.number)
                self._journal_task = asyncio.create_task(self.journal.run(),
                                                         name=f"{pid}-journal")
            await self._heartbeat.beat_once()  # before the first claim: the grantor sees us
            hb = asyncio.create_task(self._heartbeat.run(self._give_up_leases),
                                     name=f"{pid}-heartbeat")
            log.info("producer %s started on %s: %d slots x G=%d, workers %s", pid,
                     self.node_id or "this node", self.pool.slots, self.group_size,
                     self.client.worker_urls)
            await self._main_loop()
        finally:
            try:
                await self.runner.halts.park_all("stop", deadline_s=self.stop_abort_s)
                await self.handback.retry_orphans()
                if self.handback.orphans:
                    log.error("producer %s stops holding %d leases it could not hand back; "
                              "the grantor expires them once its heartbeats stop",
                              pid, len(self.handback.orphans))
            finally:
                await self._close(hb)
        if self.superseded is not None:
            raise ProducerSuperseded(self.superseded)
        refusal = self.handback.refusal
        if refusal is not None:
            raise MisconfiguredProducer(
                f"producer {pid} stopped claiming: {refusal.detail} (the task and every "
                "group it held were handed back to the queue, none dropped)", key=refusal.key)

    async def _close(self, hb: asyncio.Task[None] | None) -> None:
        """The end of ``run()``: every part it started stopped, in order."""
        await self.rolling.close()
        await self.guard.close()
        await self.runner.scorer.close()
        for t in (hb, self._journal_task):
            if t is not None:
                t.cancel()
                await asyncio.gather(t, return_exceptions=True)
        await self._slot.close()
        self._wakeup.close()
        self._heartbeat.close()
        self._io.shutdown()
        self._rewards.shutdown()
        self.running = False
        st = self.stats()
        log.info("producer %s stopped: %d groups claimed, %d completed, %d yielded, "
                 "%d dropped, %d failed; %d tokens", self.producer_id, st.groups_claimed,
                 st.groups_completed, st.groups_yielded, st.groups_dropped,
                 st.groups_failed, st.tokens_generated)
        log.debug("producer %s stats: %s", self.producer_id, st.to_dict())

    async def _pause_groups(self, why: str) -> int:
        """A bracket's pause: park every held group (returns the partials yielded), or, with
        ``timing.hold_through_pause``, hold them (``GroupHalts.hold_all``: one journal
        record, their leases kept; 0)."""
        journal = self.journal
        if journal is not None and self._bracket.holds:
            return await self.runner.halts.hold_all(why, durable=journal.flush)
        return await self.runner.halts.park_all(why)

    def _eta(self) -> int | None:
        """The collector's η (blocking; re-read every few seconds): the rolling route's
        bound on resuming a partial on a lagging engine."""
        policy = self._eta_policy.get()
        return None if policy is None else policy.max_staleness

    def _groups_wait(self) -> bool:
        """Whether the groups' samples wait: a pause is obeyed, or it was just resumed and the
        engines are being probed (``VersionGuard.probe_all``) before any sample goes on."""
        return self._bracket.pausing or self._probing_after_resume

    def _may_idle(self) -> bool:
        """Nothing to claim (pending/ listed empty), no group held or owed back, no pause
        being obeyed, heartbeats succeeding: the producer may go idle."""
        return self._wakeup.drained and not self.runner.groups and not self.handback.orphans \
            and not self._bracket.pausing and not self._heartbeat.failing and \
            self.handback.refusal is None

    async def _main_loop(self) -> None:
        w = self._wakeup
        timing = self.config.timing
        idle_since: float | None = None
        while not self._stopping and self.handback.refusal is None:
            if w.idle:
                if not await w.idle_step(lambda: self._stopping, self._run_finished):
                    continue
                idle_since = None
            await self.handback.retry_orphans()
            if self._fence.due():
                # also while it claims nothing (slots full, idle): before it acks a pause
                # under an id a newer process now holds
                try:
                    if await self._fenced():
                        break
                except StorageError:
                    pass  # the claim's check, or the next one, will tell
            was_pausing = self._bracket.pausing
            # groups held through the pause go on only once the probe after the resume took
            # out of rotation an engine the push missed (or that failed attestation)
            self._probing_after_resume = was_pausing
            try:
                if await self._bracket.poll():
                    self._book.bump("brackets")
                if was_pausing and not self._bracket.pausing:
                    await self.guard.probe_all()  # an engine the push missed stays out
            finally:
                self._probing_after_resume = False
            self.guard.tick()
            self.rolling.tick()
            if self._stopping or self.handback.refusal is not None:
                break
            timeout = timing.control_poll_s
            n = await self.gate.groups()
            if n > 0 and w.may_list():
                claimed = await self._claims.claim(n)
                if claimed is None:
                    break  # a newer process of this id claims from here on
                if claimed:
                    continue  # claimed all we could: look again at once
                timeout = min(timeout, timing.idle_poll_s)
            if self._may_idle():
                if await self._run_finished():
                    break
                now = self.clock()
                idle_since = now if idle_since is None else idle_since
                if now - idle_since >= timing.idle_after_s:
                    w.enter_idle()
                    continue
            else:
                idle_since = None
            await w.wait(timeout)

    async def _fenced(self) -> bool:
        """Whether a newer incarnation of this id exists; if so, stop (``superseded``)."""
        if await self._fence.check():
            self._stopping = True
            return True
        return False

    async def _run_finished(self) -> bool:
        """The run has finished (the collector's ``finished`` record, ``strawq.tasks.finished``):
        nothing will be released again, so the producer stops (``run()`` returns; the CLI
        exits 0). Asked only while idle or drained: one stat."""
        end = await run_finished(self._io.call, self.queue.storage)
        if end is None:
            return False
        log.info("producer %s: the run has finished (last batch %s); stopping",
                 self.producer_id, end.get("last_seq"))
        self._stopping = True
        return True

    def _give_up_leases(self, silent: float, first: bool) -> None:
        """Heartbeats keep failing: stop work on every lease; the grantor re-queues them."""
        if first:
            log.error("producer %s: no heartbeat succeeded for %.1fs (lease timeout %.1fs); "
                      "giving up %d leases, claiming nothing until a beat succeeds",
                      self.producer_id, silent, self.lease_timeout_s, len(self.runner.groups))
        self.runner.abandon_all()
