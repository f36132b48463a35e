"""A deterministic stand-in for the rollout server under verl's real resuming client.

verl's ``FullyAsyncLLMServerClient`` reaches its server through a Ray load balancer and a
vLLM/SGLang replica (GPU). ``ScriptedEngine`` takes the place of that one attempt: token
``t`` at response position ``i`` of prompt ``p`` is ``(sum(p) * 31 + i) % 997``, log-prob
``-i/1000``, stamped with the version in ``<dir>/version``; while ``<dir>/pause`` exists an
attempt stops after ``chunk`` tokens with ``stop_reason="aborted"`` (verl's abort at a
parameter sync). Everything above that attempt (verl's resume loop, strawq's durable prefix
layer) is the real code. Run as a script, it generates one request and prints the result.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from strawq.collector.integrations.verl.client import StrawqFullyAsyncLLMServerClient


def token(prompt: list[int], i: int) -> int:
    return (sum(prompt) * 31 + i) % 997


class ScriptedEngine(LLMServerClient):
    state_dir: Path = Path(".")
    chunk = 3
    calls = 0

    async def generate(self, request_id: Any, *, prompt_ids: list[int],
                       sampling_params: dict[str, Any], **kwargs: Any) -> TokenOutput:
        type(self).calls += 1
        version = int((self.state_dir / "version").read_text())
        prompt_len = int(sampling_params["_prompt_len"])
        prompt, done = list(prompt_ids[:prompt_len]), len(prompt_ids) - prompt_len
        budget = int(sampling_params["max_tokens"])
        paused = (self.state_dir / "pause").exists()
        n = min(budget, self.chunk) if paused else budget
        ids = [token(prompt, done + i) for i in range(n)]
        lps = [-(done + i) / 1000 for i in range(n)]
        stop = "aborted" if paused and n < budget else "length"
        return TokenOutput(token_ids=ids, log_probs=lps, stop_reason=stop,
                           extra_fields={"global_steps": version})


class Client(StrawqFullyAsyncLLMServerClient, ScriptedEngine):
    """verl's resuming client with strawq's durable layer, over the stand-in engine."""


def config(queue_dir: str, response_length: int) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "async_training": {"partial_rollout": True, "strawq_queue_dir": queue_dir},
        "actor_rollout_ref": {"rollout": {"response_length": response_length,
                                          "name": "vllm", "full_determinism": False}}})


async def generate(queue_dir: str, state_dir: str, prompt: list[int],
                   max_tokens: int) -> TokenOutput:
    ScriptedEngine.state_dir = Path(state_dir)
    client = Client(config=config(queue_dir, max_tokens), load_balancer_handle=None)
    out: TokenOutput = await client.generate(
        "req-1", prompt_ids=prompt,
        sampling_params={"max_tokens": max_tokens, "_prompt_len": len(prompt)})
    return out


if __name__ == "__main__":
    qdir, sdir, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    result = asyncio.run(generate(qdir, sdir, [5, 6, 7], n))
    print(json.dumps({"tokens": result.token_ids, "log_probs": result.log_probs,
                      "extra": {k: v for k, v in result.extra_fields.items()
                                if k in ("min_global_steps", "max_global_steps",
                                         "token_versions")}}))
