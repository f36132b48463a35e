"""A full JuiceFS volume: the run directory's quota used up (what ``bench/chaos.py
--disk-full --juicefs`` lands as its full-disk fault). On both clients a publish fails
with ``StorageFull`` and leaves nothing behind, a rename (a claim) and a delete still go
through, and writes succeed again once the quota is lifted."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from strawq.errors import StorageFull
from strawq.ondisk.records import Kind, decode, encode
from strawq.storage import PosixStorage

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))
from chaos_cluster import VolumeQuota  # noqa: E402

pytestmark = [pytest.mark.juicefs, pytest.mark.timeout(240)]


def test_a_used_up_quota_refuses_publishes_cleanly_on_both_clients_and_lifts(
        juicefs_dirs: tuple[str, str]) -> None:
    a, b = juicefs_dirs
    volume = os.path.dirname(os.path.realpath(os.path.dirname(a)))
    quota = VolumeQuota(volume, "/" + os.path.basename(a),
                        [os.path.join(a, "probe-A"), os.path.join(b, "probe-B")])
    on_a = PosixStorage(os.path.join(a, "run"), writer_id="a")
    on_b = PosixStorage(os.path.join(b, "run"), writer_id="b")
    on_a.publish("pending/t1", encode(Kind.TASK, {"n": 1}))
    on_a.publish("pending/t2", encode(Kind.TASK, {"n": 2}))
    os.makedirs(os.path.join(a, "run", "leased"))  # a run's state directories exist
    before = sorted(os.listdir(os.path.join(a, "run", "pending")))

    quota.fill()
    try:
        for who, storage in (("A", on_a), ("B", on_b)):
            with pytest.raises(StorageFull):
                storage.publish(f"ready/{who}", encode(Kind.TASK, {"who": who}))
            assert not storage.exists(f"ready/{who}")
        # nothing half-written: no record, no temporary file, in any directory of the run
        left = sorted(os.path.relpath(os.path.join(d, f), os.path.join(a, "run"))
                      for d, _, fs in os.walk(os.path.join(a, "run")) for f in fs)
        assert left == [f"pending/{n}" for n in before], left
        assert os.listdir(os.path.join(a, "run", "leased")) == []
        on_b.rename("pending/t1", "leased/t1")  # a claim is a rename: no new inode
        on_a.delete("pending/t2")
    finally:
        quota.free()
    on_b.publish("ready/B", encode(Kind.TASK, {"who": "B"}))
    assert decode(on_a.read("ready/B")).meta["who"] == "B"
    assert decode(on_a.read("leased/t1")).meta["n"] == 1
