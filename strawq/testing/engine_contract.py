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

import asyncio
import base64
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import numpy as np
import pytest

from strawq.extras import ROUTED_EXPERTS, TOP_P_TOKEN_IDS
from strawq.producers.engine_errors import EngineAuthError, WeightUpdateRefused
from strawq.producers.eos import eos_ids_from_model_info
from strawq.producers.sample import Sample, SamplerParams, SampleStatus
from strawq.producers.sglang_client import ClientConfig, SGLangClient
from strawq.producers.sglang_protocol import finalize_abort_at_stop
from strawq.producers.teacher import parse_teacher, teacher_payload
from strawq.producers.sample_step import step_sample

T = TypeVar("T")
# Greedy; the seed makes the sim engine reproducible (SGLang ignores it without
# --enable-deterministic-inference, and greedy needs none).
GREEDY: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True, "sampling_seed": 1234}


@dataclass(frozen=True)
class EngineTarget:
    """One engine under test.

    Fields:
        url: the worker's base URL (control calls always go here).
        eos_token_id: the model's EOS id.
        vocab_size: token ids in ``[0, vocab_size)`` are valid.
        prompt: a prompt of valid ids.
        weight_dirs: two weight directories the engine can load (``update_weights_from_disk``);
            the second one differs from the first (a real weight change).
        max_running: the engine's ``--max-running-requests``.
        long_tokens: a budget that keeps one request running for a second or more.
        api_key / admin_api_key: the keys the engine was started with (None: none).
        router_url: a router in front of ``url`` (``/generate`` goes there when set).
        timeout_s: the deadline of one test.
        no_routed_experts: why the target returns no ``routed_experts`` (a dense model);
            the routed-experts case is skipped with it.
    """

    url: str
    eos_token_id: int
    vocab_size: int
    prompt: tuple[int, ...]
    weight_dirs: tuple[str, str]
    max_running: int
    long_tokens: int = 400
    api_key: str | None = None
    admin_api_key: str | None = None
    router_url: str | None = None
    timeout_s: float = 120.0
    extra: Mapping[str, Any] = field(default_factory=dict)
    #: why the target cannot return ``routed_experts`` (None: it can; a dense model cannot)
    no_routed_experts: str | None = None
    #: a budget the engine needs well over ``3 * disconnect_deadline_s`` to generate (None:
    #: the context is generated too fast to tell an abort from the end; the case is skipped)
    orphan_tokens: int | None = 8000
    #: how soon the request of a client killed with ``kill -9`` must be gone from the engine
    disconnect_deadline_s: float = 30.0

    def client(self, **overrides: Any) -> SGLangClient:
        cfg: dict[str, Any] = {
            "max_retries": 0,
            "api_key": self.api_key,
            "admin_api_key": self.admin_api_key,
            "control_timeout_s": 60.0,
        }
        cfg.update(overrides)
        return SGLangClient([self.url], router_url=self.router_url, config=ClientConfig(**cfg))

    def headers(self, admin: bool = False) -> dict[str, str]:
        key = self.admin_api_key if admin and self.admin_api_key else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}


async def _counts(client: SGLangClient, url: str) -> tuple[int, int]:
    body = await client.loads(url)
    entry = body["loads"][0]
    return int(entry["num_running_reqs"]), int(entry["num_waiting_reqs"])


async def _live_tokens(target: EngineTarget) -> dict[str, int] | None:
    """Each request's output tokens so far, by rid (the local engines'
    ``GET /strawq/live_requests``); None where the engine has no such endpoint."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(target.url.rstrip("/") + "/strawq/live_requests",
                 headers=target.headers()) as resp,
    ):
        if resp.status != 200:
            return None
        body = await resp.json()
    return {r["rid"]: int(r["output_tokens"]) for r in body["requests"]}


async def _until(pred: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached within {timeout_s:.0f}s")
        await asyncio.sleep(0.02)


#: a client in its own process: sends one ``/generate`` and waits for the answer
_CLIENT = """
import sys, urllib.request
url, body, key = sys.argv[1:4]
headers = {"Content-Type": "application/json"}
if key:
    headers["Authorization"] = "Bearer " + key
urllib.request.urlopen(urllib.request.Request(url, data=body.encode(), headers=headers),
                       timeout=3600).read()
"""


def spawn_generate(url: str, body: Mapping[str, Any],
                   api_key: str | None = None) -> subprocess.Popen[bytes]:
    """A client in its own process that posts ``body`` to ``url``'s ``/generate`` and waits
    (kill it to leave the request orphaned, as a crashed producer does)."""
    return subprocess.Popen([sys.executable, "-c", _CLIENT, url.rstrip("/") + "/generate",
                             json.dumps(body), api_key or ""])


class EngineContract:
    """SGLang 0.5.23 behaviour that strawq relies on. Subclasses provide ``target``."""

    #: the tests that start an OS process (a client killed mid-request), so a test runner can
    #: put them in a slower tier
    STARTS_PROCESSES = frozenset({"test_a_killed_clients_request_is_aborted"})

    # -- plumbing -----------------------------------------------------------------------
    def run(self, target: EngineTarget, coro: Awaitable[T]) -> T:
        async def bounded() -> T:
            return await asyncio.wait_for(coro, target.timeout_s)

        return asyncio.run(bounded())

    async def _running(
        self, c: SGLangClient, t: EngineTarget, n: int = 1, task: asyncio.Future[Any] | None = None
    ) -> None:
        async def ok() -> bool:
            if task is not None and task.done():
                raise AssertionError(
                    f"the request finished before it was seen running ({task.result()}); "
                    "give it a longer budget"
                )
            return (await _counts(c, t.url))[0] >= n

        await _until(ok, t.timeout_s / 2, f"{n} request(s) running on {t.url}")

    async def _idle(self, c: SGLangClient, t: EngineTarget) -> None:
        async def ok() -> bool:
            return await _counts(c, t.url) == (0, 0)

        await _until(ok, t.timeout_s / 2, f"{t.url} idle")

    def _long(self, t: EngineTarget, n: int | None = None) -> dict[str, Any]:
        return {"max_new_tokens": n or t.long_tokens, "ignore_eos": True}

    async def _start_long(self, c: SGLangClient, t: EngineTarget, n: int) -> asyncio.Task[Any]:
        """One ``n``-token request, returned once the engine reports it running (it must
        not finish before that)."""
        task = asyncio.create_task(c.generate(t.prompt, self._long(t, n)))
        await self._running(c, t, task=task)
        return task

    async def _raw(
        self, t: EngineTarget, path: str, body: Any, *, admin: bool = False
    ) -> tuple[int, bytes]:
        async with (
            aiohttp.ClientSession() as s,
            s.post(t.url + path, json=body, headers=t.headers(admin)) as r,
        ):
            return r.status, await r.read()

    # -- generate ---------------------------------------------------------------------------
    def test_generate_logprobs_align(self, target: EngineTarget) -> None:
        async def go() -> None:
            async with target.client() as c:
                r = await c.generate(
                    target.prompt, {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
                )
                assert r.finish_reason == {"type": "length", "length": 6}
                assert len(r.output_ids) == len(r.logprobs) == len(r.versions) == 6
                assert r.completion_tokens == 6 and r.prompt_tokens == len(target.prompt)
                assert (r.logprobs <= 0).all()

        self.run(target, go())

    def test_stop_token_is_kept_in_ids(self, target: EngineTarget) -> None:
        async def go() -> None:
            async with target.client() as c:
                greedy = {**GREEDY, "max_new_tokens": 6}
                ref = await c.generate(target.prompt, greedy)
                stop_tok = int(ref.output_ids[2])
                stopping = {**greedy, "ignore_eos": False, "stop_token_ids": [stop_tok]}
                r = await c.generate(target.prompt, stopping)
                assert r.finish_type == "stop"
                assert r.finish_reason["matched"] in (stop_tok, target.eos_token_id)
                assert int(r.output_ids[-1]) == r.finish_reason["matched"]
                assert len(r.output_ids) <= 3
                # ignore_eos switches off every token-based stop, stop_token_ids included
                ignoring = await c.generate(target.prompt, {**stopping, "ignore_eos": True})
                assert ignoring.finish_reason == {"type": "length", "length": 6}

        self.run(target, go())

    def test_resume_reports_reduced_budget(self, target: EngineTarget) -> None:
        async def go() -> None:
            async with target.client() as c:
                first = await c.generate(target.prompt, {"max_new_tokens": 4, "ignore_eos": True})
                resumed = await c.generate(
                    list(target.prompt) + first.output_ids.tolist(),
                    {"max_new_tokens": 3, "ignore_eos": True},
                )
                assert resumed.finish_reason == {"type": "length", "length": 3}
                assert resumed.prompt_tokens == len(target.prompt) + 4
                assert len(resumed.output_ids) == 3

        self.run(target, go())

    def test_n2_sub_requests_get_unrelated_rids(self, target: EngineTarget) -> None:
        async def go() -> None:
            status, data = await self._raw(
                target,
                "/generate",
                {
                    "input_ids": list(target.prompt),
                    "rid": "n2parent",
                    "sampling_params": {"max_new_tokens": 2, "n": 2, "ignore_eos": True},
                },
            )
            assert status == 200
            body = json.loads(data)
            assert isinstance(body, list) and len(body) == 2
            rids = [item["meta_info"]["id"] for item in body]
            assert len(set(rids)) == 2
            assert not any(r.startswith("n2parent") for r in rids)  # so no rid abort reaches them
            async with target.client() as c:
                many = await c.generate_many(
                    target.prompt, {"max_new_tokens": 2, "n": 2, "ignore_eos": True}, rid="n2c"
                )
                assert [m.rid for m in many] == ["n2c#0.", "n2c#1."]

        self.run(target, go())

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

    # -- aborts -------------------------------------------------------------------------------
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
                assert (await _counts(c, target.url))[0] == 1, "a rid prefix aborted a request"
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
                    return await _counts(c, target.url) == (0, 0)

                try:
                    await _until(idle, target.disconnect_deadline_s,
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
                    return (await _counts(c, target.url))[1] >= 1

                await _until(queued, target.timeout_s / 2, "a queued request")
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
                stepped = await _live_tokens(target) is not None
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
                live = await _live_tokens(target) or {}
                if any(live.get(f"{prefix}{k}") == k for k in tasks):
                    await c.abort_matching(prefix)
                    await asyncio.sleep(0.2)
                    return
            finally:
                await c.continue_generation()

    def no_landing(self, target: EngineTarget) -> None:
        """No abort landed on a stop token this run (timing); local engines must land one."""
        pytest.fail("no abort landed on its stop token")

    # -- pause, weight updates ---------------------------------------------------------
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

    # -- authentication -----------------------------------------------------------------
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

    # -- per-token extras -----------------------------------------------------------------
    async def _two_segments(self, c: SGLangClient, t: EngineTarget, want: tuple[str, ...],
                            params: dict[str, Any]) -> Sample:
        """A sample generated as 3 tokens, then resumed (as after an abort) for 3 more."""
        first = SamplerParams(max_new_tokens=3, **params)
        s = Sample(uid="cx.0", prompt_ids=np.array(t.prompt), params=first, want_extras=want)
        assert await step_sample(c, s) is not None
        assert s.response_length == 3
        s.status = SampleStatus.ABORTED  # resume it like a prefix saved at a weight update
        s.params = SamplerParams(max_new_tokens=6, **params)
        assert await step_sample(c, s) is not None
        assert s.response_length == 6 and s.status is SampleStatus.TRUNCATED
        return s

    def test_routed_experts_across_a_resume(self, target: EngineTarget) -> None:
        if target.no_routed_experts:
            pytest.skip(target.no_routed_experts)

        async def go() -> None:
            async with target.client() as c:
                s = await self._two_segments(c, target, (ROUTED_EXPERTS,),
                                             {"temperature": 0.0, "ignore_eos": True})
                x = s.extras[ROUTED_EXPERTS]
                p = len(target.prompt)
                assert x.rows == p + 6  # every position; the last one not computed yet
                assert (x.values[-1] == -1).all() and (x.values[:-1] >= 0).all()
                # one request over the whole sequence routes every position the same way
                whole = list(target.prompt) + s.response_ids.tolist()
                status, data = await self._raw(target, "/generate", {
                    "input_ids": whole, "sampling_params": {"max_new_tokens": 1},
                    "return_routed_experts": True, "routed_experts_start_len": 0})
                assert status == 200
                ref = np.frombuffer(base64.b64decode(json.loads(data)["meta_info"][
                    "routed_experts"]), dtype="<i4")
                assert ref.size == len(whole) * x.values[0].size
                assert ref.reshape(x.values.shape).tolist()[:-1] == x.values.tolist()[:-1]

        self.run(target, go())

    def test_top_p_kept_ids_across_a_resume(self, target: EngineTarget) -> None:
        async def go() -> None:
            async with target.client() as c:
                s = await self._two_segments(c, target, (TOP_P_TOKEN_IDS,),
                                             {"temperature": 1.0, "top_p": 0.9, "top_k": 50,
                                              "ignore_eos": True, "seed": 7})
                x = s.extras[TOP_P_TOKEN_IDS]
                assert x.counts is not None and x.rows == 6 and (x.counts >= 1).all()
                off = x.offsets()
                for i, tok in enumerate(s.response_ids.tolist()):
                    kept = x.values[off[i]:off[i + 1]].tolist()
                    assert tok in kept, (i, tok, kept)  # a sampled token was kept

        self.run(target, go())

    def test_sampling_mask_needs_a_finite_top_k(self, target: EngineTarget) -> None:
        async def go() -> None:
            status, data = await self._raw(target, "/generate", {
                "input_ids": list(target.prompt), "return_sampling_mask": True,
                "sampling_params": {"max_new_tokens": 2, "temperature": 1.0, "top_k": -1}})
            assert status == 400
            assert b"return_sampling_mask requires" in data

        self.run(target, go())

    def test_teacher_scores_a_finished_sample(self, target: EngineTarget) -> None:
        """A teacher's log-probs of a finished sample: ``max_new_tokens`` 0 with
        ``logprob_start_len`` = prompt − 1 gives one entry per response token after a
        first one without a log-prob (``strawq.producers.teacher``)."""
        async def go() -> None:
            async with target.client() as c:
                s = Sample(uid="ct.0", prompt_ids=np.array(target.prompt),
                           params=SamplerParams(max_new_tokens=4, temperature=0.0,
                                                ignore_eos=True))
                await step_sample(c, s)
                ids, params, extra = teacher_payload(s)
                first = parse_teacher(await c.generate(ids, params, extra=extra), s)
                again = parse_teacher(await c.generate(ids, params, extra=extra), s)
                assert first.rows == 4 and (first.values <= 0).all()
                assert first.values.tolist() == again.values.tolist()

        self.run(target, go())
