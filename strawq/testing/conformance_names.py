"""The storage conformance suite, the namespace: rename (one winner, never a replace),
rename within a directory, list, delete, rmdir, makedirs, directory syncs.

One area of ``strawq.testing.conformance.StorageConformance``.
"""

from __future__ import annotations

import pytest

from strawq.errors import AlreadyExists, NotFound
from strawq.storage import Storage
from strawq.testing.conformance_hooks import (ConformanceHooks, rename_worker, require,
                                              thread_race)


class NamespaceConformance(ConformanceHooks):
    """Operations on names: ``rename``, ``list``, ``delete``, ``rmdir``, ``makedirs``."""

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
        require(storage, "atomic_rename")
        storage.publish("r/src", b"new")
        storage.publish("r/dst", b"old")
        with pytest.raises(AlreadyExists) as info:
            storage.rename("r/src", "r/dst")
        assert isinstance(info.value, FileExistsError)
        assert storage.read("r/dst") == b"old"
        assert storage.read("r/src") == b"new"

    def test_rename_within_is_rename_between_two_names(self, storage: Storage) -> None:
        """``rename_within(dir, a, b)``: ``rename``'s outcomes, call after call (a backend
        may hold the directory open between calls)."""
        storage.publish("w/a", b"body")
        storage.rename_within("w", "a", "b")
        storage.rename_within("w", "b", "c")
        assert storage.list("w") == ["c"] and storage.read("w/c") == b"body"
        with pytest.raises(NotFound):
            storage.rename_within("w", "a", "d")
        storage.publish("w/e", b"other")
        if storage.capabilities.atomic_rename:
            with pytest.raises(AlreadyExists):
                storage.rename_within("w", "c", "e")
        assert storage.read("w/c") == b"body" and storage.read("w/e") == b"other"
        with pytest.raises(ValueError):
            storage.rename_within("w", "c", "../x")
        storage.delete("w/c")
        storage.delete("w/e")
        storage.rmdir("w")  # a directory of the name made again: renames within it
        storage.publish("w/f", b"anew")
        storage.rename_within("w", "f", "g")
        assert storage.list("w") == ["g"] and storage.read("w/g") == b"anew"

    def test_rename_one_winner_threads(self, storage: Storage) -> None:
        require(storage, "atomic_rename")
        for r in range(self.race_rounds):
            storage.publish(f"t/src{r}", f"content {r}".encode())
            wins = thread_race(16, lambda i, r=r: storage.rename(  # type: ignore[misc]
                f"t/src{r}", f"t/dst{r}-{i:02d}"), NotFound)
            assert len(wins) == 1, f"round {r}: {len(wins)} renames won: {wins}"
            assert not storage.exists(f"t/src{r}")
            dsts = [x for x in storage.list("t") if x.startswith(f"dst{r}-")]
            assert dsts == [f"dst{r}-{wins[0]:02d}"]
            assert storage.read(f"t/{dsts[0]}") == f"content {r}".encode()

    def test_rename_one_winner_processes(self, storage: Storage) -> None:
        require(storage, "atomic_rename")
        require(storage, "multi_process")
        for r in range(self.race_rounds):
            storage.publish(f"race/src-{r:03d}", f"round {r}".encode())
        results = self._run_processes(storage, rename_worker)
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
        require(storage, "atomic_rename")
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
