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
it claims again once the pause is resumed.

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
import logging
import math
import time
from collections.abc import Callable

from strawq.control import Control
from strawq.engine_weights import EngineWeights
from strawq.errors import StorageError, StrawqError
from strawq.finished import finished
from strawq.names import validate_id
from strawq.queue import RunQueue
from strawq.storage import PosixStorage
from strawq.storage.watch import IN_CREATE, IN_MOVED_TO, DirProbe, DirWatch

from strawq.producers.claim_gate import ClaimGate, check_engine_versions, check_first_task
from strawq.producers.bracket import EngineAborter, PauseBracket
from strawq.producers.engine_client import EngineClient
from strawq.producers.engine_versions import GuardedClient, VersionGuard
from strawq.producers.eos import resolve_eos_ids
from strawq.producers.handback import HandBack, MisconfiguredProducer
from strawq.producers.heartbeat import Heartbeat
from strawq.producers.incarnation import Incarnation, ProducerSuperseded
from strawq.producers.meter import ProducerStats, StatsBook
from strawq.producers.offload import Offload
from strawq.producers.producer_config import ProducerConfig, new_producer_id
from strawq.producers.runner import GroupRunner
from strawq.producers.sglang_client import SGLangClient
from strawq.producers.slots import SlotPool

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
        self.producer_id = validate_id(config.producer_id or new_producer_id(), "producer id")
        self.node_id = node_id
        self.clock = clock
        self.queue = queue if queue is not None else open_queue(config, self.producer_id)
        self.control = Control(self.queue.storage)
        qc = self.queue.config
        self.group_size = qc.group_size  # G is held once, in the run's QueueConfig
        self.lease_timeout_s = qc.lease_timeout_s
        margin = config.timing.lease_margin_s
        margin = qc.heartbeat_interval_s if margin is None else margin
        give_up_after_s = max(qc.lease_timeout_s - margin, qc.heartbeat_interval_s)
        self._client = client
        self._owns_client = client is None
        #: ``_client`` behind the version guard: what the runner generates on
        self._guarded: GuardedClient | None = None
        pid = self.producer_id
        self._book = StatsBook(ProducerStats(producer_id=pid, node_id=node_id,
                                             slots=config.budget.slots, group_size=self.group_size))
        self._io = Offload(config.threads.io, f"{pid}-io")
        self._rewards = Offload(config.threads.reward, f"{pid}-reward")
        self.pool = SlotPool(config.budget.slots, self.group_size, eager=config.budget.eager_claim,
                             clock=clock, kick=self._kick)
        self.handback = HandBack(self.queue, self._io, self._book)
        self._heartbeat = Heartbeat(self.queue, pid, interval_s=qc.heartbeat_interval_s,
                                    give_up_after_s=give_up_after_s,
                                    idle_interval_s=qc.lease_timeout_s, clock=clock)
        self._aborter = EngineAborter(lambda: self._client, pid, poll_s=config.timing.abort_poll_s,
                                      deadline_s=config.timing.abort_deadline_s, clock=clock,
                                      live_rids=lambda: self.runner.live_rids())
        self.runner = GroupRunner(config, producer_id=pid, queue=self.queue,
                                  group_size=self.group_size, client=lambda: self.client,
                                  pool=self.pool, handback=self.handback, book=self._book,
                                  io=self._io, rewards=self._rewards, aborter=self._aborter,
                                  pausing=lambda: self._bracket.pausing, clock=clock,
                                  kick=self._kick)
        self._bracket = PauseBracket(self.control, pid, poll_s=config.timing.control_poll_s,
                                     clock=clock, io=self._io.call, park=self.runner.park_all,
                                     held=lambda: len(self.runner.groups),
                                     unreturned=lambda: len(self.handback.orphans))
        #: engines on weights other than the run's version: out of rotation, noted for
        #: the trainer in engines/, probed until they hold the run's version again
        self.guard = VersionGuard(pid, client=lambda: self._client,
                                  current_version=self.queue.current_version,
                                  notes=EngineWeights(self.queue.storage), io=self._io.call,
                                  pausing=lambda: self._bracket.pausing, book=self._book,
                                  probe_s=max(0.2, 5 * config.timing.control_poll_s), clock=clock)
        self._stopping = False
        self._last_empty_claim = -math.inf
        self._cpu0 = time.process_time()
        self._t0 = clock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._work_changed: Callable[[], bool] = lambda: True
        self._drained = False
        #: idle: heartbeat marked idle, control/ unread, pending/ statted every idle_probe_s
        self._idle = False
        #: whether, and how many groups, this producer may claim now
        self.gate = ClaimGate(producer_id=pid, run_dir=config.run_dir, handback=self.handback,
                              bracket=self._bracket, heartbeat=self._heartbeat,
                              runner=self.runner, guard=self.guard, pool=self.pool,
                              book=self._book, clock=clock)
        self.running = False
        #: this process's incarnation of its id (``strawq.producers.incarnation``)
        self.incarnation = Incarnation(self.queue, pid)
        #: why a newer incarnation of this id stopped this one (None: it was not)
        self.superseded: str | None = None
        self._fence_checked = -math.inf

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
        if self._client is None or self._guarded is None:
            raise RuntimeError("producer not running: its engine client starts in run()")
        return self._guarded

    @property
    def slots(self) -> int:
        return self.pool.slots

    def set_slots(self, n: int) -> None:
        """Change this producer's group slots. Fewer slots than busy: no new claims until
        enough groups finish (running samples are never preempted)."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"slots must be an int >= 0, got {n!r}")
        self._call_in_loop(lambda: self.pool.set_slots(n))

    def request_stop(self) -> None:
        """Ask ``run()`` to park every held group and return."""
        def stop() -> None:
            self._stopping = True
            self._kick()
        self._call_in_loop(stop)

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

    def _call_in_loop(self, fn: Callable[[], None]) -> None:
        loop = self._loop
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

    def _kick(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _on_change(self, watch: DirWatch) -> None:
        """pending/ or control/ gained an entry: claim and read control/ now."""
        watch.drain()
        self._last_empty_claim = -math.inf
        self._drained = False
        self._bracket.poll_soon()
        self._kick()

    # -- run ---------------------------------------------------------------------------------
    async def run(self) -> None:
        """Work until ``request_stop()``; then hand back every held group and return."""
        if self.running:
            raise RuntimeError(f"producer {self.producer_id} is already running")
        self.running = True
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        pid = self.producer_id
        # New work (pending/) and the bracket (control/) wake the loop at once where this
        # host sees the change (inotify); the polls of idle_poll_s / control_poll_s remain
        # the fallback for changes made on other hosts.
        watch = DirWatch(self.queue.storage, ("pending", "control"),
                         mask=IN_CREATE | IN_MOVED_TO)
        fd = watch.fileno()
        if fd is not None:
            self._loop.add_reader(fd, self._on_change, watch)
        # Where no event comes, an idle poll stats pending/ and control/ and lists only
        # when they changed (one cached getattr instead of listings, see DirProbe).
        work_probe = DirProbe(self.queue.storage, ("pending",), clock=self.clock)
        control_probe = DirProbe(self.queue.storage, ("control",), clock=self.clock)
        self._bracket.probe = control_probe.changed
        self._work_changed = work_probe.changed
        self._io.start()
        self._heartbeat.start()
        self._rewards.start()
        if self._client is None:
            self._client = make_client(self.config)
        self._guarded = GuardedClient(self._client, self.guard)
        hb: asyncio.Task[None] | None = None
        try:
            await check_first_task(self.queue, self._io, self.runner.loader, pid)
            await self.client.start()
            self.runner.eos_ids = await resolve_eos_ids(
                self._client, configured=self.config.engine.generation.eos_token_ids,
                tokenizer=self.runner.tokenizer,
                ignore_eos=self.config.sampler_params().ignore_eos, who=f"producer {pid}")
            await check_engine_versions(self._client, self.guard, pid)
            # before the first claim: leases under this id are an earlier process's
            await self._io.call(self.incarnation.begin)
            await self._heartbeat.beat_once()  # before the first claim: the grantor sees us
            hb = asyncio.create_task(self._heartbeat.run(self._give_up_leases),
                                     name=f"{pid}-heartbeat")
            log.info("producer %s started on %s: %d slots x G=%d, workers %s", pid,
                     self.node_id or "this node", self.pool.slots, self.group_size,
                     self.client.worker_urls)
            await self._main_loop()
        finally:
            try:
                await self.runner.park_all("stop")
                await self.handback.retry_orphans()
                if self.handback.orphans:
                    log.error("producer %s stops holding %d leases it could not hand back; "
                              "the grantor expires them once its heartbeats stop",
                              pid, len(self.handback.orphans))
            finally:
                await self.guard.close()
                await self.runner.scorer.close()
                if hb is not None:
                    hb.cancel()
                    await asyncio.gather(hb, return_exceptions=True)
                if self._owns_client and self._client is not None:
                    await self._client.close()
                    self._client = None
                self._guarded = None
                if fd is not None:
                    self._loop.remove_reader(fd)
                watch.close()
                work_probe.close()
                control_probe.close()
                self._heartbeat.close()
                self._io.shutdown()
                self._rewards.shutdown()
                self.running = False
                st = self.stats()
                log.info("producer %s stopped: %d groups claimed, %d completed, %d yielded, "
                         "%d dropped, %d failed; %d tokens", pid, st.groups_claimed,
                         st.groups_completed, st.groups_yielded, st.groups_dropped,
                         st.groups_failed, st.tokens_generated)
                log.debug("producer %s stats: %s", pid, st.to_dict())
        if self.superseded is not None:
            raise ProducerSuperseded(self.superseded)
        refusal = self.handback.refusal
        if refusal is not None:
            raise MisconfiguredProducer(
                f"producer {pid} stopped claiming: {refusal.detail} (the task and every "
                "group it held were handed back to the queue, none dropped)", key=refusal.key)

    def _may_idle(self) -> bool:
        """Nothing to claim (pending/ listed empty), no group held or owed back, no pause
        being obeyed, heartbeats succeeding: the producer may go idle."""
        return self._drained and not self.runner.groups and not self.handback.orphans and \
            not self._bracket.pausing and not self._heartbeat.failing and \
            self.handback.refusal is None

    async def _idle_step(self, wake: asyncio.Event) -> bool:
        """While idle: wait for a change (this host: inotify at once; another host's
        release: a stat of pending/ every ``idle_probe_s``). True once the producer left
        idle (its heartbeat unmarked first, then ``control/`` read afresh: a bracket that
        paused meanwhile sees it live before it claims anything)."""
        timing = self.config.timing
        try:
            await asyncio.wait_for(wake.wait(), timing.idle_probe_s)
            woken = True
        except asyncio.TimeoutError:
            woken = False
        wake.clear()
        if self._stopping:
            return True
        if not woken and not self._work_changed():
            if await self._run_finished():
                return True
            return False
        if not await self._heartbeat.leave_idle():
            return False  # claim nothing before a beat without the idle mark went through
        self._idle = False
        self._drained = False
        self._last_empty_claim = -math.inf
        self._bracket.poll_soon()
        if await self._bracket.poll(force=True):
            self._book.bump("brackets")
        log.debug("producer %s leaves idle", self.producer_id)
        return True

    async def _main_loop(self) -> None:
        wake = self._wake
        if wake is None:
            raise RuntimeError("the main loop runs only inside run()")
        idle_since: float | None = None
        while not self._stopping and self.handback.refusal is None:
            if self._idle:
                if not await self._idle_step(wake):
                    continue
                idle_since = None
            await self.handback.retry_orphans()
            if self.clock() - self._fence_checked >= self.queue.config.heartbeat_interval_s:
                # also while it claims nothing (slots full, idle): before it acks a pause
                # under an id a newer process now holds
                try:
                    if await self._fenced():
                        break
                except StorageError:
                    pass  # the claim's check, or the next one, will tell
            was_pausing = self._bracket.pausing
            if await self._bracket.poll():
                self._book.bump("brackets")
            if was_pausing and not self._bracket.pausing:
                await self.guard.probe_all()  # an engine the push missed stays out
            self.guard.tick()
            if self._stopping or self.handback.refusal is not None:
                break
            timeout = self.config.timing.control_poll_s
            n = await self.gate.groups()
            if n > 0 and self.clock() - self._last_empty_claim >= self.config.timing.idle_poll_s \
                    and (not self._drained or self._work_changed()):
                try:
                    if await self._fenced():  # a newer process of this id claims from here on
                        break
                    leases = await self._io.call(self.queue.claim, self.producer_id, n)
                    for lease in leases:
                        self.runner.start(lease)
                    if leases:
                        # Work was there: list again at the next claim. Claims empty a
                        # release directory without moving pending/'s own mtime, so a
                        # producer left "drained" would see the rest only at the probe's
                        # full listing (a minute later).
                        self._drained = False
                    if len(leases) < n:
                        self._last_empty_claim = self.clock()
                        timeout = min(timeout, self.config.timing.idle_poll_s)
                        # Nothing left to claim (not merely lost races): until pending/
                        # changes, idle polls stat it instead of listing it.
                        self._drained = not leases and not await self._io.call(
                            self.queue.list_pending, 1)
                    else:
                        self.gate.storage_answers(None)
                        continue  # claimed all we could: look again at once
                except StorageError as exc:
                    self.gate.storage_answers(exc)
                    self._last_empty_claim = self.clock()
                    timeout = min(timeout, self.config.timing.idle_poll_s)
                else:
                    self.gate.storage_answers(None)
            if self._may_idle():
                if await self._run_finished():
                    break
                now = self.clock()
                idle_since = now if idle_since is None else idle_since
                if now - idle_since >= self.config.timing.idle_after_s:
                    self._idle = True
                    self._heartbeat.enter_idle()
                    log.debug("producer %s is idle", self.producer_id)
                    continue
            else:
                idle_since = None
            try:
                await asyncio.wait_for(wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            wake.clear()

    async def _fenced(self) -> bool:
        """Whether a newer incarnation of this id exists; if so, stop (``superseded``)."""
        self._fence_checked = self.clock()
        self.superseded = await self._io.call(self.incarnation.superseded)
        if self.superseded is None:
            return False
        log.error("%s", self.superseded)
        self._stopping = True
        return True

    async def _run_finished(self) -> bool:
        """The run has finished (the collector's ``finished`` record, ``strawq.finished``):
        nothing will be released again, so the producer stops (``run()`` returns; the CLI
        exits 0). Asked only while idle or drained: one stat."""
        try:
            end = await self._io.call(finished, self.queue.storage)
        except StrawqError:
            return False  # unreadable now: asked again at the next idle poll
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
