"""Partial yield and resume: per-token alignment across a round trip."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from strawq.errors import ConfigError
from strawq.storage import Storage
from strawq.testing import make_group
from strawq.testing.factories import make_partial
from tests.strawq.queue_helpers import make_feeder, make_queue, tid


def test_yield_resume_round_trip_keeps_per_token_alignment(storage: Storage,
                                                           tmp_path: Path) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 1).release(1)
    (lease,) = q.claim("p1")
    assert q.load_partial(lease) is None
    part1 = make_partial(tid(0), 0, lens=(4, 2, 0), version=5)
    q.yield_partial(lease, part1)
    (lease,) = q.claim("p2")
    assert lease.has_partial and lease.name.resume == 0
    loaded = q.load_partial(lease)
    assert loaded is not None
    for col in ("tokens", "logprobs", "versions", "loss_mask"):
        np.testing.assert_array_equal(getattr(loaded, col), getattr(part1, col))
    part2 = make_partial(tid(0), 0, lens=(1, 3, 2), version=6, prefix=loaded)
    q.yield_partial(lease, part2)
    (lease,) = q.claim("p3")
    assert lease.name.resume == 1 and lease.name.version == 5
    loaded = q.load_partial(lease)
    assert loaded is not None and loaded.sample_lens == [5, 5, 2]
    final = make_group(tid(0), 0, lens=(2, 0, 1), version=7, prefix=loaded, marker=1.0)
    q.complete(lease, final)
    state, name = q.find(tid(0))
    assert state == "ready" and name.version == 5  # staleness = oldest token version
    back = q.read_group(tid(0), name.gen)
    s0 = back.sample(0)
    assert s0["tokens"].tolist() == list(range(1000, 1007))
    assert s0["versions"].tolist() == [5, 5, 5, 5, 6, 7, 7]
    assert all(len(v) == len(s0["tokens"]) for v in s0.values())
    assert back.sample_lens == [7, 5, 3]


def test_complete_refuses_a_group_of_another_task(storage: Storage, tmp_path: Path) -> None:
    q = make_queue(storage)
    make_feeder(q, tmp_path, 2).release(2)
    a, _b = q.claim("p", 2)
    with pytest.raises(ConfigError, match="lease is for"):
        q.complete(a, make_group(tid(1)))
    assert q.still_held(a) and storage.list("ready") == []
