"""The engine contract as tests: the real SGLang server and every local engine run them.

In the style of the storage conformance suite (``strawq.testing.conformance``): subclass
:class:`EngineContract` and provide a ``target`` fixture returning an
:class:`EngineTarget`::

    class TestMyEngine(EngineContract):
        @pytest.fixture(scope="class")
        def target(self):
            with start_my_engine() as url:
                yield EngineTarget(url=url, eos_token_id=2, vocab_size=512, ...)

The tests state what SGLang 0.5.23 does (docs/engines.md, "Facts observed on the real SGLang 0.5.23
server"); a local engine that passes a test the real server fails is a bug in the local engine: the
real engine decides (docs/design.md, invariant 9). Each test is small: on the real CPU fixture a
token costs tens of milliseconds. Tests that need a capability the target does not declare (API
keys) are skipped with the reason.
"""

from __future__ import annotations

import pytest

from strawq.producers.engine_errors import EngineAuthError
from strawq.producers.eos import eos_ids_from_model_info
from strawq.testing.engine_contract_aborts import AbortContract
from strawq.testing.engine_contract_generate import GenerateContract
from strawq.testing.engine_contract_stream import StreamContract
from strawq.testing.engine_contract_weights import WeightContract
from strawq.testing.engine_target import GREEDY, EngineTarget, spawn_generate

__all__ = ["GREEDY", "EngineContract", "EngineTarget", "spawn_generate"]


class EngineContract(GenerateContract, StreamContract, AbortContract, WeightContract):
    """SGLang 0.5.23 behaviour that strawq relies on. Subclasses provide ``target``.

    The areas are mixins (``engine_contract_generate``, ``engine_contract_stream``,
    ``engine_contract_aborts``, ``engine_contract_weights``); the control calls (load,
    model info, keys) are here."""

    #: the tests that start an OS process (a client killed mid-request), so a test runner can
    #: put them in a slower tier
    STARTS_PROCESSES = frozenset({"test_a_killed_clients_request_is_aborted"})

    # -- control: load, model info, keys --------------------------------------------------
    def test_loads_and_model_info(self, target: EngineTarget) -> None:
        async def go() -> None:
            async with target.client() as c:
                await self._idle(c, target)
                body = await c.loads(target.url)
                entry = body["loads"][0]
                for key in ("num_running_reqs", "num_waiting_reqs", "max_running_requests"):
                    assert key in entry, key
                assert entry["max_running_requests"] == target.max_running
                info = await c.model_info(target.url)
                assert "weight_version" in info and "model_path" in info
                await c.weight_version(target.url)  # an integer version
                # the EOS id a producer resolves at start (strawq.producers.eos)
                assert target.eos_token_id in eos_ids_from_model_info(info)

        self.run(target, go())

    def test_api_keys(self, target: EngineTarget) -> None:
        if not target.api_key:
            pytest.skip("the target was started without --api-key")

        async def go() -> None:
            async with target.client(api_key=None, admin_api_key=None) as anon:
                assert await anon.health_generate(target.url)  # health needs no key
                with pytest.raises(EngineAuthError):
                    await anon.generate(target.prompt, {"max_new_tokens": 1})
            async with target.client(admin_api_key=None) as user:
                r = await user.generate(target.prompt, {"max_new_tokens": 1, "ignore_eos": True})
                assert len(r.output_ids) == 1
                if target.admin_api_key:
                    with pytest.raises(EngineAuthError, match="admin key") as ei:
                        await user.abort_rids(["nothing"])
                    assert ei.value.url == target.url
            async with target.client() as full:
                await full.abort_rids(["nothing"])

        self.run(target, go())
