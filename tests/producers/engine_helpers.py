"""Helpers for the engine tests."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from strawq.testing.engine_contract import spawn_generate
from strawq.producers.sglang_client import ClientConfig, SGLangClient
from strawq.testing.waiting import async_wait_until

T = TypeVar("T")

FIXTURES = Path(__file__).parent / "fixtures"


def run(coro: Awaitable[T], timeout_s: float = 60.0) -> T:
    """Run a coroutine to completion with a deadline (no pytest-asyncio needed)."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class AppThread:
    """Serve an aiohttp app built by ``factory`` on a private loop in a daemon thread."""

    def __init__(self, factory: Callable[[], web.Application]) -> None:
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._factory = factory
        self.url = ""
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise TimeoutError("test server did not start")

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._loop.run_forever()
        # bounded: a client that left a connection open can keep aiohttp's graceful cleanup
        # waiting (a teardown once waited out the whole join below in the parallel suite).
        # ``asyncio.wait`` returns at its timeout; ``wait_for`` would then wait for the
        # cancelled cleanup to finish, which is the very wait being bounded
        cleanup = self._loop.create_task(self._runner.cleanup())
        self._loop.run_until_complete(asyncio.wait({cleanup}, timeout=5))
        if not cleanup.done():
            cleanup.cancel()  # not awaited: the daemon thread ends, the port goes with it

    async def _start(self) -> None:
        self._runner = web.AppRunner(self._factory(), access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        self._ready.set()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


def load_fixture(name: str) -> Any:
    import json

    return json.loads((FIXTURES / name).read_text())


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], timeout_s: float = 30.0, poll_s: float = 0.01
) -> None:
    """Poll an async predicate until it holds; fail after ``timeout_s``."""
    await async_wait_until(predicate, timeout_s, what="an engine condition", poll_s=poll_s)


async def load_counts(client: Any, url: str) -> tuple[int, int]:
    body = await client.loads(url)
    entry = body["loads"][0]
    return int(entry["num_running_reqs"]), int(entry["num_waiting_reqs"])


async def orphan_through_router(router_url: str, workers: list[str]) -> None:
    """A client killed with ``kill -9`` while its request runs behind the router: the
    router drops its upstream connection and the worker aborts the request (SGLang's
    disconnect check, every 0.5 s here) instead of generating the 20,000 tokens (100 s on
    a sim engine at 5 ms a step)."""
    async with SGLangClient(workers, config=ClientConfig(max_retries=0)) as c:
        client = spawn_generate(router_url, {
            "input_ids": [11, 22, 33, 44, 55], "rid": "orphan-r",
            "sampling_params": {"max_new_tokens": 20000, "ignore_eos": True}})

        async def running() -> int:
            return sum([(await load_counts(c, url))[0] for url in workers])

        async def started() -> bool:
            return await running() > 0

        async def idle() -> bool:
            return await running() == 0

        try:
            await async_wait_until(started, 10, what="the request running on a worker")
            assert await running() == 1
        finally:
            client.kill()
            client.wait()
        # the worker checks its client every 0.5 s
        await async_wait_until(idle, 10, what="the killed client's request aborted on the worker")
