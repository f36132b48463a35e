"""The demo's tool task: the calculator agent on the tiny engine over HTTP, its reward, and
the demo end to end with ``task="tools"``."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from strawq.config import merge
from strawq.demo import task as count_task
from strawq.demo import tools_task
from strawq.demo.run import DemoConfig, run_demo
from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.testing import EngineThread
from strawq.producers.engines.tiny_model import init_model, save_weights
from strawq.producers.producer import Producer
from strawq.producers.producer_config import ProducerConfig
from strawq.producers.trajectory import Trajectory
from tests.producers.helpers import ids, make_run, ready_groups, run_producers, wait_for

pytestmark = pytest.mark.slow


def test_reward_reads_the_last_turn() -> None:
    row = {"row": {"answer": 6}}
    # "2 3 CALL" | RESULT 6 | "6 EOS"
    resp = [7, 8, tools_task.CALL, tools_task.RESULT, 11, 11, tools_task.EOS]
    traj = {"events": [{"op": "gen", "start": 0, "end": 3, "finish": "stop"},
                       {"op": "tool", "key": "k", "name": "calculator", "args": {"x": 2, "y": 3},
                        "result": {"value": 6}},
                       {"op": "append", "start": 3, "end": 5, "kind": "tool"},
                       {"op": "gen", "start": 5, "end": 7, "finish": "stop"}]}
    meta = {"status": "completed", "trajectory": traj}
    assert tools_task.reward(row, resp, meta) == 1.0
    assert tools_task.reward({"row": {"answer": 5}}, resp, meta) == 0.0
    assert tools_task.reward(row, resp, {**meta, "status": "truncated"}) == 0.0
    assert tools_task.calculator({"x": 7, "y": 8}, "k") == {"value": 6}
    assert tools_task.calculator({}, "k") == {"error": "syntax"}


@pytest.mark.timeout(240)
def test_calculator_agent_on_the_tiny_engine(tmp_path: Path) -> None:
    weights = save_weights(init_model(count_task.tiny_config(0)), tmp_path / "w0")
    rows = tools_task.make_rows(12, seed=1)
    run = tmp_path / "run"
    q = make_run(str(run), 0, rows=rows, group_size=4)
    with EngineThread(EngineOptions(kind="tiny", model_path=str(weights), max_running=64,
                                    tiny=count_task.tiny_config(0))) as eng:
        p = Producer(ProducerConfig.from_dict(merge(
            {"run_dir": str(run), "engine": {"workers": (eng.url,)}, "budget": {"slots": 4},
             "sampling": {"seed": 3}, "timing": {"idle_poll_s": 0.02}}, tools_task.PRODUCER)))

        async def body() -> None:
            await wait_for(lambda: len(ids(q, "ready")) + len(ids(q, "dropped")) == 12, 120,
                           "all settled")

        asyncio.run(run_producers([p], body))
    calls = 0
    for grp in ready_groups(q).values():
        assert set(grp.rewards) <= {0.0, 1.0}
        for i in range(grp.num_samples):
            c = grp.sample(i)
            assert len(c["tokens"]) <= tools_task.MAX_NEW_TOKENS
            t = Trajectory.from_dict((grp.meta.get("trajectories") or [None] * 4)[i],
                                     len(c["tokens"]))
            t.check(len(c["tokens"]), c["loss_mask"])
            assert t.turns <= tools_task.MAX_CALLS + 1
            for e in t.events:
                if e["op"] == "append":
                    assert c["tokens"][e["start"]] == tools_task.RESULT
                    assert not c["loss_mask"][e["start"]:e["end"]].any()
                if e["op"] == "tool":
                    calls += 1
                    assert e["result"] == tools_task.calculator(e["args"], e["key"])
    assert calls > 0, "the untrained model never called the calculator"
    assert p.stats().tool_calls == calls


@pytest.mark.timeout(600)
# sync runs in test_demo_tools_reward_rises (80 steps); these two interrupt trajectories
@pytest.mark.parametrize("mode", ["partial", "async"])
def test_demo_tools_task_end_to_end(mode: str, tmp_path: Path) -> None:
    cfg = DemoConfig(workdir=str(tmp_path / "w"), task="tools", mode=mode, steps=4,
                     prompts=400, progress=False)
    result = run_demo(cfg)
    assert len(result.schedule.records) == 4
    assert all(np.isfinite(r.metrics["loss"]) for r in result.schedule.records)
    assert os.path.getsize(result.files["timeline"]) > 10_000


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_demo_tools_reward_rises(tmp_path: Path) -> None:
    """The model learns to delegate: the reward of the last 10 steps beats the first 10."""
    # sync: every step trains on its own version's samples, so what is measured is learning,
    # not the async schedule's timing (which changes the batches from run to run; 40 async
    # steps rose 0.008 -> 0.034 in one run, 0.023 -> 0.122 in another)
    cfg = DemoConfig(workdir=str(tmp_path / "w"), task="tools", steps=80, prompts=4000,
                     progress=False, mode="sync")
    result = run_demo(cfg)
    first, last = np.mean(result.rewards[:10]), np.mean(result.rewards[-10:])
    assert last > first + 0.1, (
        f"reward did not rise: first 10 steps {first:.3f}, last {last:.3f}")
