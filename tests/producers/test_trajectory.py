"""Multi-turn trajectories through the generate plugin: durable across weight updates and
a kill -9 of the producer, tool calls executed once per persisted result, budgets and the
failure policy. Real sim engine over HTTP; the kill test runs producers as processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from strawq.errors import ConfigError
from strawq.ondisk.groups import GroupData
from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.testing import EngineThread
from strawq.producers.generate import load_generate
from strawq.producers.producer import Producer
from strawq.producers.producer_config import (
    EngineConfig,
    PluginsConfig,
    ProducerConfig,
    ToolsConfig,
)
from strawq.producers.sglang_client import SGLangClient
from strawq.producers.trajectory import Trajectory, TrajectoryError
from strawq.tasks.grantor import LeaseMonitor
from strawq.testing.waiting import wait_until
from strawq.weights.control import Control
from tests.producers.conftest import FAST_SIM
from tests.producers.helpers import (
    config_with,
    ids,
    make_run,
    names,
    ready_groups,
    run_producers,
    wait_for,
)
from tests.producers.trajectory_plugins import ledger_counts

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
AGENT = "tests.producers.trajectory_plugins.tool_agent"
REWARD = "tests.producers.plugins_for_tests.length_reward"
MAX_NEW = 160


def check_sample(grp: GroupData, i: int, max_new: int = MAX_NEW) -> Trajectory:
    """Invariant 4 on a multi-turn sample: equal lengths, spans tile the response, tool
    tokens masked with log-prob 0, generated tokens trained, versions non-decreasing."""
    c = grp.sample(i)
    n = len(c["tokens"])
    assert len(c["logprobs"]) == len(c["versions"]) == len(c["loss_mask"]) == n
    assert n <= max_new
    trajs = grp.meta.get("trajectories")
    t = Trajectory.from_dict(trajs[i] if trajs else None, n)
    t.check(n, c["loss_mask"])
    assert np.all(np.diff(c["versions"]) >= 0)
    failed = grp.status[i] == "failed"
    for e in t.events:
        if e["op"] == "append":
            span = slice(e["start"], e["end"])
            assert not c["loss_mask"][span].any() and not c["logprobs"][span].any()
        elif e["op"] == "gen" and not failed:
            assert e["end"] is not None, "a trained sample has an open turn"
            assert c["loss_mask"][e["start"]:e["end"]].all()
    return t


def agent_config(run: Path, url: str, ledger: Path, **sections: Any) -> ProducerConfig:
    base: dict[str, Any] = {
        "run_dir": str(run), "engine": {"workers": (url,)},
        "plugins": {"reward": REWARD, "generate": AGENT,
                    "generate_args": {"ledger": str(ledger), "turns": 4}},
        "budget": {"slots": 3}, "sampling": {"max_new_tokens": MAX_NEW, "seed": 7},
        "timing": {"control_poll_s": 0.02, "idle_poll_s": 0.02}, "tools": {"timeout_s": 30.0}}
    return config_with(base, sections)


def test_generate_plugin_is_checked_at_start_up() -> None:
    assert load_generate(None).__name__ == "single_turn"
    with pytest.raises(ConfigError, match="1 positional"):
        load_generate("tests.producers.plugins_for_tests.length_reward")
    with pytest.raises(ConfigError, match="async"):
        load_generate("tests.producers.trajectory_plugins.ledger_counts")
    with pytest.raises(ConfigError, match="cannot import"):
        load_generate("no_such_module.agent")
    with pytest.raises(ConfigError, match="bad generate_args"):
        load_generate(AGENT, {"nope": 1})
    with pytest.raises(ConfigError, match=r"ToolsConfig\.on_failure: expected one of"):
        ProducerConfig(
            run_dir="r",
            engine=EngineConfig(workers=("http://x",)),
            plugins=PluginsConfig(reward=REWARD),
            tools=ToolsConfig(on_failure="pray"))  # type: ignore[arg-type]


def test_trajectory_record_round_trip_and_checks() -> None:
    t = Trajectory(events=[{"op": "gen", "start": 0, "end": 3, "finish": "stop"},
                           {"op": "tool", "key": "k", "name": "calc", "args": {}, "result": 1},
                           {"op": "append", "start": 3, "end": 5, "kind": "tool"},
                           {"op": "gen", "start": 5, "end": None, "finish": None}], epoch=1)
    t.check(9, [1, 1, 1, 0, 0, 1, 1, 1, 1])
    assert Trajectory.from_dict(t.to_dict()) == t and t.turns == 2
    assert t.open_turn() is not None
    with pytest.raises(TrajectoryError, match="loss mask 0"):
        t.check(9, [1, 1, 1, 1, 0, 1, 1, 1, 1])
    with pytest.raises(TrajectoryError, match="start at"):
        Trajectory(events=[{"op": "gen", "start": 1, "end": 3, "finish": "stop"}]).check(3)
    # a record written before trajectories: its prefix is one open turn
    old = Trajectory.from_dict(None, 4)
    assert old.open_turn() == {"op": "gen", "start": 0, "end": None, "finish": None}


@pytest.mark.slow
def test_multi_turn_across_weight_updates_runs_each_tool_call_once(tmp_path: Path,
                                                                   sim_engine: Any) -> None:
    n, g = 10, 2
    q = make_run(str(tmp_path / "run"), n, group_size=g)
    control = Control(q.storage)
    ledger = tmp_path / "ledger"
    p = Producer(agent_config(tmp_path / "run", sim_engine.url, ledger,
                              plugins={"generate_args": {"ledger": str(ledger), "turns": 4,
                                             "slow_s": 0.05}}))

    async def body() -> None:
        async with SGLangClient([sim_engine.url]) as client:
            for v in (1, 2, 3):
                await wait_for(lambda want=3 * v: sum(  # type: ignore[misc]
                    ledger_counts(str(ledger)).values()) >= want or len(ids(q, "ready")) == n,
                    60, "tool calls")
                control.pause(v)
                await wait_for(lambda: p.producer_id in control.state().acks, 60, "ack")
                assert not names(q, "leased")
                await client.update_weight_version(v)
                q.set_version(v)
                control.resume(v)
        await wait_for(lambda: len(ids(q, "ready")) == n, 120, "all ready")

    asyncio.run(run_producers([p], body))
    counts = ledger_counts(str(ledger))
    trained: list[str] = []
    spanning = 0
    for grp in ready_groups(q).values():
        assert grp.meta.get("trajectories"), "a multi-turn group lost its trajectories"
        for i in range(g):
            t = check_sample(grp, i)
            assert t.turns <= 4
            trained += [e["key"] for e in t.tool_calls()]
            v = grp.sample(i)["versions"]
            spanning += int(len(v) > 0 and v.min() != v.max() and bool(t.tool_calls()))
    assert trained, "no tool was called"
    assert all(counts[k] == 1 for k in trained), {k: counts[k] for k in trained if counts[k] != 1}
    assert spanning > 0, "no tool-calling sample spanned a weight update"
    assert p.stats().tool_calls_replayed > 0, "no persisted tool call was replayed"


@pytest.mark.slow
def test_tool_failure_policies(tmp_path: Path, sim_engine: Any) -> None:
    """fail_sample: failed, reward None, loss mask 0, never trained as finished;
    drop_group: dropped as tool_error; max_turns: truncated at the limit."""
    rows = [{"prompt": [5, 6, 7], "target": 7, "count": 3} for _ in range(3)]
    for policy in ("fail_sample", "drop_group"):
        run = tmp_path / policy
        q = make_run(str(run), 0, rows=rows, group_size=2)
        ledger = tmp_path / f"ledger-{policy}"
        p = Producer(agent_config(
            run, sim_engine.url, ledger, engine={"backoff_s": 0.01},
            plugins={"generate_args": {"ledger": str(ledger), "fail": "always"}},
            tools={"on_failure": policy, "retries": 1}))

        async def body(q: Any = q) -> None:
            await wait_for(lambda: len(ids(q, "ready")) + len(ids(q, "dropped")) == 3, 60,
                           "all settled")

        asyncio.run(run_producers([p], body))
        if policy == "drop_group":
            assert len(ids(q, "dropped")) == 3
            assert p.stats().drop_reasons.get("tool_error") == 3
            continue
        groups = ready_groups(q)
        assert len(groups) + len(ids(q, "dropped")) == 3
        for grp in groups.values():
            for i in range(2):
                check_sample(grp, i)
                if grp.status[i] == "failed":
                    assert grp.rewards[i] is None
                    assert not grp.sample(i)["loss_mask"].any()
                    assert "calculator is down" in grp.meta["failures"][str(i)]
        # each failed call was tried 1 + tool_retries times, each with the same key
        assert set(ledger_counts(str(ledger)).values()) == {2}

    # restart: a fresh environment (next epoch, new keys) up to tool_retries times, then failed
    run = tmp_path / "restart"
    q = make_run(str(run), 0, rows=rows[:1], group_size=2)
    ledger = tmp_path / "ledger-restart"
    p = Producer(agent_config(
        run, sim_engine.url, ledger,
        plugins={"generate_args": {"ledger": str(ledger), "fail": "always"}},
        tools={"on_failure": "restart", "retries": 1}))

    async def settled() -> None:
        await wait_for(lambda: len(ids(q, "ready")) + len(ids(q, "dropped")) == 1, 60,
                       "settled")

    asyncio.run(run_producers([p], settled))
    counts = ledger_counts(str(ledger))
    epochs = {k.split(".e", 1)[1].split(".", 1)[0] for k in counts}
    assert epochs <= {"0", "1"} and "1" in epochs, counts
    assert set(counts.values()) == {2}
    for grp in ready_groups(q).values():
        for i in range(2):
            if grp.meta["trajectories"][i]["epoch"] == 1:
                assert grp.status[i] == "failed"

    run = tmp_path / "turns"
    q = make_run(str(run), 0, rows=rows, group_size=2)
    ledger = tmp_path / "ledger-turns"
    p = Producer(agent_config(run, sim_engine.url, ledger, tools={"max_turns": 2},
                              plugins={"generate_args": {"ledger": str(ledger), "turns": 9}}))

    async def wait_ready() -> None:
        await wait_for(lambda: len(ids(q, "ready")) == 3, 60, "all ready")

    asyncio.run(run_producers([p], wait_ready))
    for grp in ready_groups(q).values():
        for i in range(2):
            t = check_sample(grp, i)
            assert t.turns <= 2
            if t.turns == 2 and grp.meta["finish_reasons"][i].get("limit") == "max_turns":
                assert grp.status[i] == "truncated"


def _producer_process(run: Path, url: str, ledger: Path) -> subprocess.Popen[str]:
    code = ("import sys; sys.modules['ray'] = None; from strawq.app.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    args = {"ledger": str(ledger), "turns": 4, "slow_s": 0.1}
    return subprocess.Popen(
        [sys.executable, "-c", code, "producer", str(run), "--engine", url, "--reward", REWARD,
         "--slots", "3", "--set", f"sampling.max_new_tokens={MAX_NEW}", "--set", "sampling.seed=7",
         "--set", f"plugins.generate={AGENT}",
         "--set", f"plugins.generate_args={json.dumps(args)}",
         "--set", "timing.idle_poll_s=0.02", "--set", "timing.control_poll_s=0.02",
         "--json"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)})


def _wait(cond: Any, timeout: float, what: str, proc: subprocess.Popen[str] | None = None,
          monitor: LeaseMonitor | None = None) -> None:
    def check_alive() -> None:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"producer exited: {proc.stderr.read() if proc.stderr else ''}")
        if monitor is not None:
            monitor.scan()

    wait_until(cond, timeout, what=what, poll_s=0.05, on_poll=check_alive)


@pytest.mark.slow
def test_kill_9_mid_trajectory_never_reruns_a_persisted_tool_call(tmp_path: Path) -> None:
    # its own engine: the module's one carries the versions an earlier test pushed
    with EngineThread(EngineOptions(kind="sim", max_running=256, sim=FAST_SIM)) as eng:
        _kill_9_scenario(tmp_path, eng)


def _kill_9_scenario(tmp_path: Path, sim_engine: Any) -> None:
    n, g = 8, 2
    run = tmp_path / "run"
    q = make_run(str(run), n, group_size=g, lease_timeout_s=3.0, heartbeat_interval_s=0.2)
    control = Control(q.storage)
    ledger = tmp_path / "ledger"
    monitor = LeaseMonitor(q)
    a = _producer_process(run, sim_engine.url, ledger)
    b: subprocess.Popen[str] | None = None
    try:
        _wait(lambda: sum(ledger_counts(str(ledger)).values()) >= 4, 90, "tool calls", a)
        control.pause(1)
        _wait(lambda: bool(control.state().acks), 60, "the pause acknowledged", a)
        persisted: set[str] = set()
        for t in names(q, "pending") + names(q, "partial"):
            if t.resume < 0:
                continue
            grp = _read_partial(q, t)
            for tr in grp.meta.get("trajectories") or []:
                persisted |= {e["key"] for e in Trajectory.from_dict(tr).tool_calls()}
        assert persisted, "no tool result was persisted at the weight update"
        asyncio.run(_bump_version(sim_engine.url, 1))
        q.set_version(1)
        before = sum(ledger_counts(str(ledger)).values())
        control.resume(1)
        _wait(lambda: sum(ledger_counts(str(ledger)).values()) >= before + 2 and bool(
            names(q, "leased")), 90, "tool calls after the resume", a)
        os.kill(a.pid, signal.SIGKILL)  # mid-trajectory: it holds leases with tools running
        a.wait(timeout=30)
        b = _producer_process(run, sim_engine.url, ledger)
        _wait(lambda: len(ids(q, "ready")) == n, 180, "every group ready", b, monitor)
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    assert ids(q, "ready") == sorted(f"i{i:012d}" for i in range(n))
    counts = ledger_counts(str(ledger))
    trained = []
    for grp in ready_groups(q).values():
        for i in range(g):
            t = check_sample(grp, i)
            trained += [e["key"] for e in t.tool_calls()]
    assert all(counts[k] >= 1 for k in trained)
    rerun = {k: counts[k] for k in persisted if counts[k] != 1}
    assert not rerun, f"persisted tool calls executed again: {rerun}"


def _read_partial(q: Any, t: Any) -> GroupData:
    from strawq.ondisk.names import data_key
    from strawq.ondisk.records import Kind

    rec = q._read_record(data_key(t.id, t.resume, "partial"), Kind.PARTIAL)
    return GroupData.from_record(rec)


async def _bump_version(url: str, v: int) -> None:
    async with SGLangClient([url]) as client:
        await client.update_weight_version(v)
