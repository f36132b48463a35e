"""The storage conformance suite, publish and read: atomic, exclusive, durable publishes,
seen whole by every client; records through the store.

One area of ``strawq.testing.conformance.StorageConformance``.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading

import numpy as np
import pytest

from strawq.errors import AlreadyExists, NotFound
from strawq.ondisk import records
from strawq.ondisk.groups import GroupData, decode_group
from strawq.ondisk.records import Kind
from strawq.storage import Capabilities, Storage
from strawq.testing.conformance_hooks import (
    DEADLINE_S,
    ConformanceHooks,
    eventually,
    publish_worker,
    require,
    thread_race,
)


class PublishConformance(ConformanceHooks):
    """``publish``, ``read``, ``read_prefix``, ``local_path``, and records round-tripped."""

    # -- publish -------------------------------------------------------------------------------
    def test_capabilities_declared(self, storage: Storage) -> None:
        assert isinstance(storage.capabilities, Capabilities)
        assert isinstance(storage.describe(), str) and storage.describe()

    def test_publish_read_round_trip(self, storage: Storage) -> None:
        storage.publish("a/b/c", b"hello")
        storage.publish("top", memoryview(b"view"))
        storage.publish("a/empty", b"")
        assert storage.read("a/b/c") == b"hello"
        assert storage.read("top") == b"view"
        assert storage.read("a/empty") == b""
        assert storage.size("a/b/c") == 5
        assert storage.exists("a/b/c") and storage.exists("a/b")
        assert storage.is_dir("a/b") and not storage.is_dir("a/b/c")

    def test_publish_sequence_of_buffers(self, storage: Storage) -> None:
        ints = np.arange(10, dtype=np.int32)
        chunks: list[bytes | memoryview] = [b"head", b"", memoryview(b"-mid-"),
                                            ints.data, b"tail"]
        storage.publish("seq/k", chunks)
        assert storage.read("seq/k") == b"head-mid-" + ints.tobytes() + b"tail"
        storage.publish("seq/none", [])
        assert storage.read("seq/none") == b""

    def test_publish_without_file_sync_is_still_atomic(self, storage: Storage) -> None:
        """``sync_file=False`` (heartbeat counters) gives up durability, nothing else."""
        storage.publish("nosync/k", [b"a" * 100, b"b"], sync_dir=False, sync_file=False)
        assert storage.read("nosync/k") == b"a" * 100 + b"b"
        with pytest.raises(AlreadyExists):
            storage.publish("nosync/k", b"again", sync_file=False)
        assert storage.read("nosync/k") == b"a" * 100 + b"b"

    def test_publish_is_exclusive(self, storage: Storage) -> None:
        require(storage, "exclusive_create")
        storage.publish("x/k", b"first")
        with pytest.raises(AlreadyExists) as info:
            storage.publish("x/k", b"second")
        assert isinstance(info.value, FileExistsError)
        assert storage.read("x/k") == b"first"
        storage.makedirs("x/dir")
        with pytest.raises(AlreadyExists):
            storage.publish("x/dir", b"onto a directory")
        assert storage.is_dir("x/dir")

    def test_publish_exclusive_threads(self, storage: Storage) -> None:
        require(storage, "exclusive_create")
        for r in range(10):
            wins = thread_race(12, lambda i, r=r: storage.publish(  # type: ignore[misc]
                f"t/k{r}", str(i).encode() * 1000), AlreadyExists)
            assert len(wins) == 1, f"round {r}: {len(wins)} publishers won: {wins}"
            assert storage.read(f"t/k{r}") == str(wins[0]).encode() * 1000

    def test_publish_exclusive_processes(self, storage: Storage) -> None:
        require(storage, "exclusive_create")
        require(storage, "multi_process")
        results = self._run_processes(storage, publish_worker)
        for r in range(self.race_rounds):
            winners = [me for me, wins in results.items() if r in wins]
            assert len(winners) == 1, f"round {r}: winners {winners}"
            assert storage.read(f"excl/k-{r:03d}") == f"{winners[0]}".encode() * 100

    def test_publish_atomic_no_torn_read(self, storage: Storage) -> None:
        """A reader (through another client, where there is one) sees nothing or all."""
        view = self.second_view(storage)
        size, count = 1 << 18, 24
        payloads = {f"big/k{i:02d}": bytes([i + 1]) * size for i in range(count)}
        done = threading.Event()
        bad: list[str] = []
        observed: set[str] = set()

        def reader() -> None:
            while True:
                finished = done.is_set()
                for n in view.list("big"):
                    key = f"big/{n}"
                    try:
                        data = view.read(key)
                    except NotFound:
                        continue
                    if data != payloads.get(key):
                        bad.append(f"{key}: {len(data)} bytes, first {data[:1]!r}")
                    observed.add(key)
                if finished:
                    return

        t = threading.Thread(target=reader)
        t.start()
        try:
            for key, data in payloads.items():
                storage.publish(key, [data[: size // 3], data[size // 3:]])
        finally:
            done.set()
            t.join(DEADLINE_S)
        assert not bad, bad
        assert observed == set(payloads)
        assert storage.list("big") == sorted(n.split("/")[1] for n in payloads)

    def test_publish_visible_to_second_view(self, storage: Storage) -> None:
        view = self.second_view(storage)
        storage.publish("vis/a", b"x" * 5000)
        assert eventually(lambda: view.exists("vis/a"))
        assert view.read("vis/a") == b"x" * 5000
        assert view.list("vis") == ["a"]
        view.rename("vis/a", "vis/b")
        assert not view.exists("vis/a")
        assert eventually(lambda: storage.exists("vis/b"))
        assert storage.read("vis/b") == b"x" * 5000
        with pytest.raises(NotFound):  # the source is gone for every client's rename
            storage.rename("vis/a", "vis/c")

    def test_publish_in_place(self, storage: Storage) -> None:
        """``in_place`` (records in a private staging directory): the same content,
        exclusivity, parents and durability as a publish, with no temporary file."""
        storage.publish("stage/r1/a", [b"head", memoryview(b"-tail")], sync_dir=False,
                        in_place=True)
        storage.publish("stage/r1/b", b"", in_place=True)
        assert storage.read("stage/r1/a") == b"head-tail" and storage.read("stage/r1/b") == b""
        assert storage.list("stage/r1") == ["a", "b"]
        if storage.capabilities.exclusive_create:
            with pytest.raises(AlreadyExists):
                storage.publish("stage/r1/a", b"again", in_place=True)
            assert storage.read("stage/r1/a") == b"head-tail"
        assert storage.list("tmp") == [], "an in-place publish uses no temporary file"
        storage.sync_dirs(["stage/r1", "stage"])
        storage.rename("stage/r1", "live/r1")
        assert storage.read("live/r1/a") == b"head-tail"

    def test_publish_creates_parents(self, storage: Storage) -> None:
        storage.publish("p/q/r/s", b"deep")
        assert storage.list("p") == ["q"] and storage.list("p/q/r") == ["s"]

    def test_read_range(self, storage: Storage) -> None:
        storage.publish("rr/a", b"0123456789")
        assert storage.read_range("rr/a", 0, 4) == b"0123"
        assert storage.read_range("rr/a", 3, 4) == b"3456"
        assert storage.read_range("rr/a", 8, 10) == b"89"  # fewer at the end
        assert storage.read_range("rr/a", 10, 4) == b"" and storage.read_range("rr/a", 99, 1) == b""
        with pytest.raises(NotFound):
            storage.read_range("rr/none", 0, 1)

    # -- append (``Capabilities.append``) ------------------------------------------------------
    def test_append_adds_at_the_end(self, storage: Storage) -> None:
        require(storage, "append")
        storage.publish("seg/a", b"first")
        storage.append("seg/a", b"-second")
        storage.append("seg/a", [b"-th", memoryview(b"ird"), b""])
        assert storage.read("seg/a") == b"first-second-third"
        storage.end_append("seg/a")
        storage.append("seg/a", b"!")  # reopened after end_append
        assert storage.read("seg/a") == b"first-second-third!"
        storage.end_append("seg/a")
        storage.end_append("seg/a")  # twice: nothing held, nothing to do

    def test_append_to_missing_or_deleted_is_notfound(self, storage: Storage) -> None:
        require(storage, "append")
        with pytest.raises(NotFound):
            storage.append("seg/none", b"x")
        assert not storage.exists("seg/none"), "an append never creates its file"
        storage.publish("seg/b", b"x")
        storage.append("seg/b", b"y")
        storage.delete("seg/b")  # a file held open for appends is let go of
        with pytest.raises(NotFound):
            storage.append("seg/b", b"z")
        assert not storage.exists("seg/b")

    def test_append_visible_to_second_view(self, storage: Storage) -> None:
        """What an append made durable, another client reads (a resume on another node)."""
        require(storage, "append")
        view = self.second_view(storage)
        storage.publish("seg/c", b"a" * 3000)
        assert eventually(lambda: view.exists("seg/c"))
        assert view.read("seg/c") == b"a" * 3000
        storage.append("seg/c", b"b" * 3000)
        assert eventually(lambda: view.read("seg/c") == b"a" * 3000 + b"b" * 3000)
        storage.end_append("seg/c")

    # -- read ----------------------------------------------------------------------------------
    def test_read_missing_is_notfound(self, storage: Storage) -> None:
        with pytest.raises(NotFound) as info:
            storage.read("nope/nothing")
        assert isinstance(info.value, FileNotFoundError)
        with pytest.raises(NotFound):
            storage.read_prefix("nope/nothing", 4)
        assert not storage.exists("nope/nothing") and not storage.is_dir("nope")

    def test_read_prefix(self, storage: Storage) -> None:
        storage.publish("rp", b"0123456789")
        assert storage.read_prefix("rp", 4) == b"0123"
        assert storage.read_prefix("rp", 0) == b""
        assert storage.read_prefix("rp", 100) == b"0123456789"

    # -- records through the store -------------------------------------------------------------
    def test_records_survive_round_trip(self, storage: Storage) -> None:
        meta = {"task": {"index": 7, "row": {"prompt": "hi", "ids": [1, 2]}}, "x": 1.5}
        storage.publish("rec/task", records.encode(Kind.TASK, meta))
        rec = records.decode(storage.read("rec/task"), expect=Kind.TASK)
        assert rec.meta["task"] == meta["task"] and rec.meta["x"] == 1.5
        tokens = np.arange(37, dtype=np.int32)
        group = GroupData(task_id="i7", index=7, prompt_ids=np.arange(3), sample_lens=[30, 7],
                          tokens=tokens, logprobs=-tokens.astype(np.float32) / 10,
                          versions=np.repeat([3, 4], [30, 7]), loss_mask=np.ones(37),
                          rewards=[1.0, None], status=["completed", "aborted"])
        storage.publish("rec/group", group.encode())
        back = decode_group(storage.read("rec/group"))
        for col in ("tokens", "logprobs", "versions", "loss_mask"):
            np.testing.assert_array_equal(getattr(back, col), getattr(group, col))
        assert back.sample_lens == [30, 7] and back.rewards == [1.0, None]
        assert back.min_version() == 3

    def test_local_path_mmap(self, storage: Storage) -> None:
        require(storage, "mmap")
        storage.publish("mm/k", b"mapped bytes" * 100)
        path = storage.local_path("mm/k")
        assert path is not None
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            assert m[:12] == b"mapped bytes" and len(m) == 1200

    def test_durable_publish_fsyncs(self, storage: Storage,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
        """File fsync'd before it gets its name; its directory fsync'd after."""
        require(storage, "durable")
        if storage.local_path("x") is None:
            pytest.skip("durability of a non-filesystem backend is checked by its own tests")
        storage.makedirs("dur")
        dst = storage.local_path("dur/k")
        assert dst is not None
        calls: list[tuple[bool, bool]] = []
        real_fsync = os.fsync

        def spy(fd: int) -> None:
            calls.append((stat.S_ISDIR(os.fstat(fd).st_mode), os.path.exists(dst)))
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", spy)
        storage.publish("dur/k", b"durable")
        monkeypatch.undo()
        assert (False, False) in calls, f"no file fsync before the rename: {calls}"
        assert (True, True) in calls, f"no directory fsync after the rename: {calls}"
        first_dir = calls.index((True, True))
        assert calls.index((False, False)) < first_dir
        # in place: the file fsync'd (it has its name from the start), then its directory
        in_place = storage.local_path("dur/p")
        assert in_place is not None
        seen: list[tuple[bool, bool]] = []

        def spy_in_place(fd: int) -> None:
            seen.append((stat.S_ISDIR(os.fstat(fd).st_mode), os.path.exists(in_place)))
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", spy_in_place)
        storage.publish("dur/p", b"durable", in_place=True)
        monkeypatch.undo()
        assert seen == [(False, True), (True, True)], seen
