"""Client fixes found against the real SGLang 0.5.23 server, on scripted engines.

Each test failed before the fix: the internal retry marker escaped ``model_info`` /
``loads`` / ``refresh_workers``; engine errors were no ``StrawqError``; an aborted reply that
ends on EOS or a stop token was left resumable; a refused weight push was an untyped error.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web
from tests.producers.engine_helpers import FIXTURES, run

from strawq.errors import ConfigError, StrawqError
from strawq.producers.engine_errors import (
    EngineError,
    EngineProtocolError,
    WeightUpdateRefused,
)
from strawq.producers.eos import resolve_eos_ids
from strawq.producers.sample import Sample, SamplerParams, SampleStatus
from strawq.producers.sample_step import step_sample
from strawq.producers.sglang_client import ClientConfig, SGLangClient
from strawq.producers.sglang_protocol import finalize_abort_at_stop, parse_generate_response

pytestmark = pytest.mark.timeout(60)

ABORTED = json.loads((FIXTURES / "good" / "aborted_running.json").read_text())
FAST = {"max_retries": 1, "backoff_base_s": 0.01, "backoff_max_s": 0.02}


def _aborted_ending_on(token: int) -> dict[str, Any]:
    body = copy.deepcopy(ABORTED)
    body["output_ids"][-1] = token
    body["meta_info"]["output_token_logprobs"][-1][1] = token
    return body


def _app(routes: dict[str, Callable[[web.Request], Any]]) -> Callable[[], web.Application]:
    def factory() -> web.Application:
        app = web.Application()
        for path, handler in routes.items():
            app.router.add_route("*", path, handler)
        return app

    return factory


def test_engine_errors_are_strawq_errors() -> None:
    assert issubclass(EngineError, StrawqError) and issubclass(EngineError, RuntimeError)
    assert issubclass(WeightUpdateRefused, EngineError)


@pytest.mark.parametrize("call", ["model_info", "loads", "refresh_workers"])
def test_malformed_json_never_escapes_as_internal_error(app_server: Any, call: str) -> None:
    async def garbage(request: web.Request) -> web.Response:
        return web.Response(text="{not json", content_type="application/json")

    server = app_server(
        _app({"/model_info": garbage, "/v1/loads": garbage, "/workers": garbage})
    )

    async def go() -> None:
        if call == "refresh_workers":
            client = SGLangClient([server.url], router_url=server.url, config=ClientConfig(**FAST))
        else:
            client = SGLangClient([server.url], config=ClientConfig(**FAST))
        async with client as c:
            with pytest.raises(EngineProtocolError, match="malformed JSON"):
                if call == "model_info":
                    await c.model_info(server.url)
                elif call == "loads":
                    await c.loads(server.url)
                else:
                    await c.refresh_workers()

    run(go())


def test_aborted_reply_ending_on_eos_is_final() -> None:
    eos = 2
    parsed = parse_generate_response(_aborted_ending_on(eos))
    assert parsed.is_abort
    final = finalize_abort_at_stop(parsed, eos_ids={eos}, stop_token_ids=())
    assert final.finish_reason == {"type": "stop", "matched": eos, "aborted": True}
    # a stop token counts the same; another last token stays resumable
    assert finalize_abort_at_stop(parsed, eos_ids=(), stop_token_ids=[eos]).finish_type == "stop"
    other = parse_generate_response(ABORTED)
    assert finalize_abort_at_stop(other, eos_ids={eos}, stop_token_ids=()).is_abort
    # below min_new_tokens no token stops a request
    n = len(parsed.output_ids)
    assert finalize_abort_at_stop(
        parsed, eos_ids={eos}, stop_token_ids=(), min_new_tokens=n + 1
    ).is_abort


def test_the_sample_step_makes_an_abort_on_eos_final_and_honours_ignore_eos(
        app_server: Any) -> None:
    """The client returns the engine's aborted reply as it is; the sample step, with the EOS
    ids the producer resolved at start, makes an abort that landed on EOS final."""
    body = _aborted_ending_on(2)

    async def generate(request: web.Request) -> web.Response:
        return web.json_response(body)

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response({"weight_version": "3", "model_path": "/nowhere"})

    async def model_info_with_eos(request: web.Request) -> web.Response:
        return web.json_response({"weight_version": "3", "eos_token_id": [2, 7]})

    plain = app_server(_app({"/generate": generate, "/model_info": model_info}))
    with_eos = app_server(_app({"/generate": generate, "/model_info": model_info_with_eos}))

    async def step(c: SGLangClient, eos: Any, **params: Any) -> Sample:
        s = Sample.new("s", [1, 2, 3], SamplerParams(max_new_tokens=100, **params))
        await step_sample(c, s, eos_ids=eos)
        return s

    async def go() -> None:
        async with SGLangClient([with_eos.url], config=ClientConfig(**FAST)) as c:
            assert (await c.generate([1, 2, 3], {"max_new_tokens": 100})).is_abort  # as sent
            eos = await resolve_eos_ids(c, configured=None)
            assert eos == {2, 7}
            assert (await step(c, eos)).status is SampleStatus.COMPLETED
            # ignore_eos: no token stops it, so it stays resumable
            assert not (await step(c, eos, ignore_eos=True)).is_final
        async with SGLangClient([plain.url], config=ClientConfig(**FAST)) as c:
            with pytest.raises(ConfigError, match="EOS ids"):
                await resolve_eos_ids(c, configured=None)
            assert not (await step(c, frozenset())).is_final  # EOS unknown: resumable
            stopped = await step(c, frozenset(), stop_token_ids=(2,))
            assert stopped.status is SampleStatus.COMPLETED
            eos = await resolve_eos_ids(c, configured=(2,))
            assert (await step(c, eos)).status is SampleStatus.COMPLETED

    run(go())


def test_refused_weight_push_is_typed_and_names_the_worker(app_server: Any) -> None:
    calls: list[str] = []

    def record(path: str, reply: Any, status: int = 200) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.Response:
            calls.append(path)
            return web.json_response(reply, status=status)

        return handler

    ok = {"message": "ok", "status": "ok"}
    refusing = app_server(
        _app(
            {
                "/pause_generation": record("pause", ok),
                "/v1/loads": record(
                    "loads", {"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0}]}
                ),
                "/continue_generation": record("continue", ok),
                "/update_weights_from_disk": record(
                    "update",
                    {"success": False, "message": "Weights were updated, but the cache was not "
                     "flushed because requests are still running or queued."},
                    400,
                ),
            }
        )
    )

    async def go() -> None:
        async with SGLangClient([refusing.url], config=ClientConfig(**FAST)) as c:
            with pytest.raises(WeightUpdateRefused, match="cache was not flushed") as ei:
                await c.push_weights("/w/new", weight_version=4)
            assert ei.value.url == refusing.url and refusing.url in str(ei.value)
        # waits for idle before each try, retries the flush refusal twice, never stays paused
        assert calls == ["pause"] + ["loads", "update"] * 3 + ["continue"]

    run(go())
