"""Recovery that keeps recovery possible: compacted drops stay requeueable for a window, a
refused release leaves no staging behind, ``strawq gc`` frees staged leftovers, and the
disk warning fires while there is still room to act."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import pytest

from strawq.app.cli import main as cli_main
from strawq.delivery import retention
from strawq.delivery.batches import BatchStore
from strawq.delivery.requeue import requeue_dropped
from strawq.delivery.retention import compact_drops, drop_totals
from strawq.errors import StorageFull
from strawq.storage import PosixStorage
from strawq.tasks.queue import RunQueue
from strawq.tasks.states import TaskState, names_in
from strawq.testing import audit_run
from strawq.testing.faults import FaultyStorage
from strawq.views.status import disk_space
from tests.strawq.queue_helpers import make_feeder, make_queue, tid


def _run_with_drops(tmp_path: Path) -> tuple[RunQueue, list[str]]:
    """Four released tasks: i0, i1 dropped by an engine outage, i2 by a filter, i3 pending."""
    q = make_queue(PosixStorage(str(tmp_path / "run"), writer_id="t", fsync=False))
    make_feeder(q, tmp_path, 4).release(4)
    leases = {lease.task_id: lease for lease in q.claim("p", 4)}
    for i in (0, 1):
        q.fail(leases[tid(i)], "engine_error.max_attempts", "engine down", retryable=False)
    q.drop(leases[tid(2)], "zero_variance", "filter")
    q.release(leases[tid(3)])
    return q, [tid(i) for i in range(4)]


def test_compacted_drops_can_still_be_requeued(tmp_path: Path) -> None:
    q, released = _run_with_drops(tmp_path)
    # the collector's automatic compaction (as at COMPACT_DROPS_AT entries), in the outage
    BatchStore(q).gc(compact_drops_at=0)
    assert names_in(q.storage, TaskState.DROPPED) == []
    assert drop_totals(q.storage) == {"engine_error.max_attempts": 2, "zero_variance": 1}
    rep = requeue_dropped(q, "engine_error.max_attempts")
    assert sorted(rep.requeued) == [tid(0), tid(1)]
    assert sorted(rep.from_audit) == [tid(0), tid(1)]
    assert {n.id for n in names_in(q.storage, TaskState.PENDING)} == {tid(0), tid(1), tid(3)}
    # the audit no longer counts them as dropped; every index is in exactly one state
    assert drop_totals(q.storage) == {"zero_variance": 1}
    assert audit_run(q.storage).check(released) == []
    # a producer runs them again
    assert {lease.task_id for lease in q.claim("p2", 4)} == {tid(0), tid(1), tid(3)}


def test_gc_expire_ends_the_window_and_says_so(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    q, _ = _run_with_drops(tmp_path)
    run = str(tmp_path / "run")
    assert cli_main(["gc", run, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["drops_compacted"] == 3 and out["drops_expired"] == 0
    assert len(retention.kept_drops(q.storage)) == 3  # kept: requeueable
    assert cli_main(["gc", run, "--expire", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["drops_expired"] == 3
    assert retention.kept_drops(q.storage) == []
    rep = requeue_dropped(q, "engine_error.max_attempts")
    assert rep.requeued == [] and rep.compacted == 2
    assert drop_totals(q.storage) == {"engine_error.max_attempts": 2, "zero_variance": 1}


def test_kept_drops_expire_after_the_window(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    q, _ = _run_with_drops(tmp_path)
    compact_drops(q.storage)
    assert retention.expire_kept(q.storage) == 0  # folded in today: inside the window
    later = retention._today() + retention.KEEP_DROPS_DAYS + 1
    monkeypatch.setattr(retention, "_today", lambda: later)
    assert retention.expire_kept(q.storage) == 3
    assert q.storage.list(retention.KEPT_DIR) == []


def test_a_release_refused_on_a_full_disk_leaves_no_staging(tmp_path: Path) -> None:
    storage = PosixStorage(str(tmp_path / "run"), writer_id="t", fsync=False)
    q = make_queue(storage)
    # the 3rd task record of the release finds the disk full
    full = FaultyStorage(storage, errors={"publish": (3, errno.ENOSPC)})
    feeder = make_feeder(RunQueue(full, q.config), tmp_path, 8)
    with pytest.raises(StorageFull):
        feeder.release(8)
    assert storage.list("staging") == []
    assert names_in(storage, TaskState.PENDING) == []
    # the disk has room again: the same rows are released, once
    assert make_feeder(q, tmp_path, 8).release(8) == 8
    assert audit_run(storage).check([tid(i) for i in range(8)]) == []


def test_gc_frees_release_staging_left_behind(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    storage = PosixStorage(str(tmp_path / "run"), writer_id="t", fsync=False)
    q = make_queue(storage)
    make_feeder(q, tmp_path, 4).release(2)  # committed: release 1
    # a release that died before its commit (numbered at the committed one: its writer
    # lost), and one above it, an hour old (a release refused or killed while staging)
    for name, age in (("r-000000000001.dead0001", 0.0), ("r-000000000002.dead0002", 7200.0)):
        storage.makedirs(f"staging/{name}")
        storage.publish(f"staging/{name}/task", b"x" * 1000)
        path = storage.local_path(f"staging/{name}")
        assert path is not None
        os.utime(path, (os.path.getmtime(path) - age,) * 2)
    storage.makedirs("staging/r-000000000003.live0003")  # a release in progress: kept
    storage.publish("staging/r-000000000003.live0003/task", b"x")
    assert cli_main(["gc", str(tmp_path / "run"), "--json"]) == 0
    assert storage.list("staging") == ["r-000000000003.live0003"]
    assert json.loads(capsys.readouterr().out)["staging"] == 2
    assert len(names_in(storage, TaskState.PENDING)) == 2  # the committed release stands


def test_the_disk_warning_fires_at_a_share_of_the_volume(tmp_path: Path) -> None:
    storage = PosixStorage(str(tmp_path / "run"), writer_id="t", fsync=False)
    make_queue(storage)
    disk = disk_space(storage, low_share=0.999999)  # "low" below 99.9999% free: it is
    assert disk["low"] and not disk["full"] and disk["total_bytes"] > disk["free_bytes"]
    assert not disk_space(storage, low_share=0.0)["low"]


def test_the_collector_warns_while_the_disk_runs_low(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from strawq.collector.config import CollectorConfig
    from strawq.collector.core import Collector
    from strawq.data.dataset import Dataset
    from strawq.testing import write_jsonl
    from strawq.testing.factories import prompts

    storage = PosixStorage(str(tmp_path / "run"), writer_id="t", fsync=False)
    q = make_queue(storage)
    data = Dataset(write_jsonl(tmp_path / "d.jsonl", prompts(2)))
    col = Collector(q, data, CollectorConfig(batch_groups=1, max_staleness=None,
                                             disk_warn_share=0.999999))
    col.start(wait=False)
    with caplog.at_level(logging.WARNING, logger="strawq.collector.core"):
        col.step()
    col.close()
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "running low" in text and "strawq gc" in text and "--expire" in text
