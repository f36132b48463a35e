"""Faults: refused connections, 5xx, hangs, malformed JSON, garbage shapes, a killed engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web
from tests.producers.engine_helpers import FIXTURES, free_port, load_counts, run, wait_until

from strawq.producers.engine_errors import (
    EngineError,
    EngineProtocolError,
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
)
from strawq.producers.engines.testing import start_engine_subprocess
from strawq.producers.sample import Sample, SamplerParams
from strawq.producers.sglang_client import ClientConfig, SGLangClient
from strawq.producers.sample_step import step_sample

pytestmark = pytest.mark.timeout(60)

GOOD = json.loads((FIXTURES / "good" / "completed_stop_token.json").read_text())
FAST = {"max_retries": 2, "backoff_base_s": 0.01, "backoff_max_s": 0.05, "connect_timeout_s": 2.0}


def scripted_app(
    replies: list[Callable[[], Any]], calls: list[int]
) -> Callable[[], web.Application]:
    """Each /generate call plays the next reply (the last one repeats)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        calls.append(1)
        reply = replies[min(len(calls) - 1, len(replies) - 1)]
        return await reply()

    def factory() -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", handler)
        return app

    return factory


async def ok() -> web.Response:
    return web.json_response(GOOD)


async def err500() -> web.Response:
    return web.Response(status=500, text="boom")


async def bad_json() -> web.Response:
    return web.Response(status=200, text='{"text": "unterminated', content_type="application/json")


async def hang() -> web.Response:
    await asyncio.sleep(30)
    return web.json_response(GOOD)


async def short_logprobs() -> web.Response:
    body = json.loads(json.dumps(GOOD))
    body["meta_info"]["output_token_logprobs"].pop()
    return web.json_response(body)


async def bad_request() -> web.Response:
    return web.json_response({"error": {"message": "unknown field `foo`"}}, status=400)


def gen(url: str, **cfg: Any) -> Any:
    async def go() -> Any:
        async with SGLangClient([url], config=ClientConfig(**{**FAST, **cfg})) as c:
            return await c.generate([1, 2, 3], {"max_new_tokens": 3})

    return run(go(), 50)


def test_connection_refused_names_the_worker() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineUnavailable, match="cannot connect") as info:
        gen(url)
    assert info.value.url == url and url in str(info.value)
    assert "Errno" not in str(info.value) and "nothing listens there" in str(info.value)
    assert isinstance(info.value, ConnectionError) and isinstance(info.value, EngineError)


@pytest.mark.parametrize(
    ("replies", "error", "attempts"),
    [
        ([err500, err500, ok], None, 3),
        ([err500], EngineUnavailable, 3),
        ([bad_json, ok], None, 2),
        ([bad_json], EngineProtocolError, 3),
        ([short_logprobs], EngineProtocolError, 3),
        ([bad_request], EngineRequestError, 1),
    ],
    ids=[
        "500-then-ok",
        "500-forever",
        "badjson-then-ok",
        "badjson-forever",
        "garbage-shape",
        "400-no-retry",
    ],
)
def test_retries_are_bounded_then_typed(
    app_server: Any, replies: list[Any], error: type | None, attempts: int
) -> None:
    calls: list[int] = []
    server = app_server(scripted_app(replies, calls))
    if error is None:
        r = gen(server.url)
        assert r.output_ids.tolist() == [7042, 30, 2]
    else:
        with pytest.raises(error) as info:
            gen(server.url)
        assert info.value.url == server.url
    assert len(calls) == attempts


@pytest.mark.slow
def test_hanging_engine_times_out(app_server: Any) -> None:
    """Past the segment deadline the request is aborted; an engine that does not answer
    even then (here it has no /abort_request at all) is a timeout, retried."""
    calls: list[int] = []
    server = app_server(scripted_app([hang], calls))
    with pytest.raises(EngineTimeout, match="did not come back") as info:
        gen(server.url, generate_timeout_s=0.3, control_timeout_s=0.3, max_retries=1)
    assert isinstance(info.value, TimeoutError) and len(calls) == 2


def test_garbage_is_never_stored(app_server: Any) -> None:
    server = app_server(scripted_app([short_logprobs], []))
    sample = Sample.new("g", [1, 2, 3], SamplerParams(max_new_tokens=8))
    before = sample.to_dict()

    async def go() -> None:
        async with SGLangClient([server.url], config=ClientConfig(**FAST)) as c:
            with pytest.raises(EngineProtocolError):
                await step_sample(c, sample)

    run(go())
    assert sample.to_dict() == before


@pytest.mark.process
def test_killed_engine_process_fails_over_then_errors() -> None:
    dead = start_engine_subprocess(
        "sim", step_base_ms=20, len_median=100000, len_cap=100000, cap_prob=1.0
    )
    alive = start_engine_subprocess("sim", step_base_ms=0)
    try:

        async def go() -> None:
            async with SGLangClient([dead.url], config=ClientConfig(**FAST)) as c:
                task = asyncio.create_task(c.generate([1, 2, 3], {"max_new_tokens": 20000}))
                await wait_until(lambda: _busy(c, dead.url, task))
                dead.kill()
                with pytest.raises(EngineUnavailable) as info:
                    await task
                assert info.value.url == dead.url
            # with two workers, the retry goes to the one still alive
            async with SGLangClient([dead.url, alive.url], config=ClientConfig(**FAST)) as c:
                results = [await c.generate([1, 2, 3], {"max_new_tokens": 4}) for _ in range(3)]
                assert all(r.url == alive.url for r in results)

        run(go(), 50)
    finally:
        dead.stop()
        alive.stop()


async def _busy(c: SGLangClient, url: str, task: asyncio.Task[Any]) -> bool:
    if task.done():
        task.result()  # surface an unexpected early failure instead of waiting
    return (await load_counts(c, url))[0] > 0
