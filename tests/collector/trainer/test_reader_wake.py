"""How the reader waits for a batch: woken by the manifest's arrival, else a fixed poll.

The reader used to double its poll interval while it waited (20 ms up to 0.5 s), so a
batch published just after a listing sat unseen while the trainer idled. These tests check
the behaviour, never the timing: the poll never grows, and with inotify the reader returns
on the manifest's arrival although its poll interval is an hour.
"""

from __future__ import annotations

import threading

import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.errors import BatchTimeout
from strawq.collector.trainer.reader import BatchReader
from strawq.data.dataset import Dataset
from strawq.storage.watch import DirWatch, inotify_available
from tests.collector.helpers import FakeClock, SimProducer, drive, make_run, write_dataset


@pytest.fixture
def two_batches(tmp_path):
    q = make_run(str(tmp_path / "run"))
    ds = Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 16))
    col = Collector(q, ds, CollectorConfig(batch_groups=8, max_running=16, max_ready=16,
                                           max_prefetch_batches=2, poll_interval_s=0,
                                           gc_interval_s=0))
    col.start(wait=False)
    prods = [SimProducer(q, "p0", seed=1), SimProducer(q, "p1", seed=2)]
    for _ in range(60):
        drive(col, prods, 1)
        if len(col.batches.batch_seqs()[0]) >= 2:
            break
    assert len(col.batches.batch_seqs()[0]) == 2
    return q


@pytest.mark.timeout(60)
def test_poll_interval_is_fixed_while_waiting(two_batches):
    q = two_batches
    clock = FakeClock()
    slept: list[float] = []

    def sleep(dt: float) -> None:
        slept.append(dt)
        clock.sleep(dt)

    reader = BatchReader(q, clock=clock, sleep=sleep, poll_interval_s=0.02)
    for _ in range(2):
        reader.ack(reader.next_batch(timeout=1))
    with pytest.raises(BatchTimeout):
        reader.next_batch(timeout=2)
    assert len(slept) >= 50
    assert all(dt == pytest.approx(0.02) for dt in slept[:-1])  # no back-off
    assert slept[-1] <= 0.02 + 1e-9


@pytest.mark.skipif(not inotify_available(), reason="no inotify on this OS")
@pytest.mark.timeout(120)
def test_reader_wakes_on_a_new_manifest(two_batches):
    q = two_batches
    st = q.storage
    hidden = "tmp/hidden-manifest-2"
    st.rename("batches/000000000002", hidden)  # batch 2 appears later, from another thread
    reader = BatchReader(q, poll_interval_s=3600.0)
    assert reader.waiter.watch is not None and reader.waiter.watch.event_driven
    reader.ack(reader.next_batch(timeout=5))
    t = threading.Timer(0.1, st.rename, args=(hidden, "batches/000000000002"))
    t.start()
    # Polling alone would sleep an hour before listing again; the manifest's arrival
    # wakes the reader (the test's own timeout guards a regression).
    batch = reader.next_batch(timeout=7200)
    t.join()
    assert batch.seq == 2
    reader.close()


def test_an_injected_sleep_disables_the_watch(two_batches):
    clock = FakeClock()
    reader = BatchReader(two_batches, clock=clock, sleep=clock.sleep)
    assert reader.waiter.watch is None
    w = DirWatch(two_batches.storage, ("batches",), enabled=False)
    assert BatchReader(two_batches, watch=w).waiter.watch is None  # not event-driven: plain poll


@pytest.mark.timeout(60)
def test_a_waiting_rank_lists_batches_only_when_they_changed(two_batches):
    """Where no event comes (another host's manifest on a shared mount), a waiting rank
    stats ``batches/`` at each poll and lists it only when it changed (or once a
    ``LIST_EVERY_S``): a listing every 20 ms cost ~320 metadata operations a second per
    rank on JuiceFS. A manifest that appears mid-wait is still delivered at the next poll."""
    q = two_batches
    st = q.storage
    hidden = "tmp/hidden-manifest-2"
    st.rename("batches/000000000002", hidden)
    clock = FakeClock()
    listings: list[str] = []
    real_list = st.list

    def counting_list(prefix: str, *a, **kw):
        listings.append(prefix)
        return real_list(prefix, *a, **kw)

    st.list = counting_list  # type: ignore[method-assign]
    polls: list[float] = []

    def sleep(dt: float) -> None:
        polls.append(dt)
        clock.sleep(dt)
        if len(polls) == 150:  # 3 s into the wait: batch 2 arrives
            st.rename(hidden, "batches/000000000002")

    reader = BatchReader(q, clock=clock, sleep=sleep, poll_interval_s=0.02)
    assert reader.waiter.watch is None  # the injected sleep: no events, the probe alone
    reader.ack(reader.next_batch(timeout=1))
    listings.clear()
    batch = reader.next_batch(timeout=60)
    assert batch.seq == 2
    assert len(polls) == 150  # it waited 3 s of 20 ms polls and saw the manifest at once
    # 3 s of polls: the first listing, one a second (each twice: a change seen is looked at
    # again), and the one that found the manifest; not one every poll
    assert listings.count("batches") <= 2 + 2 * 4 + 2, listings.count("batches")
    reader.close()
