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
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from strawq.errors import ConfigError, StorageError, StorageFull, StrawqError
from strawq.storage import PosixStorage, Storage
from strawq.testing.conformance_hooks import INVALID_KEYS
from strawq.testing.faults import FaultyStorage
from strawq.testing.conformance_names import NamespaceConformance
from strawq.testing.conformance_publish import PublishConformance

__all__ = ["INVALID_KEYS", "PosixConformance", "StorageConformance"]


class StorageConformance(PublishConformance, NamespaceConformance):
    """The contract every ``Storage`` backend must meet. Subclass and declare every hook.

    The areas are mixins (``conformance_publish``, ``conformance_names``) over the hooks
    (``conformance_hooks``); key validation and full filesystems are here."""

    #: the tests that start OS processes (the races; the tiny real filesystem is a mount),
    #: so a test runner can put them in a slower tier
    STARTS_PROCESSES = frozenset({"test_publish_exclusive_processes",
                                  "test_rename_one_winner_processes",
                                  "test_enospc_real_filesystem_is_storagefull"})

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
