"""The storage contract as tests: subclass ``StorageConformance`` for every backend.

In the style of zarr's ``StoreTests`` and fsspec's ``AbstractFixtures``::

    class TestMyStorage(StorageConformance):
        def make_storage(self, tmp_path):
            return MyStorage(tmp_path / "store")

Tests that need a capability the backend does not declare (``Capabilities``) are skipped
with the reason, so a backend can never pass by accident: every ``True`` capability is
exercised. The hooks are abstract: every subclass declares each one (``PosixConformance``
declares the first three for a ``PosixStorage``), so no hook is decided by the type of the
store under test:

* ``child_openers(storage)`` — picklable callables that reopen the *same* store in another
  process (several, e.g. one per mount of a shared filesystem; processes alternate); empty
  for a backend without ``multi_process``.
* ``second_view(storage)`` — the same store seen through another client (mount B), or the
  same handle where there is no other client.
* ``inject_raw(storage, key, data)`` — place bytes under a key behind the backend's back
  (dot-files, torn files), as a crash or another tool would.
* ``make_tiny_storage(tmp_path)`` — a store on a nearly full filesystem, for ENOSPC; a
  backend without one skips with its reason.
"""

from __future__ import annotations

import abc
import errno
import functools
import mmap
import multiprocessing
import os
import stat
import threading
import time
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from strawq import records
from strawq.errors import (
    AlreadyExists,
    ConfigError,
    NotFound,
    StorageError,
    StorageFull,
    StrawqError,
)
from strawq.groups import GroupData, decode_group
from strawq.records import Kind
from strawq.storage import Capabilities, PosixStorage, Storage
from strawq.testing.faults import FaultyStorage

#: Keys that must never become file names (docs/design.md, invariant 7).
INVALID_KEYS = ("", "/abs", "a/", "a//b", "..", "../escape", "a/../b", ".", "a/./b",
                ".hidden", "a/.hidden", "sp ace", "new\nline", "x" * 201, "a\\b", "a/~b",
                "nul\x00")

_DEADLINE_S = 60.0  # how long a cross-client wait may take before the test fails


def _require(storage: Storage, flag: str) -> None:
    if not getattr(storage.capabilities, flag):
        pytest.skip(f"{storage.describe()} does not declare capability {flag!r}")


def _rename_worker(opener: Callable[[], Storage], barrier: Any, rounds: int, me: int,
                   out: Any) -> None:
    """One process of the multi-process rename race: one rename per round."""
    storage = opener()
    wins = []
    for r in range(rounds):
        barrier.wait(timeout=_DEADLINE_S)
        try:
            storage.rename(f"race/src-{r:03d}", f"race/dst-{r:03d}-{me:02d}")
        except NotFound:
            continue
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails
            out.put((me, r, f"{type(exc).__name__}: {exc}"))
            continue
        wins.append(r)
    out.put((me, wins, None))


def _publish_worker(opener: Callable[[], Storage], barrier: Any, rounds: int, me: int,
                    out: Any) -> None:
    """One process of the exclusive-create race: everybody publishes the same keys."""
    storage = opener()
    wins = []
    for r in range(rounds):
        barrier.wait(timeout=_DEADLINE_S)
        try:
            storage.publish(f"excl/k-{r:03d}", f"{me}".encode() * 100)
        except AlreadyExists:
            continue
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            out.put((me, r, f"{type(exc).__name__}: {exc}"))
            continue
        wins.append(r)
    out.put((me, wins, None))


def _eventually(check: Callable[[], bool], deadline_s: float = _DEADLINE_S) -> bool:
    """Poll ``check`` until true or the deadline (a new name may reach another client late;
    this is a deadline against hangs, not a timing assertion)."""
    end = time.monotonic() + deadline_s
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def _mp_context() -> Any:
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def _thread_race(n: int, op: Callable[[int], object],
                 loses_with: type[BaseException]) -> list[int]:
    """Run ``op(i)`` in ``n`` threads released by one barrier; return who won.

    ``loses_with`` is the exception a loser gets; anything else fails the test.
    """
    barrier = threading.Barrier(n)
    wins: list[int] = []
    errors: list[BaseException] = []

    def go(i: int) -> None:
        barrier.wait(timeout=_DEADLINE_S)
        try:
            op(i)
        except loses_with:
            return
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            return
        wins.append(i)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(_DEADLINE_S)
    assert not errors, errors
    return wins


class StorageConformance(abc.ABC):
    """The contract every ``Storage`` backend must meet. Subclass and declare every hook."""

    #: processes in the multi-process races
    processes: int = 8
    #: the tests that start OS processes (the races; the tiny real filesystem is a mount),
    #: so a test runner can put them in a slower tier
    STARTS_PROCESSES = frozenset({"test_publish_exclusive_processes",
                                  "test_rename_one_winner_processes",
                                  "test_enospc_real_filesystem_is_storagefull"})
    #: rounds per race
    race_rounds: int = 20

    # -- hooks -------------------------------------------------------------------------------
    @abc.abstractmethod
    def make_storage(self, tmp_path: Path) -> Storage:
        """A fresh, empty store under ``tmp_path``."""

    @abc.abstractmethod
    def child_openers(self, storage: Storage) -> Sequence[Callable[[], Storage]]:
        """Picklable callables reopening ``storage`` in a child process; empty where the
        backend is one process only (its ``multi_process`` capability is False)."""

    @abc.abstractmethod
    def second_view(self, storage: Storage) -> Storage:
        """The same store through another client; ``storage`` itself where there is none."""

    @abc.abstractmethod
    def inject_raw(self, storage: Storage, key: str, data: bytes) -> None:
        """Write bytes under ``key`` directly (bypassing publish and key validation); a key
        ending in ``/`` makes a directory."""

    @abc.abstractmethod
    def make_tiny_storage(self, tmp_path: Path) -> Generator[Storage, None, None]:
        """Yield a store on a filesystem with a few KiB free, or ``pytest.skip`` with the
        reason the backend has none."""

    # -- fixtures ----------------------------------------------------------------------------
    @pytest.fixture
    def storage(self, tmp_path: Path) -> Storage:
        return self.make_storage(tmp_path)

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
        _require(storage, "exclusive_create")
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
        _require(storage, "exclusive_create")
        for r in range(10):
            wins = _thread_race(12, lambda i, r=r: storage.publish(  # type: ignore[misc]
                f"t/k{r}", str(i).encode() * 1000), AlreadyExists)
            assert len(wins) == 1, f"round {r}: {len(wins)} publishers won: {wins}"
            assert storage.read(f"t/k{r}") == str(wins[0]).encode() * 1000

    def test_publish_exclusive_processes(self, storage: Storage) -> None:
        _require(storage, "exclusive_create")
        _require(storage, "multi_process")
        results = self._run_processes(storage, _publish_worker)
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
            t.join(_DEADLINE_S)
        assert not bad, bad
        assert observed == set(payloads)
        assert storage.list("big") == sorted(n.split("/")[1] for n in payloads)

    def test_publish_visible_to_second_view(self, storage: Storage) -> None:
        view = self.second_view(storage)
        storage.publish("vis/a", b"x" * 5000)
        assert _eventually(lambda: view.exists("vis/a"))
        assert view.read("vis/a") == b"x" * 5000
        assert view.list("vis") == ["a"]
        view.rename("vis/a", "vis/b")
        assert not view.exists("vis/a")
        assert _eventually(lambda: storage.exists("vis/b"))
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

    # -- rename --------------------------------------------------------------------------------
    def test_rename_moves_content(self, storage: Storage) -> None:
        storage.publish("m/src", b"payload")
        storage.rename("m/src", "n/dst")
        assert not storage.exists("m/src")
        assert storage.read("n/dst") == b"payload"
        assert storage.list("m") == [] and storage.list("n") == ["dst"]

    def test_rename_missing_source_is_notfound(self, storage: Storage) -> None:
        storage.makedirs("m")
        with pytest.raises(NotFound) as info:
            storage.rename("m/gone", "m/dst")
        assert isinstance(info.value, FileNotFoundError)
        assert not storage.exists("m/dst")

    def test_rename_missing_source_onto_existing_destination(self, storage: Storage) -> None:
        """Source gone *and* destination present: the source was won (``NotFound``) or this
        is a retried rename whose first attempt won (success); never ``AlreadyExists``,
        which callers would not read as "lost the race"."""
        storage.publish("r2/dst", b"kept")
        try:
            storage.rename("r2/gone", "r2/dst")
        except NotFound:
            pass
        assert storage.read("r2/dst") == b"kept"
        assert not storage.exists("r2/gone")

    def test_rename_never_replaces(self, storage: Storage) -> None:
        _require(storage, "atomic_rename")
        storage.publish("r/src", b"new")
        storage.publish("r/dst", b"old")
        with pytest.raises(AlreadyExists) as info:
            storage.rename("r/src", "r/dst")
        assert isinstance(info.value, FileExistsError)
        assert storage.read("r/dst") == b"old"
        assert storage.read("r/src") == b"new"

    def test_rename_one_winner_threads(self, storage: Storage) -> None:
        _require(storage, "atomic_rename")
        for r in range(self.race_rounds):
            storage.publish(f"t/src{r}", f"content {r}".encode())
            wins = _thread_race(16, lambda i, r=r: storage.rename(  # type: ignore[misc]
                f"t/src{r}", f"t/dst{r}-{i:02d}"), NotFound)
            assert len(wins) == 1, f"round {r}: {len(wins)} renames won: {wins}"
            assert not storage.exists(f"t/src{r}")
            dsts = [x for x in storage.list("t") if x.startswith(f"dst{r}-")]
            assert dsts == [f"dst{r}-{wins[0]:02d}"]
            assert storage.read(f"t/{dsts[0]}") == f"content {r}".encode()

    def test_rename_one_winner_processes(self, storage: Storage) -> None:
        _require(storage, "atomic_rename")
        _require(storage, "multi_process")
        for r in range(self.race_rounds):
            storage.publish(f"race/src-{r:03d}", f"round {r}".encode())
        results = self._run_processes(storage, _rename_worker)
        for r in range(self.race_rounds):
            winners = [me for me, wins in results.items() if r in wins]
            assert len(winners) == 1, f"round {r}: winners {winners}"
            assert storage.read(f"race/dst-{r:03d}-{winners[0]:02d}") == f"round {r}".encode()
        assert not [n for n in storage.list("race") if n.startswith("src-")]

    def test_rename_into_missing_directory(self, storage: Storage) -> None:
        """Like ``publish``, a rename creates the destination's parents.

        A ``NotFound`` here would read as "somebody else won the source" to every caller.
        """
        storage.publish("rm/src", b"z")
        storage.rename("rm/src", "fresh/dir/dst")
        assert storage.read("fresh/dir/dst") == b"z"
        assert not storage.exists("rm/src")

    def test_dir_rename(self, storage: Storage) -> None:
        _require(storage, "atomic_rename")
        for i in range(5):
            storage.publish(f"stage/r1/f{i}", f"{i}".encode())
        storage.publish("stage/r1/sub/deep", b"deep")
        storage.makedirs("live")
        storage.rename("stage/r1", "live/r1")
        assert not storage.exists("stage/r1")
        assert storage.list("stage") == []
        assert storage.list("live/r1") == [*(f"f{i}" for i in range(5)), "sub"]
        assert storage.read("live/r1/f3") == b"3"
        assert storage.read("live/r1/sub/deep") == b"deep"
        # never onto an existing directory, even an empty one (plain rename(2) would)
        storage.makedirs("stage/r2")
        storage.publish("stage/r2/g", b"g")
        storage.makedirs("live/r2")
        with pytest.raises(AlreadyExists):
            storage.rename("stage/r2", "live/r2")
        assert storage.read("stage/r2/g") == b"g" and storage.list("live/r2") == []
        with pytest.raises(NotFound):
            storage.rename("stage/r1", "live/r3")

    # -- list, delete, rmdir -------------------------------------------------------------------
    def test_list_sorted_skips_dotfiles(self, storage: Storage) -> None:
        names = ["b", "a10", "a2", "Z", "c~1", "a1"]
        for n in names:
            storage.publish(f"l/{n}", b"")
        storage.makedirs("l/subdir")
        storage.publish("l/nested/x", b"")
        self.inject_raw(storage, "l/.nfs000123", b"silly rename")
        self.inject_raw(storage, "l/.hiddendir/", b"")
        got = storage.list("l")
        assert got == sorted([*names, "subdir", "nested"])
        assert storage.list("l/nested") == ["x"]
        assert storage.list("absent") == []

    def test_list_root(self, storage: Storage) -> None:
        storage.publish("one", b"")
        storage.publish("two/x", b"")
        root = storage.list("")
        assert "one" in root and "two" in root and root == sorted(root)

    def test_delete_missing_ok(self, storage: Storage) -> None:
        storage.delete("d/never")
        with pytest.raises(NotFound):
            storage.delete("d/never", missing_ok=False)
        storage.publish("d/k", b"v")
        storage.delete("d/k", missing_ok=False)
        assert not storage.exists("d/k")
        storage.delete("d/k")

    def test_rmdir_only_empty(self, storage: Storage) -> None:
        storage.publish("rd/full/f", b"")
        assert storage.rmdir("rd/full") is False
        assert storage.read("rd/full/f") == b""
        storage.makedirs("rd/empty")
        assert storage.rmdir("rd/empty") is True
        assert not storage.exists("rd/empty")
        assert storage.rmdir("rd/empty") is False
        assert storage.rmdir("rd/never") is False

    def test_makedirs_idempotent(self, storage: Storage) -> None:
        storage.makedirs("mk/a/b")
        storage.makedirs("mk/a/b")
        assert storage.is_dir("mk/a/b") and storage.list("mk/a/b") == []

    def test_sync_dirs(self, storage: Storage) -> None:
        storage.publish("s1/a", b"", sync_dir=False)
        storage.rename("s1/a", "s2/a", sync_dir=False)
        storage.sync_dirs(["s1", "s2", "s2", ""])
        assert storage.read("s2/a") == b""

    # -- validation and errors -----------------------------------------------------------------
    @pytest.mark.parametrize("key", INVALID_KEYS)
    def test_invalid_keys_rejected(self, storage: Storage, key: str) -> None:
        storage.publish("ok/src", b"x")
        ops: list[Callable[[], object]] = [
            lambda: storage.publish(key, b"x"),
            lambda: storage.read(key),
            lambda: storage.read_prefix(key, 1),
            lambda: storage.rename("ok/src", key),
            lambda: storage.rename(key, "ok/dst"),
            lambda: storage.delete(key),
            lambda: storage.makedirs(key),
        ]
        for op in ops:
            with pytest.raises(ConfigError):
                op()
        assert storage.read("ok/src") == b"x" and not storage.exists("ok/dst")

    def test_enospc_is_storagefull(self, storage: Storage) -> None:
        faulty = FaultyStorage(storage, errors={"publish": (1, errno.ENOSPC),
                                                "rename": (1, errno.EDQUOT)})
        with pytest.raises(StorageFull) as info:
            faulty.publish("full/k", b"data")
        assert info.value.errno == errno.ENOSPC
        assert isinstance(info.value, (StorageError, OSError, StrawqError))
        assert "free space" in str(info.value)
        assert not storage.exists("full/k")
        faulty.publish("full/k", b"data")  # the 2nd publish goes through
        with pytest.raises(StorageFull):
            faulty.rename("full/k", "full/k2")
        assert storage.read("full/k") == b"data"

    def test_enospc_real_filesystem_is_storagefull(self, tmp_path: Path) -> None:
        gen = self.make_tiny_storage(tmp_path)
        tiny = next(gen)
        try:
            with pytest.raises(StorageFull):
                tiny.publish("huge", b"\xff" * (1 << 20))
            assert not tiny.exists("huge")
            assert tiny.list("tmp") == [], "publish left its temporary file behind"
            with pytest.raises(StorageFull):
                tiny.publish("stage/huge", b"\xff" * (1 << 20), in_place=True)
            assert not tiny.exists("stage/huge"), "an in-place publish left its partial file"
            tiny.publish("small", b"fits")
            assert tiny.read("small") == b"fits"
        finally:
            gen.close()

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
        _require(storage, "mmap")
        storage.publish("mm/k", b"mapped bytes" * 100)
        path = storage.local_path("mm/k")
        assert path is not None
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            assert m[:12] == b"mapped bytes" and len(m) == 1200

    def test_durable_publish_fsyncs(self, storage: Storage,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
        """File fsync'd before it gets its name; its directory fsync'd after."""
        _require(storage, "durable")
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

    # -- helpers -------------------------------------------------------------------------------
    def _run_processes(self, storage: Storage, worker: Callable[..., None]
                       ) -> dict[int, list[int]]:
        openers = list(self.child_openers(storage))
        if not openers:
            pytest.fail(f"{storage.describe()} declares multi_process, but child_openers "
                        "returns no way to reopen it in another process")
        ctx = _mp_context()
        barrier = ctx.Barrier(self.processes)
        out = ctx.Queue()
        procs = [ctx.Process(target=worker, args=(openers[i % len(openers)], barrier,
                                                  self.race_rounds, i, out))
                 for i in range(self.processes)]
        for p in procs:
            p.start()
        results: dict[int, list[int]] = {}
        errors = []
        try:
            while len(results) < self.processes:
                me, wins, err = out.get(timeout=_DEADLINE_S * 2)
                if err is not None:
                    errors.append((me, wins, err))
                else:
                    results[me] = wins
        finally:
            for p in procs:
                p.join(_DEADLINE_S)
                if p.is_alive():
                    p.kill()
        assert not errors, errors
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        return results


class PosixConformance(StorageConformance):
    """The hooks for a store that is a ``PosixStorage`` (a local disk, a mount): reopen it
    from its root, view it through a second handle, write raw files under its root.
    Subclasses declare ``make_storage`` and ``make_tiny_storage``."""

    @abc.abstractmethod
    def make_storage(self, tmp_path: Path) -> PosixStorage:
        """A fresh, empty ``PosixStorage`` under ``tmp_path``."""

    @staticmethod
    def posix(storage: Storage) -> PosixStorage:
        """``storage`` as the ``PosixStorage`` that ``make_storage`` returned."""
        if not isinstance(storage, PosixStorage):
            raise TypeError(f"PosixConformance needs make_storage to return a PosixStorage, "
                            f"got {type(storage).__name__}")
        return storage

    def child_openers(self, storage: Storage) -> Sequence[Callable[[], Storage]]:
        return [functools.partial(PosixStorage, self.posix(storage).root)]

    def second_view(self, storage: Storage) -> Storage:
        return PosixStorage(self.posix(storage).root, writer_id="view2")

    def inject_raw(self, storage: Storage, key: str, data: bytes) -> None:
        path = os.path.join(self.posix(storage).root, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if key.endswith("/"):
            os.makedirs(path, exist_ok=True)
            return
        with open(path, "wb") as f:
            f.write(data)
