"""The trainer-side reader: packed layout, rank shards, checksums, acks and GC, checkpoints."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.errors import BatchTimeout
from strawq.collector.ordering import group_advantages
from strawq.collector.trainer.packing import shard_groups
from strawq.collector.trainer.reader import BatchReader
from strawq.data.dataset import Dataset
from strawq.ondisk.names import TaskName
from tests.collector.helpers import FakeClock, SimProducer, drive, make_run, write_dataset


@pytest.fixture
def world(tmp_path):
    q = make_run(str(tmp_path / "run"))
    ds = Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 16))
    col = Collector(q, ds, CollectorConfig(batch_groups=8, max_running=16, max_ready=16,
                                           max_prefetch_batches=2, poll_interval_s=0,
                                           gc_interval_s=0))
    col.start(wait=False)
    prods = [SimProducer(q, "p0", seed=1, max_new=(0, 9)), SimProducer(q, "p1", seed=2)]
    for _ in range(60):
        drive(col, prods, 1)
        if len(col.batches.batch_seqs()[0]) >= 2:
            break
    assert len(col.batches.batch_seqs()[0]) == 2
    return q, col


@pytest.mark.timeout(60)
def test_packed_layout_matches_group_records(world):
    q, col = world
    reader = BatchReader(q)
    batch = reader.next_batch(timeout=5)
    man = col.batches.read_manifest(batch.seq)
    assert [n.id for n in batch.groups] == [n.id for n in man.groups]
    cu = batch.cu_seqlens.numpy()
    assert cu.dtype == np.int32 and cu[0] == 0 and cu[-1] == batch.num_tokens
    assert batch.tokens.dtype == torch.int32 and batch.versions.dtype == torch.int64
    s = 0
    for gi, name in enumerate(batch.groups):
        g = q.read_group(name.id, name.gen)
        adv = group_advantages(g.rewards)
        for i in range(g.num_samples):
            a, b = int(cu[s]), int(cu[s + 1])
            p = g.prompt_ids.shape[0]
            resp = g.sample(i)
            assert batch.tokens[a:a + p].numpy().tolist() == g.prompt_ids.tolist()
            assert batch.tokens[a + p:b].numpy().tolist() == resp["tokens"].tolist()
            assert batch.loss_mask[a:a + p].sum() == 0
            assert batch.loss_mask[a + p:b].numpy().tolist() == resp["loss_mask"].tolist()
            assert (batch.versions[a:a + p] == -1).all()
            assert batch.versions[a + p:b].numpy().tolist() == resp["versions"].tolist()
            assert np.allclose(batch.rollout_logprobs[a + p:b].numpy(), resp["logprobs"])
            assert np.allclose(batch.advantages[a:b].numpy(), adv[i], atol=1e-6)
            assert int(batch.prompt_lens[s]) == p
            assert int(batch.response_lens[s]) == b - a - p
            assert int(batch.sample_group[s]) == gi
            assert int(batch.sample_index[s]) == g.index
            s += 1
    assert s == batch.num_samples
    # the default bound (eta = 1) adds the read-time re-check's figures
    assert set(batch.stats) == {"staleness/mean", "staleness/max",
                                "staleness/multi_version_frac", "staleness/over_eta_frac",
                                "staleness/read_minus_planned"}


@pytest.mark.timeout(60)
def test_rank_shards_partition_the_batch(world):
    q, col = world
    shards = [BatchReader(q, rank=r, world_size=3).next_batch(timeout=5) for r in range(3)]
    ids = [n.id for b in shards for n in b.groups]
    man = col.batches.read_manifest(shards[0].seq)
    assert sorted(ids) == sorted(n.id for n in man.groups)
    assert len(ids) == len(set(ids))
    assert sum(b.num_tokens for b in shards) == sum(
        s["prompt_len"] * len(s["sample_lens"]) + sum(s["sample_lens"]) for s in man.summaries)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5000), max_size=60), st.integers(1, 9))
def test_shard_groups_is_balanced_and_deterministic(counts, world_size):
    shards = shard_groups(counts, world_size)
    assert shards == shard_groups(counts, world_size)
    flat = sorted(i for s in shards for i in s)
    assert flat == list(range(len(counts)))
    assert all(s == sorted(s) for s in shards)
    loads = [sum(counts[i] for i in s) for s in shards]
    if counts:  # LPT: the heaviest rank exceeds the mean by at most one group
        assert max(loads) <= sum(counts) / world_size + max(counts)


@pytest.mark.timeout(60)
def test_corrupt_group_is_quarantined_and_dropped_not_trained(world, caplog):
    q, col = world
    man = col.batches.read_manifest(1)
    victim = man.groups[0]
    path = q.storage.local_path(f"data/{victim.id}~g{victim.gen}.group")
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xfe\xfd")
    batch = BatchReader(q).next_batch(timeout=5)
    assert batch.skipped == [victim.id]
    assert victim.id not in [n.id for n in batch.groups]
    state, name = q.find(victim.id)
    assert state == "dropped" and name.producer == "corrupt_group"
    assert any("checksum mismatch" in r.getMessage() for r in caplog.records)
    assert q.storage.list("quarantine")


@pytest.mark.timeout(60)
def test_ack_then_commit_then_gc_and_checkpoint_skips(world):
    q, col = world
    reader = BatchReader(q)
    b1 = reader.next_batch(timeout=5)
    b2 = reader.next_batch(timeout=5)
    assert (b1.seq, b2.seq) == (1, 2)
    reader.ack(b1)
    col.step()  # GC: acked is not trained until a checkpoint covering it is committed
    assert all(q.storage.exists(f"data/{n.id}~g{n.gen}.group") for n in b1.groups)
    state = reader.state_dict()
    assert state["batch_seq"] == 1 and state["feeder"]["next_index"] == 16
    # a trainer restarted before that checkpoint was saved starts over after the committed
    # position: batch 1 (acked, not checkpointed) comes again, then 2
    again = BatchReader(q)
    assert [again.next_batch(timeout=5).seq for _ in range(2)] == [1, 2]
    reader.commit(state)  # the checkpoint is durable
    col.step()  # GC
    assert not any(q.storage.exists(f"data/{n.id}~g{n.gen}.group") for n in b1.groups)
    assert all(q.storage.exists(f"data/{n.id}~g{n.gen}.group") for n in b2.groups)
    # one whose checkpoint already covers batch 2 never sees it: it is acked instead
    clock = FakeClock()
    late = BatchReader(q, clock=clock, sleep=clock.sleep)
    late.load_state_dict(reader.state_dict(consumed=b2))
    with pytest.raises(BatchTimeout, match="expected batch > 2"):
        late.next_batch(timeout=1)
    assert 2 in col.batches.batch_seqs()[1]


@pytest.mark.timeout(60)
def test_memory_storage_fallback_reads_without_mmap(tmp_path):
    from strawq.config import QueueConfig
    from strawq.storage import MemoryStorage
    from strawq.tasks.queue import RunQueue

    q = RunQueue.create(MemoryStorage(), QueueConfig(fsync=False, release_batch=4))
    ds = Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 4))
    col = Collector(q, ds, CollectorConfig(batch_groups=4, max_running=4, max_ready=4,
                                           poll_interval_s=0))
    col.start(wait=False)
    drive(col, [SimProducer(q, "p", seed=3)], 20)
    batch = BatchReader(q).next_batch(timeout=1)
    assert len(batch.groups) == 4 and batch.bytes_read > 0
    assert isinstance(batch.groups[0], TaskName)


def test_a_drained_run_says_no_batch_is_coming(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The last pass released and every group trained or dropped: a trainer that asks for
    one more batch is told the run has drained, not to check that the collector runs."""
    run = str(tmp_path / "run")
    q = make_run(run, release_batch=4)
    ds = Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 4))
    cfg = CollectorConfig(batch_groups=2, max_running=4, max_ready=4, max_prefetch_batches=2,
                          max_staleness=None, poll_interval_s=0, gc_interval_s=0,
                          metrics_interval_s=0.0)
    col = Collector(q, ds, cfg)
    col.start()
    reader = BatchReader(q)
    prod = SimProducer(q, "p0", seed=3)
    seen = []
    for _ in range(500):
        prod.step()
        rep = col.step()
        seqs, acked = col.batches.batch_seqs()
        for s in seqs:
            if s not in acked:
                b = reader.next_batch(timeout=5)
                seen.append(b.seq)
                reader.ack(b)
        if rep.drained:
            break
    assert seen == [1, 2]
    clock = FakeClock()
    late = BatchReader(q, clock=clock, sleep=clock.sleep)
    late.load_state_dict(reader.state_dict())
    with pytest.raises(BatchTimeout, match="The run has drained: the dataset's last pass"):
        late.next_batch(timeout=1)
    col.close()
