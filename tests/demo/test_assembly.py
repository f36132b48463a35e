"""The one run assembly (``strawq.demo.assembly``) and the trainer side's one bracket
(``BatchReader.configure_bracket``): what the demo, the lab and ``strawq cluster up`` share."""

from __future__ import annotations

import ast
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from strawq.collector.trainer.reader import BatchReader
from strawq.config import QueueConfig
from strawq.demo.assembly import BracketOptions, CollectorLoop, RunAssembly, producer_plan
from strawq.errors import ConfigError
from strawq.storage import MemoryStorage
from tests.collector.helpers import make_run

DEMO = Path(__file__).resolve().parents[2] / "demo"


def _repair(urls: list[str], version: int) -> list[str]:
    return []


def test_the_reader_builds_its_bracket_once_with_the_options_given(tmp_path: Path) -> None:
    reader = BatchReader(make_run(str(tmp_path / "run")))
    naps: list[float] = []
    bracket = reader.configure_bracket(lease_timeout_s=7.0, poll_interval_s=0.5,
                                       sleep=naps.append, repair=_repair)
    assert (bracket.lease_timeout_s, bracket.poll_interval_s) == (7.0, 0.5)
    assert bracket.sleep == naps.append and bracket.repair is _repair
    assert bracket.fence is not None  # the reader's trainer fence guards its writes
    assert reader.bracket is bracket  # the one the reader's own calls use
    assert reader.configure_bracket(lease_timeout_s=7.0, poll_interval_s=0.5,
                                    sleep=naps.append, repair=_repair) is bracket
    with pytest.raises(ValueError, match="already built with .*lease_timeout_s.*7.0"):
        reader.configure_bracket(lease_timeout_s=8.0)
    assert reader.bracket is bracket


def test_a_bracket_used_before_it_is_configured_refuses_other_options(tmp_path: Path) -> None:
    reader = BatchReader(make_run(str(tmp_path / "run"), lease_timeout_s=3.0))
    default = reader.bracket
    assert default.lease_timeout_s == 3.0 and default.sleep is reader.sleep
    assert reader.configure_bracket() is default
    with pytest.raises(ValueError, match="already built with the defaults"):
        reader.configure_bracket(poll_interval_s=0.01)


class _Collector:
    """What ``CollectorLoop`` uses of a collector: ``run(should_stop)``, ``stale_totals``."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.stale_totals = {"trained": 0, "regenerated": 3, "dropped": 2}
        self.entered = threading.Event()

    def run(self, *, should_stop: Callable[[], bool]) -> None:
        self.entered.set()
        if self.fail:
            raise RuntimeError("disk on fire")
        while not should_stop():
            threading.Event().wait(0.001)


def test_the_collector_loop_runs_until_stopped_and_keeps_the_error() -> None:
    col = _Collector()
    loop = CollectorLoop(col, name="t-collector")  # type: ignore[arg-type]
    loop.start()
    assert col.entered.wait(30)
    assert (loop.requeued, loop.dropped_stale) == (3, 2)  # the collector's own totals
    loop.stop()
    assert not loop.is_alive() and loop.error is None
    bad = CollectorLoop(_Collector(fail=True))  # type: ignore[arg-type]
    bad.start()
    bad.join(30)
    assert isinstance(bad.error, RuntimeError) and "disk on fire" in str(bad.error)


def test_the_assembly_stops_every_part_last_started_first(tmp_path: Path) -> None:
    stopped: list[str] = []

    def fails() -> None:
        stopped.append("b")
        raise OSError("gone already")

    run_dir = str(tmp_path / "run")
    with RunAssembly(run_dir) as run:
        q = run.create(MemoryStorage(), QueueConfig(group_size=2), meta={"who": "test"})
        assert q.config.group_size == 2 and run.queue is q
        run.add("a", lambda: stopped.append("a"))
        run.add("b", fails)
        run.add("c", lambda: stopped.append("c"))
    assert stopped == ["c", "b", "a"]  # b's error did not keep a running
    run.close()
    assert stopped == ["c", "b", "a"]  # each once


def test_the_assembly_opens_the_reader_with_its_bracket(tmp_path: Path) -> None:
    run_dir = str(tmp_path / "run")
    make_run(run_dir)
    with RunAssembly(run_dir) as run:
        reader = run.open_reader(BracketOptions(lease_timeout_s=9.0, poll_interval_s=0.25),
                                 checkpointed=False)
        assert reader.checkpointed is False and run.reader is reader
        assert (reader.bracket.lease_timeout_s, reader.bracket.poll_interval_s) == (9.0, 0.25)


def test_the_producer_plan_splits_k_slots_and_names_each_producer() -> None:
    plan = producer_plan(64, 2, 8, 3)  # K = floor(64*2/8) = 16
    assert plan.budget.total == 16
    assert plan.producers(lambda i: f"p-{i}") == [("p-0", 6), ("p-1", 5), ("p-2", 5)]
    with pytest.raises(ConfigError):
        producer_plan(4, 1, 8, 1)  # no group slot at all


def _private_imports(path: Path) -> list[str]:
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("strawq"):
            out += [f"{path.name}: from {node.module} import {a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_no_demo_module_imports_another_modules_private_name() -> None:
    found: list[Any] = [f for p in sorted(DEMO.glob("*.py")) for f in _private_imports(p)]
    assert not found, "\n".join(found)
    assert _private_imports  # the walk itself is checked below on a made-up module


def test_the_private_import_check_sees_one(tmp_path: Path) -> None:
    p = tmp_path / "m.py"
    p.write_text("from strawq.demo.lab import _Thing, Public\n")
    assert _private_imports(p) == ["m.py: from strawq.demo.lab import _Thing"]
