"""A full disk under a producer: every finished group is kept and handed back once space
returns; nothing is re-generated, released or dropped because of ENOSPC."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from strawq.producers.producer import Producer
from strawq.producers.sglang_client import ClientConfig
from tests.producers.helpers import config_with, ids, make_run, names, run_producers, wait_for
from tests.small_disk import SmallDisk, small_disk  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(60)


@pytest.mark.process
def test_a_full_disk_keeps_finished_groups_and_hands_them_back_when_space_returns(
        small_disk: SmallDisk, sim_engine: Any) -> None:  # noqa: F811
    n = 6
    run = os.path.join(small_disk.path, "run")
    q = make_run(run, n, lease_timeout_s=30.0)
    config = config_with({
        "run_dir": run,
        "engine": {"workers": (sim_engine.url,), "client": ClientConfig(generate_timeout_s=30)},
        "plugins": {"reward": "strawq.producers.rewards.count_task"},
        "budget": {"slots": 3},
        "sampling": {"max_new_tokens": 1500, "ignore_eos": True, "seed": 3},
        "timing": {"control_poll_s": 0.02, "idle_poll_s": 0.02}}, {})
    p = Producer(config)
    held: dict[str, int] = {}

    async def body() -> None:
        await wait_for(lambda: p.stats().busy_trajectories > 0, 30, "the producer generating")
        small_disk.fill()
        # Three groups finish on the full disk: each hand-back fails with ENOSPC.
        await wait_for(lambda: len(p.handback.orphans) >= 3 or p.stats().groups_released > 0
                       or any(t.gen > 0 for t in names(q, "pending")), 30,
                       "three groups finished on the full disk")
        held["released"] = p.stats().groups_released
        held["requeued"] = sum(t.gen > 0 for t in names(q, "pending"))
        held["orphans"] = len(p.handback.orphans)
        small_disk.free()
        await wait_for(lambda: len(ids(q, "ready")) == n, 30, "every group ready")

    asyncio.run(run_producers([p], body))
    # While the disk was full nothing was given back to be generated again ...
    assert held == {"released": 0, "requeued": 0, "orphans": 3}
    # ... and once space returned each finished group was handed back, exactly once.
    assert ids(q, "ready") == sorted(f"i{i:012d}" for i in range(n))
    assert not ids(q, "pending") and not ids(q, "leased") and not ids(q, "dropped")
    assert all(t.gen == 0 and t.attempts == 1 for t in names(q, "ready"))
    assert p.stats().groups_completed == n and p.stats().groups_released == 0
    assert q.storage.list("tmp") == [], "a failed write left its temporary file"


@pytest.mark.process
def test_a_full_disk_holds_a_tool_call_until_its_journal_entry_is_saved(
        small_disk: SmallDisk, sim_engine: Any, tmp_path: Any,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    """A non-idempotent tool call needs its journal entry on disk before it runs: on a full
    disk the call waits for space instead of failing its sample (and dropping the group)."""
    from strawq.demo.agentic_kv import counts

    run = os.path.join(small_disk.path, "run")
    q = make_run(run, 1, group_size=1, lease_timeout_s=30.0)
    ledger = str(tmp_path / "ledger")  # the tool's own effects, off the small disk
    config = config_with({
        "run_dir": run, "engine": {"workers": (sim_engine.url,)},
        "plugins": {"reward": "tests.producers.plugins_for_tests.length_reward",
                    "generate": "strawq.demo.agentic_kv.kv_agent",
                    "generate_args": {"ledger": ledger, "turns": 3, "env": False,
                                      "idempotent": False}},
        "budget": {"slots": 1}, "sampling": {"max_new_tokens": 200, "seed": 3},
        "timing": {"control_poll_s": 0.02, "idle_poll_s": 0.02},
        "tools": {"timeout_s": 60.0}}, {})
    p = Producer(config)
    begin = p.incarnation.begin

    def begin_then_fill() -> list[str]:
        # the disk fills once the process has recorded its incarnation (a producer started
        # on a full disk refuses, as a collector does: it cannot record it), before its
        # first claim
        out = begin()
        small_disk.fill()
        return out

    p.incarnation.begin = begin_then_fill  # type: ignore[method-assign]

    def waiting() -> bool:
        return any("tool-call journal cannot be saved" in r.getMessage()
                   for r in caplog.records)

    async def body() -> None:
        await wait_for(lambda: waiting() or p.stats().groups_released > 0
                       or p.stats().groups_dropped > 0 or bool(p.handback.orphans), 30,
                       "the first tool call to meet the full disk")
        assert not p.handback.orphans and p.stats().groups_dropped == 0, (
            "the sample failed on the full disk and its group is being dropped")
        assert waiting(), "the tool call did not wait for its journal entry"
        assert not counts(ledger, "exec"), "the call ran before its journal entry was saved"
        small_disk.free()
        await wait_for(lambda: len(ids(q, "ready")) == 1, 30, "the group ready")

    asyncio.run(run_producers([p], body))
    assert not ids(q, "dropped") and p.stats().groups_released == 0
    assert all(n == 1 for n in counts(ledger, "effect").values())
    assert q.storage.list("tmp") == []
