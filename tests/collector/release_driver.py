"""Random combinations of the data-side features, run through the real collector, the
trainer's reader and a simulated producer, and checked row by row against the release model
(``strawq.testing.release_model``).

A ``Scenario`` is 1-3 sources (a plain dataset or a mixture; weights, bad rows, a filter on
some), the stopping strategy, 1-4 passes, the zero-variance skip and its revisit window,
longest-first, the producers' zero-variance drop, the group size, the reward kind of every
row in every pass, the collector's sizing, and optionally one crash at a chosen task index:
on the queue path (a new collector on the same run directory) or on the cursor path (the
trainer's checkpoint, the run directory deleted, ``Collector.open(..., checkpoint=)``). It
is drawn through a ``Draw``: Hypothesis in ``tests/collector/test_release_combinations.py``,
``random.Random`` in ``bench/planner.py``.

``run_scenario`` writes the sources as JSONL (each row names its source and row, so what a
producer receives is known whatever the task body says), opens the run with
``fsync=False`` and zero poll and gc intervals, and loops: the producer steps, the collector
steps, the trainer reads, acks and moves the weights one version per batch. It records what
was released (every claim), trained (every batch), dropped (the collector's filter drops and
the producer's zero-variance drops) and skipped (the history), then checks it all with
``check_run``.

**Lockstep.** A scenario in lockstep runs the collector at B = 1, η = 0 and one running
group: the admission rule then releases a row only when every earlier one is trained or
dropped, and gc records each trained batch before the next release. With the history
re-read at every release and drops folded into it at every gc (``fast_history``), the
release of a row is planned on the whole history before it, so the skip set is checked
exactly, not only for soundness. Other scenarios run several groups ahead of training: a
row's earlier attempt may not be recorded yet, and only soundness and completeness hold.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.trainer.reader import BatchReader
from strawq.config import QueueConfig
from strawq.data.dataset import Dataset
from strawq.data.feeder import read_cursor_state
from strawq.data.history import load_history
from strawq.data.mixture import open_dataset
from strawq.delivery.retention import drop_totals
from strawq.errors import LeaseLost
from strawq.ondisk.groups import GroupData
from strawq.ondisk.names import TASK_IDS
from strawq.tasks.queue import Lease, RunQueue
from strawq.tasks.states import TaskState, names_in
from strawq.testing.release_model import (
    ZERO_VARIANCE,
    Behaviour,
    ModelRow,
    Observed,
    ReleaseModel,
    Resume,
    Seen,
    Source,
    agreeing,
    check_run,
)
from tests.collector.helpers import SimProducer, _Work
from tests.collector.release_filters import FILTERS

T = TypeVar("T")

NAMES = ("a", "b", "c")
STOPPING = ("first_exhausted", "all_exhausted")
#: a group's rewards by kind (G samples): ``invalid`` has a failed reward among agreeing ones
KINDS = ("solved", "failed", "mixed", "invalid")


def rewards_of_kind(kind: str, group_size: int) -> list[float | None]:
    if kind == "solved":
        return [1.0] * group_size
    if kind == "failed":
        return [0.0] * group_size
    if kind == "invalid":
        return [None] + [1.0] * (group_size - 1)
    return [float(i % 2) for i in range(group_size)]


class Draw(Protocol):
    def integers(self, lo: int, hi: int) -> int: ...

    def boolean(self) -> bool: ...

    def choice(self, options: Sequence[T]) -> T: ...


class RandomDraw:
    """A ``Draw`` from ``random.Random``."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def integers(self, lo: int, hi: int) -> int:
        return int(self.rng.randint(lo, hi))

    def boolean(self) -> bool:
        return bool(self.rng.random() < 0.5)

    def choice(self, options: Sequence[T]) -> T:
        return options[self.rng.randrange(len(options))]


@dataclass(frozen=True)
class SourcePlan:
    name: str
    rows: int
    weight: int
    #: rows that are bad (malformed JSON or no prompt)
    bad: tuple[int, ...] = ()
    #: a filter of ``release_filters.FILTERS`` by name
    filter: str | None = None
    #: per row, the reward kinds of its group, pass after pass (cycled)
    kinds: tuple[tuple[str, ...], ...] = ()

    def kind(self, row: int, pass_no: int) -> str:
        cycle = self.kinds[row] if row < len(self.kinds) and self.kinds[row] else ("mixed",)
        return cycle[pass_no % len(cycle)]


@dataclass(frozen=True)
class Crash:
    #: ``queue`` (a new collector on the same run directory) or ``cursor`` (resume from
    #: the trainer's checkpoint on a deleted run directory)
    path: str
    #: as soon as the cursor reached this task index (the trainer is always between two
    #: batches in the driver's loop: its checkpoint may be taken at any step)
    at: int
    #: cursor path: loop passes between the checkpoint and the crash (work done, then lost)
    after: int = 0
    #: queue path: the old collector closes (else it is abandoned and taken over)
    close: bool = True
    #: queue path: the producer hands its work back and a new one starts
    restart_producer: bool = False


@dataclass(frozen=True)
class Scenario:
    sources: tuple[SourcePlan, ...]
    plain: bool = False
    stopping: str = "first_exhausted"
    passes: int = 1
    skip: bool = False
    revisit: int = 2
    longest_first: bool = False
    zero_variance_drop: bool = False
    group_size: int = 2
    lockstep: bool = False
    batch_groups: int = 2
    max_running: int = 4
    max_ready: int = 4
    prefetch: int = 2
    max_staleness: int | None = None
    release_batch: int = 4
    crash: Crash | None = None
    seed: int = 0
    #: ``queue.release_chunk``: tasks per chunk directory (range claims); 1 a file per task
    release_chunk: int = 1

    def model(self) -> ReleaseModel:
        return ReleaseModel(
            [Source(s.name, s.rows, float(s.weight), frozenset(s.bad),
                    FILTERS[s.filter] if s.filter else None) for s in self.sources],
            stopping_strategy=self.stopping, passes=self.passes, plain=self.plain)

    def source(self, name: str) -> SourcePlan | None:
        return next((s for s in self.sources if s.name == name), None)

    def rewards(self, name: str, row: int, pass_no: int) -> list[float | None]:
        src = self.source(name)
        kind = src.kind(row, pass_no) if src is not None else "mixed"
        return rewards_of_kind(kind, self.group_size)

    def behaviour(self) -> Behaviour:
        def rewards(r: ModelRow) -> list[float | None]:
            return self.rewards(r.name, r.source_row, r.pass_no)
        return Behaviour(rewards, zero_variance_drop=self.zero_variance_drop,
                         skip_zero_variance=self.skip, revisit=self.revisit)

    @property
    def require_fields(self) -> bool:
        """``source_row`` and ``pass`` in the task body: implied by the index only for one
        source read once."""
        return not (len(self.sources) == 1 and self.passes == 1)

    def describe(self) -> str:
        srcs = ", ".join(f"{s.name}:{s.rows}x{s.weight}" + (f" bad{list(s.bad)}" if s.bad else "")
                         + (f" {s.filter}" if s.filter else "") for s in self.sources)
        parts = [("plain " if self.plain else "mixture ") + srcs, self.stopping,
                 f"{self.passes} pass(es)", f"G={self.group_size}"]
        if self.skip:
            parts.append(f"skip revisit={self.revisit}")
        if self.longest_first:
            parts.append("longest_first")
        if self.zero_variance_drop:
            parts.append("zv-drop")
        parts.append("lockstep" if self.lockstep else
                     f"B={self.batch_groups} running={self.max_running} ready={self.max_ready} "
                     f"prefetch={self.prefetch} eta={self.max_staleness} "
                     f"release={self.release_batch}")
        if self.release_chunk > 1:
            parts.append(f"chunk={self.release_chunk}")
        if self.crash is not None:
            c = self.crash
            parts.append(f"crash {c.path} at {c.at}" + (
                f" after {c.after}" if c.path == "cursor" else
                f" close={c.close} restart_producer={c.restart_producer}"))
        return "; ".join(parts)


def draw_scenario(d: Draw, *, max_rows: int = 15, max_total: int = 60,
                  max_passes: int = 4) -> Scenario:
    """A random combination; passes (then rows) are cut until the run has at most
    ``max_total`` rows."""
    k = d.integers(1, 3)
    plain = k == 1 and d.boolean()
    plans = []
    for name in NAMES[:k]:
        n = d.integers(1, max_rows)
        weight = d.integers(1, 3)
        bad = (d.integers(0, n - 1),) if n >= 3 and d.integers(0, 3) == 0 else ()
        filt = None if plain else d.choice((None, None, "drop_solved", "drop_failed",
                                            "drop_all"))
        kinds = tuple(tuple(d.choice(KINDS) for _ in range(d.integers(1, 2)))
                      for _ in range(n))
        plans.append(SourcePlan(name, n, weight, bad, filt, kinds))
    stopping = d.choice(STOPPING)
    passes = d.integers(1, max_passes)
    skip, revisit, longest = d.boolean(), d.integers(2, 3), d.boolean()
    zv = d.integers(0, 3) == 0
    group_size = d.integers(1, 3)
    lockstep = d.boolean()
    if lockstep:
        sizing: dict[str, Any] = {"batch_groups": 1, "max_running": 1, "max_ready": 1,
                                  "prefetch": 1, "max_staleness": 0, "release_batch": 1}
    else:
        b = d.integers(1, 3)
        sizing = {"batch_groups": b, "max_running": d.integers(b, 6),
                  "max_ready": d.integers(b, 6), "prefetch": d.integers(1, 2),
                  "max_staleness": d.choice((None, 1, 2)), "release_batch": d.integers(1, 6)}
    # range claims (release_chunk > 1) do not combine with longest_first (a config error)
    sizing["release_chunk"] = 1 if longest else d.choice((1, 2, 3))
    scn = Scenario(tuple(plans), plain, stopping, passes, skip, revisit, longest, zv,
                   group_size, lockstep, **sizing)
    while True:
        total = scn.model().end
        if total <= max_total:
            break
        if scn.passes > 1:
            scn = _replace(scn, passes=scn.passes - 1)
            continue
        big = max(range(len(scn.sources)), key=lambda i: scn.sources[i].rows)
        s = scn.sources[big]
        cut = SourcePlan(s.name, s.rows - 1, s.weight, tuple(j for j in s.bad if j < s.rows - 1),
                         s.filter, s.kinds[:s.rows - 1])
        scn = _replace(scn, sources=scn.sources[:big] + (cut,) + scn.sources[big + 1:])
    crash = None
    path = d.choice((None, "queue", "cursor"))
    model = scn.model()
    if path is not None and model.end >= 2:
        if model.num_passes > 1 and d.integers(0, 3) < 3:  # mostly just after a boundary
            e = d.integers(1, model.num_passes - 1)
            # inside the pass: the cursor has opened it (at its base it may not have yet)
            at = min(model.passes[e].base + d.integers(1, 2), model.end - 1)
        else:
            at = d.integers(1, model.end - 1)
        crash = Crash(path, at, after=d.integers(0, 4), close=d.boolean(),
                      restart_producer=d.boolean())
    return _replace(scn, crash=crash, seed=d.integers(0, 2**16))


def _replace(scn: Scenario, **kw: Any) -> Scenario:
    from dataclasses import replace
    return replace(scn, **kw)


# -- the run -----------------------------------------------------------------------------------
@contextlib.contextmanager
def fast_history() -> Iterator[None]:
    """The history as fresh as it can be: re-read at every release
    (``HISTORY_REFRESH_S``) and every drop folded into it at every gc
    (``COMPACT_DROPS_AT``), in every loaded strawq module that reads them."""
    saved = []
    for name, mod in list(sys.modules.items()):
        if not name.startswith("strawq") or mod is None:
            continue
        for attr, value in (("HISTORY_REFRESH_S", -1.0), ("COMPACT_DROPS_AT", 0)):
            if hasattr(mod, attr):
                saved.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, value)
    try:
        yield
    finally:
        for mod, attr, value in saved:
            setattr(mod, attr, value)


def write_sources(scn: Scenario, root: Path) -> Dataset:
    """Each source as JSONL (each good row names its source and row), and the mixture."""
    for s in scn.sources:
        with open(root / f"{s.name}.jsonl", "w", encoding="utf-8") as f:
            for j in range(s.rows):
                if j in s.bad:
                    f.write('{"prompt": [1, 2\n' if j % 2 else
                            json.dumps({"src": s.name, "j": j}) + "\n")
                    continue
                prompt = [1 + (j * 7 + i * 3 + ord(s.name)) % 97 for i in range(2 + j % 4)]
                f.write(json.dumps({"prompt": prompt, "src": s.name, "j": j}) + "\n")
    if scn.plain:
        return Dataset(str(root / f"{scn.sources[0].name}.jsonl"))
    spec = {"sources": [{"name": s.name, "path": f"{s.name}.jsonl", "weight": s.weight,
                         **({"filter": f"tests.collector.release_filters.{s.filter}"}
                            if s.filter else {})} for s in scn.sources],
            "stopping_strategy": scn.stopping}
    (root / "data.mixture.json").write_text(json.dumps(spec), encoding="utf-8")
    return open_dataset(str(root / "data.mixture.json"))


class RowProducer(SimProducer):
    """A simulated producer whose groups get the rewards the scenario chose for their row,
    and that tells the run what it claimed and dropped."""

    def __init__(self, queue: RunQueue, name: str, run: _Run, *, slots: int,
                 group_size: int, seed: int) -> None:
        super().__init__(queue, name, slots=slots, group_size=group_size, chunk=32,
                         max_new=(1, 9), seed=seed)
        self.run = run

    def _start(self, lease: Lease) -> _Work:
        w = super()._start(lease)
        self.run.claimed(lease.task)
        if not any(w.toks):
            w.targets = [self.run.length_of(lease.task)] * self.G
        return w

    def _group(self, w: _Work, final: bool) -> GroupData:
        g = super()._group(w, final)
        if final:
            g.rewards = self.run.rewards_of(w.lease.task)
        return g

    def _finish(self, w: _Work) -> None:
        g = self._group(w, final=True)
        try:
            if self.run.scn.zero_variance_drop and agreeing(g.rewards):
                self.queue.drop(w.lease, ZERO_VARIANCE, "every reward agrees",
                                summary=g.summary())
                self.run.dropped(int(w.lease.task["index"]), ZERO_VARIANCE)
            else:
                self.queue.complete(w.lease, g)
        except LeaseLost:
            pass


@dataclass
class RunResult:
    scenario: Scenario
    mismatches: list[str]
    #: the model's rows checked (every pass)
    rows: int
    wall_s: float
    steps: int
    #: the crash that happened (``queue`` / ``cursor``), None if none did
    crashed: str | None = None


@dataclass
class _Checkpoint:
    state: dict[str, Any]
    tick: int
    skipped: set[int]
    countdown: int


@dataclass
class _Run:
    scn: Scenario
    root: Path
    model: ReleaseModel
    tick: int = 0
    claims: dict[int, Seen] = field(default_factory=dict)
    #: the tick of each task's first claim
    claimed_at: dict[int, int] = field(default_factory=dict)
    #: (tick, task index) of every trained group and every drop (with its reason)
    trained: list[tuple[int, int]] = field(default_factory=list)
    drops: list[tuple[int, int, str]] = field(default_factory=list)
    #: drops by reason since the queue state began (the drop audit's to compare)
    segment_drops: Counter[str] = field(default_factory=Counter)
    after_resume: set[int] | None = None
    #: the checkpoint a cursor resume restored
    ckpt: _Checkpoint | None = None
    problems: list[str] = field(default_factory=list)
    #: the run went on to its end (a resume that fails stops it)
    complete: bool = True

    # -- what the producer reports ----------------------------------------------------------
    def claimed(self, task: dict[str, Any]) -> None:
        index = int(task["index"])
        row = task.get("row") or {}
        seen = Seen(index, (str(row.get("src")), int(row.get("j", -1))), task.get("source"),
                    task.get("source_row"), task.get("pass"))
        old = self.claims.get(index)
        if old is not None and old.content != seen.content:
            self.problems.append(f"[row] task index {index} was released as {old.content[0]} "
                                 f"row {old.content[1]} and again as {seen.content[0]} row "
                                 f"{seen.content[1]}")
        self.claims[index] = seen
        self.claimed_at.setdefault(index, self.tick)
        if self.after_resume is not None:
            self.after_resume.add(index)

    def _pass_of(self, task: dict[str, Any]) -> int:
        got = task.get("pass")
        if isinstance(got, int):
            return got
        row = self.model.row_at(int(task["index"]))
        return row.pass_no if row is not None else 0

    def rewards_of(self, task: dict[str, Any]) -> list[float | None]:
        row = task.get("row") or {}
        return self.scn.rewards(str(row.get("src")), int(row.get("j", 0)), self._pass_of(task))

    def length_of(self, task: dict[str, Any]) -> int:
        """Response length by row (longest-first has something to order)."""
        row = task.get("row") or {}
        k = NAMES.index(row["src"]) if row.get("src") in NAMES else 0
        return 1 + (int(row.get("j", 0)) * 5 + k * 3 + self._pass_of(task)) % 8

    def dropped(self, index: int, reason: str) -> None:
        self.drops.append((self.tick, index, reason))
        self.segment_drops[reason] += 1

    # -- the loop -----------------------------------------------------------------------------
    def configs(self) -> tuple[CollectorConfig, QueueConfig]:
        s = self.scn
        ccfg = CollectorConfig(batch_groups=s.batch_groups, max_running=s.max_running,
                               max_ready=s.max_ready, max_prefetch_batches=s.prefetch,
                               max_staleness=s.max_staleness, poll_interval_s=0,
                               gc_interval_s=0, takeover_timeout_s=0.05,
                               metrics_interval_s=0.0)
        qcfg = QueueConfig(fsync=False, lease_timeout_s=30.0, heartbeat_interval_s=0.2,
                           release_batch=s.release_batch, group_size=s.group_size,
                           num_epochs=s.passes, skip_zero_variance=s.skip,
                           zero_variance_revisit_epochs=s.revisit,
                           longest_first=s.longest_first, release_chunk=s.release_chunk,
                           max_bad_row_share=1.0 if any(p.bad for p in s.sources) else 0.05)
        return ccfg, qcfg

    def producer(self, col: Collector, n: int) -> RowProducer:
        return RowProducer(col.queue, f"p{n}", self, slots=1 if self.scn.lockstep else 4,
                           group_size=self.scn.group_size, seed=self.scn.seed + n)

    def run(self, ds: Dataset, max_steps: int) -> tuple[Collector, str | None]:
        ccfg, qcfg = self.configs()
        path = str(self.root / "run")
        col = Collector.open(path, ds, ccfg, queue_config=qcfg, fsync=False)
        reader = BatchReader(col.queue, checkpointed=False)
        producers = 0
        prod = self.producer(col, producers)
        crash = self.scn.crash
        crashed: str | None = None
        ckpt: _Checkpoint | None = None
        try:
            for _ in range(max_steps):
                self.tick += 1
                prod.step()
                rep = col.step()
                if rep.filtered:
                    reasons = {n.id: n.producer for n in names_in(col.storage,
                                                                  TaskState.DROPPED)}
                    for tid in rep.filtered:
                        index = TASK_IDS.parse(tid)
                        self.dropped(-1 if index is None else index,
                                     reasons.get(tid) or "unknown")
                seqs, acked = col.batches.batch_seqs()
                if any(s not in acked for s in seqs):
                    b = reader.next_batch(timeout=10)
                    for s in b.summaries:
                        self.trained.append((self.tick, int(s["index"])))
                    reader.ack(b)
                    col.queue.set_version(col.queue.current_version() + 1)
                assert col.feeder is not None
                # the crash (the queue path) or the trainer's checkpoint (the cursor path):
                # as soon as the cursor reaches the crash's index, between two batches
                if (crash is not None and crashed is None and ckpt is None
                        and col.feeder.cursor.next_index >= crash.at):
                    if crash.path == "queue":
                        crashed = "queue"
                        col, prod = self._queue_crash(col, prod, ds, crash, producers + 1)
                        producers += 1
                        continue
                    ckpt = _Checkpoint(json.loads(json.dumps(reader.state_dict())),
                                       self.tick, skipped_ids(col), crash.after)
                if ckpt is not None and crashed is None:
                    if ckpt.countdown > 0:
                        ckpt.countdown -= 1
                    else:
                        crashed = "cursor"
                        reader.close()
                        got = self._cursor_crash(col, ds, ckpt, path)
                        if got is None:
                            self.complete = False
                            return col, crashed
                        col, reader = got
                        producers += 1
                        prod = self.producer(col, producers)
                        continue
                if rep.drained:
                    return col, crashed
            assert col.feeder is not None
            self.problems.append(f"[run] the run did not drain within {max_steps} loop passes "
                                 f"(cursor at task index {col.feeder.cursor.next_index}, "
                                 f"{col.depths()})")
            return col, crashed
        finally:
            reader.close()

    def _queue_crash(self, col: Collector, prod: RowProducer, ds: Dataset, crash: Crash,
                     n: int) -> tuple[Collector, RowProducer]:
        """A new collector on the same run directory (the old one closed or abandoned)."""
        ccfg, qcfg = self.configs()
        if crash.close:
            col.close()
        else:
            col.metrics.close()
        new = Collector.open(str(self.root / "run"), ds, ccfg, queue_config=qcfg, fsync=False)
        if new.resume_info is None or new.resume_info.path != "queue":
            self.problems.append(f"[resume] a new collector on the same run directory took "
                                 f"the {getattr(new.resume_info, 'path', None)!r} path")
        if crash.restart_producer:
            prod.yield_all()
            return new, self.producer(new, n)
        return new, prod

    def _cursor_crash(self, col: Collector, ds: Dataset, ckpt: _Checkpoint, path: str
                      ) -> tuple[Collector, BatchReader] | None:
        """The queue state is lost: resume from the checkpoint's cursor. What was released,
        trained or dropped after the checkpoint is taken out (the trainer went back to it,
        and the rows are released again or skipped afresh)."""
        col.close()
        shutil.rmtree(path)
        for index, tick in list(self.claimed_at.items()):
            if tick > ckpt.tick:
                del self.claimed_at[index]
                del self.claims[index]
        self.trained = [(t, i) for t, i in self.trained if t <= ckpt.tick]
        self.drops = [(t, i, r) for t, i, r in self.drops if t <= ckpt.tick]
        self.segment_drops = Counter()
        self.after_resume = set()
        self.ckpt = ckpt
        ccfg, qcfg = self.configs()
        try:
            new = Collector.open(path, ds, ccfg, queue_config=qcfg, checkpoint=ckpt.state,
                                 fsync=False)
        except Exception as exc:
            self.problems.append(f"[resume] Collector.open from the checkpoint (cursor at task "
                                 f"index {ckpt.state['feeder']['next_index']}) raised "
                                 f"{type(exc).__name__}: {exc}")
            return None
        if new.resume_info is None or new.resume_info.path != "cursor":
            self.problems.append(f"[resume] the resume took the "
                                 f"{getattr(new.resume_info, 'path', None)!r} path, not cursor")
        reader = BatchReader(new.queue, checkpointed=False)
        reader.load_state_dict(ckpt.state)
        return new, reader

    def observed(self, col: Collector) -> Observed:
        skipped = skipped_ids(col)
        totals = drop_totals(col.storage)
        obs = Observed(released=dict(self.claims), trained=[i for _, i in self.trained],
                       skipped=skipped, cursor=read_cursor_state(col.storage),
                       bad_dropped=totals.get("bad_row", 0))
        for _t, i, r in self.drops:
            obs.dropped.setdefault(i, []).append(r)
        if self.ckpt is not None and self.after_resume is not None:
            t = self.ckpt.tick
            obs.skipped |= self.ckpt.skipped
            obs.resume = Resume(at=int(self.ckpt.state["feeder"]["next_index"]),
                                trained=frozenset(i for tt, i in self.trained if tt <= t),
                                dropped=frozenset(i for tt, i, _ in self.drops if tt <= t),
                                skipped=frozenset(self.ckpt.skipped),
                                released_after=frozenset(self.after_resume))
        audit = {k: v for k, v in totals.items() if k != "bad_row"}
        if audit != dict(self.segment_drops):
            self.problems.append(f"[drops] the drop audit counts {audit}, the run saw "
                                 f"{dict(self.segment_drops)}")
        return obs


def skipped_ids(col: Collector) -> set[int]:
    """Task indexes the history records as skipped."""
    out = set()
    for tid, st in load_history(col.storage).prompts.items():
        if st.skipped:
            index = st.index if isinstance(st.index, int) else TASK_IDS.parse(tid)
            if index is not None:
                out.add(index)
    return out


def run_scenario(scn: Scenario, root: Path, *, max_steps: int | None = None) -> RunResult:
    """Run ``scn`` in ``root`` (a fresh directory) and check it against the model."""
    t0 = time.perf_counter()
    model = scn.model()
    run = _Run(scn, root, model)
    steps = max_steps if max_steps is not None else 40 * model.end + 400
    with fast_history():
        ds = write_sources(scn, root)
        try:
            col, crashed = run.run(ds, steps)
        except Exception as exc:
            return RunResult(scn, [*run.problems, f"[run] the run raised "
                                   f"{type(exc).__name__}: {exc}"], len(model.rows),
                             time.perf_counter() - t0, run.tick)
        if not run.complete:
            return RunResult(scn, run.problems, len(model.rows), time.perf_counter() - t0,
                             run.tick, crashed)
        try:
            obs = run.observed(col)
        finally:
            col.close()
    mismatches = [*run.problems, *check_run(model, scn.behaviour(), obs,
                                            exact_skips=scn.lockstep,
                                            require_fields=scn.require_fields)]
    return RunResult(scn, mismatches, len(model.rows), time.perf_counter() - t0, run.tick,
                     crashed)


def anchor_scenario(rows: int) -> Scenario:
    """The plain case: one dataset, one pass, no crash."""
    return Scenario((SourcePlan("a", rows, 1, kinds=(("mixed",),) * rows),), plain=True)


def report(result: RunResult, per_kind: int = 3) -> str:
    """The scenario and its mismatches: the first few of each kind (``[row]``, ...)."""
    lines = [f"scenario: {result.scenario.describe()}",
             f"  ({result.rows} rows, {result.steps} loop passes, crash: {result.crashed}, "
             f"{len(result.mismatches)} mismatches)"]
    kinds: dict[str, list[str]] = {}
    for m in result.mismatches:
        kinds.setdefault(m.split("]", 1)[0] + "]", []).append(m)
    for kind, ms in kinds.items():
        lines += [f"  {m}" for m in ms[:per_kind]]
        if len(ms) > per_kind:
            lines.append(f"  ... and {len(ms) - per_kind} more {kind}")
    return "\n".join(lines)
