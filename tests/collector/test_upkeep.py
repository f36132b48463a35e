"""The collector's upkeep on its clock (``strawq.collector.upkeep``): when a pass collects
and when it sweeps, and how a full disk is reported while passes fail."""

from __future__ import annotations

import errno
import logging
from typing import Any

import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.upkeep import FULL_REMIND_S, SWEEP_INTERVAL_S, FullDisk, GcSchedule
from strawq.delivery.batches import BatchStore, GcReport
from strawq.errors import StorageFull
from strawq.storage import Storage


class _Storage:
    root = "/runs/r"

    def __init__(self) -> None:
        self.cleaned = 0

    def clean_dead_tmp(self) -> int:
        self.cleaned += 1
        return 2

    def describe(self) -> str:
        return self.root


class _Batches:
    def __init__(self) -> None:
        self.storage = _Storage()
        self.calls: list[bool] = []

    def gc(self, *, sweep: bool, compact_drops_at: int) -> GcReport:
        self.calls.append(sweep)
        return GcReport()


def _schedule(gc_interval_s: float) -> tuple[GcSchedule, _Batches]:
    batches = _Batches()
    cfg = CollectorConfig(gc_interval_s=gc_interval_s, disk_warn_share=0.0)
    fake: Any = batches
    return GcSchedule(cfg, fake), batches


def test_gc_runs_every_interval_and_sweeps_every_sweep_interval() -> None:
    gc, batches = _schedule(1.0)
    first = gc.due(0.0)
    assert first is not None and first.tmp == 2  # the first pass sweeps: dead writers' tmp
    assert gc.due(0.5) is None  # within gc_interval_s: nothing
    assert gc.due(1.0) is not None and gc.due(2.5) is not None
    assert gc.due(SWEEP_INTERVAL_S) is not None
    assert batches.calls == [True, False, False, True]
    assert batches.storage.cleaned == 2
    assert gc.final() is not None and batches.calls[-1] is True


def test_a_long_gc_interval_sweeps_at_every_collection() -> None:
    gc, batches = _schedule(2 * SWEEP_INTERVAL_S)
    for t in (0.0, 2 * SWEEP_INTERVAL_S, 4 * SWEEP_INTERVAL_S):
        assert gc.due(t) is not None
    assert batches.calls == [True, True, True]


def test_a_full_disk_is_said_once_then_every_remind_interval_and_cleared(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    storage: Any = _Storage()
    full = FullDisk(storage, lambda: now[0])
    exc = StorageFull(errno.ENOSPC, "No space left on device")
    with caplog.at_level(logging.INFO, logger="strawq.collector.upkeep"):
        full.note(exc)
        now[0] += FULL_REMIND_S / 2
        full.note(exc)
        now[0] += FULL_REMIND_S / 2
        full.note(exc)
        assert full.message is not None and "/runs/r" in full.message
        assert "No space left on device" in full.message
        now[0] += 5.0
        full.passed()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2, [r.getMessage() for r in errors]
    back = [r.getMessage() for r in caplog.records if "space is back" in r.getMessage()]
    assert back == ["collector: space is back after 65 s; the run goes on"]
    assert full.message is None
    full.passed()  # nothing to say when the disk was not full
    assert sum("space is back" in r.getMessage() for r in caplog.records) == 1


def test_the_stubs_match_what_the_schedule_uses() -> None:
    """The stubs above stand in for ``BatchStore`` and ``Storage``: the methods they fake
    must exist there with these names."""
    for name in ("gc",):
        assert callable(getattr(BatchStore, name))
    for name in ("clean_dead_tmp", "describe"):
        assert callable(getattr(Storage, name))
