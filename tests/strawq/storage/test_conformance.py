"""The storage conformance suite (``strawq.testing.conformance``) on every backend."""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import pytest

from strawq.storage import MemoryStorage, PosixStorage, Storage
from strawq.testing.conformance import PosixConformance, StorageConformance


def tiny_tmpfs(tmp_path: Path, **kw: Any) -> Generator[PosixStorage, None, None]:
    """A ``PosixStorage`` on a 64 KiB tmpfs (needs root / CAP_SYS_ADMIN; skipped otherwise)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tiny tmpfs: {proc.stderr.strip() or proc.returncode}")
    try:
        yield PosixStorage(str(mnt / "store"), **kw)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


class TestPosixStorage(PosixConformance):
    def make_storage(self, tmp_path: Path) -> PosixStorage:
        return PosixStorage(str(tmp_path / "store"))

    def make_tiny_storage(self, tmp_path: Path) -> Generator[Storage, None, None]:
        yield from tiny_tmpfs(tmp_path)


class TestPosixStorageNoFsync(PosixConformance):
    """``fsync=False`` (throwaway benchmarks) keeps every guarantee but durability."""

    race_rounds = 5

    def make_storage(self, tmp_path: Path) -> PosixStorage:
        return PosixStorage(str(tmp_path / "store"), fsync=False)

    def make_tiny_storage(self, tmp_path: Path) -> Generator[Storage, None, None]:
        yield from tiny_tmpfs(tmp_path, fsync=False)


class TestMemoryStorage(StorageConformance):
    def make_storage(self, tmp_path: Path) -> Storage:
        return MemoryStorage()

    def child_openers(self, storage: Storage) -> Sequence[Callable[[], Storage]]:
        return ()  # one process only: multi_process is False

    def second_view(self, storage: Storage) -> Storage:
        return storage  # no other client of a process's memory

    def inject_raw(self, storage: Storage, key: str, data: bytes) -> None:
        assert isinstance(storage, MemoryStorage)
        with storage._lock:
            if key.endswith("/"):
                storage._dirs.add(key.rstrip("/"))
            else:
                storage._files[key] = data

    def make_tiny_storage(self, tmp_path: Path) -> Generator[Storage, None, None]:
        pytest.skip("MemoryStorage has no filesystem to fill; its StorageFull path is the "
                    "injected one (test_enospc_is_storagefull)")
        yield  # pragma: no cover


@pytest.mark.juicefs
class TestPosixOnJuiceFS(PosixConformance):
    """Two independent JuiceFS clients of one volume: writes on A, reads and races on B."""

    race_rounds = 10

    @pytest.fixture(autouse=True)
    def _juicefs(self, juicefs_dirs: tuple[str, str]) -> None:
        self.dirs = juicefs_dirs

    def make_storage(self, tmp_path: Path) -> PosixStorage:
        return PosixStorage(os.path.join(self.dirs[0], "store"), writer_id="jfsA")

    def _on_b(self, storage: Storage) -> str:
        rel = os.path.relpath(self.posix(storage).root, self.dirs[0])
        return os.path.join(self.dirs[1], rel)

    def second_view(self, storage: Storage) -> Storage:
        return PosixStorage(self._on_b(storage), writer_id="jfsB")

    def child_openers(self, storage: Storage) -> Sequence[Callable[[], Storage]]:
        return [functools.partial(PosixStorage, self.posix(storage).root),
                functools.partial(PosixStorage, self._on_b(storage))]

    def make_tiny_storage(self, tmp_path: Path) -> Generator[Storage, None, None]:
        pytest.skip("the JuiceFS test volume has no size small enough to fill; a full "
                    "local filesystem is TestPosixStorage's case")
        yield  # pragma: no cover


def test_conformance_suite_has_the_documented_tests() -> None:
    """docs reference these names; renaming one must be a conscious change."""
    documented = {
        "test_publish_is_exclusive", "test_publish_atomic_no_torn_read",
        "test_rename_one_winner_threads", "test_rename_missing_source_is_notfound",
        "test_rename_never_replaces", "test_list_sorted_skips_dotfiles",
        "test_delete_missing_ok", "test_rmdir_only_empty", "test_dir_rename",
        "test_invalid_keys_rejected", "test_enospc_is_storagefull",
    }
    missing = documented - set(dir(StorageConformance))
    assert not missing, missing


def test_a_backend_declares_every_hook() -> None:
    """No hook has a default that guesses from the store's type: a subclass that declares
    only ``make_storage`` cannot run (and so cannot pass) the suite."""

    class OnlyMakeStorage(StorageConformance):
        def make_storage(self, tmp_path: Path) -> Storage:
            return MemoryStorage()

    with pytest.raises(TypeError, match="abstract") as info:
        OnlyMakeStorage()  # type: ignore[abstract]
    for hook in ("child_openers", "second_view", "inject_raw", "make_tiny_storage"):
        assert hook in str(info.value)
