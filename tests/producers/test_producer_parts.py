"""The parts a producer and its runner are composed of, each on its own: the engine-fault
back-off, the client slot, the held-group table, and how the producer shares them."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, MutableSet, Sequence
from pathlib import Path
from typing import Any

import pytest

from strawq.producers.claim_gate import FaultBackoff
from strawq.producers.engine_versions import ClientSlot
from strawq.producers.held import ActiveGroup, GroupTable
from strawq.producers.producer import Producer
from strawq.producers.producer_config import ProducerConfig
from strawq.producers.sglang_protocol import GenerateResult
from strawq.tasks.queue import Lease
from tests.producers.helpers import make_run


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class _Client:
    """An engine client that only counts its closes."""

    def __init__(self) -> None:
        self.closed = 0

    @property
    def worker_urls(self) -> list[str]:
        return ["http://engine"]

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        self.closed += 1

    async def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any], *,
                       rid: str | None = None, among: Sequence[str] | None = None,
                       extra: Mapping[str, Any] | None = None,
                       live: MutableSet[str] | None = None) -> GenerateResult:
        raise AssertionError("not called")


def test_fault_backoff_doubles_per_fault_up_to_16_times_and_a_finished_group_resets_it() -> None:
    clock = _Clock()
    b = FaultBackoff(0.5, clock)
    delays = [b.back_off() for _ in range(7)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert b.in_row == 7
    assert b.until == 108.0
    clock.t = 200.0
    b.reset()
    assert b.in_row == 0
    assert b.back_off() == 0.5  # counted afresh
    assert b.until == 200.5


def test_fault_backoff_never_moves_its_deadline_earlier() -> None:
    clock = _Clock()
    b = FaultBackoff(1.0, clock)
    for _ in range(5):
        b.back_off()  # 16 s: until 116
    b.reset()
    assert b.back_off() == 1.0
    assert b.until == 116.0


def test_client_slot_builds_its_client_at_open_and_closes_only_the_one_it_built() -> None:
    built: list[Any] = []

    def make() -> Any:
        built.append(_Client())
        return built[-1]

    guard: Any = object()
    slot = ClientSlot(None, make)
    assert slot.raw() is None
    with pytest.raises(RuntimeError, match="starts in run"):
        slot.guarded()
    raw: Any = slot.open(guard)
    assert built == [raw] and slot.raw() is raw
    assert slot.guarded().worker_urls == ["http://engine"]
    asyncio.run(slot.close())
    assert built[0].closed == 1 and slot.raw() is None

    injected = _Client()
    given: Any = injected
    slot = ClientSlot(given, make)
    assert slot.open(guard) is given and len(built) == 1
    asyncio.run(slot.close())
    assert injected.closed == 0  # its owner's to close
    assert slot.raw() is given
    with pytest.raises(RuntimeError):
        slot.guarded()


def _lease(key: str) -> Any:
    class _L:
        pass
    lease = _L()
    lease.key = key  # type: ignore[attr-defined]
    return lease


def test_group_table_counts_its_groups_and_unions_their_live_rids() -> None:
    table = GroupTable()
    assert len(table) == 0 and table.live_rids() == set()
    a = ActiveGroup(_lease("a"))
    b = ActiveGroup(_lease("b"))
    a.live_rids |= {"p/t1.g1/0.1", "p/t1.g1/1.1"}
    b.live_rids.add("p/t2.g1/0.1")
    table.groups["a"], table.groups["b"] = a, b
    assert len(table) == 2
    assert table.live_rids() == {"p/t1.g1/0.1", "p/t1.g1/1.1", "p/t2.g1/0.1"}


def test_the_producer_shares_one_group_table_with_its_aborter_bracket_and_runner(
        tmp_path: Path) -> None:
    """Built in order, no late binding: the aborter names the runner's rids, the bracket
    counts the runner's groups, and the runner generates on the producer's guarded client
    (absent until run() starts it)."""
    run = tmp_path / "run"
    make_run(str(run), 1)
    client: Any = _Client()
    p = Producer(ProducerConfig.from_dict({
        "run_dir": str(run), "engine": {"workers": ["http://engine"]},
        "plugins": {"reward": "tests.producers.plugins_for_tests.length_reward"}}),
        client=client)
    lease: Lease = _lease("k")
    a = ActiveGroup(lease)
    a.live_rids.add("rid-1")
    p.runner.groups["k"] = a
    assert p._aborter.live_rids() == {"rid-1"}
    assert p.live_rids() == {"rid-1"}
    assert p._bracket._held() == 1
    assert p._aborter.client() is client and p.guard._client() is client
    with pytest.raises(RuntimeError, match="starts in run"):
        p.runner.turns._client()
