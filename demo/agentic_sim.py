"""A simulated agent for the lab and the agentic bench: turns and tool latency drawn from
long-tailed distributions, on any engine (the ``sim`` timing model in the lab).

Each sample draws its number of turns (1 + a geometric count, capped) and, per tool call,
a log-normal latency; both are functions of the sample's id, epoch and call ordinal, so a
replayed trajectory draws the same ones (the plugin is deterministic given its trajectory,
as the generate contract asks). The tool sleeps for its latency (``asyncio.sleep``: it
holds the sample's trajectory slot, not a thread) and returns ``obs_tokens`` token ids that
are appended with loss mask 0. With ``ledger`` each execution also creates one file
``<ledger>/<key>.<random>``, so a test or bench can count executions per idempotency key.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import random
import uuid
from collections import Counter
from typing import Any

from strawq.producers.generate import GenerateContext, GenerateFn


def _rng(*parts: Any) -> random.Random:
    h = hashlib.blake2b(":".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(h, "little"))


def ledger_counts(ledger: str) -> Counter[str]:
    """Executions per idempotency key in a ledger directory."""
    if not os.path.isdir(ledger):
        return Counter()
    return Counter(name.rsplit(".", 1)[0] for name in os.listdir(ledger))


def sim_agent(*, turns_p: float = 0.5, max_turns: int = 6, tool_median_s: float = 0.2,
              tool_sigma: float = 1.0, tool_cap_s: float = 5.0, time_scale: float = 1.0,
              obs_tokens: int = 8, ledger: str | None = None, seed: int = 0) -> GenerateFn:
    """A generate plugin: turns ~ 1 + Geometric(1 - turns_p) capped at ``max_turns``;
    tool latency ~ LogNormal(log(median), sigma) capped at ``tool_cap_s`` model seconds,
    slept as ``latency * time_scale`` wall seconds."""
    if not 0 <= turns_p < 1 or max_turns < 1 or tool_median_s < 0:
        raise ValueError("sim_agent: need 0 <= turns_p < 1, max_turns >= 1, tool_median_s >= 0")

    async def tool(args: dict[str, Any], key: str) -> dict[str, Any]:
        if ledger is not None:
            os.makedirs(ledger, exist_ok=True)
            fd = os.open(os.path.join(ledger, f"{key}.{uuid.uuid4().hex}"),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.close(fd)
        await asyncio.sleep(float(args["latency"]) * time_scale)
        r = _rng(seed, key)
        return {"tokens": [r.randint(3, 30) for _ in range(obs_tokens)]}

    async def agent(ctx: GenerateContext) -> None:
        s = ctx.sample
        epoch = ctx.trajectory.epoch
        r = _rng(seed, s.uid, epoch, "turns")
        turns = 1
        while turns < max_turns and r.random() < turns_p:
            turns += 1
        for t in range(turns):
            turn = await ctx.generate()
            if turn.finish != "stop" or t == turns - 1:
                ctx.finish("completed" if turn.finish == "stop" else "truncated")
                return
            lr = _rng(seed, s.uid, epoch, "tool", t)
            latency = min(tool_cap_s, tool_median_s * math.exp(tool_sigma * lr.gauss(0, 1)))
            out = await ctx.call_tool("sim_tool", {"turn": t, "latency": round(latency, 4)},
                                      tool)
            ctx.append(out["tokens"], kind="tool")

    return agent
