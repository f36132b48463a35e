"""Turn checkpoints and the tool-call journal: fencing of stale generations, environments
restored on resume (and a wrong restore detected), a non-idempotent tool in flight
reconciled or failed with its reason, a tool running at a pause not delaying the ack, the
per-turn token cap and ``max_turns``. Real sim engine over HTTP, real files."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from strawq.demo.agentic_kv import counts
from strawq.errors import LeaseLost
from strawq.ondisk import records
from strawq.ondisk.groups import GroupData
from strawq.ondisk.names import TaskName
from strawq.ondisk.records import Kind
from strawq.producers.producer import Producer
from strawq.producers.sglang_client import SGLangClient
from strawq.producers.trajectory import Trajectory
from strawq.storage import PosixStorage
from strawq.tasks.turns import TurnLog, turn_dir
from strawq.weights.control import Control
from tests.producers.helpers import (
    config_with,
    ids,
    make_run,
    ready_groups,
    run_producers,
    wait_for,
)

pytestmark = pytest.mark.timeout(180)

KV = "strawq.demo.agentic_kv.kv_agent"
REWARD = "tests.producers.plugins_for_tests.length_reward"


def _config(run: Path, url: str, ledger: Path, args: dict[str, Any] | None = None,
            **sections: Any) -> Any:
    base: dict[str, Any] = {
        "run_dir": str(run), "engine": {"workers": (url,)},
        "plugins": {"reward": REWARD, "generate": KV,
                    "generate_args": {"ledger": str(ledger), **(args or {})}},
        "budget": {"slots": 4}, "sampling": {"max_new_tokens": 200, "seed": 3},
        "timing": {"control_poll_s": 0.02, "idle_poll_s": 0.02, "abort_deadline_s": 120.0},
        "tools": {"timeout_s": 60.0}}
    return config_with(base, sections)


def _group(task: str, n: int) -> GroupData:
    z = np.zeros(n)
    return GroupData(task_id=task, index=0, prompt_ids=np.array([1, 2]), sample_lens=[n],
                     tokens=z, logprobs=z, versions=z, loss_mask=z, rewards=[None],
                     status=["pending"], meta={})


def _name(gen: int, resume: int = -1, regenerations: int = 0) -> TaskName:
    return TaskName(key="b0.000000000001", id="t1", gen=gen, attempts=1, resume=resume,
                    producer="p", regenerations=regenerations)


def test_a_stale_generation_checkpoint_is_never_used(tmp_path: Path) -> None:
    st = PosixStorage(str(tmp_path), writer_id="w", fsync=False)
    g0 = TurnLog(st, _name(0))
    assert g0.load() is None  # nothing saved yet: nothing to fence
    g0.save(_group("t1", 3))
    g0.save(_group("t1", 5))
    assert len(st.list(turn_dir("t1"))) == 1, "older records of a holder are deleted"

    g1 = TurnLog(st, _name(1))  # re-leased: fences generation 0, loads its last save
    ck = g1.load()
    assert ck is not None and ck.gen == 0 and ck.group.num_tokens == 5
    with pytest.raises(LeaseLost):  # the stale holder's next save is fenced, nothing written
        g0.save(_group("t1", 7))

    g2 = TurnLog(st, _name(2))  # generation 1 saved nothing: 0's pre-fence record stands
    assert g2.load().group.num_tokens == 5  # type: ignore[union-attr]
    g2.save(_group("t1", 9))
    try:  # generation 1 again, stale: fenced, or its record lands in a gap below 2's
        g1.save(_group("t1", 11))
    except LeaseLost:
        pass
    g3 = TurnLog(st, _name(3))
    ck3 = g3.load()
    assert ck3 is not None and ck3.gen == 2 and ck3.group.num_tokens == 9

    # a partial record written at generation 3 supersedes every checkpoint of <= 3, and a
    # regeneration (prefix discarded) supersedes all of them
    g3.save(_group("t1", 13))
    assert TurnLog(st, _name(4, resume=3)).load() is None
    assert TurnLog(st, _name(5, regenerations=1)).load() is None
    g3.clear()  # handed back: its records and older ones go (newer holders' fences stay)
    left = [records.decode(st.read(f"{turn_dir('t1')}/{n}")) for n in st.list(turn_dir("t1"))]
    assert [r.kind for r in left] == [Kind.STATE, Kind.STATE]


def test_a_stale_holders_save_after_the_new_holder_saved_is_refused(tmp_path: Path) -> None:
    """A holder stopped past its lease wakes after the new holder saved once (its fence is
    gone, a gap left below its save): the stale save must fail, not land in the gap and
    return, or the stale holder goes on live (a tool call of a lost lease)."""
    st = PosixStorage(str(tmp_path), writer_id="w", fsync=False)
    g0 = TurnLog(st, _name(0))
    g0.save(_group("t1", 3))
    g1 = TurnLog(st, _name(1))
    assert g1.load() is not None
    g1.save(_group("t1", 5))  # deletes its fence and generation 0's record
    with pytest.raises(LeaseLost):
        g0.save(_group("t1", 7))
    with pytest.raises(LeaseLost):  # and stays lost
        g0.save(_group("t1", 9))
    left = [records.decode(st.read(f"{turn_dir('t1')}/{n}")) for n in st.list(turn_dir("t1"))]
    assert [r.meta["group"]["meta"]["checkpoint"]["gen"] for r in left] == [1]
    ck = TurnLog(st, _name(2)).load()
    assert ck is not None and ck.gen == 1 and ck.group.num_tokens == 5


def _mismatches(ledger: Path) -> int:
    return sum(counts(str(ledger), "mismatch").values())


async def _bump(url: str, v: int) -> None:
    async with SGLangClient([url]) as client:
        await client.update_weight_version(v)


def _pause_mid_tool(tmp_path: Path, url: str, restore: str) -> tuple[Any, Path, Producer]:
    """Four groups of two; the second tool call of each sample waits for ``go``: the pause
    lands with every sample's store holding two writes; resumed at version 1."""
    q = make_run(str(tmp_path / "run"), 4, group_size=2)
    control = Control(q.storage)
    ledger = tmp_path / "ledger"
    p = Producer(_config(tmp_path / "run", url, ledger,
                         {"turns": 5, "restore": restore, "block_at": 1}))

    async def body() -> None:
        await wait_for(lambda: len([n for n in os.listdir(ledger) if n.startswith("started.")])
                       >= 2 if ledger.exists() else False, 60, "tool calls waiting")
        control.pause(1)
        (ledger / "go").touch()
        await wait_for(lambda: p.producer_id in control.state().acks, 60, "ack")
        await _bump(url, 1)
        q.set_version(1)
        control.resume(1)
        await wait_for(lambda: len(ids(q, "ready")) + len(ids(q, "dropped")) == 4, 120,
                       "all settled")

    asyncio.run(run_producers([p], body))
    return q, ledger, p


def _drop_messages(q: Any) -> list[str]:
    return [str(records.decode(q.storage.read(f"data/{n}")).meta.get("message"))
            for n in q.storage.list("data") if ".drop." in n]


def test_environment_restored_on_resume(tmp_path: Path, sim_engine: Any) -> None:
    q, ledger, _ = _pause_mid_tool(tmp_path, sim_engine.url, "snapshot")
    assert len(ids(q, "ready")) == 4, _drop_messages(q)
    assert sum(counts(str(ledger), "restored").values()) >= 2, "no environment was restored"
    assert _mismatches(ledger) == 0
    for grp in ready_groups(q).values():
        assert not grp.meta.get("failures"), grp.meta.get("failures")
        for tr in grp.meta["trajectories"]:
            assert "env" not in tr and "inflight" not in tr  # resume state only in partials


def test_a_wrong_environment_restore_is_detected(tmp_path: Path, sim_engine: Any) -> None:
    q, ledger, _ = _pause_mid_tool(tmp_path, sim_engine.url, "none")
    assert _mismatches(ledger) >= 1
    failures = _drop_messages(q) + [m for grp in ready_groups(q).values()
                                    for m in (grp.meta.get("failures") or {}).values()]
    assert any("environment mismatch" in m for m in failures), failures


def test_a_tool_running_at_a_pause_does_not_delay_the_ack(tmp_path: Path,
                                                          sim_engine: Any) -> None:
    q = make_run(str(tmp_path / "run"), 2, group_size=2)
    control = Control(q.storage)
    ledger = tmp_path / "ledger"
    p = Producer(_config(tmp_path / "run", sim_engine.url, ledger,
                         {"turns": 3, "env": False, "block_at": 0}))

    async def body() -> None:
        await wait_for(lambda: ledger.exists() and len(
            [n for n in os.listdir(ledger) if n.startswith("started.")]) >= 2, 60, "tools")
        control.pause(1)
        # acknowledged while the calls still wait for "go" (abort_deadline_s is 120 s)
        await wait_for(lambda: p.producer_id in control.state().acks, 60, "ack")
        assert not counts(str(ledger), "effect"), "a tool call finished before the ack"
        (ledger / "go").touch()
        await _bump(sim_engine.url, 1)
        q.set_version(1)
        control.resume(1)
        await wait_for(lambda: len(ids(q, "ready")) == 2, 120, "all ready")

    asyncio.run(run_producers([p], body))
    assert p.stats().tool_calls_detached >= 2
    execs = counts(str(ledger), "exec")
    trained = [e["key"] for grp in ready_groups(q).values()
               for tr in grp.meta["trajectories"] for e in Trajectory.from_dict(tr).tool_calls()]
    assert trained and all(execs[k] == 1 for k in trained), execs


@pytest.mark.parametrize("reconcile", [True, False])
def test_a_non_idempotent_tool_in_flight_is_reconciled_or_failed(
        tmp_path: Path, sim_engine: Any, reconcile: bool) -> None:
    """Producer A pauses while the call waits; the call then takes effect on A, which
    stops; producer B resumes the trajectory: the call is interrupted and not idempotent."""
    q = make_run(str(tmp_path / "run"), 1, group_size=1)
    control = Control(q.storage)
    ledger = tmp_path / "ledger"
    args = {"turns": 3, "env": False, "block_at": 0, "idempotent": False,
            "reconcile": reconcile}
    a = Producer(_config(tmp_path / "run", sim_engine.url, ledger, args))

    async def first() -> None:
        await wait_for(lambda: ledger.exists() and any(
            n.startswith("started.") for n in os.listdir(ledger)), 60, "the call started")
        control.pause(1)
        await wait_for(lambda: a.producer_id in control.state().acks, 60, "ack")
        (ledger / "go").touch()
        await wait_for(lambda: bool(counts(str(ledger), "effect")), 60, "its effect")

    asyncio.run(run_producers([a], first))
    b = Producer(_config(tmp_path / "run", sim_engine.url, ledger, args))

    async def second() -> None:
        await _bump(sim_engine.url, 1)
        q.set_version(1)
        control.resume(1)
        await wait_for(lambda: len(ids(q, "ready")) + len(ids(q, "dropped")) == 1, 120,
                       "settled")

    asyncio.run(run_producers([b], second))
    execs, effects = counts(str(ledger), "exec"), counts(str(ledger), "effect")
    assert all(n == 1 for n in effects.values()), f"an effect applied twice: {effects}"
    if reconcile:
        assert b.stats().tool_calls_reconciled == 1
        (grp,) = ready_groups(q).values()
        assert grp.status == ["completed"] or grp.status == ["truncated"], grp.meta
        tr = Trajectory.from_dict(grp.meta["trajectories"][0])
        first_call = tr.tool_calls()[0]
        assert first_call.get("reconciled") and execs[first_call["key"]] == 1
    else:
        assert len(ids(q, "dropped")) == 1  # the group's only sample failed
        assert any("no reconcile hook" in m for m in _drop_messages(q)), _drop_messages(q)


def test_per_turn_token_cap_and_max_turns(tmp_path: Path, sim_engine: Any) -> None:
    q = make_run(str(tmp_path / "run"), 3, group_size=2)
    ledger = tmp_path / "ledger"
    p = Producer(_config(tmp_path / "run", sim_engine.url, ledger, {"turns": 9},
                         tools={"max_turn_tokens": 4, "max_turns": 3}))

    async def body() -> None:
        await wait_for(lambda: len(ids(q, "ready")) == 3, 120, "all ready")

    asyncio.run(run_producers([p], body))
    capped = 0
    for grp in ready_groups(q).values():
        for i, tr in enumerate(grp.meta["trajectories"]):
            t = Trajectory.from_dict(tr)
            assert t.turns <= 3
            for e in t.events:
                if e["op"] == "gen":
                    assert e["end"] - e["start"] <= 4
                    capped += int(e["end"] - e["start"] == 4 and e["finish"] == "length")
            if t.turns == 3:
                assert grp.meta["finish_reasons"][i].get("limit") == "max_turns"
    assert capped, "no turn reached the per-turn cap"
