"""The engine contract, aborts: exact rids, prefixes, waiting requests, the pause gate, a
killed client, an abort that lands on a stop token.

One area of ``strawq.testing.engine_contract.EngineContract``; the facts are SGLang 0.5.23's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import pytest

from strawq.producers.sglang_client import SGLangClient
from strawq.producers.sglang_protocol import finalize_abort_at_stop
from strawq.testing.engine_target import (GREEDY, ContractPlumbing, EngineTarget, counts,
                                          live_tokens, spawn_generate, until)


class AbortContract(ContractPlumbing):
    """How an engine aborts, and what the aborted request's reply holds."""

    def test_prefix_abort_is_ignored_exact_rid_aborts(self, target: EngineTarget) -> None:
        async def go() -> None:
            async with target.client() as c:
                task = asyncio.create_task(
                    c.generate(target.prompt, self._long(target), rid="ctr/g1/s0")
                )
                await self._running(c, target)
                status, body = await self._raw(
                    target, "/abort_request", {"rid": "ctr/"}, admin=True
                )
                assert status == 200 and body == b""
                await asyncio.sleep(0.3)
                assert (await counts(c, target.url))[0] == 1, "a rid prefix aborted a request"
                assert not task.done()
                assert await c.abort_matching("ctr/g1/") == ["ctr/g1/s0"]
                r = await task
                assert r.is_abort and not r.is_waiting_abort
                assert 0 < len(r.output_ids) < target.long_tokens
                assert len(r.logprobs) == len(r.output_ids) == len(r.versions)
                assert r.prompt_tokens == len(target.prompt)

        self.run(target, go())

    def test_a_killed_clients_request_is_aborted(self, target: EngineTarget) -> None:
        """SGLang 0.5.23 aborts the request of a client that is gone: whenever 4 s pass with
        no answer (``SGLANG_REQUEST_STATE_WAIT_TIMEOUT``) the tokenizer manager checks the
        connection and aborts the rid. So a producer killed with ``kill -9`` leaves nothing
        generating for long: the engine is idle soon after, long before the request could
        have used its budget."""

        orphan_tokens = target.orphan_tokens
        if orphan_tokens is None:
            pytest.skip("the target generates its whole context too fast to tell an abort "
                        "from the end")

        async def go() -> None:
            async with target.client() as c:
                spent = []
                for n in (8, 88):  # the per-token cost, prefill and HTTP taken out
                    started = time.monotonic()
                    await c.generate(target.prompt, self._long(target, n))
                    spent.append(time.monotonic() - started)
                whole_s = (spent[1] - spent[0]) / 80 * orphan_tokens
                assert whole_s > 3 * target.disconnect_deadline_s, (
                    f"{orphan_tokens} tokens take only ~{whole_s:.1f}s here: give the "
                    "target a larger orphan_tokens or a shorter disconnect_deadline_s")
                client = spawn_generate(
                    target.router_url or target.url,
                    {"input_ids": list(target.prompt), "rid": "orphan-1",
                     "sampling_params": self._long(target, orphan_tokens)}, target.api_key)
                try:
                    await self._running(c, target)
                finally:
                    client.kill()
                    client.wait()

                async def idle() -> bool:
                    return await counts(c, target.url) == (0, 0)

                try:
                    await until(idle, target.disconnect_deadline_s,
                                 "the request of a killed client aborted")
                finally:  # failed: the orphan must not hold the engine for the next tests
                    if not await idle():
                        await c.abort_rids(["orphan-1"])

        self.run(target, go())

    def test_abort_waiting_request(self, target: EngineTarget) -> None:
        async def go() -> None:
            async with target.client() as c:
                rids = [f"ctw-{i}" for i in range(target.max_running)]
                tasks = [
                    asyncio.create_task(c.generate(target.prompt, self._long(target), rid=r))
                    for r in rids
                ]
                await self._running(c, target, target.max_running)
                extra = asyncio.create_task(
                    c.generate(target.prompt, self._long(target), rid="ctw-extra")
                )

                async def queued() -> bool:
                    return (await counts(c, target.url))[1] >= 1

                await until(queued, target.timeout_s / 2, "a queued request")
                await c.abort_rids(["ctw-extra"])
                w = await extra
                assert w.is_waiting_abort and len(w.output_ids) == 0 and w.prompt_tokens is None
                await c.abort_rids(rids)
                for r in await asyncio.gather(*tasks):
                    assert r.is_abort and len(r.output_ids) == len(r.logprobs)

        self.run(target, go())

    def test_abort_at_pause_gate_is_lost(self, target: EngineTarget) -> None:
        """An exact abort of a request held at the pause gate does not abort it."""

        async def go() -> None:
            async with target.client() as c:
                await c.pause_generation("abort")
                try:
                    task = asyncio.create_task(
                        c.generate(
                            target.prompt, {"max_new_tokens": 3, "ignore_eos": True}, rid="gated"
                        )
                    )
                    await asyncio.sleep(0.5)
                    assert not task.done()
                    await c.abort_rids(["gated"])
                    await asyncio.sleep(0.2)
                finally:
                    await c.continue_generation()
                r = await task
                assert r.finish_reason == {"type": "length", "length": 3}

        self.run(target, go())

    def test_abort_landing_on_stop_token_is_final(self, target: EngineTarget) -> None:
        """A pending abort wins over the stop check: the reply says abort but ends on the
        stop token, and the sample step makes it final (``stop`` with ``aborted: true``).

        On the real server whether an abort lands exactly on a stop token is timing; the
        local engines are stepped until it does. The scenario is tried a few times, and
        every reply is checked each time (never past its stop token; an abort that landed
        on it reported as finished)."""

        async def once(c: Any, attempt: int, stepped: bool) -> int:
            greedy = {**GREEDY, "max_new_tokens": 24}
            ref = (await c.generate(target.prompt, greedy)).output_ids.tolist()
            # stop positions where the token first appears; at most max_running of them,
            # so that all run in lockstep: the one whose stop token comes next when the
            # engine is frozen gets the abort in the step that emits its stop token
            end = ref.index(target.eos_token_id) if target.eos_token_id in ref else len(ref)
            firsts = [k for k in range(2, end) if ref[k] not in ref[:k]]
            firsts = firsts[: target.max_running]
            if len(firsts) < 3:
                pytest.skip(f"greedy path {ref} repeats too much to place stop tokens")
            prefix = f"cts{attempt}-"
            tasks = {
                k: asyncio.create_task(
                    c.generate(
                        target.prompt,
                        {**greedy, "ignore_eos": False, "stop_token_ids": [ref[k]]},
                        rid=f"{prefix}{k}",
                    )
                )
                for k in firsts
            }
            if stepped:
                await self._abort_before_a_stop(c, target, prefix, tasks)
            else:  # where the freeze lands is timing
                await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_COMPLETED)
                await c.pause_generation("in_place")
                try:
                    await c.abort_matching(prefix)
                    await asyncio.sleep(0.2)
                finally:
                    await c.continue_generation()
            landed = 0
            for k, task in tasks.items():
                # the engine's reply, made final as the sample step does
                r = finalize_abort_at_stop(await task, eos_ids={target.eos_token_id},
                                           stop_token_ids=[ref[k]])
                ids = r.output_ids.tolist()
                assert ref[k] not in ids[:-1], "generation went past its stop token"
                if ids and ids[-1] == ref[k]:
                    assert r.finish_type == "stop" and int(r.finish_reason["matched"]) == ref[k]
                    landed += int(bool(r.finish_reason.get("aborted")))
                else:
                    assert r.is_abort, r.finish_reason
            return landed

        async def go() -> None:
            async with target.client() as c:
                stepped = await live_tokens(target) is not None
                for attempt in range(3):
                    if await once(c, attempt, stepped):
                        return
                self.no_landing(target)

        self.run(target, go())

    async def _abort_before_a_stop(
        self, c: SGLangClient, target: EngineTarget, prefix: str,
        tasks: Mapping[int, asyncio.Task[Any]],
    ) -> None:
        """Step an engine that lists its requests' tokens (the local engines'
        ``/strawq/live_requests``) by pausing in place and reading every request's tokens,
        until one request's next token is its stop token; then abort them all. The
        requests may be admitted in different steps (they arrive one by one), so freezing
        after the first one finishes does not tell where the others are."""
        while not all(t.done() for t in tasks.values()):
            await c.pause_generation("in_place")
            try:
                live = await live_tokens(target) or {}
                if any(live.get(f"{prefix}{k}") == k for k in tasks):
                    await c.abort_matching(prefix)
                    await asyncio.sleep(0.2)
                    return
            finally:
                await c.continue_generation()

    def no_landing(self, target: EngineTarget) -> None:
        """No abort landed on a stop token this run (timing); local engines must land one."""
        pytest.fail("no abort landed on its stop token")
