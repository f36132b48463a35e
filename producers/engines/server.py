"""aiohttp server speaking SGLang 0.5.x's native HTTP protocol for the local engines.

Endpoints: ``/generate`` (POST/PUT), ``/abort_request``, ``/pause_generation``,
``/continue_generation``, ``/update_weights_from_disk``, ``/update_weight_version``,
``/flush_cache``, ``/v1/loads``, ``/model_info`` (+ ``/get_model_info``), ``/health``,
``/health_generate``, ``/ready``; strawq's own ``/strawq/live_requests`` (the requests in
flight, with their tokens so far). Differences from SGLang are listed in ``docs/engines.md``.

This module is the HTTP side: routes, bodies, authentication, a client gone away. What a
``/generate`` body means and what its reply holds is ``strawq.producers.engines.wire``
(its names stay importable from here).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import secrets
import time
import uuid
from typing import Any

from aiohttp import web

from strawq.producers.engines.core import ABORT_WAITING, EngineCore, Req, ReqParams, UpdateRejected
from strawq.producers.engines.extras import add_extras
from strawq.producers.engines.wire import (
    SAMPLING_KEYS,
    UNSUPPORTED_NON_DEFAULT,
    BadRequest,
    build_response,
    make_reqs,
    stream_due,
    stream_event,
    parse_generate,
    parse_sampling_params,
    version_spans,
)

logger = logging.getLogger(__name__)

CORE_KEY = web.AppKey("core", EngineCore)
INFO_KEY = web.AppKey("info", dict)
#: the submissions of clients that went away, kept until they end (so the tasks are not
#: collected): an aborted request ends within a step; one whose abort was lost at the pause
#: gate runs to its end with nobody waiting, as on SGLang
ORPHANS_KEY = web.AppKey("orphans", set)

#: SGLang 0.5.23's ``SGLANG_REQUEST_STATE_WAIT_TIMEOUT``: how often the tokenizer manager
#: checks, while a request has no new output, that its HTTP client is still connected
DISCONNECT_POLL_S = 4.0


def error_response(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


async def _json_body(request: web.Request, *, allow_empty: bool = True) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        if allow_empty:
            return {}
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


async def handle_generate(request: web.Request) -> web.StreamResponse:
    core = request.app[CORE_KEY]
    try:
        body = await _json_body(request, allow_empty=False)
        g = parse_generate(body, vocab_size=core.backend.vocab_size,
                           context_length=core.backend.context_length)
    except BadRequest as exc:
        return error_response(str(exc))
    reqs = make_reqs(g)
    multi = len(reqs) > 1
    started = time.monotonic()
    if body.get("stream"):
        return await _stream_generate(request, core, body, reqs[0])
    try:
        if not await _submit_while_connected(request, core, reqs):
            return web.Response(status=499)  # nobody reads it: the client is gone
    except ValueError as exc:
        return error_response(str(exc))
    latency = time.monotonic() - started
    out = [
        build_response(
            r,
            core,
            return_logprob=bool(body.get("return_logprob")),
            text_in_logprobs=bool(body.get("return_text_in_logprobs")),
            latency=latency,
        )
        for r in reqs
    ]
    for r, o in zip(reqs, out, strict=True):  # per-token extras (routed experts, top-p)
        if r.finish != ABORT_WAITING:
            add_extras(o["meta_info"], body, r.input_ids, r.out_ids, r.out_logprobs,
                       core.backend.vocab_size, r.params.temperature, r.params.top_k)
    return web.json_response(out if multi else out[0])


def _reply(req: Req, core: EngineCore, body: dict[str, Any], started: float) -> dict[str, Any]:
    out = build_response(req, core, return_logprob=bool(body.get("return_logprob")),
                         text_in_logprobs=bool(body.get("return_text_in_logprobs")),
                         latency=time.monotonic() - started)
    if req.finish is None:  # a chunk before the last: SGLang 0.5.23 sends no spans
        for key in ("weight_versions", "e2e_latency"):
            out["meta_info"].pop(key, None)
    elif req.finish != ABORT_WAITING:  # per-token extras
        add_extras(out["meta_info"], body, req.input_ids, req.out_ids, req.out_logprobs,
                   core.backend.vocab_size, req.params.temperature, req.params.top_k)
    return out


async def _stream_generate(request: web.Request, core: EngineCore, body: dict[str, Any],
                           req: Req) -> web.StreamResponse:
    """``/generate`` with ``"stream": true``, framed as SGLang 0.5.23 frames it: an SSE
    ``data: {json}`` event per chunk, each the whole reply so far (cumulative ids,
    log-probs, version spans; ``finish_reason`` null until the last), then
    ``data: [DONE]``. A request that fails after the headers ends with an ``error`` event.
    A client gone away (a write fails, or the connection closed) gets its request aborted."""
    started = time.monotonic()
    req.progress = asyncio.Event()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    task = asyncio.ensure_future(core.submit([req]))
    poll = request.app[INFO_KEY]["disconnect_poll_s"]
    sent = 0
    try:
        while req.finish is None and not task.done():  # the chunks before the last
            req.progress.clear()
            if stream_due(req, sent):
                n, chunk = len(req.out_ids), _reply(req, core, body, started)
                await resp.write(stream_event(chunk))
                sent = n
                continue  # tokens may have come while it was written
            tick = asyncio.ensure_future(req.progress.wait())
            await asyncio.wait({task, tick}, timeout=poll, return_when=asyncio.FIRST_COMPLETED)
            tick.cancel()
            if request.transport is None or request.transport.is_closing():
                raise ConnectionResetError("the client closed the connection")
        await asyncio.wait({task})  # ends with the request (the last chunk goes once)
        exc = task.exception()
        if exc is not None:
            await resp.write(stream_event({"error": {
                "message": str(exc), "type": "invalid_request_error", "code": 400,
                "retryable": False}}))
        else:
            await resp.write(stream_event(_reply(req, core, body, started)))
        await resp.write(stream_event(None))
        await resp.write_eof()
    except ConnectionError:
        _orphan(request, core, req, task)
    except asyncio.CancelledError:
        _orphan(request, core, req, task)
        raise
    return resp


def _orphan(request: web.Request, core: EngineCore, req: Req, task: asyncio.Future[Any]) -> None:
    """A streamed request whose client went away: abort it, keep its task till it ends."""
    if task.done():
        _ignore_result(task)
        return
    logger.info("client of streamed %s went away; aborting it", req.rid)
    core.abort(req.rid)
    orphans = request.app[ORPHANS_KEY]
    orphans.add(task)
    task.add_done_callback(orphans.discard)
    task.add_done_callback(_ignore_result)


async def _submit_while_connected(request: web.Request, core: EngineCore,
                                  reqs: list[Req]) -> bool:
    """Run ``reqs``; False when the client went away first.

    As SGLang 0.5.23's tokenizer manager does: whenever ``disconnect_poll_s`` pass with the
    requests unfinished, check the client's connection, and abort the rids of a client that
    is gone (a producer killed with ``kill -9`` leaves no request generating for long).
    Each abort is an ordinary exact-rid abort, so one that meets a request held at the pause
    gate is lost there, as on SGLang: that request runs on, with nobody waiting."""
    task = asyncio.ensure_future(core.submit(reqs))
    if not await client_gone_first(request, task, request.app[INFO_KEY]["disconnect_poll_s"]):
        task.result()
        return True
    logger.info("client of %s went away; aborting %d request(s)", reqs[0].rid, len(reqs))
    for req in reqs:
        core.abort(req.rid)
    orphans = request.app[ORPHANS_KEY]
    orphans.add(task)
    task.add_done_callback(orphans.discard)
    task.add_done_callback(_ignore_result)
    return False


async def client_gone_first(request: web.Request, work: asyncio.Future[Any],
                            poll_s: float = DISCONNECT_POLL_S) -> bool:
    """Wait for ``work``, checking every ``poll_s`` that ``request``'s client is still
    connected (SGLang's tokenizer manager's check); True as soon as it is gone, False once
    ``work`` is done."""
    while not (await asyncio.wait({work}, timeout=poll_s))[0]:
        if request.transport is None or request.transport.is_closing():
            return True
    return False


def _ignore_result(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: nobody is waiting for an orphan's outcome


async def handle_abort(request: web.Request) -> web.Response:
    try:
        body = await _json_body(request)
    except BadRequest as exc:
        return error_response(str(exc))
    rid = body.get("rid")
    request.app[CORE_KEY].abort(
        rid if isinstance(rid, str) else None, abort_all=bool(body.get("abort_all"))
    )
    return web.Response(status=200)


async def handle_pause(request: web.Request) -> web.Response:
    try:
        body = await _json_body(request)
    except BadRequest as exc:
        return error_response(str(exc))
    mode = body.get("mode") or "abort"
    if mode not in ("abort", "retract", "in_place"):
        return error_response(f"mode must be one of abort, retract, in_place; got {mode!r}")
    await request.app[CORE_KEY].pause(mode)
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def handle_continue(request: web.Request) -> web.Response:
    await request.app[CORE_KEY].cont()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def handle_update_weights(request: web.Request) -> web.Response:
    core = request.app[CORE_KEY]
    try:
        body = await _json_body(request, allow_empty=False)
    except BadRequest as exc:
        return error_response(str(exc))
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        return error_response("model_path is required")
    version = body.get("weight_version")
    paused_before = core.paused is not None
    try:
        message = await core.update_weights(
            path,
            None if version is None else str(version),
            abort_all_requests=bool(body.get("abort_all_requests", False)),
            flush_cache=bool(body.get("flush_cache", True)),
        )
    except UpdateRejected as exc:
        return web.json_response(
            {"success": False, "message": str(exc), "num_paused_requests": 0}, status=400
        )
    paused = len(core.waiting) + len(core.running) if paused_before else 0
    return web.json_response({"success": True, "message": message, "num_paused_requests": paused})


async def handle_update_version(request: web.Request) -> web.Response:
    try:
        body = await _json_body(request, allow_empty=False)
    except BadRequest as exc:
        return error_response(str(exc))
    new = body.get("new_version")
    if new is None:
        return error_response("new_version is required")
    request.app[CORE_KEY].set_version(
        str(new), abort_all_requests=bool(body.get("abort_all_requests", True))
    )
    return web.json_response(
        {"success": True, "message": f"Weight version updated to {new}", "new_version": str(new)}
    )


async def handle_flush_cache(request: web.Request) -> web.Response:
    core = request.app[CORE_KEY]
    try:
        timeout = float(request.query.get("timeout", "0"))
    except ValueError:
        return error_response("timeout must be a number of seconds")
    if core.paused == "in_place" and (core.running or core.waiting):
        return web.Response(status=400, text="Flush cache failed.")
    # abort / retract pauses free every KV slot, so flushing is allowed even with
    # retracted requests waiting (as observed on SGLang 0.5.23)
    if core.paused in ("abort", "retract") or await core.flush_cache(timeout):
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. (When there are "
            "running or waiting requests, the operation will not be performed.)\n"
        )
    return web.Response(status=400, text="Flush cache failed.")


async def handle_loads(request: web.Request) -> web.Response:
    core = request.app[CORE_KEY]
    return web.json_response(
        {
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "version": request.app[INFO_KEY]["engine_version"],
            "loads": [core.loads()],
        }
    )


async def handle_model_info(request: web.Request) -> web.Response:
    core = request.app[CORE_KEY]
    info = {
        "model_path": core.model_path,
        "tokenizer_path": None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": core.label,
        "load_format": "auto",
        "served_model_name": request.app[INFO_KEY]["served_model_name"],
        "engine_kind": core.backend.kind,
        "eos_token_id": core.backend.eos_token_id,
        "max_running_requests": core.max_running,
    }
    info.update(core.backend.model_info())
    return web.json_response(info)


async def handle_weights_by_name(request: web.Request) -> web.Response:
    """SGLang 0.5.23's ``/get_weights_by_name``: the first ``truncate_size`` rows of a
    parameter (a 1-D one: values) as float32 lists; 400 when the engine has no such
    parameter (the backend's ``weights_by_name``)."""
    try:
        body = await _json_body(request, allow_empty=False)
        rows = int(body.get("truncate_size", 100))
    except (BadRequest, TypeError, ValueError) as exc:
        return error_response(str(exc))
    getter = getattr(request.app[CORE_KEY].backend, "weights_by_name", None)
    found = None if getter is None else getter(str(body.get("name", "")), rows)
    if found is None:
        return error_response("Get parameter by name failed")
    return web.json_response(found)


async def handle_live_requests(request: web.Request) -> web.Response:
    """strawq's own: every request in the engine now, with the tokens generated so far."""
    core = request.app[CORE_KEY]
    live = [{"rid": r.rid, "state": r.state, "output_tokens": len(r.out_ids)}
            for r in core.live.values()]
    return web.json_response({"generated_tokens": core.generated_tokens, "requests": live})


async def handle_health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def handle_ready(request: web.Request) -> web.Response:
    if request.app[CORE_KEY].paused is not None:
        return web.Response(status=503, text="paused")
    return web.Response(status=200)


async def handle_health_generate(request: web.Request) -> web.Response:
    core = request.app[CORE_KEY]
    if core.running:
        return web.Response(status=200)
    req = Req(
        rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
        input_ids=[0],
        params=ReqParams(max_new_tokens=1, ignore_eos=True),
        seed=0,
        done=asyncio.get_running_loop().create_future(),
    )
    try:
        await asyncio.wait_for(core.submit([req]), request.app[INFO_KEY]["health_check_timeout_s"])
    except (asyncio.TimeoutError, ValueError):
        core.abort(req.rid)
        return web.Response(status=503, text="health check timed out")
    return web.Response(status=200)


# SGLang 0.5.23 marks these ADMIN_OPTIONAL: with --admin-api-key they need that key.
ADMIN_PATHS = frozenset(
    {
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
        "/update_weights_from_disk",
        "/update_weight_version",
        "/flush_cache",
        "/get_weights_by_name",
    }
)


def auth_allowed(
    path: str, authorization: str | None, *, api_key: str | None, admin_api_key: str | None
) -> bool:
    """SGLang 0.5.23's ``decide_request_auth`` for the NORMAL and ADMIN_OPTIONAL levels."""
    if path.startswith(("/health", "/ready", "/metrics")):
        return True
    expected = api_key
    if path in ADMIN_PATHS and admin_api_key:
        expected = admin_api_key
    if not expected:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token, expected)


def _auth_middleware(api_key: str | None, admin_api_key: str | None) -> Any:
    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if not auth_allowed(
            request.path,
            request.headers.get("Authorization"),
            api_key=api_key,
            admin_api_key=admin_api_key,
        ):
            return web.json_response({"error": "Unauthorized"}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    return check


def build_app(
    core: EngineCore,
    *,
    served_model_name: str,
    health_check_timeout_s: float = 20.0,
    disconnect_poll_s: float = DISCONNECT_POLL_S,
    api_key: str | None = None,
    admin_api_key: str | None = None,
) -> web.Application:
    middlewares = [_auth_middleware(api_key, admin_api_key)] if api_key or admin_api_key else []
    app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=middlewares)
    app[CORE_KEY] = core
    app[INFO_KEY] = {
        "served_model_name": served_model_name,
        "engine_version": f"strawq-local-{core.backend.kind}",
        "health_check_timeout_s": health_check_timeout_s,
        "disconnect_poll_s": disconnect_poll_s,
    }
    app[ORPHANS_KEY] = set()
    r = app.router
    r.add_post("/generate", handle_generate)
    r.add_put("/generate", handle_generate)
    r.add_post("/abort_request", handle_abort)
    r.add_post("/pause_generation", handle_pause)
    r.add_post("/continue_generation", handle_continue)
    r.add_post("/update_weights_from_disk", handle_update_weights)
    r.add_post("/update_weight_version", handle_update_version)
    r.add_get("/flush_cache", handle_flush_cache)
    r.add_post("/flush_cache", handle_flush_cache)
    r.add_get("/v1/loads", handle_loads)
    r.add_get("/model_info", handle_model_info)
    r.add_get("/get_model_info", handle_model_info)
    r.add_route("*", "/get_weights_by_name", handle_weights_by_name)
    r.add_get("/health", handle_health)
    r.add_get("/strawq/live_requests", handle_live_requests)
    r.add_get("/health_generate", handle_health_generate)
    r.add_get("/ready", handle_ready)

    async def on_startup(_: web.Application) -> None:
        core.start()

    async def on_shutdown(_: web.Application) -> None:
        await core.stop()  # before aiohttp waits for open handlers

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    return app


__all__ = ["ADMIN_PATHS", "DISCONNECT_POLL_S", "SAMPLING_KEYS", "UNSUPPORTED_NON_DEFAULT",
           "BadRequest", "auth_allowed", "build_app", "build_response", "client_gone_first",
           "error_response", "parse_sampling_params", "version_spans"]
