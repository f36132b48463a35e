"""The engine contract, weights: pausing, updating weights from disk, flushing the cache,
and the version each token is stamped with.

One area of ``strawq.testing.engine_contract.EngineContract``; the facts are SGLang 0.5.23's.
"""

from __future__ import annotations

import asyncio

import pytest

from strawq.producers.engine_errors import WeightUpdateRefused
from strawq.producers.sglang_client import SGLangClient
from strawq.testing.engine_target import ContractPlumbing, EngineTarget


class WeightContract(ContractPlumbing):
    """Weight updates around running requests, in every pause mode."""

    async def _version(self, c: SGLangClient, t: EngineTarget) -> int:
        return await c.weight_version(t.url)

    def test_push_weights_keeps_tokens_and_stamps_versions(self, target: EngineTarget) -> None:
        async def go() -> None:
            async with target.client() as c:
                v = await self._version(c, target)
                task = asyncio.create_task(c.generate(target.prompt, self._long(target)))
                await self._running(c, target)
                await c.push_weights(target.weight_dirs[1], weight_version=v + 1)
                r = await task
                assert r.is_abort and len(r.output_ids) > 0
                assert set(r.versions.tolist()) == {v}
                assert await self._version(c, target) == v + 1
                after = await c.generate(target.prompt, {"max_new_tokens": 2, "ignore_eos": True})
                assert set(after.versions.tolist()) == {v + 1}
                await c.push_weights(target.weight_dirs[0], weight_version=v + 2)
                assert await self._version(c, target) == v + 2

        self.run(target, go())

    def test_unpaused_update_waits_for_inflight(self, target: EngineTarget) -> None:
        async def go() -> None:
            async with target.client() as c:
                v = await self._version(c, target)
                task = await self._start_long(c, target, min(32, target.long_tokens))
                try:
                    await c.update_weights_from_disk(target.weight_dirs[0], weight_version=v + 1)
                    refused = False
                except WeightUpdateRefused as exc:
                    # SGLang 0.5.23 races here: the request's reply releases the update
                    # lock before the scheduler retires it, so the flush can find it
                    # still "running" (400); push_weights waits for idle instead
                    assert "cache was not flushed" in str(exc)
                    refused = True
                r = await task
                assert r.finish_type == "length" and set(r.versions.tolist()) == {v}
                if not refused:
                    assert await self._version(c, target) == v + 1
                await c.push_weights(target.weight_dirs[0], weight_version=v + 2)
                assert await self._version(c, target) == v + 2

        self.run(target, go())

    def test_retract_update_continue_spans_versions(self, target: EngineTarget) -> None:
        async def go() -> None:
            async with target.client() as c:
                v = await self._version(c, target)
                n = min(64, target.long_tokens)
                task = await self._start_long(c, target, n)
                await c.pause_generation("retract")
                try:
                    await c.flush_cache(deadline_s=5)  # retract frees the KV cache
                    await c.update_weights_from_disk(target.weight_dirs[0], weight_version=v + 1)
                finally:
                    await c.continue_generation()
                r = await task
                assert r.finish_reason == {"type": "length", "length": n}
                versions = r.versions.tolist()
                assert versions == sorted(versions) and set(versions) <= {v, v + 1}
                assert versions[-1] == v + 1 and (r.num_retractions or 0) >= 1

        self.run(target, go())

    def test_in_place_update_is_refused_while_running(self, target: EngineTarget) -> None:
        async def go() -> None:
            async with target.client() as c:
                v = await self._version(c, target)
                n = min(64, target.long_tokens)
                task = await self._start_long(c, target, n)
                await c.pause_generation("in_place")
                try:
                    status, _ = await self._raw(target, "/flush_cache", None, admin=True)
                    assert status == 400
                    with pytest.raises(WeightUpdateRefused, match="cache was not flushed") as ei:
                        await c.update_weights_from_disk(
                            target.weight_dirs[0], weight_version=v + 1
                        )
                    assert ei.value.url == target.url
                    assert await self._version(c, target) == v  # the label stays stale
                finally:
                    await c.continue_generation()
                r = await task
                assert r.finish_type == "length"
                assert r.versions.tolist()[-1] == v + 1  # while tokens get the new version
                await c.push_weights(target.weight_dirs[0], weight_version=v + 2)
                assert await self._version(c, target) == v + 2

        self.run(target, go())

    def test_flush_cache_refused_while_busy(self, target: EngineTarget) -> None:
        async def go() -> None:
            async with target.client() as c:
                task = asyncio.create_task(
                    c.generate(target.prompt, self._long(target), rid="ctf")
                )
                await self._running(c, target)
                status, _ = await self._raw(target, "/flush_cache", None, admin=True)
                assert status == 400
                await c.abort_rids(["ctf"])
                await task
                await self._idle(c, target)
                status, _ = await self._raw(target, "/flush_cache", None, admin=True)
                assert status == 200

        self.run(target, go())
