"""A rolling upgrade across an on-disk format change, end to end: nothing lost, nothing
duplicated.

``rolling_upgrade(path)`` runs one run with two producers, the collector and a trainer's
reader, all in this process, each inside the simulated release it stands for
(``strawq.testing.formats.release``), in the order docs/operations.md gives:

1. everything on the old release (format 1);
2. the collector and the trainer restarted on the new release (they read format 2, still
   write the run's format 1); ``strawq upgrade`` is refused: the old producers are live;
3. the producers restarted on the new release one by one (each hands back what it holds
   first); while one old producer is live the upgrade is still refused;
4. ``strawq upgrade`` raises the run to format 2; the producers write format 2 from then on;
5. the run drains. An old collector can no longer start on the run.

It returns the counts a chaos line reports: ``lost`` and ``duplicated`` (from
``check_total_queue`` over the trained groups and the run audit's problems), and what the
steps saw. ``bench/chaos_upgrade.py`` prints them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.trainer.reader import BatchReader
from strawq.config import QueueConfig
from strawq.data.dataset import Dataset
from strawq.errors import LeaseLost, NewerFormat
from strawq.ondisk import records
from strawq.ondisk.names import data_key, dataset_task_id
from strawq.storage import Storage, open_storage
from strawq.tasks.formats import UpgradeRefused, live_parts, run_format, upgrade
from strawq.tasks.queue import RunQueue
from strawq.testing.audit import audit_run, check_total_queue
from strawq.testing.factories import make_group, prompts, write_jsonl
from strawq.testing.formats import release


@dataclass
class UpgradeResult:
    """What a rolling upgrade saw."""

    released: int = 0
    trained: int = 0
    lost: int = 0
    duplicated: int = 0
    #: audit problems other than lost and duplicated (torn records, stray entries)
    problems: list[str] = field(default_factory=list)
    #: how often ``upgrade`` was refused while an old part was live (expected: 2)
    refused: int = 0
    #: group records written per schema version
    written: dict[int, int] = field(default_factory=dict)
    #: whether an old collector refused to start on the upgraded run
    old_refused: bool = False
    final_format: int = 0

    def line(self) -> str:
        return (f"rolling upgrade: lost = {self.lost}, duplicated = {self.duplicated} "
                f"({self.trained} of {self.released} trained; group records by schema "
                f"{dict(sorted(self.written.items()))}; upgrade refused {self.refused}x while "
                f"old parts were live; run format {self.final_format})")


class _Producer:
    """A producer that finishes each claimed task at once (no work held between steps)."""

    def __init__(self, path: str, name: str, newest: int) -> None:
        self.newest = newest
        self.name = name
        with release(newest):
            self.queue = RunQueue.open(open_storage(path, writer_id=name, fsync=False))

    def step(self, slots: int = 1) -> None:
        with release(self.newest):
            self.queue.formats.refresh()
            self.queue.heartbeat(self.name)
            for lease in self.queue.claim(self.name, slots):
                g = make_group(lease.task_id, int(lease.task["index"]), lens=(2, 3),
                               version=self.queue.current_version(), marker=1.0)
                try:
                    self.queue.complete(lease, g)
                except LeaseLost:
                    pass

    def stop(self) -> None:
        """Leave the run: its heartbeat goes (what the collector does for a departed one)."""
        for producer, counter, idle in list(self.queue.heartbeat_states()):
            if producer == self.name:
                from strawq.ondisk.names import heartbeat_key

                self.queue.storage.delete(heartbeat_key(producer, counter, idle))


class _Trainer:
    def __init__(self, path: str, newest: int) -> None:
        self.newest = newest
        with release(newest):
            self.reader = BatchReader(RunQueue.open(open_storage(path, writer_id="trainer",
                                                                 fsync=False)))
        self.trained: list[str] = []

    def step(self, collector: Collector) -> None:
        seqs, acked = collector.batches.batch_seqs()
        if all(s in acked for s in seqs):
            return
        with release(self.newest):
            b = self.reader.next_batch(timeout=5)
            self.trained += [str(s["task_id"]) for s in b.summaries]
            self.reader.ack(b)
            self.reader.commit(self.reader.state_dict(consumed=b))  # a restart resumes here


@contextmanager
def _collector(path: str, data: str, newest: int, batch: int) -> Iterator[Collector]:
    with release(newest):
        q = RunQueue.open(open_storage(path, writer_id=f"collector{newest}", fsync=False))
        col = Collector(q, Dataset(data), CollectorConfig(
            batch_groups=batch, max_staleness=None, max_running=4 * batch,
            max_ready=4 * batch, max_prefetch_batches=2, poll_interval_s=0.0,
            gc_interval_s=1000.0))
        col.start(wait=False)
    try:
        yield col
    finally:
        with release(newest):
            col.close()


def _pass(col: Collector, newest: int, producers: list[_Producer], trainer: _Trainer) -> bool:
    for p in producers:
        p.step()
    with release(newest):
        drained = col.step().drained
    trainer.step(col)
    return drained


def _try_upgrade(storage: Storage, target: int, newest: int) -> bool:
    """Whether ``strawq upgrade`` (of release ``newest``) to ``target`` went through."""
    with release(newest):
        try:
            upgrade(storage, target, live_parts(storage))
            return True
        except UpgradeRefused:
            return False


def _written(storage: Storage, ids: list[str]) -> dict[int, int]:
    """Group records per schema version, of the tasks ``ids`` (those still on disk)."""
    out: dict[int, int] = {}
    with release(2):
        for tid in ids:
            for gen in range(4):
                key = data_key(tid, gen, "group")
                if not storage.exists(key):
                    continue
                _k, meta, _n = records.decode_meta_only(storage.read_prefix(key, 4096))
                out[int(meta["v"])] = out.get(int(meta["v"]), 0) + 1
    return out


def rolling_upgrade(path: str, *, n: int = 48, batch: int = 4,
                    across_format: bool = True) -> UpgradeResult:
    """Run the rolling upgrade of the module's docstring in the new directory ``path``.
    The process is the new release throughout (the trainer's reader threads read in it);
    the old parts step inside ``release(1)``. ``across_format=False``: the same restarts
    with no format change (the new release is the old one; a benchmark's anchor)."""
    with release(2 if across_format else 1):
        return _rolling_upgrade(path, n, batch, 2 if across_format else 1)


def _rolling_upgrade(path: str, n: int, batch: int, new: int) -> UpgradeResult:
    os.makedirs(path, exist_ok=True)
    run = os.path.join(path, "run")
    data = write_jsonl(os.path.join(path, "data.jsonl"), prompts(n))
    with release(1):
        q = RunQueue.create(open_storage(run, writer_id="setup", fsync=False),
                            QueueConfig(fsync=False, group_size=2, release_batch=batch,
                                        lease_timeout_s=30.0))
    res = UpgradeResult()
    storage = q.storage
    olds = [_Producer(run, "p0", 1), _Producer(run, "p1", 1)]
    phase = max(2, n // (6 * batch))
    with _collector(run, data, 1, batch) as col:
        trainer = _Trainer(run, 1)
        for _ in range(phase):  # 1. all old
            _pass(col, 1, olds, trainer)
    trained = list(trainer.trained)
    # 2. collector and trainer on the new release
    with _collector(run, data, new, batch) as col:
        trainer = _Trainer(run, new)
        res.refused += not _try_upgrade(storage, 2, new)
        for _ in range(phase):
            _pass(col, new, olds, trainer)
        # 3. producers one by one
        olds[0].stop()
        mixed = [_Producer(run, "p0", new), olds[1]]
        for _ in range(phase):
            _pass(col, new, mixed, trainer)
        res.refused += not _try_upgrade(storage, 2, new)
        olds[1].stop()
        news = [mixed[0], _Producer(run, "p1", new)]
        _pass(col, new, news, trainer)
        # 4. the upgrade
        if new > 1 and not _try_upgrade(storage, 2, new):
            res.problems.append("upgrade refused with every part on the new release")
        for _ in range(20 * n):
            if _pass(col, new, news, trainer):
                break
        else:
            res.problems.append("the run did not drain")
        trained += trainer.trained
    with release(new):
        res.final_format = run_format(storage)
    with release(1):
        try:
            RunQueue.open(open_storage(run, writer_id="old", fsync=False))
        except NewerFormat:
            res.old_refused = True
    released = [dataset_task_id(i) for i in range(n)]
    res.written = _written(storage, released)
    check = check_total_queue(released, trained)
    with release(new):
        problems = audit_run(storage).check(released, trained=set(trained))
    res.released = len(released)
    res.trained = len(set(trained))
    res.lost = len(check.lost | {p.split()[1] for p in problems if p.startswith("lost:")})
    res.duplicated = (sum(v - 1 for v in check.duplicated.values())
                      + sum(p.startswith("duplicated") or " is in batches " in p
                            for p in problems))
    res.problems += [p for p in problems if not p.startswith(("lost", "duplicated"))]
    return res
