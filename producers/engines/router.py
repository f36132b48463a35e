"""A minimal stand-in for sglang-router 0.3.x: worker registry and round-robin ``/generate``.

Only what strawq uses: ``GET /workers`` (the 0.3.x shape), ``POST /workers`` (202),
``DELETE /workers/{id}``, ``/generate`` forwarded round-robin with the body unchanged (a
streamed reply passed on chunk by chunk), ``/flush_cache`` fanned out, ``/health`` and
``/health_generate`` answered by the router.
Control endpoints (abort, pause, weight updates) are deliberately *not* routed (404), as
in the real router: clients must send them to each worker.

With an API key (``--api-key``, as sglang-router's), every endpoint but ``/health`` needs
``Authorization: Bearer <key>``; the header is passed on to the workers with ``/generate``
and ``/flush_cache`` (workers started with the same ``--api-key``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import uuid
from typing import Any

import aiohttp
from aiohttp import web

logger = logging.getLogger(__name__)

STATE_KEY = web.AppKey("router_state", dict)


def _worker(url: str) -> dict[str, Any]:
    return {
        "id": str(uuid.uuid4()),
        "url": url.rstrip("/"),
        "worker_type": "regular",
        "is_healthy": True,
        "load": -1,
    }


async def _list_workers(request: web.Request) -> web.Response:
    workers = request.app[STATE_KEY]["workers"]
    return web.json_response({"workers": workers, "total": len(workers), "stats": {}})


async def _add_worker(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except ValueError:
        return web.json_response(
            {"error": {"message": "body must be JSON with a 'url'"}}, status=400
        )
    if not isinstance(body, dict) or not isinstance(body.get("url"), str):
        return web.json_response(
            {"error": {"message": "body must be JSON with a 'url'"}}, status=400
        )
    worker = _worker(body["url"])
    request.app[STATE_KEY]["workers"].append(worker)
    return web.json_response(
        {"status": "accepted", "worker_id": worker["id"], "url": worker["url"]}, status=202
    )


async def _delete_worker(request: web.Request) -> web.Response:
    workers = request.app[STATE_KEY]["workers"]
    wid = request.match_info["wid"]
    kept = [w for w in workers if w["id"] != wid]
    if len(kept) == len(workers):
        return web.json_response({"error": {"message": f"no worker with id {wid}"}}, status=404)
    workers[:] = kept
    return web.json_response({"status": "accepted", "worker_id": wid}, status=202)


def _upstream_headers(request: web.Request) -> dict[str, str]:
    auth = request.headers.get("Authorization")
    return {"Authorization": auth} if auth else {}


async def _generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    workers = state["workers"]
    if not workers:
        return web.json_response({"error": {"message": "no workers registered"}}, status=503)
    url = workers[next(state["rr"]) % len(workers)]["url"]
    body = await request.read()
    headers = {"Content-Type": "application/json", **_upstream_headers(request)}
    out: web.StreamResponse | None = None
    try:
        async with state["session"].post(url + "/generate", data=body, headers=headers) as resp:
            if resp.status != 200 or resp.content_type != "text/event-stream":
                data = await resp.read()
                return web.Response(body=data, status=resp.status,
                                    content_type=resp.content_type)
            # a streamed reply: each chunk passed on as it comes (the worker's own framing)
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                              "Cache-Control": "no-cache"})
            await out.prepare(request)
            async for data in resp.content.iter_any():
                await out.write(data)
            await out.write_eof()
            return out
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        if out is not None:  # the headers went out: the client sees the stream end early
            return out
        return web.json_response({"error": {"message": f"worker {url} failed: {exc}"}}, status=502)


async def _flush_cache(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    headers = _upstream_headers(request)

    async def one(url: str) -> int:
        try:
            async with state["session"].post(
                url + "/flush_cache", timeout=aiohttp.ClientTimeout(total=5), headers=headers
            ) as resp:
                return int(resp.status)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return 599

    codes = await asyncio.gather(*(one(w["url"]) for w in state["workers"]))
    ok = all(c == 200 for c in codes)
    return web.Response(
        status=200 if ok else 500, text="Cache flushed." if ok else f"flush failed: {codes}"
    )


async def _ok(request: web.Request) -> web.Response:
    return web.Response(status=200)


def _auth_middleware(api_key: str) -> Any:
    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path != "/health":
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token, api_key):
                return web.json_response({"error": "Unauthorized"}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    return check


def build_router_app(worker_urls: list[str], *, api_key: str | None = None) -> web.Application:
    middlewares = [_auth_middleware(api_key)] if api_key else []
    app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=middlewares)
    app[STATE_KEY] = {
        "workers": [_worker(u) for u in worker_urls],
        "rr": itertools.count(),
        "session": None,
    }
    app.router.add_get("/workers", _list_workers)
    app.router.add_post("/workers", _add_worker)
    app.router.add_delete("/workers/{wid}", _delete_worker)
    app.router.add_post("/generate", _generate)
    app.router.add_post("/flush_cache", _flush_cache)
    app.router.add_get("/health", _ok)
    app.router.add_get("/health_generate", _ok)

    async def startup(a: web.Application) -> None:
        a[STATE_KEY]["session"] = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5)
        )

    async def cleanup(a: web.Application) -> None:
        await a[STATE_KEY]["session"].close()

    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)
    return app
