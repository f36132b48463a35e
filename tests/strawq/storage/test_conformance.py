"""The storage conformance suite (``strawq.testing.conformance``) on every backend."""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Callable, Generator, Sequence
from pathlib import Path

import pytest

from strawq.storage import MemoryStorage, PosixStorage, Storage
from strawq.testing.conformance import StorageConformance


class TestPosixStorage(StorageConformance):
    def make_storage(self, tmp_path: Path) -> Storage:
        return PosixStorage(str(tmp_path / "store"))

    def make_tiny_storage(self, tmp_path: Path) -> Generator[Storage, None, None]:
        """A 64 KiB tmpfs (needs root / CAP_SYS_ADMIN; skipped otherwise)."""
        mnt = tmp_path / "tiny"
        mnt.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tiny tmpfs: {proc.stderr.strip() or proc.returncode}")
        try:
            yield PosixStorage(str(mnt / "store"))
        finally:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


class TestPosixStorageNoFsync(StorageConformance):
    """``fsync=False`` (throwaway benchmarks) keeps every guarantee but durability."""

    race_rounds = 5

    def make_storage(self, tmp_path: Path) -> Storage:
        return PosixStorage(str(tmp_path / "store"), fsync=False)


class TestMemoryStorage(StorageConformance):
    def make_storage(self, tmp_path: Path) -> Storage:
        return MemoryStorage()

    def inject_raw(self, storage: Storage, key: str, data: bytes) -> None:
        assert isinstance(storage, MemoryStorage)
        with storage._lock:
            if key.endswith("/"):
                storage._dirs.add(key.rstrip("/"))
            else:
                storage._files[key] = data


@pytest.mark.juicefs
class TestPosixOnJuiceFS(StorageConformance):
    """Two independent JuiceFS clients of one volume: writes on A, reads and races on B."""

    race_rounds = 10

    @pytest.fixture(autouse=True)
    def _juicefs(self, juicefs_dirs: tuple[str, str]) -> None:
        self.dirs = juicefs_dirs

    def make_storage(self, tmp_path: Path) -> Storage:
        return PosixStorage(os.path.join(self.dirs[0], "store"), writer_id="jfsA")

    def _on_b(self, storage: Storage) -> str:
        assert isinstance(storage, PosixStorage)
        rel = os.path.relpath(storage.root, self.dirs[0])
        return os.path.join(self.dirs[1], rel)

    def second_view(self, storage: Storage) -> Storage:
        return PosixStorage(self._on_b(storage), writer_id="jfsB")

    def child_openers(self, storage: Storage) -> Sequence[Callable[[], Storage]]:
        assert isinstance(storage, PosixStorage)
        return [functools.partial(PosixStorage, storage.root),
                functools.partial(PosixStorage, self._on_b(storage))]


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
