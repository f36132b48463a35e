"""Rolling weight updates against the real SGLang 0.5.23 server: one engine loads a new
version (``push_weights`` on that engine only: pause with abort, ``update_weights_from_disk``
with the version label, continue) while another stays on the old one; both serve at once,
each stamping its own version; a resumed prefix goes to the engine of its own version.

Real tier (marker ``sglang_real``): skipped with the reason without the CPU fixture."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from strawq.producers.engine_versions import GuardedClient, VersionGuard, resuming
from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.sim_backend import SimConfig
from strawq.producers.engines.testing import EngineThread
from strawq.producers.meter import ProducerStats, StatsBook
from strawq.producers.sglang_client import ClientConfig, SGLangClient
from strawq.storage import MemoryStorage
from strawq.testing.real_sglang import PROMPTS, RealServer
from strawq.weights.engine_weights import EngineWeights

pytestmark = [pytest.mark.sglang_real, pytest.mark.slow, pytest.mark.timeout(420)]


def test_two_engines_on_two_versions_and_a_prefix_resumed_on_its_own(
        sglang_real: RealServer) -> None:
    local = EngineThread(EngineOptions(kind="sim", max_running=8, weight_version="0",
                                       sim=SimConfig(time_scale=0.05, len_median=8)))
    real = sglang_real.url
    cfg = ClientConfig(api_key=sglang_real.api_key, admin_api_key=sglang_real.admin_api_key,
                       max_retries=1)
    book = StatsBook(ProducerStats())

    async def io(fn: Callable[[], Any]) -> Any:
        return fn()

    async def main() -> None:
        async with SGLangClient([local.url, real], config=cfg) as c:
            assert await c.weight_version(real) == 0 == await c.weight_version(local.url)
            # one engine of the fleet loads version 1; the other is not touched
            await c.push_weights(sglang_real.model_dir, weight_version=1, url=real)
            assert await c.weight_version(real) == 1  # /model_info reports the label
            assert await c.weight_version(local.url) == 0
            guard = VersionGuard("p1", client=lambda: c, current_version=lambda: 1,
                                 notes=EngineWeights(MemoryStorage()), io=io,
                                 pausing=lambda: False, book=book)
            guard.lag = 1
            await guard.refresh()
            for u in (real, local.url):
                await guard.probe(u)
            g = GuardedClient(c, guard)
            params = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
            prompt = list(PROMPTS[0])
            # both engines serve at once, each stamping its own version
            on_new, on_old = await asyncio.gather(
                g.generate(prompt, params, rid="rolling-a", among=[real]),
                g.generate(prompt, params, rid="rolling-b", among=[local.url]))
            assert on_new.url == real and set(np.asarray(on_new.versions).tolist()) == {1}
            assert on_old.url == local.url and \
                set(np.asarray(on_old.versions).tolist()) == {0}
            # a prefix sampled on version 1 resumes on the engine of version 1
            with resuming(np.asarray(on_new.versions)):
                more = await g.generate(prompt + list(on_new.output_ids), params,
                                        rid="rolling-c")
            assert more.url == real and set(np.asarray(more.versions).tolist()) == {1}
            # and one sampled on version 0 on the engine still at 0 (within the lag)
            with resuming(np.asarray(on_old.versions)):
                more = await g.generate(prompt + list(on_old.output_ids), params,
                                        rid="rolling-d")
            assert more.url == local.url
            assert book.snapshot().resumed_tokens_other_version == 0

    try:
        asyncio.run(main())
    finally:
        local.stop()
