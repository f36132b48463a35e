"""The producer loop: claim groups, drive the engines, persist ready and partial groups.

One ``Producer`` per node (``strawq.producers.placement`` pins it there as a Ray actor), a plain
class running on one asyncio event loop::

    main loop ── poll control/ (bracket) ── claim while free trajectory slots >= G ──┐
        │                                                                            │
        ├─ group task per lease: load partial / build samples ─ sample tasks ─ settle:
        │     all final  -> rewards, filter -> RunQueue.complete | RunQueue.drop
        │     parked     -> RunQueue.yield_partial (prefixes kept, no attempt spent)
        │     engine gone-> RunQueue.yield_partial + claim back-off
        │     rejected   -> RunQueue.fail(retryable=True)
        └─ heartbeat task: RunQueue.heartbeat every heartbeat_interval_s

**Slots.** ``slots`` group slots are counted in trajectories (``slots * G``). A claim
reserves G; each sample frees its trajectory when its generation ends, so one long-tail
sample never blocks a new claim once G trajectories are free (verl's continuous loop).

**Heartbeat** (``strawq.producers.heartbeat``): beats are scheduled by this loop, written on their
own thread; when none succeeded for ``lease_timeout_s - margin`` the producer stops work
on every lease (aborts their requests, persists nothing: the grantor will re-queue them)
and claims nothing until a beat succeeds again.

**Bracket** (``strawq.producers.bracket``): on a pause this producer has not acknowledged, it
stops claiming, aborts its requests, completes or yields every held group, then acks; it
claims again once the pause is resumed.

rids are ``<producer>/<task>.g<gen>/<sample>.<n>``: the ``/`` after each part keeps one
producer's (or one lease's) prefix from matching another's.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from strawq.control import Control
from strawq.errors import CorruptRecord, LeaseLost, NotFound, StrawqError
from strawq.groups import GroupData
from strawq.names import validate_id
from strawq.queue import Lease, RunQueue
from strawq.storage import PosixStorage

from strawq.producers.bracket import EngineAborter, PauseBracket
from strawq.producers.engine_errors import EngineError, EngineUnavailable
from strawq.producers.group import GroupRun, TaskError, prompt_ids_of, sample_seed
from strawq.producers.heartbeat import Heartbeat
from strawq.producers.meter import ProducerStats, SlotMeter
from strawq.producers.plugins import FilterFn, RewardFn, load_filter, load_reward, resolve
from strawq.producers.producer_config import ProducerConfig, new_producer_id
from strawq.producers.sample import SampleError, SamplerParams
from strawq.producers.sglang_client import SGLangClient

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(eq=False)
class _Active:
    """A lease this producer holds, and the tasks working on it."""

    lease: Lease
    #: trajectories this group's running samples hold
    reserved: int = 0
    #: samples claimed but not yet holding a trajectory (counted against new claims)
    demand: int = 0
    run: GroupRun | None = None
    task: asyncio.Task[None] | None = None
    sample_tasks: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    parking: bool = False
    abandoned: bool = False
    fault: BaseException | None = None


class Producer:
    """Claims groups from one run's queue and generates them on SGLang-protocol engines.

    ``await producer.run()`` works until ``request_stop()``; then it parks every held group
    (yields it as a partial, or completes it) and returns. ``set_slots`` and ``stats`` may
    be called from any thread.
    """

    def __init__(self, config: ProducerConfig, *, node_id: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 client: SGLangClient | None = None) -> None:
        self.config = config
        self.producer_id = validate_id(config.producer_id or new_producer_id(), "producer id")
        self.node_id = node_id
        self.clock = clock
        # writer_id == producer id: the grantor cleans a silent producer's tmp files by it.
        queue = RunQueue.open(PosixStorage(config.run_dir, writer_id=self.producer_id))
        if not queue.config.fsync:
            queue = RunQueue(PosixStorage(config.run_dir, writer_id=self.producer_id,
                                          fsync=False), queue.config)
        self.queue = queue
        self.control = Control(queue.storage)
        qc = queue.config
        self.group_size = config.group_size or qc.group_size
        self.prompt_key = qc.prompt_key
        self.heartbeat_interval_s = qc.heartbeat_interval_s
        self.lease_timeout_s = qc.lease_timeout_s
        margin = qc.heartbeat_interval_s if config.lease_margin_s is None else config.lease_margin_s
        self.give_up_after_s = max(qc.lease_timeout_s - margin, qc.heartbeat_interval_s)
        self.reward_fn: RewardFn = load_reward(config.reward)
        self.filter_fn: FilterFn | None = load_filter(config.filter)
        self.tokenizer: Callable[[str], list[int]] | None = (
            resolve(config.tokenizer, what="tokenizer", arity=1) if config.tokenizer else None)
        self._client = client
        self._own_client = client is None
        self._slots = config.slots
        self._groups: dict[str, _Active] = {}
        self._orphans: list[Lease] = []
        self._demand = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._meter = SlotMeter(clock)
        self._meter.set_capacity(self._slots * self.group_size)
        self._stats = ProducerStats(producer_id=self.producer_id, node_id=node_id,
                                    slots=self._slots, group_size=self.group_size)
        self._lock = threading.Lock()  # guards cross-thread stats/slot reads
        self._stopping = False
        self._backoff_until = 0.0
        self._faults_in_row = 0
        self._last_empty_claim = -math.inf
        self._cpu0 = time.process_time()
        self._t0 = clock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._io: ThreadPoolExecutor | None = None
        self._reward_pool: ThreadPoolExecutor | None = None
        self._heartbeat = Heartbeat(queue, self.producer_id,
                                    interval_s=self.heartbeat_interval_s,
                                    give_up_after_s=self.give_up_after_s, clock=clock)
        self._aborter = EngineAborter(lambda: self._client, self.producer_id,
                                      poll_s=config.abort_poll_s,
                                      deadline_s=config.abort_deadline_s, clock=clock)
        self._bracket = PauseBracket(self.control, self.producer_id,
                                     poll_s=config.control_poll_s, clock=clock,
                                     io=self._io_call, park=self._park_all,
                                     held=lambda: len(self._groups),
                                     unreturned=lambda: len(self._orphans))
        self.running = False

    # -- public controls (any thread) --------------------------------------------------------
    @property
    def client(self) -> SGLangClient:
        if self._client is None:
            raise RuntimeError("producer not running: its engine client starts in run()")
        return self._client

    @property
    def slots(self) -> int:
        return self._slots

    def set_slots(self, n: int) -> None:
        """Change this producer's group slots. Fewer slots than busy: no new claims until
        enough groups finish (running samples are never preempted)."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"slots must be an int >= 0, got {n!r}")
        self._call_in_loop(lambda: self._set_slots(n))

    def _set_slots(self, n: int) -> None:
        with self._lock:
            self._slots = n
            self._stats.slots = n
            self._meter.set_capacity(n * self.group_size)
        self._wake_waiters(all_=True)
        self._kick()

    def request_stop(self) -> None:
        """Ask ``run()`` to park every held group and return."""
        def stop() -> None:
            self._stopping = True
            self._kick()
        self._call_in_loop(stop)

    def stats(self) -> ProducerStats:
        with self._lock:
            s = ProducerStats(**{k: v for k, v in vars(self._stats).items()})
            s.drop_reasons = dict(self._stats.drop_reasons)
            s.busy_trajectories = self._meter.busy
            s.slot_utilisation = self._meter.utilisation()
            s.wall_s = self.clock() - self._t0
            s.cpu_s = time.process_time() - self._cpu0
            s.paused = self._bracket.pausing
        s.cpu_s_per_group = s.cpu_s / s.groups_done if s.groups_done else None
        return s

    def reset_stats_window(self) -> None:
        """Start a fresh utilisation / CPU window (benchmarks)."""
        with self._lock:
            self._meter.reset()
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

    # -- run ---------------------------------------------------------------------------------
    async def run(self) -> None:
        """Work until ``request_stop()``; then hand back every held group and return."""
        if self.running:
            raise RuntimeError(f"producer {self.producer_id} is already running")
        self.running = True
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        pid = self.producer_id
        self._io = ThreadPoolExecutor(self.config.io_threads, thread_name_prefix=f"{pid}-io")
        self._heartbeat.start()
        self._reward_pool = ThreadPoolExecutor(self.config.reward_threads,
                                               thread_name_prefix=f"{pid}-reward")
        if self._client is None:
            self._client = SGLangClient(self.config.workers, router_url=self.config.router_url,
                                        config=self.config.client)
        hb: asyncio.Task[None] | None = None
        try:
            await self.client.start()
            await self._heartbeat.beat_once()  # before the first claim: the grantor sees us
            hb = asyncio.create_task(self._heartbeat.run(self._give_up_leases),
                                     name=f"{pid}-heartbeat")
            log.info("producer %s started on %s: %d slots x G=%d, workers %s", pid,
                     self.node_id or "this node", self._slots, self.group_size,
                     self.client.worker_urls)
            await self._main_loop()
        finally:
            try:
                await self._park_all("stop")
                await self._retry_orphans()
                if self._orphans:
                    log.error("producer %s stops holding %d leases it could not hand back; "
                              "the grantor expires them once its heartbeats stop",
                              self.producer_id, len(self._orphans))
            finally:
                if hb is not None:
                    hb.cancel()
                    await asyncio.gather(hb, return_exceptions=True)
                if self._own_client and self._client is not None:
                    await self._client.close()
                    self._client = None
                self._heartbeat.close()
                for pool in (self._io, self._reward_pool):
                    pool.shutdown(wait=False, cancel_futures=True)
                self.running = False
                log.info("producer %s stopped: %s", pid, self.stats().to_dict())

    async def _io_call(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._io, lambda: fn(*args, **kw))

    async def _main_loop(self) -> None:
        assert self._wake is not None
        while not self._stopping:
            await self._retry_orphans()
            if await self._bracket.poll():
                with self._lock:
                    self._stats.brackets += 1
            if self._stopping:
                break
            timeout = self.config.control_poll_s
            n = self._claimable_groups()
            if n > 0 and self.clock() - self._last_empty_claim >= self.config.idle_poll_s:
                leases = await self._io_call(self.queue.claim, self.producer_id, n)
                for lease in leases:
                    self._start_group(lease)
                if len(leases) < n:
                    self._last_empty_claim = self.clock()
                    timeout = min(timeout, self.config.idle_poll_s)
                else:
                    continue  # claimed all we could: look again at once
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    def _claimable_groups(self) -> int:
        """Groups to claim now. Eager (default): as soon as any trajectory is free and no
        claimed sample waits for one, so the engines never idle on slot granularity; the
        new group's samples start as trajectories free up. Strict: only whole groups."""
        if self._bracket.pausing or self._heartbeat.failing or self._orphans or \
                self.clock() < self._backoff_until:
            return 0
        free = self._slots * self.group_size - self._meter.busy - self._demand
        if free <= 0:
            return 0
        if self.config.eager_claim:
            return -(-free // self.group_size)
        return free // self.group_size

    # -- parking (bracket, stop), giving up (heartbeats failing) -----------------------------
    async def _park_all(self, why: str) -> int:
        """Stop every held group and hand it back; returns how many were yielded."""
        actives = list(self._groups.values())
        if not actives:
            return 0
        with self._lock:
            before = self._stats.groups_yielded
        for a in actives:
            a.parking = True
        self._wake_waiters(all_=True)
        pending = {t for a in actives for t in a.sample_tasks.values() if not t.done()}
        await self._aborter.abort_until_returned(pending, f"{self.producer_id}/", why)
        await asyncio.gather(*(a.task for a in actives if a.task is not None),
                             return_exceptions=True)
        with self._lock:
            return self._stats.groups_yielded - before

    def _give_up_leases(self, silent: float, first: bool) -> None:
        """Heartbeats keep failing: stop work on every lease; the grantor re-queues them."""
        if first:
            log.error("producer %s: no heartbeat succeeded for %.1fs (lease timeout %.1fs); "
                      "giving up %d leases, claiming nothing until a beat succeeds",
                      self.producer_id, silent, self.lease_timeout_s, len(self._groups))
        self._wake_waiters(all_=True)
        for a in list(self._groups.values()):
            if not a.abandoned:
                a.abandoned = True
                self._stop_samples(a)

    # -- groups ------------------------------------------------------------------------------
    def _set_demand(self, a: _Active, n: int) -> None:
        self._demand += n - a.demand
        a.demand = n

    def _wake_waiters(self, all_: bool = False) -> None:
        while self._waiters:
            f = self._waiters.popleft()
            if not f.done():
                f.set_result(None)
                if not all_:
                    return

    async def _acquire(self, a: _Active) -> bool:
        """Wait (FIFO) for a free trajectory slot; False if the group is being parked."""
        loop = asyncio.get_running_loop()
        try:
            while self._meter.busy >= self._slots * self.group_size:
                if a.parking or a.abandoned or a.fault is not None or self._bracket.pausing:
                    return False
                fut: asyncio.Future[None] = loop.create_future()
                self._waiters.append(fut)
                try:
                    await asyncio.wait_for(fut, 0.25)
                except asyncio.TimeoutError:
                    pass
            with self._lock:
                self._meter.add(1)
            a.reserved += 1
            return True
        finally:
            self._set_demand(a, a.demand - 1)

    def _unreserve(self, a: _Active, n: int) -> None:
        n = min(n, a.reserved)
        if n <= 0:
            return
        with self._lock:
            self._meter.add(-n)
        a.reserved -= n
        for _ in range(n):
            self._wake_waiters()
        self._kick()

    def _start_group(self, lease: Lease) -> None:
        a = _Active(lease)
        self._groups[lease.key] = a
        self._set_demand(a, self.group_size)
        with self._lock:
            self._stats.groups_claimed += 1
        a.task = asyncio.create_task(self._run_group(a), name=f"group-{lease.task_id}")

    def _params(self, task: dict[str, Any], i: int) -> SamplerParams:
        row = task.get("row") if isinstance(task.get("row"), dict) else {}
        overrides = row.get("sampling_params") if isinstance(row, dict) else None
        seed = None if self.config.seed is None else sample_seed(
            self.config.seed, int(task.get("index", 0)), i)
        try:
            return self.config.sampler_params(overrides, seed)
        except StrawqError as exc:
            raise TaskError(f"task {task.get('id')}: {exc}") from exc

    def _load(self, lease: Lease) -> tuple[int, GroupData | None, list[int] | None]:
        """I/O thread: the current version and the saved prefixes, or the prompt ids."""
        version = self.queue.current_version()
        if lease.has_partial:
            try:
                return version, self.queue.load_partial(lease), None
            except (NotFound, CorruptRecord) as exc:
                log.error("task %s: its partial record is unusable (%s); generating the "
                          "group afresh", lease.task_id, exc)
        return version, None, prompt_ids_of(lease.task, self.prompt_key, self.tokenizer)

    async def _run_group(self, a: _Active) -> None:
        lease = a.lease
        try:
            try:
                version, partial, prompt = await self._io_call(self._load, lease)
                if partial is not None:
                    run = GroupRun.from_partial(lease, partial,
                                                lambda i: self._params(lease.task, i))
                else:
                    assert prompt is not None
                    run = GroupRun.fresh(lease, prompt, [self._params(lease.task, i)
                                                         for i in range(self.group_size)])
            except (TaskError, SampleError) as exc:
                log.error("task %s cannot run: %s", lease.task_id, exc)
                await self._hand_back(a, "fail", "bad_task", str(exc), retryable=False)
                return
            a.run = run
            todo = run.unfinished()
            self._set_demand(a, len(todo))  # a partial needs only its unfinished samples
            if not (a.parking or a.abandoned):
                for i in todo:
                    a.sample_tasks[i] = asyncio.create_task(self._run_sample(a, i))
                if a.sample_tasks:
                    await asyncio.wait(list(a.sample_tasks.values()))
            await self._settle(a, version)
        except Exception as exc:  # noqa: BLE001 - a bug must not kill the loop or lose the task
            log.exception("producer %s: unexpected error on task %s", self.producer_id,
                          lease.task_id)
            await self._hand_back(a, "release", "producer_error", repr(exc))
        finally:
            self._unreserve(a, a.reserved)
            self._set_demand(a, 0)
            self._groups.pop(lease.key, None)
            self._kick()

    async def _run_sample(self, a: _Active, i: int) -> None:
        run = a.run
        assert run is not None
        s = run.samples[i]
        failures = 0
        freed = False
        if not await self._acquire(a):
            return
        try:
            while not s.is_final:
                if a.parking or a.abandoned or a.fault is not None or self._bracket.pausing:
                    return
                rid = run.next_rid(self.producer_id, i)
                try:
                    res = await self.client.generate_sample(s, rid=rid)
                except (EngineError, SampleError) as exc:
                    failures += 1
                    with self._lock:
                        self._stats.engine_faults += 1
                    if isinstance(exc, SampleError) or failures > self.config.sample_retries:
                        log.warning("task %s sample %d: giving up after %d failures: %s",
                                    run.task_id, i, failures, exc)
                        a.fault = exc
                        self._stop_samples(a, keep=i)
                        return
                    log.info("task %s sample %d: %s; retry %d/%d", run.task_id, i, exc,
                             failures, self.config.sample_retries)
                    if isinstance(exc, EngineUnavailable):  # maybe still running somewhere
                        self._aborter.abort_soon(rid)
                    await asyncio.sleep(self.config.engine_backoff_s * failures)
                    continue
                if res is None:
                    continue
                run.texts[i] += res.text
                with self._lock:
                    self._stats.tokens_generated += len(res.output_ids)
                if res.is_abort and not (a.parking or a.abandoned or self._bracket.pausing):
                    # Aborted by someone else (an operator, an engine-side pause): resume.
                    with self._lock:
                        self._stats.unexpected_aborts += 1
                    await asyncio.sleep(min(0.05 * run.requests[i], 1.0))
            self._unreserve(a, 1)
            freed = True
            with self._lock:
                self._stats.samples_finished += 1
            await self._score(run, i)
        finally:
            if not freed:
                self._unreserve(a, 1)

    def _stop_samples(self, a: _Active, keep: int | None = None) -> None:
        """Cancel the group's sample tasks (all but ``keep``, the caller) and abort its
        requests on the engines."""
        for j, t in a.sample_tasks.items():
            if j != keep and not t.done():
                t.cancel()
        if a.run is not None:
            self._aborter.abort_soon(a.run.rid_prefix(self.producer_id))

    async def _score(self, run: GroupRun, i: int) -> None:
        """Reward one final sample; an error is recorded on it, never raised."""
        s = run.samples[i]
        loop = asyncio.get_running_loop()
        try:
            value = await loop.run_in_executor(
                self._reward_pool, self.reward_fn, run.lease.task,
                [int(t) for t in s.response_ids], run.sample_meta(i))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not math.isfinite(value):
                raise TypeError(f"reward function returned {value!r}; expected a finite float")
            run.rewards[i] = float(value)
            run.reward_errors.pop(i, None)
        except Exception as exc:  # noqa: BLE001 - a plugin's failure is the sample's
            run.rewards[i] = None
            run.reward_errors[i] = f"{type(exc).__name__}: {exc}"[:500]
            with self._lock:
                self._stats.reward_errors += 1
            log.warning("task %s sample %d: reward failed: %s", run.task_id, i, exc)

    async def _settle(self, a: _Active, version: int) -> None:
        run = a.run
        assert run is not None
        if a.abandoned:
            with self._lock:
                self._stats.leases_lost += 1
            log.warning("task %s abandoned (heartbeats failing); the grantor re-queues it",
                        run.task_id)
            return
        if run.all_final:
            for i in range(run.size):
                if run.rewards[i] is None and i not in run.reward_errors:
                    await self._score(run, i)
            await self._finish(a, version)
            return
        fault = a.fault
        if fault is not None and not isinstance(fault, EngineUnavailable) and not a.parking:
            await self._hand_back(a, "fail", "engine_rejected", str(fault)[:500])
            return
        if fault is not None:
            self._faults_in_row += 1
            delay = self.config.engine_backoff_s * min(2 ** (self._faults_in_row - 1), 16)
            self._backoff_until = max(self._backoff_until, self.clock() + delay)
            log.warning("task %s handed back as partial after an engine fault: %s "
                        "(claiming again in %.1fs)", run.task_id, fault, delay)
        group = run.to_group(producer=self.producer_id, version_hint=version, partial=True)
        await self._hand_back(a, "yield", group=group)

    async def _finish(self, a: _Active, version: int) -> None:
        run = a.run
        assert run is not None
        self._faults_in_row = 0
        reason: str | None = None
        message = ""
        if self.filter_fn is not None:
            try:
                reason = self.filter_fn(run.lease.task, run.rewards_for_filter())
                if reason is not None:
                    validate_id(reason, "filter drop reason")
            except Exception as exc:  # noqa: BLE001 - keep the group, note the failure
                log.warning("task %s: filter failed (%s); keeping the group", run.task_id, exc)
                reason = None
        if reason is None and run.size and not run.rewards_for_filter():
            reason, message = "reward_error", "; ".join(sorted(set(run.reward_errors.values())))
        group = run.to_group(producer=self.producer_id, version_hint=version, partial=False,
                             mask_offpolicy=self.config.mask_offpolicy_in_partial_rollout)
        if reason is not None:
            await self._hand_back(a, "drop", reason, message or f"filter: {reason}",
                                  summary=group.summary())
        else:
            await self._hand_back(a, "complete", group=group)

    async def _hand_back(self, a: _Active, how: str, reason: str = "", message: str = "", *,
                         group: GroupData | None = None, retryable: bool = True,
                         summary: dict[str, Any] | None = None) -> None:
        """One persisting transition of the lease; failures never lose the task."""
        q, lease = self.queue, a.lease
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "complete": lambda: self._io_call(q.complete, lease, group),
            "yield": lambda: self._io_call(q.yield_partial, lease, group),
            "drop": lambda: self._io_call(q.drop, lease, reason, message, summary),
            "fail": lambda: self._io_call(q.fail, lease, reason, message, retryable=retryable),
            "release": lambda: self._io_call(q.release, lease),
        }
        counter = {"complete": "groups_completed", "yield": "groups_yielded",
                   "drop": "groups_dropped", "fail": "groups_failed",
                   "release": "groups_released"}[how]
        try:
            await calls[how]()
        except LeaseLost as exc:
            with self._lock:
                self._stats.leases_lost += 1
            log.warning("task %s: %s", lease.task_id, exc)
            return
        except Exception as exc:  # noqa: BLE001 - storage trouble: keep the lease on books
            log.error("task %s: %s failed (%s); will release it", lease.task_id, how, exc)
            self._orphans.append(lease)
            return
        with self._lock:
            setattr(self._stats, counter, getattr(self._stats, counter) + 1)
            if how == "drop":
                self._stats.drop_reasons[reason] = self._stats.drop_reasons.get(reason, 0) + 1

    async def _retry_orphans(self) -> None:
        for lease in list(self._orphans):
            try:
                await self._io_call(self.queue.release, lease)
            except LeaseLost:
                pass
            except Exception as exc:  # noqa: BLE001
                log.warning("release of %s failed again: %s", lease.task_id, exc)
                continue
            self._orphans.remove(lease)
            with self._lock:
                self._stats.groups_released += 1
