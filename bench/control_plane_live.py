"""The control plane of a run driven live at its real rates (``bench/scale.py --control-plane
--live SECONDS``).

``bench/control_plane.py`` counts each operation's Redis commands once and multiplies by
its rate (the model). This mode makes every client's operations concurrently, at their
real schedule, for ``SECONDS`` of wall time, against the same kind of Redis-backed JuiceFS
volume, and counts what reaches the server per second and per weight update with Redis's
own ``INFO commandstats``. Hardware is scaled down (one machine, one FUSE client for all
simulated nodes), counts are not: at ``--gpus 10000`` there are 1,250 producers, each with
its own queue handle and its ``slots`` leases, and 10,000 trainer ranks.

**The schedule.** Heaps of next-due times, drained by ``--live-workers`` threads (not a
thread per client); an update's parks take at most three quarters of them, and a steady
operation that is due goes first, so the steady schedule is kept through an update as far
as the machine allows:

- every producer heartbeats every ``heartbeat_s`` (its phase spread over the interval;
  each producer's first two beats, which list and open ``hb/``, are made at setup);
- the run's groups (``batch_groups / step_s`` a second) are each completed and replaced
  by a producer chosen round-robin: it completes its oldest held lease and claims one
  task (one ``complete`` and one ``claim`` a group);
- the collector releases ``release_batch`` tasks (``Feeder.release``) at the rate groups
  are claimed, and every step acks the previous batch, collects garbage (``ack``,
  ``gc``) and batches the ready groups (lists ``ready/``, reads each summary, publishes
  the manifest);
- trainer ranks: with ``--trainer-watch rank0`` one thread runs the real rank 0
  ``BatchReader.next_batch`` (its 20 ms stat of ``batches/``, its listing and end check
  once a second, its look at ``hb/`` before each wait, the delivery mark), and after each
  delivery every other rank loads its shard (``delivery, heard``), all due at once; with
  ``per-rank`` every rank lists ``batches/`` and ``acked/`` and checks for the run's end
  once a second, every node stats ``batches/`` once per attribute TTL, and every rank
  lists, reads the manifest and loads its shard after each batch (the counted mode's
  operations, at their schedule);
- with the in-flight journal (``--journal-every-s W``) every producer writes its window
  record every W seconds (its own ``JournalLog``: deltas of its slots' entries, a full
  record starting a segment where one is due and the records it supersedes deleted);
- the update after each step: every producer parks its held leases (75 % saved as
  partials, 25 % handed back: ``--handback-share``), all due at once when the step's
  batch is published; once every producer has parked (the pause; the weights pushed),
  every producer refills its slots in one claim (claims again while short) and loads
  each resumed partial. With the journal, producers hold their groups through the pause
  instead, as a producer does by default (``timing.hold_through_pause``; ``--park``
  parks): each writes its next window record at once (taken in due order with the steady
  operations: it is one of them in size), and once all have, every one goes on with its
  leases. A paused producer completes and claims nothing (its turns are
  not wanted). The burst takes as long as this machine takes.

Before the live window, at setup (not counted): the run's ``pending_depth`` tasks beyond
every producer's slots are released and each producer fills its slots in one claim.
Steps are scaled down (``step_s`` to ``SECONDS / 2``, ``batch_groups`` with it, the
groups' rate kept) where a real step would not fit one step and one update in
``SECONDS``: the output says so.

**What is recorded.** Per operation kind: WANTED (due within the window by the schedule)
and ACHIEVED (started within it, on time or late: lag p50 / p99 from the due time). Once
a second the server's total calls (``INFO commandstats``, every command summed): the
steady commands a second (p50 and max over the seconds that overlap no update), and per
update the commands from its start until its last producer's refill and loads are done,
and that duration. An update still running at the window's end is let finish (for as
long again as the window) so that its burst is measured; the steady operations stop at
the window's end. The model's prediction comes from the counted mode's own code
(``control_plane.measure`` and ``demand``) on the same ``Run``, counted first on the same
volume. The counted mode averages the per-step terms (the collector's batch, ack and gc;
the ranks' deliveries) over the step; a run makes them at the step, in the seconds of the
update, so the line compares like with like: the model's steady commands a second without
them against the live seconds between updates, and the model's burst with one step's
per-step terms against the live commands per update (less the live steady rate over the
update's seconds). The live figures include the idle clients' own traffic (printed; a few
commands a second), which the model subtracts.

**What limits it.** Two cores for every client and the JuiceFS client and Redis; one
FUSE client (one kernel, one cache) for every simulated node; the rank 0 reader's stat
of ``batches/`` every 20 ms reaches the server at every poll with no attribute cache
(the model counts one a second per node, the TTL of a real node's cache).
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from control_plane import Run, collector_side, demand, demand_mix, group_of, journal_entry, \
    measure, steady_rates, wait_for
from redis_meta import Volume, capacity, commandstats

from strawq.delivery.batches import BatchStore
from strawq.errors import BatchTimeout
from strawq.storage import PosixStorage
from strawq.tasks.journal import JournalLog
from strawq.tasks.queue import Lease, RunQueue

#: the share of wanted operations a run must achieve to count as kept up with
KEPT_UP = 0.95


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


@dataclass
class Tally:
    wanted: int = 0
    done: int = 0
    failed: int = 0
    lags: list[float] = field(default_factory=list)
    error: str = ""


#: seconds the setup (the releases and every producer's first fill) may take before the
#: size is given up as one this machine cannot bring up
SETUP_LIMIT_S = 600.0


class SetupTooSlow(RuntimeError):
    """The setup of a size did not finish within ``SETUP_LIMIT_S``."""


@dataclass
class Burst:
    """One step and its update: from the step's start (its commands ``before``), the
    parks from ``parks_start``, the refills once every producer has parked, and the
    ranks' loads of the step's batch; it ends (``end``, its commands ``after``) once
    the update and the loads are both done."""

    start: float
    before: int
    producers: int
    #: what is still running: the update, and the ranks' loads of the step's batch
    parts: int = 1
    loads_left: int = 0
    #: when the update was done (every producer going on) and the last load was
    update_end: float = 0.0
    loads_end: float = 0.0
    parks_start: float = 0.0
    parks_left: int = 0
    parked: float = 0.0
    refills_left: int = 0
    end: float = 0.0
    after: int = 0
    #: when an unfinished update was cut off (the drain's end)
    cut: float = 0.0


class Schedule:
    """Operations at due times (seconds from ``t0``), run by a few worker threads.

    Two heaps: the steady operations, taken first whenever one is due, and an update's
    (``burst``), which may hold at most ``burst_workers`` workers at once, so that the
    others stay free for the steady schedule (a real run's clients do not wait for one
    another's parks). Periodic chains count every due time within the window as wanted at
    their first push (a late chain drifts; what it misses stays wanted). After ``end``
    only an update still running goes on, until ``drain``."""

    Item = tuple[float, int, str, Callable[[], object], float]

    def __init__(self, end: float, drain: float, burst_workers: int) -> None:
        self.t0 = time.monotonic()
        self.end, self.drain = end, drain
        self.steady: list[Schedule.Item] = []
        self.burst: list[Schedule.Item] = []
        self.burst_workers = max(1, burst_workers)
        self.burst_running = 0
        self.seq = itertools.count()
        self.cond = threading.Condition()
        self.tally: dict[str, Tally] = {}
        self.stop = False
        self.bursts_open = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def at(self, due: float, kind: str, fn: Callable[[], object], *, every: float = 0.0,
           burst: bool = False) -> None:
        with self.cond:
            t = self.tally.setdefault(kind, Tally())
            if every:
                if due < self.end:
                    t.wanted += math.ceil((self.end - due) / every)
            else:
                t.wanted += due < self.end
            self._push(due, kind, fn, every, burst)

    def _push(self, due: float, kind: str, fn: Callable[[], object], every: float,
              burst: bool) -> None:
        if burst:
            heapq.heappush(self.burst, (due, next(self.seq), kind, fn, every))
        elif due < self.end:
            heapq.heappush(self.steady, (due, next(self.seq), kind, fn, every))
        self.cond.notify()

    def _take(self, now: float) -> tuple[Schedule.Item, bool] | None:
        if self.steady and self.steady[0][0] <= now and now < self.end:
            return heapq.heappop(self.steady), False
        if self.burst and self.burst[0][0] <= now and self.burst_running < self.burst_workers:
            self.burst_running += 1
            return heapq.heappop(self.burst), True
        return None

    def worker(self) -> None:
        while True:
            with self.cond:
                while True:
                    now = self.now()
                    if self.stop or now >= self.drain or (
                            now >= self.end and not self.burst and not self.bursts_open):
                        self.cond.notify_all()
                        return
                    took = self._take(now)
                    if took is not None:
                        (due, _s, kind, fn, every), burst = took
                        break
                    dues = [h[0][0] for h in (self.steady, self.burst) if h]
                    wait = min(dues) - now if dues else 0.2
                    self.cond.wait(max(0.001, min(wait, 0.2)))
            start = self.now()
            try:
                fn()
                ok, err = True, ""
            except Exception as e:  # recorded per kind, the run goes on
                ok, err = False, f"{type(e).__name__}: {e}"
            with self.cond:
                t = self.tally[kind]
                if due < self.end and start < self.end:
                    t.done += ok
                    t.lags.append(start - due)
                t.failed += not ok
                t.error = t.error or err
                if burst:
                    self.burst_running -= 1
                    self.cond.notify_all()
                if every:
                    self._push(due + every, kind, fn, every, burst)


@dataclass
class LiveResult:
    gpus: int
    clients: int
    seconds: float
    wanted: int
    achieved: int
    steady_p50: float
    steady_max: float
    burst_cmds: float
    burst_raw: int
    burst_s: float
    burst_done: bool
    model_steady: float
    model_burst: float
    tally: dict[str, Tally]
    #: the idle clients' own commands a second (in the live figures, not the model's)
    quiet: float = 0.0
    #: the run was driven at 1/``dilate`` of its rates (``dilated``); 1: at its real rates
    dilate: float = 1.0
    #: the metadata server's ops/s for the run's command mix (``redis-benchmark``); 0: not
    #: measured
    capacity: float = 0.0
    #: the seconds, at the real rates, an update's commands are spread over for its share
    #: (the counted mode's ``burst_window_s``)
    window_s: float = 10.0

    @property
    def share(self) -> float:
        return self.achieved / self.wanted if self.wanted else 1.0

    @property
    def kept_up(self) -> bool:
        """At least ``KEPT_UP`` of the wanted operations achieved, and the update done."""
        return self.share >= KEPT_UP and self.burst_done

    def line(self) -> str:
        return (f"scale live: {self.gpus} GPUs, {self.clients} clients, achieved "
                f"{self.achieved / self.seconds:.1f} of wanted {self.wanted / self.seconds:.1f} "
                f"ops/s (share {self.share:.3f}); Redis {self.steady_p50:.0f} commands/s steady "
                f"(p50), {self.burst_cmds:.0f} per update over {self.burst_s:.1f} s; model "
                f"(cost x rate) predicts {self.model_steady:.0f} commands/s steady, "
                f"{self.model_burst:.0f} per update")


    @property
    def real_steady(self) -> float:
        """The steady commands a second at the run's real rates: the clients' part of the
        live p50 times ``dilate``, the idle clients' own (not dilated) once."""
        return max(self.steady_p50 - self.quiet, 0.0) * self.dilate + self.quiet

    def real_line(self) -> str:
        """What a dilated run says of the run at its real rates, against the server's
        capacity: the steady share, and the update's (its commands, the step's batch and
        loads with it, spread over ``window_s`` as the counted mode spreads them, on top of
        the steady rate). The update's own seconds here are this machine's pace, not the
        real run's."""
        cap = self.capacity or float("nan")
        return (f"scale live at real rates: {self.gpus} GPUs driven at 1/{self.dilate:g} of "
                f"their rates: Redis {self.real_steady:.0f} commands/s steady, "
                f"{self.burst_cmds:.0f} per update over {self.window_s:g} s; model "
                f"{self.model_steady * self.dilate:.0f} commands/s steady, "
                f"{self.model_burst:.0f} per update; metadata server capacity = "
                f"{self.capacity:.0f} ops/s; share = {self.real_steady / cap:.3f} steady "
                f"(model {self.model_steady * self.dilate / cap:.3f}), update "
                f"{(self.real_steady + self.burst_cmds / self.window_s) / cap:.3f}")


def dilated(run: Run, factor: float) -> Run:
    """``run`` slowed ``factor`` times: every period (the step, the heartbeat, the journal's
    window, a waiting rank's listing, the attribute TTL, an update's window, an engine's
    load) times ``factor``, so every rate is divided by it; every count (GPUs, producers,
    ranks, slots, groups per step, pending depth, the tokens of a journal window) is kept.
    What reaches the server per operation is unchanged (the same directories, as full),
    and its commands a second at the real rates are the dilated run's times ``factor``."""
    if factor < 1:
        raise ValueError(f"a dilation factor is at least 1, got {factor}")
    if factor == 1:
        return run
    return replace(run, step_s=run.step_s * factor, heartbeat_s=run.heartbeat_s * factor,
                   journal_every_s=run.journal_every_s * factor,
                   journal_tok_s=run.journal_tok_s / factor,
                   list_every_s=run.list_every_s * factor, attr_ttl_s=run.attr_ttl_s * factor,
                   burst_window_s=run.burst_window_s * factor, load_s=run.load_s * factor)


def live_run(run: Run, seconds: float) -> Run:
    """``run`` with its step scaled down so that one step and its update fit ``seconds``
    (the groups' rate kept); unchanged when a real step fits."""
    if run.step_s <= seconds / 2:
        return run
    step = seconds / 2
    return replace(run, step_s=step,
                   batch_groups=max(1, round(run.batch_groups * step / run.step_s)))


#: the steady terms the model averages over a step but a run makes at the step, in the
#: same seconds as the update (live, they fall inside the update's window)
PER_STEP = ("batch, per group (list, read, publish)", "ack (rank 0) and gc, per step",
            "delivery (list, manifest, shard)", "delivery, heard (shard)")


def model(vol: Volume, run: Run, quiet_s: float, capacity_requests: int = 0
          ) -> dict[str, float]:
    """The counted mode's prediction for ``run``: its per-operation costs (counted here,
    on this volume, by ``control_plane.measure``) times ``run``'s rates. ``between``: the
    steady commands a second between steps (without the per-step terms); ``per_update``:
    one update's burst and one step's per-step terms, which a run makes together;
    ``capacity`` (with ``capacity_requests``): the server's ops/s for the run's steady
    command mix, as the counted mode measures it."""
    print(f"model: the counted pass (bench/control_plane.py) at {run.gpus} GPUs", flush=True)
    counter, _ = measure(vol, run, quiet_s)
    d = demand(counter, run)
    if capacity_requests:
        assert vol.sock is not None
        d["capacity"], _rates = capacity(vol.sock, demand_mix(counter, run),
                                         requests=capacity_requests)
    per_step = sum(rate * run.step_s * counter.cost(name)
                   for name, rate in steady_rates(run).items() if name in PER_STEP)
    d["between"] = d["steady"] - per_step / run.step_s
    d["per_update"] = d["burst"] + per_step
    d["per_step"] = per_step
    d["quiet"] = counter.quiet_per_s
    print(f"model: {d['steady']:,.0f} commands/s steady as the counted mode averages it, "
          f"{d['between']:,.0f} between steps (less the per-step batch, ack and gc and "
          f"deliveries: {per_step:,.0f} a step); an update's burst {d['burst']:,.0f}, with "
          f"the step's terms {d['per_update']:,.0f}", flush=True)
    return d


def drive(vol: Volume, run: Run, seconds: float, workers: int, burst_workers: int,
          predicted: dict[str, float], dilate: float = 1.0) -> LiveResult:
    """Every client of ``run`` at its schedule for ``seconds``; what the server saw.
    ``dilate``: ``run`` is ``dilated`` by it, and the real readers' own clocks (their poll,
    listing and end-check intervals) are slowed with it."""
    from strawq.collector.trainer.reader import BatchReader
    from strawq.storage.watch import DirProbe

    assert vol.sock is not None
    sock = vol.sock
    name = f"live-{secrets.token_hex(3)}"
    root_a, root_b = os.path.join(vol.a, name), os.path.join(vol.b, name)
    os.makedirs(root_a)
    g = run.groups_per_s
    drain_s = max(seconds, 30.0)
    tasks = (run.in_flight + run.pending_depth + math.ceil(g * (seconds + drain_s) * 2)
             + 4 * run.release_batch)
    q_a, feeder = collector_side(root_a, run, tasks)
    bs = BatchStore(q_a)
    wait_for(os.path.join(root_b, "run", "run.meta"))
    t_setup = time.monotonic()
    released = 0
    while released < run.in_flight + run.pending_depth:
        if time.monotonic() - t_setup > SETUP_LIMIT_S:
            raise SetupTooSlow(f"the setup did not finish in {SETUP_LIMIT_S:.0f} s: "
                               f"{released} of {run.in_flight + run.pending_depth} tasks "
                               "released")
        n = feeder.release()
        if not n:
            raise RuntimeError(f"the dataset ran out at {released} released tasks")
        released += n
    pids = list(range(run.producers))
    queues = {i: RunQueue.open(PosixStorage(os.path.join(root_b, "run"), writer_id=f"p{i}"))
              for i in pids}
    held: dict[int, list[Lease]] = {i: [] for i in pids}
    locks = {i: threading.Lock() for i in pids}

    def fill(i: int) -> None:
        for _ in range(50):
            want = run.slots - len(held[i])
            if want <= 0:
                return
            got = queues[i].claim(f"p{i}", want)
            for lease in got:
                if lease.has_partial:
                    queues[i].load_partial(lease)
            held[i] += got
            if not got:
                time.sleep(0.01)
        raise RuntimeError(f"producer p{i} holds {len(held[i])} of its {run.slots} slots "
                           "after 50 claims")

    def setup_fill(i: int) -> None:
        if time.monotonic() - t_setup > SETUP_LIMIT_S:
            filled = sum(map(len, held.values()))
            raise SetupTooSlow(
                f"the setup did not finish in {SETUP_LIMIT_S:.0f} s: {filled} of "
                f"{run.in_flight} leases held after every producer's first fill so far (one "
                f"claim of {run.slots} each; on this machine {run.gpus} GPUs' groups in "
                "flight cannot be brought up in time)")
        fill(i)

    def first_beats(i: int) -> None:
        queues[i].heartbeat(f"p{i}")
        queues[i].heartbeat(f"p{i}")

    # the in-flight journal (--journal-every-s): each producer's own writer, a window
    # record of its slots' entries (deltas), full where one is due (a new segment, and the
    # records it supersedes deleted), as JournalFlush writes them
    delta = max(1, round(run.journal_every_s * run.journal_tok_s))
    fake = [(f"held{k}", 0) for k in range(run.slots)]
    logs = {i: JournalLog(queues[i].storage, f"p{i}", 1,
                          segments=run.journal_format == "segments") for i in pids}

    def journal_window(i: int) -> None:
        with locks[i]:
            log = logs[i]
            full = log.next == 0 or log.full_due()
            n = log.append([journal_entry(t, g, start=0 if full else delta, tokens=delta)
                            for t, g in fake], full=full)
            if full and n:
                log.superseded(fake, before=n)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(first_beats, pids))
        list(pool.map(setup_fill, pids))
        if run.journal_every_s:  # each writer's first record (full; once a lease)
            list(pool.map(journal_window, pids))
    q_b = RunQueue.open(PosixStorage(os.path.join(root_b, "run"), writer_id="reader"))
    readers: dict[int, BatchReader] = {}
    rlock = threading.Lock()

    def reader(r: int) -> BatchReader:
        with rlock:
            if r not in readers:
                readers[r] = BatchReader(q_b, rank=r, world_size=run.ranks,
                                         sleep=lambda s: time.sleep(s * dilate),
                                         clock=lambda: time.monotonic() / dilate,
                                         checkpointed=False)
            return readers[r]

    for r in range(run.ranks):  # each rank's reader exists before the run, as a trainer's
        reader(r)
    print(f"  setup: {released} tasks released, {run.producers} producers hold "
          f"{sum(map(len, held.values()))} leases ({time.monotonic() - t_setup:.0f} s, not "
          f"counted)", flush=True)

    sch = Schedule(seconds, seconds + drain_s, burst_workers)
    samples: list[tuple[float, int]] = []
    bursts: list[Burst] = []
    state: dict[str, Any] = {"rr": 0, "published": [], "acked": None, "skipped": 0,
                             "burst_of": {}}

    def calls() -> int:
        return sum(commandstats(sock).values())

    # -- producers ------------------------------------------------------------------------
    for i in pids:
        sch.at(run.heartbeat_s * i / len(pids), "heartbeat",
               lambda i=i: queues[i].heartbeat(f"p{i}"), every=run.heartbeat_s)

    claims = Tally()

    paused: set[int] = set()

    def group() -> None:
        with sch.cond:
            i = state["rr"] % len(pids)
            state["rr"] += 1
        start = sch.now()
        with locks[i]:
            if i in paused:  # parked for the update: it completes and claims nothing
                with sch.cond:
                    state["skipped"] += start < seconds
                return
            if held[i]:
                lease = held[i].pop(0)
                queues[i].complete(lease, group_of(lease))
            got = queues[i].claim(f"p{i}", 1)
            held[i] += got
        with sch.cond:
            if start < seconds:
                claims.done += bool(got)
                claims.failed += not got

    sch.at(0.0, "complete (and a claim of one)", group, every=1 / g)
    if run.journal_every_s:
        for i in pids:
            sch.at(run.journal_every_s * (i + 0.5) / len(pids), "journal: window record",
                   lambda i=i: journal_window(i), every=run.journal_every_s)
    sch.at(0.5 / g * run.release_batch, "release (per 64 tasks)", feeder.release,
           every=run.release_batch / g)

    # -- the update -----------------------------------------------------------------------
    saved = round(run.slots * (1 - run.handback_share))

    hold = run.held

    def park(i: int, b: Burst) -> None:
        """The pause: the producer parks every held lease (saved or handed back), or, held
        through the pause (``run.hold``: timing.hold_through_pause), writes its next journal
        window record at once and keeps them."""
        try:
            with locks[i]:
                paused.add(i)
                if not hold:
                    for k, lease in enumerate(held[i]):
                        if k < saved:
                            queues[i].yield_partial(lease, group_of(lease, tokens=32))
                        else:
                            queues[i].release(lease)
                    held[i] = []
            if hold:
                journal_window(i)
        finally:
            with sch.cond:
                b.parks_left -= 1
                last = b.parks_left == 0
            if last and hold:  # every producer acked: the weights are pushed, they go on
                b.parked = sch.now()
                for j in pids:
                    with locks[j]:
                        paused.discard(j)
                b.refills_left = 0
                b.update_end = sch.now()
                close_part(b)
            elif last:  # every producer parked: the weights are pushed, they resume
                b.parked = sch.now()
                for j in pids:
                    sch.at(b.parked, "update: refill and load (per producer)",
                           lambda j=j: refill(j, b), burst=True)

    def refill(i: int, b: Burst) -> None:
        """The resume: one claim of the producer's slots (again while short), and the load
        of each resumed partial."""
        try:
            with locks[i]:
                fill(i)
                paused.discard(i)
        finally:
            with sch.cond:
                b.refills_left -= 1
                last = b.refills_left == 0
            if last:
                b.update_end = sch.now()
                close_part(b)

    def close_part(b: Burst) -> None:
        """The update, or the step's loads, are done; the burst ends with the later."""
        with sch.cond:
            b.parts -= 1
            last = b.parts == 0
        if last:
            b.after, b.end = calls(), sch.now()
            with sch.cond:
                sch.bursts_open -= 1

    def counted_load(b: Burst | None, fn: Callable[[], object]) -> None:
        """One rank's load of the step's batch; the last one closes the burst's loads."""
        try:
            fn()
        finally:
            if b is not None:
                with sch.cond:
                    b.loads_left -= 1
                    last = b.loads_left == 0
                if last:
                    b.loads_end = sch.now()
                    close_part(b)

    def update(b: Burst) -> None:
        b.parks_start, b.parks_left, b.refills_left = sch.now(), len(pids), len(pids)
        kind = "update: hold, a journal record (per producer)" if hold else \
            "update: park (per producer)"
        # a held update is one window record per producer, the size of a steady one: taken
        # in due order with the steady operations (a park's burst waits behind them, on at
        # most burst_workers workers), unless due after the window, where only bursts run
        burst = not hold or b.parks_start >= sch.end
        for i in pids:
            sch.at(b.parks_start, kind, lambda i=i: park(i, b), burst=burst)

    # -- the collector's step ---------------------------------------------------------------
    def step() -> None:
        b = Burst(start=sch.now(), before=calls(), producers=len(pids))
        bursts.append(b)
        with sch.cond:
            sch.bursts_open += 1
        if state["acked"] is not None:
            bs.ack(state["acked"])
            bs.gc()
            state["acked"] = None
        names = bs.scan_ready()
        for n in names:
            bs.read_summary(n)
        if names:
            seq = bs.next_seq()
            # the ranks' loads of this batch belong to this step's burst: all due at once
            # (every rank on its own node in a real run), they run on the burst's workers,
            # and the seconds until the last is done are the update's, not steady ones
            b.loads_left = run.ranks - 1 if run.trainer_watch == "rank0" else run.ranks
            b.parts += b.loads_left > 0  # a single rank 0 loads nothing more
            state["burst_of"][seq] = b
            bs.publish_batch(seq, names)
            state["published"].append((seq, sch.now()))
            if run.trainer_watch == "per-rank":
                t = sch.now()
                for r in range(run.ranks):
                    sch.at(t, "delivery (list, manifest, shard)",
                           lambda r=r: counted_load(b, lambda: deliver(r)), burst=True)
        update(b)

    sch.at(run.step_s, "collector step (ack, gc, batch)", step, every=run.step_s)

    # -- trainer ranks ----------------------------------------------------------------------
    def deliver(r: int) -> None:
        rd = reader(r)
        seq = rd.positions.next_seq()
        if seq is None:
            raise RuntimeError(f"rank {r} sees no batch")
        rd.load(rd.batches.read_manifest(seq))
        rd.positions.delivered = seq
        if r == 0:
            state["acked"] = seq

    stop_watch = threading.Event()
    watch_tally = Tally()

    def watch() -> None:
        rd = reader(0)
        while not stop_watch.is_set():
            left = seconds - sch.now()
            if left <= 0:
                return
            try:
                batch = rd.next_batch(timeout=left / dilate)
            except BatchTimeout:
                return
            t = sch.now()
            pub = dict(state["published"]).get(batch.seq)
            with sch.cond:
                watch_tally.done += 1
                watch_tally.lags.append(t - pub if pub is not None else 0.0)
            state["acked"] = batch.seq
            man = rd.batches.read_manifest(batch.seq)
            b = state["burst_of"].get(batch.seq)
            for r in range(1, run.ranks):
                sch.at(t, "delivery, heard (shard)",
                       lambda r=r, m=man, b=b: counted_load(b, lambda: reader(r).load(m)),
                       burst=True)

    watcher: threading.Thread | None = None
    if run.trainer_watch == "rank0":
        sch.tally["rank 0: next_batch (real reader)"] = watch_tally
        watcher = threading.Thread(target=watch, daemon=True)
    else:
        for r in range(run.ranks):
            ph = run.list_every_s * r / run.ranks
            sch.at(ph, "wait: list batches/, acked/",
                   lambda r=r: reader(r).positions.next_seq(), every=run.list_every_s)
            sch.at(ph, "wait: end-of-run check",
                   lambda r=r: reader(r).waiter.check_finished(), every=run.list_every_s)
        probes = {n: DirProbe(q_b.storage, ("batches",)) for n in range(run.rank_nodes)}
        for n, p in probes.items():
            p.changed()
            sch.at(run.attr_ttl_s * n / run.rank_nodes, "wait: node probe (stat)", p.changed,
                   every=run.attr_ttl_s)

    # -- go ---------------------------------------------------------------------------------
    def sample() -> None:
        while not sch.stop:
            samples.append((sch.now(), calls()))
            time.sleep(max(0.0, 1.0 - (sch.now() % 1.0)))

    sch.t0 = time.monotonic()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    if watcher is not None:
        watcher.start()
    threads = [threading.Thread(target=sch.worker, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop_watch.set()
    if watcher is not None:
        watcher.join(5)
    watch_tally.wanted = sum(1 for _s, t in state["published"] if t < seconds)
    done = sch.tally["complete (and a claim of one)"]
    # a paused producer's turn is no group wanted: the whole fleet is parked then
    done.wanted -= state["skipped"]
    done.done -= state["skipped"]
    claims.wanted, claims.lags = done.wanted, done.lags
    if state["skipped"]:
        print(f"  {state['skipped']} group turns fell to producers paused for the update "
              "(not wanted: a paused producer completes and claims nothing)")
    if claims.failed:
        claims.error = "claimed nothing (every race lost, or pending/ empty)"
    sch.tally["claim (one, after each complete)"] = claims
    sch.stop = True
    sampler.join(3)
    for b in bursts:  # an update still running at the drain's end: what it made so far
        if not b.end:
            b.after, b.cut = calls(), sch.now()
    samples.append((sch.now(), calls()))
    for rd in readers.values():  # rank 0's fence released before its run goes
        rd.close()
    shutil.rmtree(root_a, ignore_errors=True)
    return summarize(run, seconds, sch, samples, bursts, predicted, dilate)


def summarize(run: Run, seconds: float, sch: Schedule, samples: list[tuple[float, int]],
              bursts: list[Burst], predicted: dict[str, float], dilate: float = 1.0
              ) -> LiveResult:
    print(f"  {'operation':<44} {'wanted':>8} {'achieved':>9} {'share':>6} {'lag p50 ms':>11} "
          f"{'p99 ms':>9} {'failed':>6}")
    wanted = achieved = 0
    for kind, t in sch.tally.items():
        wanted += t.wanted
        achieved += min(t.done, t.wanted)
        share = t.done / t.wanted if t.wanted else float("nan")
        print(f"  {kind:<44} {t.wanted:>8} {t.done:>9} {share:>6.2f} "
              f"{pct(t.lags, 0.5) * 1e3:>11.1f} {pct(t.lags, 0.99) * 1e3:>9.1f} {t.failed:>6}"
              + (f"  first failure: {t.error[:120]}" if t.error else ""))
    windows = [(b.start, b.end if b.end else math.inf) for b in bursts]
    steady, every = [], []
    for (t0, c0), (t1, c1) in itertools.pairwise(samples):
        if t1 - t0 < 0.5 or t0 >= seconds:
            continue
        rate = (c1 - c0) / (t1 - t0)
        every.append(rate)
        if not any(t0 < e and t1 > s for s, e in windows):
            steady.append(rate)
    p50 = pct(steady, 0.5) if steady else 0.0
    print(f"  Redis commands/s, {len(steady)} steady seconds (no update): p50 {p50:,.0f}, max "
          f"{max(steady, default=0.0):,.0f}; every second of the window: p50 "
          f"{pct(every, 0.5):,.0f}, max {max(every, default=0.0):,.0f} (the idle clients "
          f"send {predicted.get('quiet', 0.0):.0f} of them, in both figures)")
    done = [b for b in bursts if b.end]
    hold = run.held
    for k, b in enumerate(bursts):
        if b.end:
            raw = b.after - b.before
            what = (f"held from {b.parks_start:.1f} s, every producer's record at "
                    f"{b.parked:.1f} s, going on at" if hold else
                    f"parks from {b.parks_start:.1f} s, all parked at {b.parked:.1f} s, "
                    "refilled at")
            loads = (f", the ranks' loads of the batch done at {b.loads_end:.1f} s"
                     if b.loads_end else "")
            print(f"  update {k + 1}: the step from {b.start:.1f} s, {what} "
                  f"{b.update_end:.1f} s{loads}: {b.end - b.start:.1f} s, {raw:,} Redis "
                  f"commands ({raw - p50 * (b.end - b.start):,.0f} less the steady p50 over "
                  "it: the update and the step's batch and deliveries)")
        else:
            print(f"  update {k + 1}: the step from {b.start:.1f} s, not finished at "
                  f"{b.cut:.1f} s: {b.after - b.before:,} Redis commands so far "
                  f"({b.producers - b.parks_left} of {b.producers} producers "
                  f"{'held' if hold else 'parked'}, "
                  f"{b.producers - b.refills_left if b.parked else 0} refilled, "
                  f"{b.loads_left} ranks' loads of the batch left)")
    first = bursts[0] if bursts else None
    raw = (first.after - first.before) if first else 0
    dur = ((first.end or first.cut) - first.start) if first else 0.0
    if first is not None and not first.end:
        print(f"  the update did not finish: its figures below are what it made in the "
              f"{dur:.1f} s until the run was cut off")
    clients = run.producers + 1 + run.ranks
    return LiveResult(run.gpus, clients, seconds, wanted, achieved, p50,
                      max(steady, default=0.0), max(raw - p50 * dur, 0.0),
                      raw, dur, bool(done), predicted["between"], predicted["per_update"],
                      sch.tally, quiet=predicted.get("quiet", 0.0), dilate=dilate,
                      capacity=predicted.get("capacity", 0.0),
                      window_s=run.burst_window_s / dilate)
