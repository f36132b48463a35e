"""One rank-0 trainer per run: a second is refused while the first lives, takes over once it
is dead, and the fenced first's acks, commits and bracket calls are refused naming the
holder (docs/design.md, invariant 8; ``strawq.collector.trainer.fence``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.trainer.fence import TrainerBusy, TrainerFence, read_trainer_holder
from strawq.collector.trainer.reader import BatchReader
from strawq.data.dataset import Dataset
from strawq.delivery.batches import BatchStore, delivered
from strawq.delivery.commits import committed_seq
from strawq.errors import FencedOut
from strawq.tasks.queue import RunQueue
from tests.collector.helpers import FakeClock, SimProducer, drive, make_run, write_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


def _run_with_batches(tmp_path: Any, n: int = 2) -> RunQueue:
    q = make_run(str(tmp_path / "run"))
    ds = Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 4 * n))
    col = Collector(q, ds, CollectorConfig(batch_groups=4, max_running=4 * n, max_ready=4 * n,
                                           max_prefetch_batches=n, poll_interval_s=0,
                                           gc_interval_s=0))
    col.start(wait=False)
    prods = [SimProducer(q, "p0", seed=1), SimProducer(q, "p1", seed=2)]
    for _ in range(200):
        drive(col, prods, 1)
        if len(col.batches.batch_seqs()[0]) >= n:
            break
    assert len(col.batches.batch_seqs()[0]) >= n
    col.fence.close()
    return q


def _reader(q: RunQueue, fence: TrainerFence) -> BatchReader:
    return BatchReader(q, watch=None, sleep=lambda _s: None, fence=fence)


@pytest.mark.timeout(60)
def test_a_second_trainer_is_refused_while_the_first_beats(tmp_path: Any) -> None:
    q = _run_with_batches(tmp_path)
    first_fence = TrainerFence(q.storage, beat_interval_s=None)
    first = _reader(q, first_fence)
    got = first.next_batch(timeout=1)
    clock = FakeClock(hook=first_fence.beat)  # the first lives: it beats while watched
    second = _reader(q, TrainerFence(q.storage, takeover_timeout_s=30, beat_interval_s=None,
                                     clock=clock, sleep=clock.sleep))
    with pytest.raises(TrainerBusy) as err:
        second.next_batch(timeout=1)
    msg = str(err.value)
    assert f"pid {os.getpid()}" in msg and socket.gethostname() in msg
    assert "trainer epoch 1" in msg and "heartbeat moved" in msg
    holder = read_trainer_holder(q.storage)
    assert holder is not None and (holder.epoch, holder.pid) == (1, os.getpid())
    first.ack(got)  # the holder goes on
    assert got.seq in BatchStore(q).batch_seqs()[1]
    assert set(delivered(q.storage)) == {got.seq}  # the second was given nothing


@pytest.mark.timeout(60)
def test_takeover_after_silence_fences_the_first(tmp_path: Any) -> None:
    q = _run_with_batches(tmp_path)
    first_fence = TrainerFence(q.storage, beat_interval_s=None)
    first = _reader(q, first_fence)
    b1 = first.next_batch(timeout=1)
    first.ack(b1)
    first.commit(first.state_dict())
    b2 = first.next_batch(timeout=1)  # the first stalls here (a frozen job)
    clock = FakeClock()  # silent: nothing beats while the second watches
    second_fence = TrainerFence(q.storage, takeover_timeout_s=30, beat_interval_s=None,
                                clock=clock, sleep=clock.sleep)
    second = _reader(q, second_fence)
    got = second.next_batch(timeout=1)
    assert second_fence.epoch == 2 and clock.t - 1000.0 >= 30
    assert got.seq == b2.seq  # after the committed batch: nothing committed is trained twice
    for refused in (lambda: first.ack(b2), lambda: first.commit(first.state_dict()),
                    lambda: first.begin_weight_update(timeout=1),
                    lambda: first.end_weight_update(), lambda: first.next_batch(timeout=1)):
        with pytest.raises(FencedOut) as err:
            refused()
        assert "trainer epoch 2" in str(err.value) and f"pid {os.getpid()}" in str(err.value)
    assert not q.storage.exists("control/pause-000000000001")
    second.ack(got)
    assert second.commit(second.state_dict()) == got.seq == committed_seq(q.storage)


@pytest.mark.timeout(60)
def test_a_released_trainer_is_succeeded_at_once(tmp_path: Any) -> None:
    q = _run_with_batches(tmp_path)
    fence = TrainerFence(q.storage, beat_interval_s=None)
    _reader(q, fence).next_batch(timeout=1)
    fence.release()
    clock = FakeClock()
    nxt = TrainerFence(q.storage, beat_interval_s=None, clock=clock, sleep=clock.sleep)
    assert nxt.acquire() == 2 and clock.t == 1000.0  # no wait
    with pytest.raises(FencedOut):
        fence.check()


@pytest.mark.process
@pytest.mark.timeout(120)
def test_two_trainer_processes_on_one_run(tmp_path: Any) -> None:
    """The requeued job: a second trainer process is refused while the first runs (it never
    gets a batch), and takes over at once once the first is killed, after its commit."""
    q = _run_with_batches(tmp_path)
    run = str(tmp_path / "run")
    child = textwrap.dedent("""
        import sys, time
        from strawq.collector.trainer.reader import BatchReader
        r = BatchReader.open(sys.argv[1])
        b = r.next_batch(timeout=30)
        r.ack(b)
        r.commit(r.state_dict())
        print(b.seq, flush=True)
        time.sleep(600)
    """)
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, "-c", child, run], stdout=subprocess.PIPE,
                            env=env, text=True)
    try:
        assert proc.stdout is not None
        trained = int(proc.stdout.readline())
        reader = BatchReader.open(run, watch=None)
        with pytest.raises(TrainerBusy) as err:
            reader.next_batch(timeout=5)  # the child beats every few seconds
        assert f"pid {proc.pid}" in str(err.value)
        assert set(delivered(q.storage)) == {trained}  # the refused one was given nothing
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        got = reader.next_batch(timeout=5)  # known dead on this host: no wait
        assert got.seq == trained + 1
        reader.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(60)
def test_other_ranks_take_no_epoch_and_are_never_refused(tmp_path: Any) -> None:
    q = _run_with_batches(tmp_path)
    holder = TrainerFence(q.storage, beat_interval_s=None)
    _reader(q, holder).next_batch(timeout=1)
    other = BatchReader(q, rank=1, world_size=2, watch=None, sleep=lambda _s: None)
    got = other.next_batch(timeout=1)
    other.ack(got)
    other.close()
    assert other.fence_use.taken is None and holder.epoch == 1
    assert [h.epoch for h in [read_trainer_holder(q.storage)] if h] == [1]


@pytest.mark.timeout(60)
def test_a_reader_dropped_without_close_is_succeeded_at_once_in_its_process(
        tmp_path: Any) -> None:
    """A restart inside one process (a notebook, a trainer that rebuilds its reader after an
    error) that dropped the old reader without ``close()``: the epoch names this process and
    no live fence here holds it, so the new reader takes over without watching a heartbeat
    that can never move (it waited the whole takeover timeout before)."""
    import gc

    q = _run_with_batches(tmp_path)
    first = BatchReader(q, watch=None, sleep=lambda _s: None)  # the process's shared fence
    first.next_batch(timeout=1)
    del first
    gc.collect()
    clock = FakeClock()
    nxt = TrainerFence(q.storage, beat_interval_s=None, clock=clock, sleep=clock.sleep)
    assert nxt.acquire() == 2 and clock.t == 1000.0  # no wait
    # a fence of this process that is still alive is still watched: a second one is refused
    watch = FakeClock(hook=nxt.beat)
    live = TrainerFence(q.storage, beat_interval_s=None, clock=watch, sleep=watch.sleep)
    with pytest.raises(TrainerBusy, match="heartbeat moved"):
        live.acquire()
