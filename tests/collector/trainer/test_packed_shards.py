"""Rank shards packed by the collector (``CollectorConfig.pack_ranks``, ``strawq.delivery.packed``):
a rank's ``load`` from its shard equals the load from the records tensor by tensor; every
shard that does not fit (world size, corrupt, torn, missing) falls back to the records;
shards leave with their batch, and a crash's orphans are swept."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from strawq.collector.config import CollectorConfig
from strawq.collector.trainer.packing import pack_batch
from strawq.collector.trainer.reader import Batch, BatchReader
from strawq.delivery import packed
from strawq.delivery.batches import BatchStore, Manifest
from strawq.delivery.commits import commit
from strawq.errors import ConfigError
from strawq.ondisk.extras import ROUTED_EXPERTS, TEACHER_LOGPROBS, TOP_P_TOKEN_IDS
from strawq.tasks.queue import RunQueue
from tests.collector.packed_run import packed_run as _run

REPO = Path(__file__).resolve().parents[3]
#: the Batch fields that are tensors (extras compared separately)
TENSORS = [f.name for f in dataclasses.fields(Batch)
           if f.type in ("torch.Tensor", "torch.Tensor | None")]


def _records(man: Manifest) -> Manifest:
    """The same manifest without its packed shards: the reader reads the records."""
    return dataclasses.replace(man, meta={k: v for k, v in man.meta.items() if k != "packed"})


def _load(q: RunQueue, man: Manifest, rank: int, world: int) -> Batch:
    reader = BatchReader(q, rank=rank, world_size=world, checkpointed=False, watch=None,
                         sleep=lambda _s: None)
    try:
        return reader.load(man)
    finally:
        reader.close()


def _assert_same(a: Batch, b: Batch) -> None:
    for name in TENSORS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape, (name, x.dtype, y.dtype)
            assert torch.equal(x, y), name
    assert a.extras.keys() == b.extras.keys()
    for name, x in a.extras.items():
        assert x.dtype == b.extras[name].dtype and torch.equal(x, b.extras[name]), name
    for name in ("seq", "rank", "world_size", "version", "groups", "summaries",
                 "total_groups", "skipped", "stats", "total_samples", "total_loss_tokens"):
        assert getattr(a, name) == getattr(b, name), name


@pytest.mark.parametrize("max_len", [12, 300], ids=["short", "long"])
def test_each_ranks_shard_equals_its_load_from_the_records(tmp_path, max_len):
    """World sizes 1 to 4 read from the shards of one run each; resumed samples span two
    versions, some groups carry extras (a prompt extra, a response extra, a ragged one)."""
    for world in (1, 2, 3, 4):
        q, _ = _run(tmp_path / f"w{world}", groups=7, max_len=max_len, pack_ranks=world,
                    seed=world)
        man = BatchStore(q).read_manifest(1)
        assert man.meta["packed"]["ranks"] == list(range(world))
        assert any(n.resume >= 0 for n in man.groups)
        seen = 0
        for rank in range(world):
            got = _load(q, man, rank, world)
            want = _load(q, _records(man), rank, world)
            assert got.packed and not want.packed
            _assert_same(got, want)
            seen += len(got.groups)
            if got.extras:
                assert {ROUTED_EXPERTS, TEACHER_LOGPROBS, TOP_P_TOKEN_IDS} <= got.extras.keys()
        assert seen == 7
        assert torch.equal(got.versions.unique(), torch.tensor([-1, 0, 1])) or world > 1


def test_the_shards_tensors_are_views_of_one_read(tmp_path):
    q, _ = _run(tmp_path, groups=4, max_len=40, pack_ranks=1)
    man = BatchStore(q).read_manifest(1)
    b = _load(q, man, 0, 1)
    key = packed.shard_key(1, man.meta["packed"]["tag"], 1, 0)
    assert b.packed and b.bytes_read == q.storage.size(key)
    lo = b.tokens.data_ptr()
    for name in ("versions", "loss_mask", "cu_seqlens", "sample_index", "top_k"):
        t = getattr(b, name)
        off = t.data_ptr() - lo  # inside the one buffer the shard was read into
        assert 0 < off and off + t.numel() * t.element_size() <= b.bytes_read, name
    assert b.tokens.data_ptr() % 64 == 0


def test_another_world_size_reads_the_records_and_says_so_once(tmp_path, caplog):
    q, _ = _run(tmp_path, groups=6, max_len=20, pack_ranks=2)
    man = BatchStore(q).read_manifest(1)
    reader = BatchReader(q, rank=1, world_size=3, checkpointed=False, watch=None,
                         sleep=lambda _s: None)
    with caplog.at_level(logging.WARNING, logger="strawq.collector.trainer.reader"):
        got = [reader.load(man), reader.load(man)]
    reader.close()
    want = _load(q, _records(man), 1, 3)
    for b in got:
        assert not b.packed
        _assert_same(b, want)
    warned = [r for r in caplog.records if "packed shards for 2 ranks" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("damage", ["flip", "torn", "missing", "other_batch"])
def test_a_damaged_shard_falls_back_and_still_equals(tmp_path, caplog, damage):
    q, _ = _run(tmp_path, groups=6, max_len=30, pack_ranks=2)
    man = BatchStore(q).read_manifest(1)
    tag = man.meta["packed"]["tag"]
    path = q.storage.local_path(packed.shard_key(1, tag, 2, 0))
    assert path is not None
    data = bytearray(Path(path).read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
        Path(path).write_bytes(bytes(data))
    elif damage == "torn":
        Path(path).write_bytes(bytes(data[:len(data) - 100]))
    elif damage == "missing":
        os.unlink(path)
    else:  # a well-formed shard of another batch under this one's name
        other = packed.encode_shard({"seq": 2, "tag": tag, "world_size": 2, "rank": 0},
                                    {"tokens": np.zeros(3, np.int32)})
        Path(path).write_bytes(b"".join(other))
    with caplog.at_level(logging.WARNING, logger="strawq.collector.trainer.reader"):
        got = _load(q, man, 0, 2)
    assert not got.packed
    _assert_same(got, _load(q, _records(man), 0, 2))
    assert any("reading the group records instead" in r.getMessage() for r in caplog.records)
    assert _load(q, man, 1, 2).packed  # the other rank's shard is intact


def test_a_rank_with_an_unreadable_group_gets_no_shard_and_drops_it_from_the_records(
        tmp_path):
    q, col = _run(tmp_path, groups=6, max_len=20, pack_ranks=None)
    man = BatchStore(q).read_manifest(1)
    bad = man.groups[0]
    path = q.storage.local_path(f"data/{bad.id}~g{bad.gen}.group")
    assert path is not None
    data = bytearray(Path(path).read_bytes())
    data[-5] ^= 0xFF
    Path(path).write_bytes(bytes(data))
    rep = pack_batch(q.storage, 1, man.groups, man.summaries, 2)
    assert len(rep.meta["ranks"]) == 1  # the rank holding the bad group: none
    assert rep.bytes_written > 0 and rep.bytes_read > 0
    with_shards = dataclasses.replace(man, meta={**man.meta, "packed": rep.meta})
    got = [_load(q, with_shards, r, 2) for r in range(2)]
    assert [b.packed for b in got] == [r in rep.meta["ranks"] for r in range(2)]
    (hit,) = [b for b in got if not b.packed]
    assert hit.skipped == [bad.id]  # dropped with its reason by the reader, as before
    assert any(n.endswith("corrupt_group") and bad.id in n for n in q.storage.list("dropped"))


def test_gc_deletes_the_shards_with_their_batch(tmp_path):
    q, col = _run(tmp_path, groups=4, max_len=10, pack_ranks=3)
    assert len(q.storage.list(packed.PACKED_DIR)) == 3
    BatchStore(q).ack(1)
    commit(q.storage, 1)
    rep = BatchStore(q).gc()
    assert rep.batches == 1
    assert q.storage.list(packed.PACKED_DIR) == []


def test_the_shards_of_a_crash_before_the_manifest_are_swept_and_never_read(tmp_path):
    """A collector that wrote batch 1's shards and died before its manifest: the next one
    publishes batch 1 with other shards (a new tag), its readers read those, and the
    orphans go at the next sweep."""
    q, col = _run(tmp_path, groups=4, max_len=10, pack_ranks=None)
    man = BatchStore(q).read_manifest(1)
    st = q.storage
    # the state a crash right before publishing batch 2 leaves: its shards, no manifest
    orphan = pack_batch(st, 2, man.groups, man.summaries, 2)
    assert len(st.list(packed.PACKED_DIR)) == 2
    assert not st.exists("batches/000000000002")
    rep = BatchStore(q).gc(sweep=True)
    assert rep.shards == 2 and st.list(packed.PACKED_DIR) == []
    # a shard set for a live manifest stays
    live = pack_batch(st, 1, man.groups, man.summaries, 2)
    assert live.meta["tag"] != orphan.meta["tag"]
    assert BatchStore(q).gc(sweep=True).shards == 0
    assert len(st.list(packed.PACKED_DIR)) == 2


def test_pack_ranks_is_validated():
    with pytest.raises(ConfigError, match="pack_ranks"):
        CollectorConfig(pack_ranks=0)
    assert CollectorConfig().pack_ranks is None


def test_the_reference_gradient_from_the_shards(tmp_path):
    """Invariant 11 on the packed path: the ranks' gradients from their shards, averaged,
    are the single-process reference's."""
    from strawq.testing.reference import (
        Objective,
        TinyPolicy,
        gradients,
        make_reference_run,
        max_relative_error,
        reader_loss,
        reference_gradients,
    )

    run_dir, seq = make_reference_run(str(tmp_path), groups=5, group_size=2, seed=4,
                                      max_response=16, pack_ranks=3)
    from strawq.storage import open_storage

    q = RunQueue.open(open_storage(run_dir, writer_id="test"))
    man = BatchStore(q).read_manifest(seq)
    obj = Objective(aggregation="seq_mean_token_mean")
    _, ref = reference_gradients(run_dir, seq, TinyPolicy(), objective=obj)
    total: dict[str, torch.Tensor] = {}
    for r in range(3):
        b = _load(q, man, r, 3)
        assert b.packed
        model = TinyPolicy()
        reader_loss(model, b, obj).backward()
        for k, g in gradients(model).items():
            total[k] = total.get(k, torch.zeros_like(g)) + g / 3
    assert max_relative_error(total, ref) <= 1e-5


@pytest.mark.process
def test_the_collector_packs_without_torch(tmp_path):
    """The collector process never imports torch, packing shards included."""
    code = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
from tests.collector.packed_run import packed_run as _run
from pathlib import Path
q, col = _run(Path({str(tmp_path)!r}), groups=4, max_len=10, pack_ranks=2)
assert len(q.storage.list("packed")) == 2
assert "torch" not in sys.modules, "the collector imported torch"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_store_without_local_paths_reads_its_shard_too(tmp_path):
    """``Storage.read`` instead of one ``preadv``: the same batch."""
    from strawq.storage import MemoryStorage

    q, _ = _run(tmp_path, groups=5, max_len=20, pack_ranks=2)
    mem = MemoryStorage()
    root = tmp_path / "run"
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            rel = (Path(dirpath) / f).relative_to(root).as_posix()
            if not rel.startswith("tmp/"):
                mem.publish(rel, (Path(dirpath) / f).read_bytes())
    mq = RunQueue.open(mem)
    man = BatchStore(mq).read_manifest(1)
    assert mem.local_path("run.meta") is None
    for r in range(2):
        got = _load(mq, man, r, 2)
        assert got.packed
        _assert_same(got, _load(q, _records(man), r, 2))
