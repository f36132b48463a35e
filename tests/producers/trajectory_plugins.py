"""Generate plugins for the trajectory tests: a tool-calling agent whose tool writes one
ledger file per execution (so a test can count executions per idempotency key)."""

from __future__ import annotations

import os
import time
import uuid
from collections import Counter
from typing import Any

from strawq.producers.generate import GenerateContext, GenerateFn

TOOL_TOKEN_BASE = 3


def ledger_counts(ledger: str) -> Counter[str]:
    """Executions per idempotency key."""
    if not os.path.isdir(ledger):
        return Counter()
    return Counter(name.rsplit(".", 1)[0] for name in os.listdir(ledger))


def tool_agent(ledger: str, turns: int = 3, slow_s: float = 0.0, fail: str = "") -> GenerateFn:
    """Up to ``turns`` turns; after each turn but the last, a ``calc`` tool call whose result
    becomes two appended tokens. ``fail``: "always" makes the tool raise."""

    def calc(args: dict[str, Any], key: str) -> dict[str, int]:
        os.makedirs(ledger, exist_ok=True)
        fd = os.open(os.path.join(ledger, f"{key}.{uuid.uuid4().hex}"),
                     os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        os.close(fd)
        if slow_s:
            time.sleep(slow_s)
        if fail == "always":
            raise RuntimeError("calculator is down")
        return {"value": int(args["x"]) * 2 % 97}

    async def agent(ctx: GenerateContext) -> None:
        for t in range(turns):
            turn = await ctx.generate()
            if turn.finish != "stop" or t == turns - 1:
                ctx.finish("completed" if turn.finish == "stop" else "truncated")
                return
            x = len(turn.token_ids) + sum(turn.token_ids) % 7
            out = await ctx.call_tool("calc", {"x": x}, calc)
            ctx.append([TOOL_TOKEN_BASE + int(out["value"]), TOOL_TOKEN_BASE], kind="tool")

    return agent


def chat_two_turns(model_dir: str, second: str) -> GenerateFn:
    """Two chat turns with the model's own chat template: the glue between the first answer
    (ended by the template's end-of-turn token) and the second assistant turn is what the
    template renders for a user message ``second``; it is appended with loss mask 0."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    mark = "\x00ANSWER\x00"

    async def chat(ctx: GenerateContext) -> None:
        first = ctx.task["row"]["prompt"]
        turn = await ctx.generate()
        if turn.finish != "stop":
            ctx.finish("truncated")
            return
        rendered = tok.apply_chat_template(
            [*first, {"role": "assistant", "content": mark}, {"role": "user", "content": second}],
            tokenize=False, add_generation_prompt=True)
        glue = rendered.split(mark + tok.eos_token, 1)[1]
        ctx.append(tok.encode(glue, add_special_tokens=False), kind="glue")
        turn = await ctx.generate()
        ctx.finish("completed" if turn.finish == "stop" else "truncated")

    return chat
