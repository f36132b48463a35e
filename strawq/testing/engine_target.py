"""The engine under test and the plumbing the engine contract's tests share.

``EngineTarget`` describes one engine (its URL, model facts, keys, budgets); ``ContractPlumbing``
runs one test's coroutine under the target's deadline and waits for the engine's states
(requests running, idle). ``spawn_generate`` is a client in its own process, killed to leave
a request orphaned. The contract itself: ``strawq.testing.engine_contract``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

from strawq.producers.sglang_client import ClientConfig, SGLangClient

T = TypeVar("T")
# Greedy; the seed makes the sim engine reproducible (SGLang ignores it without
# --enable-deterministic-inference, and greedy needs none).
GREEDY: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True, "sampling_seed": 1234}


@dataclass(frozen=True)
class EngineTarget:
    """One engine under test.

    Fields:
        url: the worker's base URL (control calls always go here).
        eos_token_id: the model's EOS id.
        vocab_size: token ids in ``[0, vocab_size)`` are valid.
        prompt: a prompt of valid ids.
        weight_dirs: two weight directories the engine can load (``update_weights_from_disk``);
            the second one differs from the first (a real weight change).
        max_running: the engine's ``--max-running-requests``.
        long_tokens: a budget that keeps one request running for a second or more.
        api_key / admin_api_key: the keys the engine was started with (None: none).
        router_url: a router in front of ``url`` (``/generate`` goes there when set).
        timeout_s: the deadline of one test.
        no_routed_experts: why the target returns no ``routed_experts`` (a dense model);
            the routed-experts case is skipped with it.
    """

    url: str
    eos_token_id: int
    vocab_size: int
    prompt: tuple[int, ...]
    weight_dirs: tuple[str, str]
    max_running: int
    long_tokens: int = 400
    api_key: str | None = None
    admin_api_key: str | None = None
    router_url: str | None = None
    timeout_s: float = 120.0
    extra: Mapping[str, Any] = field(default_factory=dict)
    #: why the target cannot return ``routed_experts`` (None: it can; a dense model cannot)
    no_routed_experts: str | None = None
    #: a budget the engine needs well over ``3 * disconnect_deadline_s`` to generate (None:
    #: the context is generated too fast to tell an abort from the end; the case is skipped)
    orphan_tokens: int | None = 8000
    #: how soon the request of a client killed with ``kill -9`` must be gone from the engine
    disconnect_deadline_s: float = 30.0

    def client(self, **overrides: Any) -> SGLangClient:
        cfg: dict[str, Any] = {
            "max_retries": 0,
            "api_key": self.api_key,
            "admin_api_key": self.admin_api_key,
            "control_timeout_s": 60.0,
        }
        cfg.update(overrides)
        return SGLangClient([self.url], router_url=self.router_url, config=ClientConfig(**cfg))

    def headers(self, admin: bool = False) -> dict[str, str]:
        key = self.admin_api_key if admin and self.admin_api_key else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}


async def counts(client: SGLangClient, url: str) -> tuple[int, int]:
    body = await client.loads(url)
    entry = body["loads"][0]
    return int(entry["num_running_reqs"]), int(entry["num_waiting_reqs"])


async def live_tokens(target: EngineTarget) -> dict[str, int] | None:
    """Each request's output tokens so far, by rid (the local engines'
    ``GET /strawq/live_requests``); None where the engine has no such endpoint."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(target.url.rstrip("/") + "/strawq/live_requests",
                 headers=target.headers()) as resp,
    ):
        if resp.status != 200:
            return None
        body = await resp.json()
    return {r["rid"]: int(r["output_tokens"]) for r in body["requests"]}


async def until(pred: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached within {timeout_s:.0f}s")
        await asyncio.sleep(0.02)


#: a client in its own process: sends one ``/generate`` and waits for the answer
_CLIENT = """
import sys, urllib.request
url, body, key = sys.argv[1:4]
headers = {"Content-Type": "application/json"}
if key:
    headers["Authorization"] = "Bearer " + key
urllib.request.urlopen(urllib.request.Request(url, data=body.encode(), headers=headers),
                       timeout=3600).read()
"""


def spawn_generate(url: str, body: Mapping[str, Any],
                   api_key: str | None = None) -> subprocess.Popen[bytes]:
    """A client in its own process that posts ``body`` to ``url``'s ``/generate`` and waits
    (kill it to leave the request orphaned, as a crashed producer does)."""
    return subprocess.Popen([sys.executable, "-c", _CLIENT, url.rstrip("/") + "/generate",
                             json.dumps(body), api_key or ""])


class ContractPlumbing:
    """What every area of the engine contract uses: a bounded run, waits on the engine's
    load, a long request, a raw HTTP call."""

    def run(self, target: EngineTarget, coro: Awaitable[T]) -> T:
        async def bounded() -> T:
            return await asyncio.wait_for(coro, target.timeout_s)

        return asyncio.run(bounded())

    async def _running(
        self, c: SGLangClient, t: EngineTarget, n: int = 1, task: asyncio.Future[Any] | None = None
    ) -> None:
        async def ok() -> bool:
            if task is not None and task.done():
                raise AssertionError(
                    f"the request finished before it was seen running ({task.result()}); "
                    "give it a longer budget"
                )
            return (await counts(c, t.url))[0] >= n

        await until(ok, t.timeout_s / 2, f"{n} request(s) running on {t.url}")

    async def _idle(self, c: SGLangClient, t: EngineTarget) -> None:
        async def ok() -> bool:
            return await counts(c, t.url) == (0, 0)

        await until(ok, t.timeout_s / 2, f"{t.url} idle")

    def _long(self, t: EngineTarget, n: int | None = None) -> dict[str, Any]:
        return {"max_new_tokens": n or t.long_tokens, "ignore_eos": True}

    async def _start_long(self, c: SGLangClient, t: EngineTarget, n: int) -> asyncio.Task[Any]:
        """One ``n``-token request, returned once the engine reports it running (it must
        not finish before that)."""
        task = asyncio.create_task(c.generate(t.prompt, self._long(t, n)))
        await self._running(c, t, task=task)
        return task

    async def _raw(
        self, t: EngineTarget, path: str, body: Any, *, admin: bool = False
    ) -> tuple[int, bytes]:
        async with (
            aiohttp.ClientSession() as s,
            s.post(t.url + path, json=body, headers=t.headers(admin)) as r,
        ):
            return r.status, await r.read()
