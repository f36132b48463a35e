"""The generate context's rules on one sample, without an engine: an append respects the
context length, ending the sample during the replay raises, and tool idempotency keys name
the lease generation the trajectory started under.

A stand-in host (``SampleHost``, all a context reaches of the producer) gives it the tools'
settings, inline threads and a ``generate_turn`` that appends scripted tokens the way a
segment does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from strawq.ondisk.names import TaskName
from strawq.producers.generate import GenerateContext, SampleHost, run_plugin
from strawq.producers.group import GroupRun
from strawq.producers.producer_config import ToolsConfig
from strawq.producers.sample import (
    LOGPROB_DTYPE,
    MASK_DTYPE,
    TOKEN_DTYPE,
    VERSION_DTYPE,
    SamplerParams,
    SampleStatus,
)
from strawq.producers.trajectory import Trajectory, TrajectoryError, idempotency_key
from strawq.producers.turn_saver import TurnSaver
from strawq.tasks.queue import Lease

PROMPT = [11, 12, 13, 14, 15]


class Host:
    """A ``SampleHost`` for one group without a producer: the tools' settings, threads
    that run inline, and a ``generate_turn`` that appends scripted tokens the way a
    segment does."""

    def __init__(self, run: GroupRun, *, context_length: int | None = None,
                 turns: list[list[int]] | None = None) -> None:
        self.run = run
        self.tools = ToolsConfig(retries=0, timeout_s=5.0, on_failure="fail_sample")
        self.context_length = context_length
        self.turns: TurnSaver | None = None
        self.abandoned = False
        self.scripted = list(turns or [])
        self.engine_calls = 0
        self.dropped: tuple[str, str] | None = None
        self.detached: dict[str, asyncio.Future[Any]] = {}

    def halted(self) -> bool:
        return False

    def check_halted(self) -> None:
        pass

    def lose_lease(self, keep: int) -> None:
        self.abandoned = True

    def drop_group(self, reason: str, message: str, keep: int) -> None:
        self.dropped = (reason, message)

    def take_detached(self, key: str) -> asyncio.Future[Any] | None:
        return self.detached.pop(key, None)

    def detach(self, key: str, task: asyncio.Future[Any]) -> None:
        self.detached[key] = task

    async def offload(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    def bump(self, counter: str, n: int = 1) -> None:
        pass

    def hop(self, name: str, seconds: float) -> None:
        pass

    async def generate_turn(self, i: int) -> str:
        """One scripted turn (its tokens get loss mask 1, version 0), cut to the budget."""
        self.engine_calls += 1
        s = self.run.samples[i]
        budget = s.remaining_budget(self.context_length)
        if budget == 0:
            s.finish_without_request()
            return "length"
        ids = np.asarray(self.scripted.pop(0)[:budget], dtype=TOKEN_DTYPE)
        s.response_ids = np.concatenate([s.response_ids, ids])
        s.logprobs = np.concatenate([s.logprobs, np.full(len(ids), -0.5, LOGPROB_DTYPE)])
        s.versions = np.concatenate([s.versions, np.zeros(len(ids), VERSION_DTYPE)])
        s.loss_mask = np.concatenate([s.loss_mask, np.ones(len(ids), MASK_DTYPE)])
        s.check()
        return "stop"


def _host(h: Host) -> SampleHost:
    return h  # (type-checked: Host is a SampleHost)


def lease(gen: int = 0, resume: int = -1) -> Lease:
    name = TaskName(key=f"{0:012d}.{0:012d}", id="i000000000000", gen=gen, attempts=1,
                    resume=resume, producer="p0")
    return Lease(name, {"id": "i000000000000", "index": 0, "row": {"prompt": PROMPT}})


def fresh(max_new: int = 100, *, gen: int = 0, resume: int = -1) -> GroupRun:
    return GroupRun.fresh(lease(gen, resume), PROMPT, [SamplerParams(max_new_tokens=max_new)])


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- finding: an append past the context length ---------------------------------------------
@pytest.mark.parametrize("n_append, fits", [(4, True), (5, False), (8, False)])
def test_an_append_respects_the_context_length(n_append: int, fits: bool) -> None:
    """context_length 20, prompt 5, a turn of 10: the longest sequence the engine serves is
    19 tokens, so 4 appended tokens fit and 5 do not; a refused append is never cut and
    the sample ends truncated with the limit recorded."""

    async def agent(ctx: GenerateContext) -> None:
        await ctx.generate()
        ctx.append(list(range(100, 100 + n_append)), kind="tool")
        await ctx.generate()
        ctx.finish("completed")

    g = fresh()
    host = Host(g, context_length=20, turns=[[7] * 10, [8] * 10])
    run(run_plugin(agent, host, 0, 0))
    s = g.samples[0]
    assert len(PROMPT) + s.response_length <= 20 - 1  # docs/design.md, invariant 4
    g.trajectories[0].check(s.response_length, s.loss_mask)
    if fits:
        assert s.response_ids[10:].tolist() == [100, 101, 102, 103]  # no room for turn 2
        assert [e["op"] for e in g.trajectories[0].events] == ["gen", "append", "gen"]
    else:
        assert s.response_length == 10 and s.status is SampleStatus.TRUNCATED
        assert s.finish_reason == {"type": "length", "limit": "context_length",
                                   "tokens": n_append}
        assert [e["op"] for e in g.trajectories[0].events] == ["gen"]
        assert host.engine_calls == 1


def test_the_response_budget_is_still_the_append_limit() -> None:
    async def agent(ctx: GenerateContext) -> None:
        await ctx.generate()
        ctx.append([100, 101, 102], kind="tool")
        ctx.finish("completed")

    g = fresh(max_new=12)
    run(run_plugin(agent, Host(g, context_length=1000, turns=[[7] * 10]), 0, 0))
    s = g.samples[0]
    assert s.response_length == 10 and s.finish_reason["limit"] == "append"


# -- finding: finish() / fail() during the replay -------------------------------------------
def aborted_mid_second_turn() -> GroupRun:
    """A resumed sample: turn 1 (3 tokens), a tool call, 2 appended tokens, then turn 2 cut
    by an abort after 2 tokens (an open turn)."""
    g = fresh(gen=4, resume=3)
    s = g.samples[0]
    s.response_ids = np.asarray([7, 7, 7, 100, 101, 8, 8], TOKEN_DTYPE)
    s.logprobs = np.asarray([-0.5] * 3 + [0.0] * 2 + [-0.5] * 2, LOGPROB_DTYPE)
    s.versions = np.zeros(7, VERSION_DTYPE)
    s.loss_mask = np.asarray([1, 1, 1, 0, 0, 1, 1], MASK_DTYPE)
    s.status = SampleStatus.ABORTED
    g.trajectories[0] = Trajectory(events=[
        {"op": "gen", "start": 0, "end": 3, "finish": "stop"},
        {"op": "tool", "key": "k", "name": "calc", "args": {"x": 1}, "result": {"value": 9}},
        {"op": "append", "start": 3, "end": 5, "kind": "tool"},
        {"op": "gen", "start": 5, "end": None, "finish": None}], gen=3)
    return g


def test_finish_during_the_replay_raises_and_the_aborted_turn_is_never_complete() -> None:
    async def early(ctx: GenerateContext) -> None:
        await ctx.generate()                       # replays turn 1
        await ctx.call_tool("calc", {"x": 1}, lambda a, k: {"value": 9})
        ctx.append([100, 101])
        ctx.finish("completed")                    # but turn 2 was cut by an abort

    g = aborted_mid_second_turn()
    ctx = GenerateContext(Host(g), 0, 0)
    with pytest.raises(TrajectoryError, match="during the replay.*aborted turn"):
        run(early(ctx))
    assert g.samples[0].status is SampleStatus.ABORTED

    g = aborted_mid_second_turn()
    run(run_plugin(early, Host(g), 0, 0))
    s = g.samples[0]
    assert s.status is not SampleStatus.COMPLETED and 0 in g.failures  # never trained
    assert "during the replay" in g.failures[0]


def test_fail_during_the_replay_raises() -> None:
    async def flaky(ctx: GenerateContext) -> None:
        await ctx.generate()
        ctx.fail("environment gone")  # the record says a tool call came next

    g = aborted_mid_second_turn()
    ctx = GenerateContext(Host(g), 0, 0)
    with pytest.raises(TrajectoryError, match=r"fail\('environment gone'\) during the replay"):
        run(flaky(ctx))


def test_a_plugin_that_replays_everything_finishes_normally() -> None:
    async def agent(ctx: GenerateContext) -> None:
        await ctx.generate()
        await ctx.call_tool("calc", {"x": 1}, lambda a, k: {"value": 9})
        ctx.append([100, 101])
        await ctx.generate()                       # continues the open turn
        ctx.finish("completed")

    g = aborted_mid_second_turn()
    host = Host(g, turns=[[8, 8, 2]])
    run(run_plugin(agent, host, 0, 0))
    s = g.samples[0]
    assert s.status is SampleStatus.COMPLETED and not g.failures
    assert s.response_ids.tolist() == [7, 7, 7, 100, 101, 8, 8, 8, 8, 2]
    assert host.engine_calls == 1


# -- finding: idempotency keys and the lease generation -------------------------------------
def tool_key(g: GroupRun) -> str:
    seen: list[str] = []

    async def agent(ctx: GenerateContext) -> None:
        await ctx.call_tool("reset", {"env": "box"}, lambda a, k: seen.append(k) or "ok")
        ctx.finish("completed")

    run(run_plugin(agent, Host(g), 0, 0))
    assert len(seen) == 1 and g.trajectories[0].tool_calls()[0]["key"] == seen[0]
    return seen[0]


def test_a_trajectory_started_afresh_gets_new_keys() -> None:
    """The same call at the same point (a reset before any token) in a trajectory begun
    again from the prompt (its prefix regenerated, or nothing saved before a crash) is a
    new episode: its key differs, so a deduplicating tool runs it."""
    first, again = tool_key(fresh(gen=0)), tool_key(fresh(gen=3))
    assert first != again
    assert ".g0." in first and ".g3." in again


def test_every_resume_of_one_record_keeps_the_keys() -> None:
    """Two producers resuming the same partial (saved at generation 2) under different
    leases (a crash in between) issue the same key for a call not yet persisted."""
    a, b = tool_key(fresh(gen=3, resume=2)), tool_key(fresh(gen=6, resume=2))
    assert a == b and ".g2." in a


def test_the_generation_is_persisted_with_the_trajectory() -> None:
    g = fresh(gen=5)
    tool_key(g)
    t = g.trajectories[0]
    assert t.gen == 5
    assert Trajectory.from_dict(t.to_dict()) == t
    legacy = {"schema": 1, "epoch": 0, "events": []}
    assert Trajectory.from_dict(legacy).gen is None
    assert idempotency_key("t", 0, 0, 0, "n", {}, []) == idempotency_key(
        "t", 0, 0, 0, "n", {}, [], gen=None)
    assert idempotency_key("t", 0, 0, 0, "n", {}, [], gen=1) != idempotency_key(
        "t", 0, 0, 0, "n", {}, [], gen=2)
