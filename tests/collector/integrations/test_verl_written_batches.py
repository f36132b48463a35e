"""Puts their putter wrote as ONE batch file (``IncomingWriter.write_batch``: group commit in
verl's Rollouter), without Ray: durable in ``incoming/`` before the queue hears of them; the
queue numbers the file's places and renames it whole
(``DurableSampleQueue.begin_written_batch``, ``StrawqMessageQueue.put_written_batches``).
The client over a real Ray actor is in ``test_verl_queue_ray.py``."""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from strawq.collector.integrations.verl.queue import DurableSampleQueue, StrawqMessageQueue
from strawq.collector.integrations.verl.samples import (INCOMING, SAMPLES, IncomingWriter,
                                                        WrittenBatch, incoming_batch,
                                                        incoming_part)
from strawq.storage import PosixStorage
from strawq.testing.faults import CrashPoint
from tests.collector.integrations import verl_helpers as vh
from tests.collector.integrations.test_verl_written_puts import (crash_at_every_step, drain,
                                                                 writer)


def write(w: IncomingWriter, puts: Sequence[tuple[bytes, str | None]]) -> WrittenBatch:
    written, failed = w.write_batch([(data, sid, None) for data, sid in puts])
    assert written is not None and not failed, failed
    return written


def put_batch(q: DurableSampleQueue, w: IncomingWriter,
              puts: Sequence[tuple[bytes, str | None]]) -> list[bool]:
    """A putter's batch file, as the client and the actor make it: write here, name there.
    One answer a place (a duplicate: True, stored already)."""
    return name_batch(q, write(w, puts))


def name_batch(q: DurableSampleQueue, written: WrittenBatch) -> list[bool]:
    live = q.begin_written_batch(written.name, written.parts, written.size)
    errors = q.write(live)
    for p, error in zip(live, errors, strict=True):
        if error is not None:
            q.abort(p)
    for error in errors:
        if error is not None:
            raise error
    answers = [True] * len(written.parts)
    first = live[0].batch.first if live and live[0].batch else 0
    for p in live:
        answers[p.seq - first] = q.finish(p)
    return answers


def test_a_putters_batch_file_is_named_whole_and_handed_out_in_put_order(
        tmp_path: Path) -> None:
    q = DurableSampleQueue(str(tmp_path))
    w = writer(tmp_path)
    q.put(b"own-0", sample_id="s0")
    assert put_batch(q, w, [(b"w-1", "s1"), (b"w-2", "s2"), (b"w-3", "s3")]) == [True] * 3
    q.put(b"own-4", sample_id="s4")
    assert os.listdir(tmp_path / INCOMING) == []
    assert sorted(os.listdir(tmp_path / SAMPLES)) == [
        "000000000000~s0", "000000000001~000000000003~batch", "000000000004~s4"]
    stats = q.stats()
    assert (stats["puts_written_by_putter"], stats["files_written_by_putter"],
            stats["files_written"]) == (3, 1, 2)
    assert drain(q) == [b"own-0", b"w-1", b"w-2", b"w-3", b"own-4"]
    again = DurableSampleQueue(str(tmp_path))  # a restart reads it like the queue's own
    assert drain(again) == [b"own-0", b"w-1", b"w-2", b"w-3", b"own-4"]


def test_verl_samples_in_a_batch_file_keep_their_ids(tmp_path: Path) -> None:
    """Ids come from the pickles, as for a put through the queue: a re-put is a duplicate."""
    q = DurableSampleQueue(str(tmp_path))
    w = writer(tmp_path)
    written = write(w, [(vh.blob(7), None), (vh.blob(8), None)])
    assert incoming_batch(written.name) == 2 and incoming_part(written.name) is None
    assert written.parts == ("sample_0_7", "sample_0_8")
    assert name_batch(q, written) == [True, True]
    assert q.is_held("sample_0_7") and q.is_held("sample_0_8")
    assert q.put(vh.blob(8)) is True and q.stats()["duplicates"] == 1
    assert len(drain(q)) == 2


def test_a_batch_file_that_does_not_match_its_put_is_refused(tmp_path: Path) -> None:
    q = DurableSampleQueue(str(tmp_path))
    written = write(writer(tmp_path), [(b"a", "s1"), (b"b", "s2")])
    for parts in (("s1",), ("s1", "s2", "s3"), ("s1", "bad~id")):
        try:
            q.begin_written_batch(written.name, parts, written.size)
        except ValueError as exc:
            assert "not a batch file of" in str(exc)
        else:
            raise AssertionError(f"{parts} accepted")
    live = q.begin_written_batch(written.name, ("s2", "s1"), written.size)  # wrong order
    errors = q.write(live)
    assert all(e is not None and "other samples" in str(e) for e in errors), errors
    for p in live:
        q.abort(p)
    assert q.size() == 0 and not q.is_held("s1")
    assert os.listdir(tmp_path / INCOMING) == [written.name]  # left for recovery to read


def test_duplicates_in_a_batch_file_are_never_handed_out_not_even_after_restarts(
        tmp_path: Path) -> None:
    """A place whose sample the queue holds (put before, or twice in the file) is a
    duplicate: not handed out, and recorded in ``drops/`` so that no restart hands it out,
    even once the sample it copies is committed and out of the recent commits' memory."""
    q = DurableSampleQueue(str(tmp_path), keep_commits=1)
    w = writer(tmp_path)
    q.put(b"s1", sample_id="s1")
    assert put_batch(q, w, [(b"s2", "s2"), (b"copy-1", "s1"), (b"copy-2", "s2"),
                            (b"s3", "s3")]) == [True] * 4
    assert q.stats()["duplicates"] == 2
    q.put(b"s4", sample_id="s4")
    assert drain(q) == [b"s1", b"s2", b"s3", b"s4"]
    q.commit(1)  # s1
    q.commit(2)  # s2: s1 is no longer among the commits remembered (keep_commits=1)
    assert not q.is_held("s1")
    again = DurableSampleQueue(str(tmp_path), keep_commits=1)
    assert drain(again) == [b"s3", b"s4"]
    again.commit(4)
    assert os.listdir(tmp_path / SAMPLES) == []


def test_a_batch_file_of_duplicates_only_is_deleted(tmp_path: Path) -> None:
    q = DurableSampleQueue(str(tmp_path))
    q.put(b"s1", sample_id="s1")
    assert put_batch(q, writer(tmp_path), [(b"copy", "s1")]) == [True]
    assert os.listdir(tmp_path / INCOMING) == []
    assert drain(DurableSampleQueue(str(tmp_path))) == [b"s1"]


def test_batch_files_never_named_are_adopted_at_the_restart(tmp_path: Path) -> None:
    """The queue died between the putter's write and its own rename: the next queue numbers
    each file after every sample on disk, in written order; a place it holds is dropped."""
    q = DurableSampleQueue(str(tmp_path))
    w = writer(tmp_path)
    q.put(b"own-0", sample_id="s0")
    write(w, [(b"o-1", "s1"), (b"copy-0", "s0")])
    w.write(b"o-2", sample_id="s2")
    write(w, [(b"o-3", "s3"), (b"copy-1", "s1"), (b"o-4", "s4")])
    again = DurableSampleQueue(str(tmp_path))
    assert again.recovered == 5
    assert os.listdir(tmp_path / INCOMING) == []
    assert drain(again) == [b"own-0", b"o-1", b"o-2", b"o-3", b"o-4"]
    assert drain(DurableSampleQueue(str(tmp_path))) == [b"own-0", b"o-1", b"o-2", b"o-3",
                                                        b"o-4"]


def test_a_sample_stored_twice_by_the_queue_is_handed_out_once_after_a_restart(
        tmp_path: Path) -> None:
    """A put whose file was published but whose directory fsync failed returns an error;
    the sample put again, with another in one batch file, is a second copy on disk. A
    restart hands it out once, from the first file, and its place in the batch file never."""

    class SyncFailsOnce(PosixStorage):
        armed = False

        def sync_dirs(self, directories):  # type: ignore[no-untyped-def]
            if self.armed:
                self.armed = False
                raise OSError(errno.EIO, "injected: the directory fsync failed")
            super().sync_dirs(directories)

    st = SyncFailsOnce(str(tmp_path), writer_id="verlq")
    q = DurableSampleQueue(st)
    st.armed = True
    with pytest.raises(OSError, match="injected"):
        q.put(b"a", sample_id="s1")
    again = [q.begin(b"a-again", sample_id="s1"), q.begin(b"b", sample_id="s2")]
    assert None not in again
    assert q.write(again) == [None, None]  # type: ignore[arg-type]
    for p in again:
        q.finish(p)  # type: ignore[arg-type]
    assert drain(q) == [b"a-again", b"b"]
    assert drain(DurableSampleQueue(str(tmp_path))) == [b"a", b"b"]


def test_many_batch_files_are_named_in_one_call(tmp_path: Path) -> None:
    """``put_written_batches``: per file, one answer a place (a duplicate: True), or None
    for a file the queue cannot see; each named file in ``samples/`` whole."""
    w = writer(tmp_path / "queue")
    elsewhere = writer(tmp_path / "other-node")

    async def go() -> tuple[list[list[bool] | None], StrawqMessageQueue]:
        mq = StrawqMessageQueue(None, 10, path=str(tmp_path / "queue"))
        await mq.put_sample(b"own-0", sample_id="s0")
        files = [write(w, [(b"w-1", "s1"), (b"copy", "s0")]),
                 write(elsewhere, [(b"far", "s9")]),
                 write(w, [(b"w-2", "s2"), (b"w-3", "s3")])]
        answers = await mq.put_written_batches([(f.name, list(f.parts), f.size)
                                                for f in files])
        return answers, mq

    answers, mq = asyncio.run(go())
    assert answers == [[True, True], None, [True, True]]
    assert mq.q.stats()["puts_written_by_putter"] == 3
    assert os.listdir(tmp_path / "queue" / INCOMING) == []
    assert drain(mq.q) == [b"own-0", b"w-1", b"w-2", b"w-3"]


def test_a_crash_at_any_storage_step_of_batch_files_loses_no_returned_put(
        tmp_path: Path) -> None:
    """The putter's batch files and the queue's drop records, renames, commits and restarts,
    each process crashed before each of its mutating storage operations in turn."""

    def scenario(q: DurableSampleQueue, w: IncomingWriter, returned: list[str],
                 handed: list[str]) -> None:
        for b in range(3):
            sids = [f"b{b}_{i}" for i in range(3)]
            # the later files repeat a sample of the first: a duplicate place
            puts = [(s.encode(), s) for s in sids] + ([(b"dup", "b0_0")] if b else [])
            put_batch(q, w, puts)
            returned += sids
            handed += [q.get()[0].sample_id for _ in range(3)]  # type: ignore[index]
            q.commit(len(handed) - 1)

    # the putter: a publish a file; the queue: the drop records, renames, commits
    crash_at_every_step(tmp_path, scenario, {"putter": 3, "queue": 9})


class Faults(PosixStorage):
    """Posix storage with one armed fault: publishing into ``drops/`` fails (``drops``) or
    crashes (``drops-crash``); the rename of a batch file into ``samples/`` crashes
    (``rename-crash``); or the next directory fsync fails (``sync``)."""

    mode: str | None = None

    def publish(self, key, data, **kw):  # type: ignore[no-untyped-def]
        if self.mode == "drops" and key.startswith("drops/"):
            raise OSError(errno.EIO, "injected: drops/ publish failed")
        super().publish(key, data, **kw)

    def rename(self, src, dst, **kw):  # type: ignore[no-untyped-def]
        if self.mode == "rename-crash" and dst.startswith(SAMPLES + "/"):
            raise CrashPoint("injected: crash before the rename into samples/")
        super().rename(src, dst, **kw)

    def sync_dirs(self, directories):  # type: ignore[no-untyped-def]
        directories = list(directories)
        if self.mode == "sync" and SAMPLES in directories:
            self.mode = None
            raise OSError(errno.EIO, "injected: the directory fsync failed")
        super().sync_dirs(directories)


def committed_one_of_two(tmp_path: Path) -> tuple[Faults, DurableSampleQueue]:
    """s1 and s2 put, s1 handed out and committed (the one commit remembered)."""
    st = Faults(str(tmp_path), writer_id="verlq")
    q = DurableSampleQueue(st, keep_commits=1)
    q.put(b"s1", sample_id="s1")
    q.put(b"s2", sample_id="s2")
    assert q.get()[0].sample_id == "s1"  # type: ignore[index]
    q.commit(1)
    return st, q


def forget_s1(q: DurableSampleQueue) -> None:
    assert q.get()[0].sample_id == "s2"  # type: ignore[index]
    q.commit(2)  # s1 is no longer among the commits remembered
    assert not q.is_held("s1")


def test_a_duplicate_that_cannot_be_recorded_fails_its_file_and_leaves_nothing(
        tmp_path: Path) -> None:
    """The drop record of a duplicate place cannot be written: the file's puts fail and the
    file is deleted, so no restart adopts the copy once the sample it copies is forgotten."""
    st, q = committed_one_of_two(tmp_path)
    st.mode = "drops"
    with pytest.raises(OSError, match="injected"):
        put_batch(q, writer(tmp_path), [(b"copy-of-s1", "s1"), (b"s3", "s3")])
    st.mode = None
    assert os.listdir(tmp_path / INCOMING) == [] and not q.is_held("s3")
    forget_s1(q)
    assert drain(DurableSampleQueue(str(tmp_path), keep_commits=1)) == []


def test_a_commit_while_a_file_is_named_then_a_crash_hands_out_no_copy(tmp_path: Path) -> None:
    """The duplicate is judged when the call arrives; a commit forgets the sample it copies
    while the writer thread names the file; the queue dies before the rename (or the rename
    is made and its fsync fails). Its drop record, written before the rename and naming the
    file and the place, keeps the copy from being handed out, the file renamed or adopted."""
    for crash in ("rename-crash", "sync"):
        root = tmp_path / crash
        st, q = committed_one_of_two(root)
        written = write(writer(root), [(b"copy-of-s1", "s1"), (b"s3", "s3")])
        live = q.begin_written_batch(written.name, written.parts, written.size)
        assert [p.part for p in live] == ["s3"]
        forget_s1(q)  # on the loop, while the file is being named
        st.mode = crash
        if crash == "rename-crash":
            with pytest.raises(CrashPoint):
                q.write(live)
        else:  # the rename made, its fsync failed: the puts fail, the queue lives on
            assert all(e is not None for e in q.write(live))
            for p in live:
                q.abort(p)
        assert drain(DurableSampleQueue(str(root), keep_commits=1)) == [b"s3"], crash


def test_a_file_naming_a_sample_twice_keeps_its_first_place_when_adopted(
        tmp_path: Path) -> None:
    """The second place of a sample in one file is the duplicate, recorded; the queue dies
    before the rename: the adoption keeps the first place and drops the recorded one."""
    st = Faults(str(tmp_path), writer_id="verlq")
    q = DurableSampleQueue(st)
    written = write(writer(tmp_path), [(b"s1", "s1"), (b"s1-copy", "s1"), (b"s2", "s2")])
    live = q.begin_written_batch(written.name, written.parts, written.size)
    st.mode = "rename-crash"
    with pytest.raises(CrashPoint):
        q.write(live)
    assert drain(DurableSampleQueue(str(tmp_path))) == [b"s1", b"s2"]
    assert drain(DurableSampleQueue(str(tmp_path))) == [b"s1", b"s2"]


class RenameFails(PosixStorage):
    """The rename of one named ``incoming/`` file fails (EIO), once."""

    victim: str | None = None

    def rename(self, src, dst, **kw):  # type: ignore[no-untyped-def]
        if self.victim and src.endswith(self.victim):
            self.victim = None
            raise OSError(errno.EIO, "injected: rename failed")
        super().rename(src, dst, **kw)


def test_a_copy_of_a_put_that_then_fails_is_restored_at_the_restart(tmp_path: Path) -> None:
    """Two files of one call name the same sample: the second's place is a duplicate of the
    first's put, in flight. The first file's rename fails (its put fails, the file stays in
    ``incoming/``): the sample is not in the queue until the restart adopts that file, and
    the duplicate's record, which names the second file, does not drop it there."""
    w = writer(tmp_path)
    st = RenameFails(str(tmp_path), writer_id="verlq")

    async def go() -> tuple[StrawqMessageQueue, list[object]]:
        mq = StrawqMessageQueue(None, 10, path=str(tmp_path))
        mq.q.storage = st
        first = write(w, [(b"s1", "s1")])
        second = write(w, [(b"s1-again", "s1"), (b"s2", "s2")])
        st.victim = first.name
        return mq, await mq.put_written_batches([(f.name, list(f.parts), f.size)
                                                 for f in (first, second)])

    mq, answers = asyncio.run(go())
    assert isinstance(answers[0], list) and "injected" in str(answers[0][0])
    assert answers[1] == [True, True]
    assert drain(mq.q) == [b"s2"]
    assert drain(DurableSampleQueue(str(tmp_path))) == [b"s2", b"s1"]


def test_a_put_whose_joining_failed_fails_alone(tmp_path: Path) -> None:
    """A put stored whose joining the queue failed (its queue-full drop could not be
    written) is answered with its own error; the file's other puts are answered as usual."""
    w = writer(tmp_path)
    st = Faults(str(tmp_path), writer_id="verlq")

    async def go() -> tuple[StrawqMessageQueue, list[object]]:
        mq = StrawqMessageQueue(None, 1, path=str(tmp_path))
        mq.q.storage = st
        written = write(w, [(b"a", "s1"), (b"b", "s2"), (b"c", "s3")])
        st.mode = "drops"  # the queue-full drops (copied out of the batch file) fail
        return mq, await mq.put_written_batches([(written.name, list(written.parts),
                                                  written.size)])

    mq, answers = asyncio.run(go())
    each = answers[0]
    assert isinstance(each, list) and each[0] is True, each
    assert all(isinstance(a, dict) and "injected" in a["error"] for a in each[1:]), each
    assert mq.q.produced == 3


def test_a_file_named_whose_fsync_failed_never_hands_out_its_copy(tmp_path: Path) -> None:
    """The rename into ``samples/`` made, the directories' fsync failed: the puts fail (a
    failed put may be stored), the queue lives on and commits; a restart hands out the
    file's other samples, never its duplicate place."""
    st, q = committed_one_of_two(tmp_path)
    st.mode = "sync"
    with pytest.raises(OSError, match="injected"):
        put_batch(q, writer(tmp_path), [(b"copy-of-s1", "s1"), (b"s9", "s9")])
    assert os.listdir(tmp_path / INCOMING) == []  # the file is in samples/
    forget_s1(q)
    assert drain(DurableSampleQueue(str(tmp_path), keep_commits=1)) == [b"s9"]


def test_a_sample_full_queue_drops_out_of_a_putters_file_stay_dropped(tmp_path: Path) -> None:
    q = DurableSampleQueue(str(tmp_path), max_size=2)
    q.put(b"s0", sample_id="s0")
    assert put_batch(q, writer(tmp_path), [(b"s1", "s1"), (b"d", "s0"), (b"s2", "s2"),
                                           (b"s3", "s3")]) == [True, True, False, False]
    assert drain(q) == [b"s2", b"s3"]
    again = DurableSampleQueue(str(tmp_path), max_size=2)
    assert drain(again) == [b"s2", b"s3"]
    again.commit(2)
    assert os.listdir(tmp_path / SAMPLES) == []


def test_a_put_that_cannot_be_encoded_fails_alone(tmp_path: Path) -> None:
    written, failed = writer(tmp_path).write_batch([
        (b"a", "s1", None), ("not bytes", "s2", None), (b"c", "s3", {"x": object()})])
    assert written is not None and written.parts == ("s1",)
    assert sorted(failed) == [1, 2] and isinstance(failed[1], TypeError)
    assert writer(tmp_path).write_batch([("x", None, None)])[0] is None


# -- the client, without Ray: the queue in the same event loop ----------------------------


class LocalActor:
    """A ``StrawqMessageQueue`` called as the client calls its actor (``m.remote(...)``,
    then ``.future()``), in the client's own event loop; ``answers`` replaces the queue's
    answer to ``put_written_batches`` once."""

    def __init__(self, mq: StrawqMessageQueue) -> None:
        self.mq = mq
        self.answers: list[object] | None = None

    def __getattr__(self, method: str) -> object:
        actor = self

        class Method:
            @staticmethod
            def remote(*args: object, **kwargs: object) -> object:
                async def call() -> object:
                    got = await getattr(actor.mq, method)(*args, **kwargs)
                    if method == "put_written_batches" and actor.answers is not None:
                        got, actor.answers = actor.answers, None
                    return got

                task = asyncio.ensure_future(call())

                class Ref:
                    @staticmethod
                    def future() -> object:
                        return task

                return Ref()

        return Method()


def client_for(tmp_path: Path) -> tuple[object, LocalActor]:
    pytest.importorskip("verl")
    from strawq.collector.integrations.verl.queue_client import StrawqMessageQueueClient

    actor = LocalActor(StrawqMessageQueue(None, 100, path=str(tmp_path / "queue")))
    return StrawqMessageQueueClient(actor), actor


def test_a_file_the_queue_cannot_see_sends_its_puts_through_the_actor_even_if_undeletable(
        tmp_path: Path) -> None:
    """The queue answers None (it cannot see the file) and the file cannot be deleted: the
    puts are still answered, and sent through the actor (they hung before)."""
    client, actor = client_for(tmp_path)

    async def go() -> list[bool]:
        await client.connect()  # type: ignore[attr-defined]

        def undeletable(name: str) -> None:
            raise OSError(errno.EACCES, "injected: cannot delete")

        client._writer.discard = undeletable  # type: ignore[attr-defined]
        actor.answers = [None]
        return await asyncio.wait_for(asyncio.gather(
            client.put_sample(b"a", sample_id="s1"),  # type: ignore[attr-defined]
            client.put_sample(b"b", sample_id="s2")), 30)  # type: ignore[attr-defined]

    assert asyncio.run(go()) == [True, True]
    assert client.sent == 2 and client.written == 0  # type: ignore[attr-defined]
    assert drain(actor.mq.q) == [b"a", b"b"]


def test_a_file_the_queue_could_not_store_fails_its_puts_only(tmp_path: Path) -> None:
    client, actor = client_for(tmp_path)

    async def go() -> list[object]:
        actor.answers = [{"error": "OSError: injected"}]
        first = await asyncio.gather(client.put_sample(b"a", sample_id="s1"),  # type: ignore[attr-defined]
                                     return_exceptions=True)
        second = await client.put_sample(b"b", sample_id="s2")  # type: ignore[attr-defined]
        return [*first, second]

    got = asyncio.run(go())
    assert "could not store" in str(got[0]) and got[1] is True
    # the file the answer was replaced for was stored: a re-put of s1 is a duplicate
    assert actor.mq.q.is_held("s1")


def test_a_put_the_client_cannot_encode_fails_alone(tmp_path: Path) -> None:
    client, actor = client_for(tmp_path)

    async def go() -> list[object]:
        return await asyncio.gather(
            client.put_sample(b"a", sample_id="s1"),  # type: ignore[attr-defined]
            client.put_sample(b"b", sample_id="s2", x=object()),  # type: ignore[attr-defined]
            client.put_sample(b"c", sample_id="s3"),  # type: ignore[attr-defined]
            return_exceptions=True)

    got = asyncio.run(go())
    assert got[0] is True and got[2] is True and isinstance(got[1], Exception), got
    assert drain(actor.mq.q) == [b"a", b"c"]


def test_the_end_of_stream_follows_the_puts_made_before_it(tmp_path: Path) -> None:
    """verl's ``put_sample(None)`` goes to the actor at once; it waits for the puts this
    client made before it, which are still being written, so the trainer gets them first."""
    client, actor = client_for(tmp_path)

    async def go() -> list[object]:
        puts = [asyncio.ensure_future(client.put_sample(bytes([i]) * 8,  # type: ignore[attr-defined]
                                                        sample_id=f"s{i}")) for i in range(5)]
        await asyncio.sleep(0)  # the puts are waiting for their file
        await client.put_sample(None)  # type: ignore[attr-defined]
        await asyncio.gather(*puts)
        got = []
        while (item := await actor.mq.get_sample()) is not None and item[0] is not None:
            got.append(item[0])
        return got

    assert asyncio.run(go()) == [bytes([i]) * 8 for i in range(5)]


@pytest.mark.juicefs
def test_a_batch_file_written_on_one_node_is_named_by_the_queue_on_another(
        juicefs_engine_dirs: tuple[str, str]) -> None:
    """The Rollouter on node A writes batch files into the queue directory on a real JuiceFS
    volume (both metadata engines); the queue on node B names them, hands them out in put
    order with their bytes, and a queue started again on B after a crash before naming
    adopts the file A wrote."""
    a, b = (Path(d) / "q" for d in juicefs_engine_dirs)
    q = DurableSampleQueue(str(b))
    w = writer(a)
    q.put(b"own-0", sample_id="s0")
    assert put_batch(q, w, [(b"a-1", "s1"), (b"copy", "s0"), (b"a-2", "s2")]) == [True] * 3
    write(w, [(b"a-3", "s3"), (b"a-4", "s4")])  # the queue dies before it hears of it
    assert drain(q) == [b"own-0", b"a-1", b"a-2"]
    again = DurableSampleQueue(str(b))
    assert drain(again) == [b"own-0", b"a-1", b"a-2", b"a-3", b"a-4"]
    assert os.listdir(b / INCOMING) == []
    again.commit(5)
    assert os.listdir(b / SAMPLES) == []
