"""Puts written by their putter (verl's Rollouter, ``StrawqMessageQueueClient``), without Ray:
the record is durable in ``incoming/`` before the queue hears of it, and the queue only names
it (``DurableSampleQueue.begin_written``, ``StrawqMessageQueue.put_written``). The client
over a real Ray actor is in ``test_verl_queue_ray.py``."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from strawq.collector.integrations.verl.queue import DurableSampleQueue, StrawqMessageQueue
from strawq.collector.integrations.verl.samples import (INCOMING, SAMPLES, IncomingWriter,
                                                        incoming_part)
from strawq.storage import PosixStorage
from strawq.testing.faults import CrashPoint, FaultyStorage
from tests.collector.integrations import verl_helpers as vh


def writer(root: Path) -> IncomingWriter:
    return IncomingWriter(PosixStorage(str(root), writer_id="verlc"))


def put_written(q: DurableSampleQueue, w: IncomingWriter, data: bytes, sid: str) -> bool | None:
    """A written put, as the client and the actor make it: write here, name there."""
    written = w.write(data, sample_id=sid)
    pending = q.begin_written(written.name, sample_id=written.sample_id, size=written.size)
    if pending is None:
        return True
    error = q.write([pending])[0]
    if error is not None:
        q.abort(pending)
        raise error
    return q.finish(pending)


def drain(q: DurableSampleQueue) -> list[bytes]:
    return [got[1] for got in iter(q.get, None)]


def test_written_puts_are_handed_out_in_order_with_their_bytes(tmp_path: Path) -> None:
    q = DurableSampleQueue(str(tmp_path))
    w = writer(tmp_path)
    q.put(b"own-0", sample_id="s0")
    assert put_written(q, w, b"written-1", "s1") is True
    q.put(b"own-2", sample_id="s2")
    assert put_written(q, w, b"written-3", "s3") is True
    assert os.listdir(tmp_path / INCOMING) == []
    assert sorted(os.listdir(tmp_path / SAMPLES)) == [
        "000000000000~s0", "000000000001~s1", "000000000002~s2", "000000000003~s3"]
    assert q.stats()["puts_written_by_putter"] == 2
    assert drain(q) == [b"own-0", b"written-1", b"own-2", b"written-3"]
    again = DurableSampleQueue(str(tmp_path))  # a restart reads them like any put's file
    assert drain(again) == [b"own-0", b"written-1", b"own-2", b"written-3"]


def test_a_verl_sample_written_by_its_putter_keeps_its_id(tmp_path: Path) -> None:
    """The id comes from the pickle, as for a put through the queue: a re-put is a duplicate,
    and its copy in ``incoming/`` is deleted."""
    q = DurableSampleQueue(str(tmp_path))
    w = writer(tmp_path)
    written = w.write(vh.blob(7))
    assert incoming_part(written.name) == written.sample_id == "sample_0_7"
    pending = q.begin_written(written.name, sample_id=written.sample_id, size=written.size)
    assert pending is not None and q.write([pending]) == [None] and q.finish(pending)
    again = w.write(vh.blob(7))
    assert q.begin_written(again.name, sample_id=again.sample_id, size=again.size) is None
    assert q.stats()["duplicates"] == 1
    assert os.listdir(tmp_path / INCOMING) == []
    assert q.is_held("sample_0_7") and len(drain(q)) == 1


def test_a_name_that_is_not_the_puts_record_is_refused(tmp_path: Path) -> None:
    q = DurableSampleQueue(str(tmp_path))
    written = writer(tmp_path).write(b"x", sample_id="s1")
    with pytest.raises(ValueError, match="not the record of a put"):
        q.begin_written(written.name, sample_id="s2", size=written.size)
    with pytest.raises(ValueError, match="not the record of a put"):
        q.begin_written("../samples/x", sample_id="s1", size=1)


def test_records_written_but_never_named_are_adopted_at_the_restart(tmp_path: Path) -> None:
    """The queue died between the putter's write and its own rename: the next queue names
    them after every sample on disk, in written order; one it holds already is deleted."""
    q = DurableSampleQueue(str(tmp_path))
    w = writer(tmp_path)
    q.put(b"own-0", sample_id="s0")
    w.write(b"orphan-1", sample_id="s1")
    w.write(b"orphan-2", sample_id="s2")
    w.write(b"copy-of-0", sample_id="s0")
    again = DurableSampleQueue(str(tmp_path))
    assert again.recovered == 3
    assert os.listdir(tmp_path / INCOMING) == []
    assert drain(again) == [b"own-0", b"orphan-1", b"orphan-2"]


class Recording(PosixStorage):
    """Posix storage that records renames, directory fsyncs and commit publications."""

    events: list[str]

    def rename(self, src, dst, **kw):  # type: ignore[no-untyped-def]
        super().rename(src, dst, **kw)
        self.events.append(f"rename {src.partition('/')[0]} -> {dst.partition('/')[0]}")

    def sync_dirs(self, directories):  # type: ignore[no-untyped-def]
        directories = list(directories)
        super().sync_dirs(directories)
        self.events.append("sync " + ",".join(sorted(directories)))

    def publish(self, key, data, **kw):  # type: ignore[no-untyped-def]
        if key.startswith("commits/"):
            self.events.append("commit")
        super().publish(key, data, **kw)


def test_a_written_put_returns_only_once_its_rename_is_durable(tmp_path: Path) -> None:
    """A put's hand-outs, and the commits that count them, rest on its name and sequence
    number: were its rename undone by a power cut, a restart would number it again and a
    commit by count would cover the wrong samples. So ``write`` fsyncs both directories,
    once for the puts it named, before any of them returns."""
    st = Recording(str(tmp_path), writer_id="verlq")
    st.events = []
    q = DurableSampleQueue(st)
    w = writer(tmp_path)
    pending = []
    for i in range(3):
        written = w.write(f"s{i}".encode(), sample_id=f"s{i}")
        got = q.begin_written(written.name, sample_id=written.sample_id, size=written.size)
        assert got is not None
        pending.append(got)
    st.events.clear()
    assert q.write(pending) == [None] * 3
    assert st.events == [f"rename {INCOMING} -> {SAMPLES}"] * 3 + [f"sync {INCOMING},{SAMPLES}"]
    for p in pending:
        q.finish(p)
    assert q.get() is not None
    st.events.clear()
    q.commit(1)
    assert st.events == ["commit"], st.events


def test_a_rename_made_but_reported_lost_is_a_named_put(tmp_path: Path) -> None:
    """A retried rename on a shared mount can report ENOENT for a rename it made: the put is
    named (its file is at its new name), not refused, and no second copy is stored."""
    st = FaultyStorage(PosixStorage(str(tmp_path), writer_id="verlq"),
                       phantom_enoent={"rename": 1})
    q = DurableSampleQueue(st)
    assert put_written(q, writer(tmp_path), b"once", "s1") is True
    assert q.stats()["puts_written_by_putter"] == 1
    assert drain(q) == [b"once"]
    assert drain(DurableSampleQueue(str(tmp_path))) == [b"once"]


def test_two_files_of_one_sample_hand_it_out_once_after_a_restart(tmp_path: Path) -> None:
    """Should a sample ever be stored twice (a put's outcome unknown, the bytes sent
    again), a restart keeps the first sequence number and deletes the other file."""
    q = DurableSampleQueue(str(tmp_path))
    q.put(b"a", sample_id="s1")
    q.put(b"b", sample_id="s2")
    os.link(tmp_path / SAMPLES / "000000000000~s1", tmp_path / SAMPLES / "000000000005~s1")
    again = DurableSampleQueue(str(tmp_path))
    assert drain(again) == [b"a", b"b"]
    assert sorted(os.listdir(tmp_path / SAMPLES)) == ["000000000000~s1", "000000000001~s2"]


Scenario = Callable[[DurableSampleQueue, IncomingWriter, list[str], list[str]], None]


def crash_at_every_step(tmp_path: Path, scenario: Scenario, least: dict[str, int]) -> None:
    """Run ``scenario(queue, putter, returned, handed)`` with the putter's process, then the
    queue's, crashed before each of its mutating storage operations in turn (at least
    ``least[side]`` of them): a queue started again holds every put that returned and no
    commit covers, in put order (the ids sort so), once, and nothing is left in
    ``incoming/``."""
    for side in ("putter", "queue"):
        n = 1
        while True:
            root = tmp_path / f"{side}{n}"
            faulty = FaultyStorage(PosixStorage(str(root), writer_id="v"), crash_after=n)
            plain = PosixStorage(str(root), writer_id="v")
            q = DurableSampleQueue(faulty if side == "queue" else plain)
            w = IncomingWriter(faulty if side == "putter" else plain)
            returned: list[str] = []
            handed: list[str] = []
            try:
                scenario(q, w, returned, handed)
            except CrashPoint:
                pass
            else:
                break
            again = DurableSampleQueue(str(root))
            committed = handed[:again.consumed]
            held = [got[0].sample_id for got in iter(again.get, None)]
            assert held == sorted(held), (side, n, held)
            assert len(held) == len(set(held)), (side, n, held)
            assert not set(held) & set(committed), (side, n, held)
            assert set(returned) - set(committed) <= set(held), (side, n, held, returned)
            assert os.listdir(root / INCOMING) == [], (side, n)
            n += 1
        assert n > least[side], (side, n)  # every step was a crash point once


def test_a_crash_at_any_storage_step_of_written_puts_loses_no_returned_put(
        tmp_path: Path) -> None:
    """The putter's writes and the queue's renames, commits and restarts, each process
    crashed before each of its mutating storage operations in turn."""

    def scenario(q: DurableSampleQueue, w: IncomingWriter, returned: list[str],
                 handed: list[str]) -> None:
        for b in range(3):
            for i in range(2):
                sid = f"b{b}_{i}"
                put_written(q, w, sid.encode(), sid)
                returned.append(sid)
            handed += [q.get()[0].sample_id for _ in range(2)]  # type: ignore[index]
            q.commit(len(handed) - 1)

    crash_at_every_step(tmp_path, scenario, {"putter": 6, "queue": 6})


def test_the_queue_tells_a_putter_it_cannot_see_the_file(tmp_path: Path) -> None:
    """A putter whose directory is not the queue's (another node's local directory at the
    same path): ``put_written`` answers None, the queue is unchanged, and the same sample
    put with its bytes is stored."""
    elsewhere = writer(tmp_path / "other-node")

    async def go() -> tuple[bool | None, bool, int]:
        mq = StrawqMessageQueue(None, 10, path=str(tmp_path / "queue"))
        written = elsewhere.write(b"bytes", sample_id="s1")
        answer = await mq.put_written(written.name, written.sample_id, written.size)
        size_after_refusal = mq.q.size()
        ok = await mq.put_sample(b"bytes", sample_id="s1")
        return answer, ok, size_after_refusal

    answer, ok, size = asyncio.run(go())
    assert (answer, ok, size) == (None, True, 0)
    assert drain(DurableSampleQueue(str(tmp_path / "queue"))) == [b"bytes"]


def test_the_names_of_many_written_puts_go_in_one_call(tmp_path: Path) -> None:
    """``put_written_many``: one answer per put, in order: named (True), a duplicate (True,
    its copy deleted), one the queue cannot see (None); each named put in ``samples/``."""
    w = writer(tmp_path / "queue")
    elsewhere = writer(tmp_path / "other-node")

    async def go() -> tuple[list[bool | None], StrawqMessageQueue]:
        mq = StrawqMessageQueue(None, 10, path=str(tmp_path / "queue"))
        await mq.put_sample(b"own-0", sample_id="s0")
        puts = [w.write(b"w-1", sample_id="s1"), w.write(b"copy", sample_id="s0"),
                elsewhere.write(b"far", sample_id="s9"), w.write(b"w-2", sample_id="s2")]
        answers = await mq.put_written_many([(p.name, p.sample_id, p.size) for p in puts])
        return answers, mq

    answers, mq = asyncio.run(go())
    assert answers == [True, True, None, True]
    assert mq.q.stats()["puts_written_by_putter"] == 2
    assert os.listdir(tmp_path / "queue" / INCOMING) == []
    assert drain(mq.q) == [b"own-0", b"w-1", b"w-2"]


MOUNTINFO = """\
22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
30 22 0:40 / /mnt/jfs rw,relatime shared:2 - fuse.juicefs JuiceFS:vol rw,user_id=0
31 22 0:41 / /mnt/nfs rw,relatime shared:3 - nfs4 server:/export rw
32 22 0:42 / /scratch rw,relatime shared:4 - overlay overlay rw
"""


def test_a_putter_writes_its_puts_only_on_a_local_filesystem(tmp_path: Path) -> None:
    """On a shared mount a file a put costs more metadata operations than the queue's own
    batch files: the client writes puts itself only where the queue directory is local."""
    pytest.importorskip("verl")
    from strawq.collector.integrations.verl.queue_client import writes_here

    table = tmp_path / "mountinfo"
    table.write_text(MOUNTINFO)
    assert writes_here("/var/q", mountinfo=str(table))
    assert writes_here("/scratch/q", mountinfo=str(table))
    assert not writes_here("/mnt/jfs/verl/q1", mountinfo=str(table))
    assert not writes_here("/mnt/nfs/q", mountinfo=str(table))


@pytest.mark.juicefs
def test_a_queue_on_juicefs_is_not_written_by_its_putter(
        juicefs_mounts: tuple[str, str]) -> None:
    pytest.importorskip("verl")
    from strawq.collector.integrations.verl.queue_client import writes_here

    assert not writes_here(os.path.join(juicefs_mounts[0], "verl-q"))
