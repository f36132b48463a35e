"""``GET /strawq/live_requests``: the requests a local engine runs now, with their tokens so
far (the chaos benchmark reads it at a producer kill to count the tokens in flight)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from tests.producers.engine_helpers import run, wait_until

from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.sim_backend import SimConfig
from strawq.producers.engines.testing import running_engine
from strawq.producers.sglang_client import ClientConfig, SGLangClient

pytestmark = pytest.mark.timeout(90)

LONG = SimConfig(step_base_ms=5.0, len_median=10**4, len_cap=10**4, cap_prob=1.0)


async def _live(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url + "/strawq/live_requests") as resp:
        assert resp.status == 200
        body: dict[str, Any] = await resp.json()
        return body


def test_live_requests_lists_each_request_with_its_tokens_so_far() -> None:
    async def go() -> None:
        opts = EngineOptions(kind="sim", max_running=4, sim=LONG)
        async with (running_engine(opts) as url, aiohttp.ClientSession() as http,
                    SGLangClient([url], config=ClientConfig(max_retries=0)) as c):
            assert (await _live(http, url))["requests"] == []
            sp = {"max_new_tokens": 5000, "ignore_eos": True}
            task = asyncio.create_task(c.generate([5, 6, 7], sp, rid="p/t.g1/0.1"))

            async def generating() -> bool:
                reqs = (await _live(http, url))["requests"]
                return bool(reqs) and reqs[0]["output_tokens"] >= 3

            await wait_until(generating)
            body = await _live(http, url)
            [req] = body["requests"]
            assert req["rid"] == "p/t.g1/0.1" and req["state"] == "running"
            assert body["generated_tokens"] >= req["output_tokens"]
            await c.abort("p/t.g1/0.1")
            result = await task
            assert result.is_abort and len(result.output_ids) >= req["output_tokens"]
            after = await _live(http, url)
            assert after["requests"] == []
            assert after["generated_tokens"] == len(result.output_ids)

    run(go())
