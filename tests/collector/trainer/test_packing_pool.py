"""The reader's buffer pool: a batch's memory is reused only once nothing references it."""

from __future__ import annotations

import numpy as np
import torch

from strawq.collector.trainer.packing import BufferPool


def test_a_buffer_is_reused_only_when_free():
    pool = BufferPool(keep=2)
    a = pool.take(1000)
    a_id = id(a)
    view = torch.from_numpy(a[64:128].view(np.int32))  # a batch's tensor over it
    del a
    b = pool.take(1000)
    b_id = id(b)
    assert b_id != a_id  # a is held through the tensor
    del b
    c = pool.take(900)
    assert id(c) == b_id  # b is free: reused, no new pages
    del c
    del view
    d = pool.take(900)
    assert id(d) in (a_id, b_id)
    del d
    assert pool.take(10_000).nbytes >= 10_000  # too small: a new one


def test_held_batches_keep_their_values(tmp_path):
    """Two batches alive at once (the trainer holds one while the next is read): the
    second never writes into the first's memory."""
    from strawq.collector.trainer.packing import ShardPacker

    def summary(p: int, lens: list[int]) -> dict[str, object]:
        return {"prompt_len": p, "sample_lens": lens, "advantages": [1.0] * len(lens)}

    pool = BufferPool()
    first = ShardPacker([summary(2, [3, 1])], pool)
    first.add(0, np.array([7, 8], np.int32), {
        "tokens": np.array([1, 2, 3, 4], np.int32),
        "logprobs": np.full(4, -0.5, np.float32), "versions": np.zeros(4, np.int64),
        "loss_mask": np.ones(4, np.uint8)})
    first.finish()
    kept = torch.from_numpy(first.tokens)
    before = kept.clone()
    del first
    second = ShardPacker([summary(2, [3, 1])], pool)
    second.add(0, np.array([9, 9], np.int32), {
        "tokens": np.array([5, 5, 5, 5], np.int32),
        "logprobs": np.zeros(4, np.float32), "versions": np.ones(4, np.int64),
        "loss_mask": np.zeros(4, np.uint8)})
    second.finish()
    assert torch.equal(kept, before)
    assert kept.tolist() == [7, 8, 1, 2, 3, 7, 8, 4]
    assert second.versions.tolist() == [-1, -1, 1, 1, 1, -1, -1, 1]
    assert second.logprobs.tolist() == [0.0] * 8
