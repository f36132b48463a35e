"""The reader's fast path (one read per record, Arrow views, shard-wide packing) gives exactly
the tensors of the plain per-sample definition, for any mix of groups, ranks and threads."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.trainer.packing import RecordFile, ShardPacker
from strawq.collector.trainer.reader import Batch, BatchReader
from strawq.data.dataset import Dataset
from strawq.ondisk.groups import GroupData
from strawq.tasks.queue import RunQueue
from tests.collector.helpers import make_run, write_dataset


def _publish(q: RunQueue, ds: str, n: int, rng: np.random.Generator, *,
             max_len: int, multi_version: bool) -> Collector:
    """Complete ``n`` groups with random contents and publish one batch of all of them."""
    col = Collector(q, Dataset(ds), CollectorConfig(batch_groups=n, max_running=n, max_ready=n,
                                                    poll_interval_s=0, gc_interval_s=1e9))
    col.start(wait=False)
    col.step()
    done = 0
    while done < n:
        for lease in q.claim("p", n):
            g = int(rng.integers(1, 5))
            lens = rng.integers(0, max_len + 1, g)
            total = int(lens.sum())
            if multi_version and rng.random() < 0.5:
                vers = rng.integers(0, 4, total).astype(np.int64)
            else:
                vers = np.full(total, int(rng.integers(0, 4)), np.int64)
            grp = GroupData(task_id=lease.task_id, index=int(lease.task["index"]),
                            prompt_ids=np.asarray(lease.task["row"]["prompt"], np.int32),
                            sample_lens=lens.tolist(),
                            tokens=rng.integers(0, 1 << 30, total, dtype=np.int32),
                            logprobs=-rng.random(total, dtype=np.float32),
                            versions=vers, loss_mask=rng.integers(0, 2, total, dtype=np.uint8),
                            rewards=rng.random(g).tolist(), status=["completed"] * g,
                            meta={"version_hint": 7})
            q.complete(lease, grp)
            done += 1
    col.step()
    return col


def _reference(q: RunQueue, batch: Batch) -> dict[str, np.ndarray]:
    """The packed layout by definition, sample by sample, from ``GroupData``."""
    out: dict[str, list[np.ndarray]] = {k: [] for k in (
        "tokens", "loss_mask", "rollout_logprobs", "versions", "min_version", "multi")}
    for summ, name in zip(batch.summaries, batch.groups, strict=True):
        g = q.read_group(name.id, name.gen)
        p = g.prompt_ids.shape[0]
        for i in range(g.num_samples):
            s = g.sample(i)
            out["tokens"] += [g.prompt_ids, s["tokens"]]
            out["loss_mask"] += [np.zeros(p, np.uint8), s["loss_mask"]]
            out["rollout_logprobs"] += [np.zeros(p, np.float32), s["logprobs"]]
            out["versions"] += [np.full(p, -1, np.int64), s["versions"]]
            v = s["versions"]
            out["min_version"].append(np.array(
                [v.min() if v.size else int(summ.get("min_version", 0))], np.int64))
            out["multi"].append(np.array([v.size > 0 and v.min() != v.max()]))
    return {k: np.concatenate(v) if v else np.empty(0) for k, v in out.items()}


def _check(q: RunQueue, batch: Batch) -> None:
    ref = _reference(q, batch)
    for k in ("tokens", "loss_mask", "rollout_logprobs", "versions"):
        got = getattr(batch, k)
        assert got.dtype == {"tokens": torch.int32, "loss_mask": torch.uint8,
                             "rollout_logprobs": torch.float32, "versions": torch.int64}[k]
        assert np.array_equal(got.numpy(), ref[k].astype(got.numpy().dtype)), k
    assert np.array_equal(batch.sample_min_version.numpy(), ref["min_version"])
    assert batch.stats["staleness/multi_version_frac"] == pytest.approx(
        float(ref["multi"].mean()) if ref["multi"].size else 0.0)
    cu = batch.cu_seqlens.numpy()
    assert cu[-1] == batch.num_tokens and np.all(np.diff(cu) >= 0)
    assert np.array_equal(np.diff(cu), batch.prompt_lens.numpy() + batch.response_lens.numpy())
    assert batch.prompt_lens.dtype == torch.int32 and batch.response_lens.dtype == torch.int32


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), n=st.integers(1, 12), world=st.integers(1, 3),
       threads=st.integers(1, 3), max_len=st.sampled_from([0, 3, 40]),
       multi=st.booleans(), corrupt=st.booleans())
def test_fast_reader_matches_the_definition(tmp_path_factory, seed, n, world, threads, max_len,
                                            multi, corrupt):
    tmp = tmp_path_factory.mktemp("run")
    rng = np.random.default_rng(seed)
    q = make_run(str(tmp / "run"), group_size=4, release_batch=max(n, 1))
    ds = write_dataset(str(tmp / "ds.jsonl"), n, seed=seed)
    col = _publish(q, ds, n, rng, max_len=max_len, multi_version=multi)
    man = col.batches.read_manifest(1)
    victim = None
    if corrupt:
        victim = man.groups[int(rng.integers(0, n))]
        path = q.storage.local_path(f"data/{victim.id}~g{victim.gen}.group")
        with open(path, "r+b") as f:
            f.seek(-2, os.SEEK_END)
            f.write(b"\x5a\xa5")
    ids = []
    for rank in range(world):
        reader = BatchReader(q, rank=rank, world_size=world, read_threads=threads)
        batch = reader.load(man)
        reader.close()
        _check(q, batch)
        ids += [g.id for g in batch.groups] + batch.skipped
        if victim is not None and victim.id in batch.skipped:
            assert victim.id not in [g.id for g in batch.groups]
    assert sorted(ids) == sorted(g.id for g in man.groups)


def test_record_file_reads_whole_records_and_grows(tmp_path):
    from strawq.storage import open_storage

    st_ = open_storage(str(tmp_path), writer_id="w", fsync=False)
    rf = RecordFile(capacity=16)
    os.makedirs(os.path.join(str(tmp_path), "data"), exist_ok=True)
    for size in (10, 1000, 5, 300_000):
        data = os.urandom(size)
        with open(os.path.join(str(tmp_path), f"data/x{size}"), "wb") as f:
            f.write(data)
        view = rf.read(st_, f"data/x{size}")
        assert bytes(view) == data
        assert np.frombuffer(view, np.uint8).ctypes.data % 64 == 0
    from strawq.errors import CorruptRecord, NotFound

    with pytest.raises(NotFound):
        rf.read(st_, "data/absent")
    open(os.path.join(str(tmp_path), "data/empty"), "wb").close()
    with pytest.raises(CorruptRecord, match="empty"):
        rf.read(st_, "data/empty")


def test_shard_packer_with_no_groups_is_empty():
    pk = ShardPacker([])
    ok = pk.finish()
    assert ok.shape == (0,) and pk.tokens.shape == (0,) and pk.min_version.shape == (0,)
