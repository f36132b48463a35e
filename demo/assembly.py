"""One run, assembled: the run folder, the producers' slots, the engines, the collector and
the reader, for ``strawq demo``, ``strawq lab`` and ``strawq cluster up``.

* ``create_run``: the run folder (``RunQueue.create``), the one way all three make it;
* ``producer_plan``: the producers' ids and slots, K = floor(C*E/G) group slots split over
  W producers (``strawq.producers.budget.split_budget``);
* ``RunAssembly``: a run whose parts live in this process or its children (the demo, the
  lab): engines, producer processes (``ProducerProcesses``; the demo places its producers
  with Ray and adds them), the collector in a thread (``CollectorLoop``), the reader and its
  weight-update bracket (the reader's own: ``BatchReader.configure_bracket``), and any part
  the caller starts (``add``); ``close`` stops them in reverse start order.

``strawq cluster up`` starts every part as a ``strawq`` command of its own (logs,
incarnations) and stops them itself; it takes the run folder and the plan from here.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from strawq.config import QueueConfig
from strawq.producers.budget import Budget, split_budget
from strawq.storage import Storage
from strawq.tasks.queue import RunQueue

if TYPE_CHECKING:  # loaded where used: ``strawq cluster up`` needs neither torch nor them
    from strawq.collector.core import Collector
    from strawq.collector.trainer.bracket import WeightUpdateBracket
    from strawq.collector.trainer.engine_repair import PushTo
    from strawq.collector.trainer.reader import BatchReader
    from strawq.producers.engines.testing import EngineProcess

__all__ = ["BracketOptions", "CollectorLoop", "ProducerPlan", "ProducerProcesses", "RunAssembly",
           "create_run", "producer_child", "producer_plan"]

log = logging.getLogger(__name__)


def create_run(storage: Storage, config: QueueConfig,
               meta: Mapping[str, Any] | None = None) -> RunQueue:
    """The run folder at ``storage``: a new run, or the run already there
    (``RunQueue.create`` is idempotent for the same queue config)."""
    return RunQueue.create(storage, config, meta=dict(meta) if meta is not None else None)


@dataclass(frozen=True)
class ProducerPlan:
    """The producers of a run: producer ``i`` gets ``budget.slots[i]`` group slots."""

    budget: Budget

    def producers(self, producer_id: Callable[[int], str]) -> list[tuple[str, int]]:
        """``(id, slots)`` of each producer, producer ``i`` named ``producer_id(i)``."""
        return [(producer_id(i), n) for i, n in enumerate(self.budget.slots)]


def producer_plan(concurrency: int, engines: int, group_size: int,
                  producers: int) -> ProducerPlan:
    """K = floor(C*E/G) group slots split over ``producers`` (``ConfigError`` with the
    numbers when there are fewer slots than producers)."""
    return ProducerPlan(split_budget(concurrency, engines, group_size, producers))


class CollectorLoop(threading.Thread):
    """The collector (grantor + feeder) in a thread of the driver: ``Collector.run`` until
    ``stop_event`` is set (``stop()``); ``error`` is what it died of (None while it runs or
    after a clean stop), logged when it happens."""

    def __init__(self, collector: Collector, *, stop_event: threading.Event | None = None,
                 name: str = "strawq-collector") -> None:
        super().__init__(daemon=True, name=name)
        self.collector = collector
        self.stop_event = stop_event if stop_event is not None else threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.collector.run(should_stop=self.stop_event.is_set)
        except BaseException as exc:  # noqa: BLE001 - reported by the driver
            self.error = exc
            log.exception("the collector failed")

    @property
    def requeued(self) -> int:
        """Stale groups re-queued (regenerated) so far."""
        return int(self.collector.stale_totals["regenerated"])

    @property
    def dropped_stale(self) -> int:
        """Stale groups dropped so far."""
        return int(self.collector.stale_totals["dropped"])

    def stop(self, timeout_s: float = 30.0) -> None:
        """Set the stop flag and wait up to ``timeout_s`` for the loop to end."""
        self.stop_event.set()
        if self.is_alive():
            self.join(timeout_s)


# -- producers as plain processes (the lab's: no Ray, no fork) ----------------------------------
STATS_PREFIX = "STRAWQ_LAB_STATS "


def producer_child() -> None:
    """Child process (``python -c``): one ``Producer`` on its own event loop.

    Reads its ``ProducerConfig`` as one JSON line on stdin; drains when stdin closes or on
    SIGTERM / SIGINT, as ``strawq producer`` does (``strawq.producers.drain``: within
    ``timing.grace_period_s``, else exit 3); prints its final stats as one line
    ``STRAWQ_LAB_STATS {json}``.
    """
    import asyncio
    import sys

    from strawq.producers.drain import Drain
    from strawq.producers.producer import Producer
    from strawq.producers.producer_config import ProducerConfig

    logging.basicConfig(level=logging.WARNING)
    config = json.loads(sys.stdin.readline())
    cfg = ProducerConfig.from_dict(config)
    producer = Producer(cfg, node_id=config.get("producer_id"))
    stop = threading.Event()
    drain = Drain(producer.request_stop, cfg.timing.grace_period_s,
                  who=f"producer {producer.producer_id}")

    def watch_stdin() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()

    async def main() -> None:
        task = asyncio.create_task(producer.run())
        while not stop.is_set() and not task.done() and drain.began_at is None:
            await asyncio.sleep(0.05)
        if not task.done():
            drain.begin("stdin closed")  # nothing when a signal began it
        await task

    try:
        with drain.signals():
            try:
                asyncio.run(main())
            finally:
                drain.finish()
    finally:
        print(STATS_PREFIX + json.dumps(producer.stats().to_dict()), flush=True)


class ProducerProcesses:
    """Producer processes on one host (plain subprocesses: no Ray, no fork), one per
    config (``producer_child``)."""

    def __init__(self, configs: list[dict[str, Any]]) -> None:
        code = "from strawq.demo.assembly import producer_child; producer_child()"
        self.finished = False
        self.procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True) for _ in configs]
        for p, c in zip(self.procs, configs, strict=True):
            assert p.stdin is not None
            p.stdin.write(json.dumps(c) + "\n")
            p.stdin.flush()

    def check_alive(self) -> None:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"lab producer process {p.pid} exited with {p.returncode}; "
                                   "see its output above")

    def wait_started(self, bracket: WeightUpdateBracket, timeout_s: float = 300.0) -> None:
        """Until every producer process has beaten once (its loop is up). An idle producer
        counts: one that beat and found nothing to claim yet has started (the bracket's
        ``live_producers`` leaves idle ones out, so waiting on it raced the first release)."""
        deadline = time.monotonic() + timeout_s
        n = len(self.procs)
        while len(started := set(bracket.observe())) < n:
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(started)} of {n} lab producers "
                                   f"started within {timeout_s:.0f}s")
            time.sleep(0.05)

    def terminate(self, i: int) -> None:
        """SIGTERM to producer ``i`` (a preemption): it drains (``producer_child``)."""
        p = self.procs[i]
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)

    def finish(self, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Stop every producer (it parks its groups) and collect its stats (once: a later
        call returns ``[]``)."""
        if self.finished:
            return []
        self.finished = True
        for p in self.procs:
            if p.stdin is not None and not p.stdin.closed:
                p.stdin.close()
            p.stdin = None  # communicate() must not flush the closed pipe
        stats = []
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            # read while waiting: the stats line (with its hop samples) can exceed the
            # pipe's 64 KiB, and a child blocked on a full pipe never exits
            try:
                out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # hung: kill it, its leases expire
                p.kill()
                out, _ = p.communicate()
            for line in (out or "").splitlines():
                if line.startswith(STATS_PREFIX):
                    try:
                        stats.append(json.loads(line[len(STATS_PREFIX):]))
                    except json.JSONDecodeError as exc:
                        log.error("lab producer %d: unreadable stats line (%s)", p.pid, exc)
        return stats


@dataclass(frozen=True)
class BracketOptions:
    """``BatchReader.configure_bracket``'s options (None: the bracket's default)."""

    lease_timeout_s: float | None = None
    poll_interval_s: float | None = None
    sleep: Callable[[float], None] | None = None
    repair: PushTo | None = None
    #: the update's mode and its rolling and delta settings
    weight_update: str | None = None
    wave: float | None = None
    max_lag: int | None = None
    publish_dir: str | None = None
    max_delta_chain: int | None = None
    engine_urls: tuple[str, ...] | None = None


class RunAssembly:
    """The parts of one run in this process (and its children), started in order and
    stopped in reverse by ``close`` (each once; an error stopping one is logged and the
    others still stop)."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.queue: RunQueue | None = None
        self.engines: list[EngineProcess] = []
        self.loop: CollectorLoop | None = None
        self.reader: BatchReader | None = None
        self._stops: list[tuple[str, Callable[[], object]]] = []

    def add(self, name: str, stop: Callable[[], object]) -> None:
        """A part the caller started: ``stop`` is called by ``close``, before every part
        added earlier."""
        self._stops.append((name, stop))

    def create(self, storage: Storage, config: QueueConfig,
               meta: Mapping[str, Any] | None = None) -> RunQueue:
        """The run folder (``create_run``); ``storage`` is at ``run_dir``."""
        self.queue = create_run(storage, config, meta)
        return self.queue

    def start_engines(self, kind: str, count: int, **options: Any) -> list[str]:
        """``count`` engine processes of ``kind`` (``start_engine_subprocess``); their URLs."""
        from strawq.producers.engines.testing import start_engine_subprocess

        for i in range(count):
            engine = start_engine_subprocess(kind, **options)
            self.engines.append(engine)
            self.add(f"engine {i}", engine.stop)
        return [e.url for e in self.engines]

    def start_producer_processes(self, configs: list[dict[str, Any]]) -> ProducerProcesses:
        """One producer process per config (``ProducerProcesses``), started now; ``close``
        stops them (they park their groups) if nobody ``finish``-ed them before."""
        procs = ProducerProcesses(configs)
        self.add("producers", lambda: procs.finish(10.0))
        return procs

    def start_collector(self, collector: Collector, *,
                        stop_event: threading.Event | None = None,
                        name: str = "strawq-collector", close: bool = True) -> CollectorLoop:
        """``collector`` in a thread (``CollectorLoop``), started now. ``close`` stops the
        loop and, with ``close=True``, closes the collector (a clean hand-over: a later
        collector on the run takes the fence at once)."""
        if close:
            self.add("collector", collector.close)
        self.loop = CollectorLoop(collector, stop_event=stop_event, name=name)
        self.add("collector loop", self.loop.stop)
        self.loop.start()
        return self.loop

    def open_reader(self, bracket: BracketOptions | None = None,
                    **options: Any) -> BatchReader:
        """The trainer's reader on the run (``BatchReader.open(run_dir, **options)``), its
        bracket built with ``bracket``'s options; ``close`` closes it (its metrics, and the
        run's trainer fence released for the next trainer)."""
        from strawq.collector.trainer.reader import BatchReader

        reader = BatchReader.open(self.run_dir, **options)
        b = bracket or BracketOptions()
        reader.configure_bracket(**{f.name: getattr(b, f.name) for f in fields(b)})
        self.add("reader", reader.close)
        self.reader = reader
        return reader

    def close(self) -> None:
        """Stop every part, the last started first."""
        while self._stops:
            name, stop = self._stops.pop()
            try:
                stop()
            except Exception as exc:  # noqa: BLE001 - shutting down anyway
                log.warning("stopping %s: %s", name, exc)

    def __enter__(self) -> RunAssembly:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
