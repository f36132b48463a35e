"""The demo's agentic task: arithmetic the tiny model must delegate to a calculator tool.

A prompt asks for ``(a * b) mod 10`` of two digits. The model cannot see the answer in the
prompt; it can call the calculator with a fixed syntax — the two operand tokens, then
``CALL`` — and the tool's result comes back as appended tokens ``RESULT, <digit>`` (loss
mask 0). The model then answers with one digit token and EOS. Reward 1 for the right digit
as the first token of the last turn, else 0; so the policy has to learn to copy the
operands, call, and copy the result back.

Token ids (vocabulary of the demo's tiny model, 32)::

    BOS 1, EOS 2, CALL 3, RESULT 4, digit d -> 5 + d (5..14), ASK 15
    prompt: [BOS, ASK, 5 + a, 5 + b]

Every operation goes through the generate plugin (``agent``); the calculator is
idempotent by key (a pure function), so a call re-executed after a crash is harmless.
"""

from __future__ import annotations

import random
from typing import Any

from strawq.demo.task import write_jsonl
from strawq.producers.generate import GenerateContext

BOS, EOS, CALL, RESULT, ASK = 1, 2, 3, 4, 15
DIGIT0 = 5
MAX_NEW_TOKENS = 24
MAX_CALLS = 2
#: what the producer needs for this task (``ProducerConfig`` sections, as a mapping)
PRODUCER = {"plugins": {"generate": "strawq.demo.tools_task.agent",
                        "reward": "strawq.demo.tools_task.reward"},
            "sampling": {"stop_token_ids": (CALL,), "max_new_tokens": MAX_NEW_TOKENS},
            "tools": {"max_turns": 4}}


def digit(tok: int) -> int | None:
    d = int(tok) - DIGIT0
    return d if 0 <= d <= 9 else None


def answer(a: int, b: int) -> int:
    return (a * b) % 10


def prompt_for(a: int, b: int) -> list[int]:
    return [BOS, ASK, DIGIT0 + a, DIGIT0 + b]


def make_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": prompt_for(a, b), "a": a, "b": b, "answer": answer(a, b)})
    return rows


def write_dataset(path: str, n: int, seed: int = 0) -> str:
    return write_jsonl(path, make_rows(n, seed))


def calculator(args: dict[str, Any], key: str) -> dict[str, Any]:
    """The tool: ``(x * y) mod 10``; an unparsable call returns an error the model sees."""
    x, y = args.get("x"), args.get("y")
    if x is None or y is None:
        return {"error": "syntax"}
    return {"value": answer(int(x), int(y))}


async def agent(ctx: GenerateContext) -> None:
    """Turns until the model answers without calling; each ``x y CALL`` runs the calculator
    and appends ``RESULT <digit>`` (or ``RESULT EOS`` after a syntax error)."""
    for _ in range(MAX_CALLS + 1):
        turn = await ctx.generate()
        toks = turn.token_ids
        if turn.finish != "stop" or not toks or toks[-1] != CALL:
            ctx.finish("completed" if turn.finish == "stop" else "truncated")
            return
        ops = [digit(t) for t in toks[-3:-1]] if len(toks) >= 3 else []
        args = {"x": ops[0], "y": ops[1]} if len(ops) == 2 and None not in ops else {}
        out = await ctx.call_tool("calculator", args, calculator)
        ctx.append([RESULT, DIGIT0 + int(out["value"]) if "value" in out else EOS],
                   kind="tool")
    ctx.finish("truncated", {"type": "length", "limit": "calls"})


def reward(task: dict[str, Any], response_ids: list[int], meta: dict[str, Any]) -> float:
    """1 when the last turn starts with the right digit, else 0."""
    row = task.get("row") or {}
    events = (meta.get("trajectory") or {}).get("events") or []
    turns = [e for e in events if e["op"] == "gen" and e["end"] is not None]
    if not turns or meta.get("status") != "completed":
        return 0.0
    last = turns[-1]
    if last["end"] <= last["start"]:
        return 0.0
    return 1.0 if digit(response_ids[last["start"]]) == int(row.get("answer", -1)) else 0.0


def tool_spans(meta: dict[str, Any]) -> list[tuple[float, float]]:
    """(start, end) wall-clock seconds of each tool call of a group (its record's meta)."""
    return [(float(e["started"]), float(e["started"]) + float(e.get("seconds", 0.0)))
            for t in meta.get("trajectories") or []
            for e in (t or {}).get("events", []) if e.get("op") == "tool" and "started" in e]


def tool_series(spans: list[tuple[float, float]], clock_offset: float, scale: int,
                step_s: float = 0.05) -> list[tuple[float, float]]:
    """Tools in flight over time as a timeline row: (monotonic t, min(1, calls / scale));
    ``clock_offset`` = time.time() - time.monotonic() of this host."""
    if not spans:
        return []
    lo = min(s for s, _ in spans)
    hi = max(e for _, e in spans) + step_s
    out = []
    n = int((hi - lo) / step_s) + 1
    for k in range(n):
        t = lo + k * step_s
        live = sum(1 for s, e in spans if s <= t < e)
        out.append((t - clock_offset, min(1.0, live / max(scale, 1))))
    return out
