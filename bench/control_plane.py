"""The control plane of a large run, counted at the metadata server (``bench/scale.py
--control-plane``).

The run's clients make their own real operations, with the project's own queue, batch and
reader code, against a Redis-backed JuiceFS volume brought up for the run (client A: the
collector; client B: producers and trainer ranks); what reaches the metadata server is
counted with Redis's own ``INFO commandstats``.

**Counts and rates assumed** (``Run``; each a flag of ``scale.py``), for 10,000 GPUs:

- producers: one per 8-GPU node, 1,250, each with 24 group slots (30,000 groups in
  flight); each heartbeats every ``heartbeat_interval_s`` (5 s): the steady beat, one
  rename within ``hb/``, counted after each producer's first two (a process's first beat
  lists ``hb/`` and publishes its file, its second opens ``hb/``: counted apart, once per
  process, not a steady rate); together they
  claim and complete the run's groups, 2,048 a step of 60 s (34 groups/s: one claim and one
  completion per group).
- weight update after every step: of the 30,000 groups in flight, 75 % are saved as
  partials (``yield_partial``) and resumed (a claim and ``load_partial``), 25 % handed back
  (``release``) and claimed again; the burst is spread over 10 s. Each producer takes its
  slots back in one claim of its whole slot budget (``refill``: what the producer does
  after a resume), counted as such: a claim of ``slots`` tasks from a top of ``pending/``
  holding every sampled producer's parked tasks; the burst with claims of one task each
  (the model before) is printed beside. The refill's tasks are the parked ones, single
  files at the top of ``pending/``: no chunk holds them (``--release-chunk``), so chunks
  gain nothing there.
- a producer's start: it fills its slots in one claim of ``slots`` fresh tasks (whole
  chunks where ``release_chunk`` > 1), once per producer and run: printed apart, not in
  the steady or the burst figures.
- the collector: releases tasks 64 at a time as they are claimed, batches every group
  (lists ``ready/``, reads each group's summary, publishes the manifest, moves the groups),
  acks and garbage-collects once a step.
- the in-flight journal (``--journal-every-s W``; 0, the default: off, the figures above
  unchanged): each producer writes one journal record a window (``JournalLog.append``, the
  real writer: 24 held groups x G = 16, deltas of ``W * journal_tok_s`` tokens a sequence),
  a steady producer term at ``producers / W``: ``--journal-format records`` publishes a
  file a window and deletes one superseded a window; ``segments`` (the writer's choice on a
  store that can append) appends the window to the open segment (held open: a write and an
  fsync; its first append opens it), and every ``FULL_EVERY``-th window publishes a new
  segment and deletes the superseded one; at the
  update a parked group is yielded into the journal (one full record per producer for its
  24 groups, ``RunQueue.yield_journaled`` per group) instead of a
  ``.partial``, and its resume reads the journal prefix (``load_chain``: the writer's
  listing and its records) instead of the ``.partial``. The figures without the journal
  are printed beside, from the same counts, and the burst of a pause that holds the groups
  (``Run.hold``, ``timing.hold_through_pause``: one window record per producer, nothing
  yielded, claimed or loaded).
- trainer ranks: 10,000 (one per GPU: a colocated trainer, every rank reading), 8 per
  node, all waiting all the time (an upper bound: a rank training is not polling): each
  lists ``batches/`` and ``acked/`` once a second and checks for the run's end once a
  second (``BatchReader.next_batch`` today); its stat of ``batches/`` every 20 ms reaches
  the server once per node per attribute-cache TTL (1 s); at each step each rank lists,
  reads the manifest and loads its shard. With ``--trainer-watch rank0``
  (``BatchReader(process_group=...)``) one rank (one trainer, one group) waits so, and the
  others, hearing the manifest over the group, only load their shard.

**Why Redis commands per logical operation is what is measured.** A 10,000-GPU control
plane makes tens of thousands of filesystem calls a second; a 2-core machine cannot make
them in real time (the driver here reaches about 2,000-4,000 Redis commands a second). So
time is scaled per operation with the count kept in the rates: identities of each kind
(producers ``p<i>`` with their own queue handle, trainer ranks with their own reader,
numbered in the full world size, rank nodes) make each of their real operations once, as
fast as the machine goes (8 threads), and the server's command count over that round,
less what the idle clients send over the same time, divided by the operations made, is
that operation's cost. The cost of an operation does not depend on how many clients make
it (it depends on the directories it lists, kept at their real sizes where they matter:
``pending/`` at ``pending_depth``); so ``--sample`` identities per kind, spread over the
whole population (100 by default, every one with ``--sample 0``), are counted (the steady
claims one at a time: at the run's rates they rarely meet), and those
costs times each operation's rate in the real run (``Run`` below, every rate a flag) are
the run's demand. What this leaves out: retries of contended transactions at full
concurrency (8 threads here, not 11,250 clients), and at an update the partial and
returned tasks at the top of ``pending/`` number the sample, not the 30,000 of the real
run (a resuming claim lists them: the real burst is larger than counted).

**Caches.** Every simulated node shares this machine's one kernel and one JuiceFS client,
where a real node has its own. So the volume is mounted with no attribute or entry cache
(``STRAWQ_JUICEFS_META_CACHE=zero``, ``--meta-cache zero``, the default): every call a
client makes reaches the server, as if no node shared a cache with another: an upper
bound, since a real node with the default 1 s caches answers repeated path lookups within
one operation, and its ranks' lookups within a second, from its own kernel.
``--meta-cache default`` mounts with the 1 s caches instead, shared here by every simulated
client: the lower bound (caching no real node has). The one call whose caching is
modelled either way is the waiting rank's stat of ``batches/`` at each 20 ms poll: a
node's kernel answers its ranks' stats from its attribute cache, one getattr per node per
TTL (1 s), so that look is counted once per node per TTL (``node probe``).

Counted the same way per operation: a Redis command is one call in ``INFO commandstats``,
the commands JuiceFS's Lua scripts run inside the server included (each is work the
server does); the capacity it is compared with is ``redis-benchmark``'s commands a second
on the same server, command by command in the run's steady mix (each operation's commands
weighted by its rate in the run), combined by the mix's weights.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from control_plane_rolling import measure_rolling, rolling_counts, shape
from redis_meta import Volume, capacity, commandstats, delta

from strawq.config import QueueConfig
from strawq.data.dataset import Dataset
from strawq.data.feeder import Feeder
from strawq.delivery.batches import BatchStore
from strawq.errors import LeaseLost
from strawq.ondisk.groups import GroupData
from strawq.storage import PosixStorage
from strawq.tasks.journal import FULL_EVERY, JournalLog, load_chain
from strawq.tasks.queue import Lease, RunQueue
from strawq.ondisk.names import CHUNK_PREFIX

#: a journaling producer's group size (G) in the window record
JOURNAL_G = 16


@dataclass(frozen=True)
class Run:
    """The run whose control plane is counted: counts and rates (flags of scale.py)."""

    gpus: int = 10_000
    gpus_per_node: int = 8
    #: trainer ranks that wait for batches (default: every GPU, a colocated trainer)
    ranks: int = 10_000
    #: group slots in flight per producer (30,000 groups in flight at 1,250 producers)
    slots: int = 24
    #: groups per batch and seconds per training step (a weight update after each step)
    batch_groups: int = 2048
    step_s: float = 60.0
    #: of the groups in flight at an update, the share handed back with nothing generated
    #: (the rest are saved as partials and resumed)
    handback_share: float = 0.25
    #: the seconds an update's saves and resumes spread over
    burst_window_s: float = 10.0
    #: released tasks waiting in pending/ when producers claim (the collector admits about
    #: a batch ahead): a claim lists pending/, so its cost grows with this depth
    pending_depth: int = 1024
    #: the identities of each kind whose operations are counted (spread over the whole
    #: population, ranks numbered in the full world size); 0: every one
    sample: int = 0
    heartbeat_s: float = QueueConfig().heartbeat_interval_s
    release_batch: int = QueueConfig().release_batch
    attr_ttl_s: float = 1.0
    #: a waiting rank lists batches/ (and acked/) at least this often, and checks for the
    #: run's end as often (strawq.collector.trainer.reader.LIST_EVERY_S)
    list_every_s: float = 1.0
    #: how trainer ranks wait: "per-rank" (each rank watches batches/) or "rank0" (one rank
    #: of the trainer's process group watches, the others hear over the group:
    #: ``BatchReader(process_group=...)``)
    trainer_watch: str = "per-rank"
    #: the in-flight journal's window in seconds (0: no journal), and the tokens a second
    #: each held sequence receives (a window's delta is ``journal_every_s * journal_tok_s``
    #: tokens a sequence)
    journal_every_s: float = 0.0
    journal_tok_s: float = 30.0
    #: "records": a file published per window and deleted once superseded (a store that
    #: cannot append); "segments": each window appended to the writer's open segment, a
    #: new segment and a delete every FULL_EVERY windows
    journal_format: str = "segments"
    #: the collector's ``queue.release_chunk`` (``--release-chunk``): 1, one task per file;
    #: K > 1, each release stages chunks of K tasks. Producers still claim one task per
    #: claim in the steady state: a producer claims as many tasks as it has free slots, and
    #: its slots free one at a time as its groups finish, so a steady claim wants 1 task
    #: and takes one task out of a chunk (a chunk is leased whole only by a claim that
    #: wants at least K: a producer's start fill, ``refill``; the update's refill takes
    #: partials and handed-back tasks, which are single files)
    release_chunk: int = 1
    #: how weights are updated (``--update``): "bracket" (every producer parks its groups:
    #: the update burst above) or "rolling" (nothing parked: engines load in waves, the
    #: update's operations are the producers' steps and the slots,
    #: ``bench/control_plane_rolling.py``); both are counted, this names the one in the
    #: last line
    update: str = "bracket"
    #: engines per producer (a node's GPUs over the engines' tensor-parallel size), the
    #: rolling wave (a count, or a share of the engines below 1: the trainer's default
    #: 0.25) and the seconds one engine's load takes
    engines_per_node: int = 8
    wave: float = 0.25
    load_s: float = 30.0
    #: with the journal on: every producer holds its groups through the pause
    #: (``timing.hold_through_pause``, the producer's default with the journal): the burst
    #: is one window record per producer, the resume nothing; the report prints it beside
    #: the park either way (``bench/scale.py`` sets it unless ``--park``)
    hold: bool = False

    @property
    def held(self) -> bool:
        """Whether the bracket's producers hold their groups (``hold``, with the journal on:
        without it there is nothing to hold them in)."""
        return bool(self.journal_every_s and self.hold)

    @property
    def watchers(self) -> int:
        """Ranks that watch batches/ while they wait."""
        return 1 if self.trainer_watch == "rank0" else self.ranks

    @property
    def watcher_nodes(self) -> int:
        return 1 if self.trainer_watch == "rank0" else self.rank_nodes

    @property
    def producers(self) -> int:
        return self.gpus // self.gpus_per_node

    @property
    def rank_nodes(self) -> int:
        return math.ceil(self.ranks / self.gpus_per_node)

    @property
    def groups_per_s(self) -> float:
        return self.batch_groups / self.step_s

    def spread(self, n: int) -> list[int]:
        """The counted identities among ``n``: every one, or ``sample`` spread evenly."""
        k = n if not self.sample or self.sample >= n else self.sample
        return [i * n // k for i in range(k)]

    @property
    def in_flight(self) -> int:
        return self.producers * self.slots


@dataclass
class Op:
    kind: str
    name: str
    made: int = 0
    commands: float = 0.0
    mix: dict[str, int] = field(default_factory=dict)

    @property
    def per_op(self) -> float:
        return self.commands / self.made if self.made else 0.0


class Counter:
    """Redis commands per logical operation, net of the idle clients' own traffic."""

    def __init__(self, sock: str, quiet_s: float) -> None:
        self.sock = sock
        before, t0 = commandstats(sock), time.perf_counter()
        time.sleep(quiet_s)
        after = commandstats(sock)
        self.quiet_per_s = sum(delta(after, before).values()) / (time.perf_counter() - t0)
        self.ops: list[Op] = []

    def measure(self, kind: str, name: str, fn: Callable[[Any], object],
                items: Sequence[Any], threads: int = 8,
                made: Callable[[list[Any]], int] = len) -> list[Any]:
        before, t0 = commandstats(self.sock), time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            out = list(pool.map(fn, items))
        dt = time.perf_counter() - t0
        d = delta(commandstats(self.sock), before)
        op = Op(kind, name, made(out), max(sum(d.values()) - self.quiet_per_s * dt, 0.0), d)
        self.ops.append(op)
        top = sorted(d.items(), key=lambda kv: -kv[1])[:3]
        mix = ", ".join(f"{k} {v / op.made:.1f}" for k, v in top) if op.made else ""
        print(f"  {kind:<9} {name:<34} {op.made:>6} in {dt:6.1f} s: {op.per_op:7.1f} "
              f"Redis commands each ({mix})", flush=True)
        return out

    def cost(self, name: str) -> float:
        return next(o.per_op for o in self.ops if o.name == name)


def group_of(lease: Lease, samples: int = 16, tokens: int = 64) -> GroupData:
    n = samples * tokens
    return GroupData(task_id=lease.task_id, index=lease.task["index"], prompt_ids=[1, 2, 3],
                     sample_lens=[tokens] * samples, rewards=[1.0] * samples,
                     status=["completed"] * samples,
                     tokens=np.ones(n, dtype=np.int32), logprobs=np.zeros(n, dtype=np.float32),
                     versions=np.zeros(n, dtype=np.int64), loss_mask=np.ones(n, dtype=np.uint8))


def journal_entry(task: str, gen: int, *, start: int, tokens: int,
                  g: int = JOURNAL_G) -> dict[str, Any]:
    """One lease's journal entry as ``JournalFlush`` writes it: per sample the columns of
    ``tokens`` tokens from ``start`` (a delta; ``start`` 0 and the prompt: a full entry)."""
    def part(i: int) -> dict[str, Any]:
        return {"i": i, "start": start, "tokens": np.ones(tokens, np.int32).tobytes(),
                "logprobs": np.zeros(tokens, np.float32).tobytes(),
                "versions": np.zeros(tokens, np.int64).tobytes(),
                "mask": np.ones(tokens, np.uint8).tobytes(), "status": "aborted",
                "finish": None, "segments": 1, "reward": None, "extras": {},
                **({"params": {"max_new_tokens": 4096, "seed": i}} if start == 0 else {})}

    e: dict[str, Any] = {"task": task, "gen": gen, "full": start == 0, "min_version": 0,
                         "version_hint": 0, "samples": [part(i) for i in range(g)],
                         "reward_errors": {}, "failures": {}}
    if start == 0:
        e["prompt"] = np.array([1, 2, 3], np.int32).tobytes()
        e["size"] = g
    return e


def wait_for(path: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear on client B within {seconds:.0f} s")
        time.sleep(0.05)


def collector_side(root_a: str, run: Run, tasks: int) -> tuple[RunQueue, Feeder]:
    """The run made on client A: a dataset of ``tasks`` rows, the queue (leases that never
    expire here, the run's heartbeat interval and ``release_chunk``) and its feeder."""
    ds = os.path.join(root_a, "ds.jsonl")
    with open(ds, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"prompt": [1, 2, 3], "i": i}) + "\n" for i in range(tasks))
    q_a = RunQueue.create(PosixStorage(os.path.join(root_a, "run"), writer_id="collector"),
                          QueueConfig(lease_timeout_s=3600, heartbeat_interval_s=run.heartbeat_s,
                                      release_chunk=run.release_chunk))
    return q_a, Feeder(q_a, Dataset(ds))


def measure(vol: Volume, run: Run, quiet_s: float) -> tuple[Counter, dict[str, float]]:
    """Every client's operations once, counted; returns the counter and the demand."""
    from strawq.collector.trainer.reader import BatchReader
    from strawq.storage.watch import DirProbe

    assert vol.sock is not None
    name = f"cp-{secrets.token_hex(3)}"
    root_a, root_b = os.path.join(vol.a, name), os.path.join(vol.b, name)
    os.makedirs(root_a)
    pids = run.spread(run.producers)
    tasks = (len(pids) * ((6 if run.journal_every_s else 4) + run.slots) + run.pending_depth
             + 2 * run.release_batch)
    q_a, feeder = collector_side(root_a, run, tasks)
    wait_for(os.path.join(root_b, "run", "run.meta"))
    print(f"setup: run on client A, {run.producers} producers and {run.ranks} trainer ranks "
          f"on client B", flush=True)
    counter = Counter(vol.sock, quiet_s)
    print(f"  idle clients: {counter.quiet_per_s:.1f} Redis commands/s (subtracted)")
    released = [0]

    def release(_i: int) -> int:
        n = feeder.release()
        released[0] += n
        return n

    claimed = [0]

    def top_up(claims: int) -> None:
        """pending/ holds ``pending_depth`` tasks beyond the next ``claims`` (uncounted)."""
        while released[0] < claimed[0] + claims + run.pending_depth and release(0):
            pass
        claimed[0] += claims

    releases = max(1, math.ceil((run.pending_depth + len(pids)) / run.release_batch))
    counter.measure("collector", "release (per 64 tasks)", release,
                    range(min(releases, 4 if run.sample else releases)), threads=1)
    top_up(len(pids))
    if run.release_chunk > 1:
        pending = os.path.join(root_a, "run", "pending")
        staged = sum(n.startswith(CHUNK_PREFIX) for r in os.listdir(pending)
                     if os.path.isdir(os.path.join(pending, r))
                     for n in os.listdir(os.path.join(pending, r)))
        print(f"  release_chunk = {run.release_chunk}: {staged} chunk directories staged in "
              f"pending/; steady claims want 1 task (slots free one at a time)", flush=True)
    queues = {i: RunQueue.open(PosixStorage(os.path.join(root_b, "run"), writer_id=f"p{i}"))
              for i in pids}

    def claim(i: int) -> Lease:
        # a claim that lost every race comes back empty; a producer claims again (counted:
        # contention is part of a claim's cost)
        for _ in range(50):
            got = queues[i].claim(f"p{i}", 1)
            if got:
                return got[0]
            time.sleep(0.01)
        raise RuntimeError(f"producer p{i} found nothing to claim 50 times")

    # A process's first beat lists hb/ and publishes its file anew, its second opens the
    # descriptor of hb/ its renames go through (once per process each, not in the rates);
    # every beat after them is one rename within hb/: the steady cost.
    counter.measure("producer", "heartbeat: a process's first", lambda i: queues[i].heartbeat(
        f"p{i}"), pids)
    counter.measure("producer", "heartbeat: its second (opens hb/)",
                    lambda i: queues[i].heartbeat(f"p{i}"), pids)
    counter.measure("producer", "heartbeat", lambda i: queues[i].heartbeat(f"p{i}"), pids)
    # Steady claims one at a time: at the run's rates they rarely meet (34 a second over
    # 1,250 producers, each a few ms), while 8 claimers at once race for the same first
    # names and a lost race lists again: counted so at 10,000 GPUs with no cache, a claim
    # cost 240.8 Redis commands, against 73.7 one at a time (docs/benchmarks.md).
    leases = dict(zip(pids, counter.measure("producer", "claim", claim, pids, threads=1),
                      strict=True))
    counter.measure("producer", "complete", lambda i: queues[i].complete(leases[i],
                                                                        group_of(leases[i])),
                    pids)
    # the update: a group in flight saved as a partial and resumed, or handed back
    top_up(len(pids))
    held = {i: claim(i) for i in pids}
    counter.measure("update", "save partial", lambda i: queues[i].yield_partial(
        held[i], group_of(held[i], tokens=32)), pids)
    resumed = dict(zip(pids, counter.measure("update", "resume: claim", claim, pids), strict=True))
    counter.measure("update", "resume: load partial",
                    lambda i: queues[i].load_partial(resumed[i]), pids)
    counter.measure("update", "hand back", lambda i: queues[i].release(resumed[i]), pids)
    counter.measure("update", "hand back: claim again", claim, pids)  # the returned ones
    if run.journal_every_s:
        journal(counter, run, queues, pids, claim, top_up)
    refill(counter, run, queues, pids, top_up)
    # the collector's batch of every completed group (cost per group)
    bs = BatchStore(q_a)
    wait_s = time.monotonic() + 30
    while len(bs.scan_ready()) < len(pids) and time.monotonic() < wait_s:
        time.sleep(0.1)

    def batch(_i: int) -> int:
        names = bs.scan_ready()
        for n in names:
            bs.read_summary(n)
        bs.publish_batch(bs.next_seq(), names)
        return len(names)

    counter.measure("collector", "batch, per group (list, read, publish)", batch, [0], threads=1,
                    made=lambda out: out[0])  # per group batched
    # the trainer ranks: one shared queue per process here; a rank's own reader state
    q_b = RunQueue.open(PosixStorage(os.path.join(root_b, "run"), writer_id="reader"))
    ranks = run.spread(run.ranks)
    readers = {r: BatchReader(q_b, rank=r, world_size=run.ranks,
                              sleep=lambda s: time.sleep(s), checkpointed=False)
               for r in ranks}
    wait_s = time.monotonic() + 30
    while readers[ranks[0]].positions.next_seq() is None and time.monotonic() < wait_s:
        time.sleep(0.1)

    def deliver(r: int) -> int:
        rd = readers[r]
        seq = rd.positions.next_seq()
        if seq is None:
            raise RuntimeError(f"rank {r} sees no batch")
        rd.load(rd.batches.read_manifest(seq))
        rd.positions.delivered = seq
        return seq

    seqs = counter.measure("rank", "delivery (list, manifest, shard)", deliver, ranks)
    # one watcher: the others get the manifest over the process group, and load their shard
    heard = readers[ranks[0]].batches.read_manifest(seqs[0])
    counter.measure("rank", "delivery, heard (shard)", lambda r: readers[r].load(heard), ranks)
    counter.measure("collector", "ack (rank 0) and gc, per step",
                    lambda _i: (bs.ack(seqs[0]), bs.gc()), [0], threads=1)
    counter.measure("rank", "wait: list batches/, acked/",
                    lambda r: readers[r].positions.next_seq(), ranks)
    counter.measure("rank", "wait: end-of-run check",
                    lambda r: readers[r].waiter.check_finished(),
                    ranks)
    nodes = run.spread(run.rank_nodes)
    probes = {n: DirProbe(q_b.storage, ("batches",)) for n in nodes}
    for p in probes.values():  # opened (the descriptor each node's ranks stat)
        p.changed()
    counter.measure("rank", "wait: node probe (stat)", lambda n: probes[n].changed(), nodes)
    measure_rolling(counter, run, q_a, root_b, pids)
    shutil.rmtree(root_a, ignore_errors=True)
    return counter, demand(counter, run)


def journal(counter: Counter, run: Run, queues: dict[int, RunQueue], pids: list[int],
            claim: Callable[[int], Lease], top_up: Callable[[int], None]) -> None:
    """The journal's operations: a window's record and a superseded record's delete (each
    producer's own ``JournalLog``), and the park into the journal with its resume."""
    delta = max(1, round(run.journal_every_s * run.journal_tok_s))
    seg = run.journal_format == "segments"
    logs = {i: JournalLog(queues[i].storage, f"p{i}", 1, segments=seg) for i in pids}
    fake = [(f"held{k}", 0) for k in range(run.slots)]

    def window(i: int, *, full: bool = False) -> int:
        start = 0 if full else delta
        return logs[i].append([journal_entry(t, g, start=start, tokens=delta) for t, g in fake],
                              full=full)

    for i in pids:  # each lease's first entry is full (not counted: once per lease)
        window(i, full=True)
    if seg:  # a segment's first append opens it (held open for the appends after it)
        counter.measure("producer", "journal: first append (opens)", window, pids)
    counter.measure("producer", "journal: window record", window, pids)
    if seg:  # every FULL_EVERY-th record starts a segment (full entries: the same size here)
        last = dict(zip(pids, counter.measure("producer", "journal: new segment",
                                              lambda i: window(i, full=True), pids),
                        strict=True))
    else:
        last = {i: logs[i].next - 1 for i in pids}
    # the record (or segment) the newest full one superseded
    counter.measure("producer", "journal: delete superseded",
                    lambda i: logs[i].superseded(fake, before=last[i]), pids, made=sum)
    # the update: a producer's held groups parked at once, one full record for all of
    # them, each lease yielded by the rename alone; the next holder reads the prefix
    top_up(len(pids))
    held = {i: claim(i) for i in pids}
    parks = {i: JournalLog(queues[i].storage, f"p{i}", 2, segments=seg) for i in pids}
    tokens = max(1, round(run.step_s / 2 * run.journal_tok_s))  # half a step, on average
    counter.measure("update", "park: journal record (per producer)", lambda i: parks[i].append(
        [journal_entry(held[i].task_id, held[i].gen, start=0, tokens=tokens)]
        + [journal_entry(t, g, start=0, tokens=tokens) for t, g in fake[1:]], full=True), pids)
    counter.measure("update", "park: yield into the journal", lambda i: queues[i].yield_journaled(
        held[i], 0), pids)
    resumed = dict(zip(pids, counter.measure("update", "resume from journal: claim", claim,
                                             pids), strict=True))

    def load(i: int) -> int:
        lease = resumed[i]
        if lease.journal is None:
            raise RuntimeError(f"producer p{i} claimed {lease.name}, not a journaled prefix")
        chain = load_chain(queues[i].storage, lease.journal, lease.task_id, lease.name.resume,
                           quarantine=queues[i].quarantine)
        if not chain:
            raise RuntimeError(f"no journal prefix for {lease.name}")
        return len(chain)

    counter.measure("update", "resume from journal: load prefix", load, pids)


def refill(counter: Counter, run: Run, queues: dict[int, RunQueue], pids: list[int],
           top_up: Callable[[int], None]) -> None:
    """A producer's refills, each one claim of its whole slot budget (``run.slots`` tasks,
    as the producer asks for every free slot in one claim): at its start, from fresh tasks
    (whole chunks where ``release_chunk`` > 1), and after an update, from the tasks every
    producer parked (75 % partials, 25 % handed back: single files at the top of
    ``pending/``, which no chunk holds). A claim that comes back short (lost races) is
    followed by another for the rest, counted with it. The parks themselves are counted
    above (``save partial``, ``hand back``), not again here."""
    s = run.slots

    def fill(i: int) -> list[Lease]:
        got: list[Lease] = []
        for _ in range(50):
            got += queues[i].claim(f"p{i}", s - len(got))
            if len(got) == s:
                return got
            time.sleep(0.01)
        raise RuntimeError(f"producer p{i} claimed {len(got)} of its {s} slots 50 times")

    top_up(len(pids) * s)
    held = dict(zip(pids, counter.measure("start", f"fill: claim {s} tasks at once", fill,
                                          pids), strict=True))
    chunked = sum(lease.name.chunk is not None for got in held.values() for lease in got)
    saved = round(s * (1 - run.handback_share))

    def park(i: int) -> int:
        """The producer's parks; returns its leases found lost (``LeaseLost``)."""
        lost = 0
        for k, lease in enumerate(held[i]):
            try:
                if k < saved:
                    queues[i].yield_partial(lease, group_of(lease, tokens=32))
                else:
                    queues[i].release(lease)
            except LeaseLost:
                lost += 1
        return lost

    with ThreadPoolExecutor(8) as pool:
        lost = sum(pool.map(park, pids))
    ids = [lease.task_id for got in held.values() for lease in got]
    if lost or len(set(ids)) < len(ids):
        # Not a state the protocol makes any more: a claim took a task out of a queued
        # chunk by its path, which could race another claimer's rename of the whole chunk
        # (3 and 11 of 2,400 tasks at k = 16 before every claim took a chunk whole:
        # docs/protocol.md §5). Counted, should it come back.
        print(f"  start fill: {len(ids) - len(set(ids))} tasks leased twice, {lost} leases "
              f"found lost at the park", flush=True)
    again = counter.measure("update", f"refill: claim {s} tasks at once", fill, pids)
    print(f"  refill: {chunked} of {len(pids) * s} tasks at the start fill leased inside a "
          f"whole chunk, {sum(x.name.chunk is not None for got in again for x in got)} at the "
          f"update's refill (parked tasks are single files)", flush=True)


#: client kind of each operation's steady term
KIND = {"heartbeat": "producer", "claim": "producer", "complete": "producer",
        "release (per 64 tasks)": "collector", "batch, per group (list, read, publish)":
        "collector", "ack (rank 0) and gc, per step": "collector",
        "wait: list batches/, acked/": "rank", "wait: end-of-run check": "rank",
        "wait: node probe (stat)": "rank", "delivery (list, manifest, shard)": "rank",
        "delivery, heard (shard)": "rank", "journal: window record": "producer",
        "journal: delete superseded": "producer", "journal: new segment": "producer",
        "journal: first append (opens)": "producer"}


def steady_rates(run: Run) -> dict[str, float]:
    """Each steady operation's rate per second in the real run."""
    g = run.groups_per_s
    journal: dict[str, float] = {}
    if run.journal_every_s:
        windows = run.producers / run.journal_every_s
        if run.journal_format == "segments":
            journal = {"journal: window record": windows * (1 - 2 / FULL_EVERY),
                       "journal: first append (opens)": windows / FULL_EVERY,
                       "journal: new segment": windows / FULL_EVERY,
                       "journal: delete superseded": windows / FULL_EVERY}
        else:
            journal = {"journal: window record": windows,
                       "journal: delete superseded": windows}
    return {**journal, "heartbeat": run.producers / run.heartbeat_s, "claim": g, "complete": g,
            "release (per 64 tasks)": g / run.release_batch,
            "batch, per group (list, read, publish)": g,
            "ack (rank 0) and gc, per step": 1 / run.step_s,
            "wait: list batches/, acked/": run.watchers / run.list_every_s,
            "wait: end-of-run check": run.watchers / run.list_every_s,
            "wait: node probe (stat)": run.watcher_nodes / run.attr_ttl_s,
            "delivery (list, manifest, shard)": run.watchers / run.step_s,
            "delivery, heard (shard)": (run.ranks - run.watchers) / run.step_s}


def fill_op(run: Run) -> str:
    """The start's claim of a producer's whole slot budget (counted per producer)."""
    return f"fill: claim {run.slots} tasks at once"


def refill_op(run: Run) -> str:
    """The update's refill claim of a producer's whole slot budget (per producer)."""
    return f"refill: claim {run.slots} tasks at once"


def burst_counts(run: Run, *, refill: bool = True) -> dict[str, float]:
    """Each operation's count at one weight update. ``refill``: each producer takes its
    parked slots back in one claim of its slot budget (what the producer does); else in
    claims of one task each (the model before refills were counted)."""
    saved = run.in_flight * (1 - run.handback_share)
    handed = run.in_flight * run.handback_share
    if run.held:
        # held through the pause: one record (the producer's next window) per producer; no
        # group yielded, handed back, claimed or loaded again
        return {"journal: window record": run.producers}
    if run.journal_every_s:
        counts = {"park: journal record (per producer)": run.producers,
                  "park: yield into the journal": saved, "resume from journal: claim": saved,
                  "resume from journal: load prefix": saved, "hand back": handed,
                  "hand back: claim again": handed}
    else:
        counts = {"save partial": saved, "resume: claim": saved, "resume: load partial": saved,
                  "hand back": handed, "hand back: claim again": handed}
    if refill:
        for single in ("resume: claim", "resume from journal: claim", "hand back: claim again"):
            counts.pop(single, None)
        counts[refill_op(run)] = run.producers
    return counts


def demand(c: Counter, run: Run) -> dict[str, float]:
    """Steady ops/s by client kind; the ops of one update's burst, with its refill claims
    (``burst``) and with claims of one task each (``burst_single``); and the ops of the
    run's start, every producer filling its slots in one claim (``start``)."""
    steady = dict.fromkeys(("producer", "collector", "rank"), 0.0)
    for name, rate in steady_rates(run).items():
        steady[KIND[name]] += rate * c.cost(name)
    burst = sum(n * c.cost(name) for name, n in burst_counts(run).items())
    single = sum(n * c.cost(name) for name, n in burst_counts(run, refill=False).items())
    rolling = {when: sum(n * c.cost(name) for name, n in rolling_counts(
        run, before=when == "rolling_before").items()) for when in ("rolling", "rolling_before")}
    return {**{f"steady_{k}": v for k, v in steady.items()},
            "steady": sum(steady.values()), "burst": burst, "burst_single": single,
            "start": run.producers * c.cost(fill_op(run)), **rolling}


def demand_mix(c: Counter, run: Run) -> dict[str, int]:
    """The run's steady command mix: each operation's commands weighted by its rate."""
    mix: dict[str, float] = {}
    for name, rate in steady_rates(run).items():
        op = next(o for o in c.ops if o.name == name)
        for cmd, n in op.mix.items():
            mix[cmd] = mix.get(cmd, 0.0) + rate * n / max(op.made, 1)
    return {k: round(v) for k, v in mix.items() if round(v) > 0}


def report(vol: Volume, run: Run, quiet_s: float, capacity_requests: int) -> dict[str, Any]:
    counter, d = measure(vol, run, quiet_s)
    assert vol.sock is not None
    mix = demand_mix(counter, run)
    cap, rates = capacity(vol.sock, mix, requests=capacity_requests)
    top = sorted(mix.items(), key=lambda kv: -kv[1])[:8]
    total = sum(mix.values()) or 1
    print("observed command mix, weighted by each operation's rate: "
          + ", ".join(f"{k} {v / total:.0%}" for k, v in top))
    print("redis-benchmark on this machine (50 clients): "
          + ", ".join(f"{k} {v:,.0f}/s" for k, v in rates.items()))
    print(f"demand at {run.gpus:,} GPUs ({run.producers:,} producers, {run.ranks:,} ranks on "
          f"{run.rank_nodes:,} nodes, {run.groups_per_s:.1f} groups/s, an update every "
          f"{run.step_s:g} s with {run.in_flight:,} groups in flight):")
    for kind in ("producer", "collector", "rank"):
        v = d[f"steady_{kind}"]
        print(f"  {kind:<10} {v:>10,.0f} ops/s steady ({v / cap:.1%} of the server)")
    burst_share = d["burst"] / run.burst_window_s / cap
    print(f"  update burst {d['burst']:,.0f} ops = {d['burst'] / cap:.1f} s of the whole server; "
          f"over {run.burst_window_s:g} s: {burst_share:.1%} on top of the steady load; "
          f"averaged over the step: {d['burst'] / run.step_s:,.0f} ops/s")
    if run.trainer_watch != "per-rank":
        before = demand(counter, replace(run, trainer_watch="per-rank"))
        print(f"  before (every rank watches batches/): rank {before['steady_rank']:,.0f} ops/s, "
              f"all {before['steady']:,.0f} ops/s steady ({before['steady'] / cap:.1%} of the "
              f"server, ranks {before['steady_rank'] / before['steady']:.0%} of it); now "
              f"{run.trainer_watch}: rank {d['steady_rank']:,.0f} ops/s, all "
              f"{d['steady']:,.0f} ops/s ({d['steady'] / cap:.1%}, ranks "
              f"{d['steady_rank'] / d['steady']:.0%} of it)")
    # the refills are a parked bracket's (a held one claims nothing at the resume)
    parks = demand(counter, replace(run, hold=False)) if run.held else d
    if run.journal_every_s:
        off = demand(counter, replace(run, journal_every_s=0.0))
        w = run.journal_every_s
        per_window = {k: r * w / run.producers for k, r in steady_rates(run).items()
                      if k.startswith("journal:")}
        window = sum(n * counter.cost(k) for k, n in per_window.items())
        parts = ", ".join(f"{k[len('journal: '):]} {counter.cost(k):,.1f} x {n:.3g}"
                          for k, n in per_window.items())
        print(f"  journal every {w:g} s ({run.journal_format}): {window:,.1f} Redis commands a "
              f"window per producer ({parts}) = {window / w:,.1f} per "
              f"producer-second; producers {off['steady_producer']:,.0f} -> "
              f"{d['steady_producer']:,.0f} ops/s; all steady {off['steady']:,.0f} -> "
              f"{d['steady']:,.0f} ops/s ({off['steady'] / cap:.1%} -> {d['steady'] / cap:.1%} "
              f"of the server); update burst {off['burst']:,.0f} -> {d['burst']:,.0f} ops")
        held = demand(counter, replace(run, hold=True))["burst"]
        print(f"  bracket pause: parked {parks['burst']:,.0f} ops, held {held:,.0f} ops (one "
              f"window record per producer); this run's producers "
              f"{'hold' if run.held else 'park'} (timing.hold_through_pause)")
    per_task = {"fill": counter.cost(fill_op(run)) / run.slots,
                "refill": counter.cost(refill_op(run)) / run.slots}
    resume = "resume from journal: claim" if run.journal_every_s else "resume: claim"
    single = ((1 - run.handback_share) * counter.cost(resume)
              + run.handback_share * counter.cost("hand back: claim again"))
    print(f"  refills (one claim of a producer's {run.slots} slots): at the start "
          f"{per_task['fill']:,.1f} Redis commands a task, {d['start']:,.0f} ops for every "
          f"producer's first fill ({d['start'] / cap:.1f} s of the server, once a run); at "
          f"an update {per_task['refill']:,.1f} a task against {single:,.1f} in claims of "
          f"one, a parked update's burst {parks['burst_single']:,.0f} -> {parks['burst']:,.0f} "
          f"ops")
    roll = shape(run)
    costs = ", ".join(f"{name[len('rolling: '):]} {counter.cost(name):,.1f}"
                      for name in rolling_counts(run, before=True) | rolling_counts(run))
    rolling_share = d["rolling"] / roll.seconds / cap
    print(f"  rolling update instead ({roll.engines:,} engines in waves of {roll.wave:,}, "
          f"{run.load_s:g} s a load: {roll.seconds:,.0f} s): {d['rolling']:,.0f} ops "
          f"({d['rolling'] / roll.seconds:,.0f} ops/s, {rolling_share:.1%} on top of the "
          f"steady load); before, with a full step at every poll: {d['rolling_before']:,.0f} "
          f"ops ({d['rolling_before'] / roll.seconds:,.0f} ops/s); Redis commands: {costs}")
    if run.update == "rolling":
        burst, burst_s, burst_share = d["rolling"], roll.seconds, rolling_share
    else:
        burst, burst_s = d["burst"], run.burst_window_s
    worst = max(d["steady"] / cap, d["steady"] / cap + burst_share)
    volumes = max(1, math.ceil(worst / 0.2))
    # every term but the collector's per-step ack and gc grows with the GPUs: at these
    # rates a volume's 20 % is reached at about this many (an estimate from this run's count)
    most = run.gpus * 0.2 / worst if worst > 0 else math.inf
    print(f"  one volume carries it within the 20 % target: "
          f"{'yes' if volumes == 1 else f'no: shard across {volumes} volumes'}; one volume's "
          f"20 % at these rates: about {most:,.0f} GPUs (demand taken as proportional to the "
          f"GPUs; the per-step terms do not grow, so a small run's figure is low)")
    size = f"{run.gpus // 1000}k" if run.gpus % 1000 == 0 else str(run.gpus)
    if run.journal_every_s:
        print(f"journal: {run.journal_every_s:g} s window ({run.journal_format}) = "
              f"{window:.1f} Redis commands a window per producer, "
              f"{window / run.journal_every_s:.1f} per producer-second; "
              f"steady share {off['steady'] / cap:.5f} without, {d['steady'] / cap:.5f} with")
    print(f"refill: release_chunk = {run.release_chunk}, start fill = {per_task['fill']:.1f} "
          f"Redis commands a task, update refill = {per_task['refill']:.1f} a task (claims "
          f"of one: {single:.1f}); update burst {parks['burst']:.0f} ops (claims of one: "
          f"{parks['burst_single']:.0f})")
    print(f"rolling: {roll.engines} engines, wave {roll.wave}, {roll.seconds:.0f} s = "
          f"{d['rolling']:.0f} ops a rolling update ({d['rolling_before']:.0f} with a full "
          f"step at every poll); share {rolling_share:.5f} over the update "
          f"({d['rolling_before'] / roll.seconds / cap:.5f} before)")
    print(f"scale: {size}-GPU control plane = {d['steady']:.0f} ops/s steady, {burst:.0f} ops "
          f"per update burst; metadata server capacity = {cap:.0f} ops/s; share = "
          f"{d['steady'] / cap:.3f} (burst {burst_share:.3f} over {burst_s:g} s)")
    return {"run": run.__dict__, "ops": [o.__dict__ for o in counter.ops], "demand": d,
            "capacity_ops_s": cap, "capacity_by_command": rates, "steady_mix": mix,
            "volumes_needed": volumes}
