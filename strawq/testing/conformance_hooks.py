"""The storage conformance suite's hooks and plumbing: what a backend declares, and the
races, waits and child processes the tests share.

``ConformanceHooks`` holds the abstract hooks (described in ``strawq.testing.conformance``)
and the ``storage`` fixture; the areas of ``StorageConformance`` are mixins over it.
"""

from __future__ import annotations

import abc
import multiprocessing
import threading
import time
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import pytest

from strawq.errors import AlreadyExists, NotFound
from strawq.storage import Storage

#: Keys that must never become file names (docs/design.md, invariant 7).
INVALID_KEYS = ("", "/abs", "a/", "a//b", "..", "../escape", "a/../b", ".", "a/./b",
                ".hidden", "a/.hidden", "sp ace", "new\nline", "x" * 201, "a\\b", "a/~b",
                "nul\x00")

DEADLINE_S = 60.0  # how long a cross-client wait may take before the test fails


def require(storage: Storage, flag: str) -> None:
    if not getattr(storage.capabilities, flag):
        pytest.skip(f"{storage.describe()} does not declare capability {flag!r}")


def rename_worker(opener: Callable[[], Storage], barrier: Any, rounds: int, me: int,
                   out: Any) -> None:
    """One process of the multi-process rename race: one rename per round."""
    storage = opener()
    wins = []
    for r in range(rounds):
        barrier.wait(timeout=DEADLINE_S)
        try:
            storage.rename(f"race/src-{r:03d}", f"race/dst-{r:03d}-{me:02d}")
        except NotFound:
            continue
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails
            out.put((me, r, f"{type(exc).__name__}: {exc}"))
            continue
        wins.append(r)
    out.put((me, wins, None))


def publish_worker(opener: Callable[[], Storage], barrier: Any, rounds: int, me: int,
                    out: Any) -> None:
    """One process of the exclusive-create race: everybody publishes the same keys."""
    storage = opener()
    wins = []
    for r in range(rounds):
        barrier.wait(timeout=DEADLINE_S)
        try:
            storage.publish(f"excl/k-{r:03d}", f"{me}".encode() * 100)
        except AlreadyExists:
            continue
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            out.put((me, r, f"{type(exc).__name__}: {exc}"))
            continue
        wins.append(r)
    out.put((me, wins, None))


def eventually(check: Callable[[], bool], deadline_s: float = DEADLINE_S) -> bool:
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


def thread_race(n: int, op: Callable[[int], object],
                 loses_with: type[BaseException]) -> list[int]:
    """Run ``op(i)`` in ``n`` threads released by one barrier; return who won.

    ``loses_with`` is the exception a loser gets; anything else fails the test.
    """
    barrier = threading.Barrier(n)
    wins: list[int] = []
    errors: list[BaseException] = []

    def go(i: int) -> None:
        barrier.wait(timeout=DEADLINE_S)
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
        t.join(DEADLINE_S)
    assert not errors, errors
    return wins


class ConformanceHooks(abc.ABC):
    """The hooks every backend declares, and the multi-process race runner."""

    #: processes in the multi-process races
    processes: int = 8
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
                me, wins, err = out.get(timeout=DEADLINE_S * 2)
                if err is not None:
                    errors.append((me, wins, err))
                else:
                    results[me] = wins
        finally:
            for p in procs:
                p.join(DEADLINE_S)
                if p.is_alive():
                    p.kill()
        assert not errors, errors
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        return results
