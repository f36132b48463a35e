"""One rank watches ``batches/``, the others hear it over the process group
(``strawq.collector.trainer.rank_watch``), on real ``torch.distributed`` ranks (gloo, CPU,
processes forked from the test).

The ranks get the batches — numbers and shards — that per-rank polling gives them; while
they wait, only the group's rank 0 calls the storage or stats ``batches/``; what ends the
watcher's wait (here ``BatchTimeout``) ends every rank's, with the same exception.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.data.dataset import Dataset
from strawq.storage import PosixStorage
from tests.collector.helpers import SimProducer, drive, make_run, write_dataset


WORLD = 3
BATCHES = 2


class CountingStorage(PosixStorage):
    """A ``PosixStorage`` that counts every call a reader makes, by method and directory."""

    def __init__(self, root: str, **kwargs: Any) -> None:
        super().__init__(root, **kwargs)
        self.calls: Counter[str] = Counter()

    def _count(self, method: str, key: str) -> None:
        self.calls[f"{method} {key.split('/')[0]}"] += 1


for _name in ("list", "read", "read_prefix", "exists", "is_dir", "size", "publish", "rename",
              "delete"):
    def _counted(self: CountingStorage, key: str, *args: Any, _m: str = _name,
                 **kwargs: Any) -> Any:
        self._count(_m, key)
        return getattr(PosixStorage, _m)(self, key, *args, **kwargs)
    setattr(CountingStorage, _name, _counted)


@pytest.fixture
def runs(tmp_path: Path) -> tuple[str, str]:
    """Two copies of one run holding ``BATCHES`` batches: one read as it is, the other with
    its last manifest held back (published once the ranks are waiting)."""
    run = str(tmp_path / "run")
    q = make_run(run)
    ds = Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 8 * BATCHES))
    col = Collector(q, ds, CollectorConfig(batch_groups=8, max_running=16, max_ready=16,
                                           max_prefetch_batches=2, poll_interval_s=0,
                                           gc_interval_s=0))
    col.start(wait=False)
    prods = [SimProducer(q, "p0", seed=1), SimProducer(q, "p1", seed=2)]
    for _ in range(200):
        drive(col, prods, 1)
        if len(col.batches.batch_seqs()[0]) >= BATCHES:
            break
    assert len(col.batches.batch_seqs()[0]) == BATCHES
    col.close()
    other = str(tmp_path / "run2")
    shutil.copytree(run, other, symlinks=True)
    return run, other


def _rank_main(rank: int, run_dir: str, watch: bool, init: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from strawq.collector.errors import BatchTimeout
    from strawq.collector.trainer.reader import BatchReader
    from strawq.tasks.queue import RunQueue

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        storage = CountingStorage(run_dir, writer_id=f"r{rank}", fsync=False)
        reader = BatchReader(RunQueue.open(storage), rank=rank, world_size=WORLD,
                             checkpointed=False, poll_interval_s=0.01,
                             sleep=lambda s: time.sleep(s),  # a fixed poll, no inotify
                             process_group=dist.group.WORLD if watch else None,
                             one_rank_watches=None if watch else False)
        got = []
        for _ in range(BATCHES):
            b = reader.next_batch(timeout=120)
            got.append([b.seq, b.num_samples, b.num_tokens,
                        [str(g) for g in b.groups]])
            dist.barrier()  # the training step: every rank has its shard before the ack
            reader.ack(b)
        dist.barrier()
        storage.calls.clear()
        probe = reader.waiter.probe
        assert probe is not None
        stats = [0]
        changed = probe.changed

        def counted() -> bool:
            stats[0] += 1
            return changed()
        probe.changed = counted  # type: ignore[method-assign]
        if reader.rank_watch is not None:
            reader.rank_watch.beat_s = 0.2  # several "nothing yet" broadcasts in the wait
        try:
            reader.next_batch(timeout=1.0)
            ended = "returned"
        except BatchTimeout as exc:
            ended = f"BatchTimeout: {str(exc)[:40]}"
        with open(os.path.join(out, f"{rank}.json"), "w", encoding="utf-8") as f:
            json.dump({"batches": got, "ended": ended, "calls": dict(storage.calls),
                       "stats": stats[0],
                       "events": reader.rank_watch.events if reader.rank_watch else 0}, f)
        reader.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _ranks(run_dir: str, watch: bool, tmp: Path, *, late: str | None = None
           ) -> list[dict[str, Any]]:
    """Run ``WORLD`` ranks over ``run_dir``; ``late``: a held-back manifest published while
    they run."""
    import torch.multiprocessing as mp

    out = tmp / ("watch" if watch else "per-rank")
    out.mkdir()
    init = f"file://{out / 'rendezvous'}"
    ctx = mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
        _rank_main, args=(run_dir, watch, init, str(out)), nprocs=WORLD, join=False,
        start_method="fork")
    if late is not None:
        time.sleep(0.5)  # not a timed assertion: the ranks get it whenever it comes
        os.rename(late + ".held", late)
    while not ctx.join():
        pass
    return [json.loads((out / f"{r}.json").read_text()) for r in range(WORLD)]


def _held_back(run_dir: str) -> str:
    st = PosixStorage(run_dir, fsync=False)
    last = sorted(st.list("batches"))[-1]
    path = os.path.join(run_dir, "batches", last)
    os.rename(path, path + ".held")
    return path


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ranks_hear_the_batches_per_rank_polling_gives_and_only_rank_0_waits_on_storage(
        runs: tuple[str, str], tmp_path: Path) -> None:
    plain, watched = runs
    polling = _ranks(plain, False, tmp_path)
    hearing = _ranks(watched, True, tmp_path, late=_held_back(watched))
    # the same batches, numbers and shards, rank by rank
    assert [r["batches"] for r in hearing] == [r["batches"] for r in polling]
    assert [b[0] for b in hearing[0]["batches"]] == list(range(1, BATCHES + 1))
    assert len({json.dumps(r["batches"][0][3]) for r in hearing}) == WORLD  # own shards
    # the wait ends the same way on every rank
    assert all(r["ended"].startswith("BatchTimeout") for r in polling + hearing)
    assert len({r["ended"] for r in hearing}) == 1
    # per-rank polling: every rank lists batches/ and stats it while it waits
    for r in polling:
        assert r["calls"].get("list batches", 0) >= 1 and r["stats"] >= 1, r
    # one watcher: rank 0 alone touches the storage while waiting; the others only hear
    assert hearing[0]["calls"].get("list batches", 0) >= 1 and hearing[0]["stats"] >= 1
    for r in hearing[1:]:
        assert r["calls"] == {} and r["stats"] == 0, r
        assert r["events"] >= 2 + BATCHES  # the batches, "nothing yet" beats, the timeout


def test_one_rank_watching_needs_a_group_and_torch_distributed_set_up(tmp_path: Path) -> None:
    """Asking for one watcher without a group, or giving a group before
    ``init_process_group``, is refused with what to do."""
    from strawq.collector.trainer.reader import BatchReader

    q = make_run(str(tmp_path / "run"))
    with pytest.raises(ValueError, match="needs the trainer's process group"):
        BatchReader(q, one_rank_watches=True)
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        BatchReader(q, process_group=object())


def test_the_watchers_exception_is_raised_alike_on_the_other_ranks() -> None:
    """strawq's own exceptions cross as their class and message; another kind, or one that
    cannot be rebuilt from its message, as ``WatcherFailed`` naming it."""
    from strawq.collector.trainer.rank_watch import WatcherFailed, _portable, _rebuild
    from strawq.errors import BracketTimeout, FencedOut, RunFinished

    for exc in (RunFinished("the run has finished"), FencedOut("taken over by epoch 3")):
        got = _rebuild(_portable(exc), str(exc))
        assert type(got) is type(exc) and str(got) == str(exc)
    for exc in (KeyError("x"), BracketTimeout("late", {"p0": 1.0})):
        got = _rebuild(_portable(exc), str(exc))
        assert isinstance(got, WatcherFailed)
        assert type(exc).__qualname__ in str(got)
