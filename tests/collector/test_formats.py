"""On-disk format versions across a live run (docs/operations.md, Upgrading a live run): a
record in a newer format stops the part that meets it and loses nothing; a rolling upgrade
across a format change loses and duplicates nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.data.dataset import Dataset
from strawq.ondisk import records
from strawq.ondisk.names import data_key
from strawq.ondisk.records import Kind
from strawq.storage import open_storage
from strawq.tasks.queue import RunQueue
from tests.collector.helpers import make_run, write_dataset


def _rewrite_as_schema_2(q: RunQueue, key: str) -> None:
    """Replace a group record by the same group at schema version 2 (a newer strawq's)."""
    rec = records.decode(q.storage.read(key), expect=Kind.GROUP)
    chunks = records._frame(Kind.GROUP, {**rec.meta, "v": 2}, [bytes(rec.payload)])
    q.storage.delete(key)
    q.storage.publish(key, chunks)


def test_a_newer_format_group_stops_the_collector_and_keeps_the_group(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    q = make_run(run, release_batch=4, group_size=2)
    data = write_dataset(str(tmp_path / "data.jsonl"), 4)
    col = Collector(q, Dataset(data), CollectorConfig(
        batch_groups=2, max_staleness=None, max_running=4, max_ready=4,
        max_prefetch_batches=1, poll_interval_s=0.0, gc_interval_s=1000))
    col.start(wait=False)
    col.step()  # releases the 4 tasks
    from strawq.testing.factories import make_group

    p = RunQueue.open(open_storage(run, writer_id="p0", fsync=False))
    leases = p.claim("p0", 2)
    for lease in leases:
        p.complete(lease, make_group(lease.task_id, int(lease.task["index"]), lens=(2, 2)))
    newer = leases[0]
    key = data_key(newer.task_id, newer.gen, "group")
    _rewrite_as_schema_2(q, key)

    with pytest.raises(Exception) as info:  # noqa: PT011 - the type is checked below
        col.step()
    assert type(info.value).__name__ == "NewerFormat", info.value
    msg = str(info.value)
    assert key in msg and "version 2" in msg and "up to version 1" in msg
    assert "upgrade this part" in msg.lower()
    # nothing dropped, nothing quarantined, nothing batched: the group waits, readable
    assert any(newer.task_id in n for n in q.storage.list("ready"))
    assert q.storage.exists(key)
    assert q.storage.list("quarantine") == [] and q.storage.list("dropped") == []
    assert q.storage.list("batches") == []
    col.close()

    from strawq.testing.formats import release

    with release(2):  # the collector upgraded: the group is trained
        new = Collector(RunQueue.open(open_storage(run, writer_id="c2", fsync=False)),
                        Dataset(data), col.config)
        new.start(wait=False)
        published = new.step().published
        assert len(published) == 1
        man = new.batches.read_manifest(published[0])
        assert newer.task_id in [str(s["task_id"]) for s in man.summaries]


def test_an_old_part_refuses_a_run_at_a_newer_format(tmp_path: Path) -> None:
    from strawq.errors import NewerFormat
    from strawq.tasks.formats import upgrade
    from strawq.testing.formats import release

    run = str(tmp_path / "run")
    make_run(run)
    storage = open_storage(run, writer_id="cli", fsync=False)
    with release(2):
        upgrade(storage, 2, {})
        RunQueue.open(storage)  # the new release opens it
    with release(1), pytest.raises(NewerFormat, match="run is at format 2.*reads formats up "
                                   "to 1: upgrade this part"):
        RunQueue.open(storage)


def test_upgrade_is_refused_while_an_old_part_is_live_and_names_it(tmp_path: Path) -> None:
    from strawq.tasks.formats import UpgradeRefused, live_parts, run_format, upgrade
    from strawq.testing.formats import release

    run = str(tmp_path / "run")
    make_run(run)
    with release(1):
        old = RunQueue.open(open_storage(run, writer_id="p-old", fsync=False))
        old.heartbeat("p-old")
    with release(2):
        new = RunQueue.open(open_storage(run, writer_id="p-new", fsync=False))
        new.heartbeat("p-new")
        storage = new.storage
        assert live_parts(storage) == {"producer p-old": 1, "producer p-new": 2}
        with pytest.raises(UpgradeRefused, match=r"producer p-old \(reads up to 1\)") as info:
            upgrade(storage, 2, live_parts(storage))
        assert "p-new" not in str(info.value)
        assert run_format(storage) == 1 and storage.list("format") == []


def test_writers_write_the_runs_format_not_their_newest(tmp_path: Path) -> None:
    from strawq.tasks.formats import upgrade
    from strawq.testing.factories import make_group
    from strawq.testing.formats import release

    run = str(tmp_path / "run")
    q = make_run(run, release_batch=4)
    from strawq.testing.factories import prompts, write_jsonl

    col = Collector(q, Dataset(write_jsonl(str(tmp_path / "d.jsonl"), prompts(4))),
                    CollectorConfig(batch_groups=2, max_staleness=None, max_running=4,
                                    max_ready=4, max_prefetch_batches=1, poll_interval_s=0.0,
                                    gc_interval_s=1000))
    col.start(wait=False)
    col.step()
    col.close()

    def schema_of_next() -> int:
        p = RunQueue.open(open_storage(run, writer_id="p0", fsync=False))
        lease = p.claim("p0", 1)[0]
        p.complete(lease, make_group(lease.task_id, int(lease.task["index"])))
        key = data_key(lease.task_id, lease.gen, "group")
        return int(records.decode(q.storage.read(key)).meta["v"])

    with release(2):
        assert schema_of_next() == 1  # the run is at format 1: a new writer writes it
        upgrade(q.storage, 2, {})
        assert schema_of_next() == 2


def test_a_rolling_upgrade_across_a_format_change_loses_and_duplicates_nothing(
        tmp_path: Path) -> None:
    from strawq.testing.upgrade import rolling_upgrade

    res = rolling_upgrade(os.fspath(tmp_path), n=24)
    assert (res.lost, res.duplicated, res.problems) == (0, 0, []), res.line()
    assert res.trained == res.released == 24
    assert res.refused == 2  # while the old producers were live
    assert res.written.get(1, 0) > 0 and res.written.get(2, 0) > 0, res.written
    assert res.old_refused and res.final_format == 2


def test_the_upgrade_command_refuses_with_the_live_old_part_and_exits_1(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from strawq.app.cli import main
    from strawq.testing.formats import release

    run = str(tmp_path / "run")
    make_run(run)
    with release(1):
        RunQueue.open(open_storage(run, writer_id="p-old", fsync=False)).heartbeat("p-old")
    with release(2):
        assert main(["upgrade", run]) == 1
        err = capsys.readouterr().err
        assert "producer p-old (reads up to 1)" in err and "Traceback" not in err
        storage = open_storage(run, writer_id="x", fsync=False)
        storage.delete(next(f"hb/{n}" for n in storage.list("hb")))
        assert main(["upgrade", run]) == 0
        assert "raised from 1 to 2" in capsys.readouterr().out
