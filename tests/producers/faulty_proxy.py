"""A fault-injecting HTTP proxy in front of a local engine (its own loop, in a thread).

``mode`` of ``/generate``: ``ok`` (forward), ``500`` (every call fails), ``flaky`` (every
other call fails with 500), ``first_try_fails`` (a request's first attempt fails with 500,
its retry — rid ``…~retry<n>`` — is forwarded), ``hang`` (never answers). Other paths are
forwarded, except those in ``refuse``, answered 400 ``{"success": false}`` (a refused weight
update).
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import aiohttp
from aiohttp import web


class FaultyProxy:
    def __init__(self, upstream: str, mode: str = "ok") -> None:
        self.upstream = upstream.rstrip("/")
        self.mode = mode
        self.calls = {"ok": 0, "500": 0, "hang": 0}
        self.refuse: set[str] = set()
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, daemon=True, name="faulty-proxy")
        self._thread.start()
        if not self._ready.wait(30):
            raise TimeoutError("faulty proxy did not start")

    def _main(self) -> None:
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        session = aiohttp.ClientSession()
        n = 0

        async def forward(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            if request.path in self.refuse:
                return web.json_response({"success": False, "message": "injected refusal"},
                                         status=400)
            async with session.request(request.method, self.upstream + request.path_qs,
                                       data=body, headers={"Content-Type": "application/json"}
                                       ) as r:
                data = await r.read()
                return web.Response(status=r.status, body=data,
                                    content_type=r.content_type or "application/json")

        async def generate(request: web.Request) -> web.StreamResponse:
            nonlocal n
            n += 1
            mode = self.mode
            first_try = False
            if mode == "first_try_fails":
                try:
                    rid = str(json.loads(await request.read()).get("rid", ""))
                except ValueError:
                    rid = ""
                first_try = "~retry" not in rid
            if mode == "500" or (mode == "flaky" and n % 2 == 0) or first_try:
                self.calls["500"] += 1
                await request.read()
                return web.Response(status=500, text="injected fault")
            if mode == "hang":
                self.calls["hang"] += 1
                await asyncio.sleep(3600)
            self.calls["ok"] += 1
            return await forward(request)

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        sock: Any = site._server.sockets[0]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()
            await session.close()

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def __enter__(self) -> FaultyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
