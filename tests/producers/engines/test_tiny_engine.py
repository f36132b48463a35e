"""The client against the tiny torch engine over real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from tests.producers.engine_helpers import load_counts, run, wait_until

from strawq.producers.engine_errors import EngineRequestError, EngineTimeout
from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.testing import running_engine
from strawq.producers.engines.tiny_model import TinyConfig, load_weights, recompute_logprobs
from strawq.producers.sample import Sample, SamplerParams, SampleStatus, mask_offpolicy_prefix
from strawq.producers.sglang_client import ClientConfig, SGLangClient
from strawq.producers.sample_step import step_sample

pytestmark = pytest.mark.timeout(90)

PROMPT = [11, 22, 33, 44, 55]
LONG = {"max_new_tokens": 900, "ignore_eos": True}  # aborted long before its end


def opts(weight_dirs: dict[int, Path] | None = None, **kw: Any) -> EngineOptions:
    base: dict[str, Any] = {
        "kind": "tiny",
        "max_running": 4,
        "tiny": TinyConfig(context_length=1024),
    }
    if weight_dirs is not None:
        base["model_path"] = str(weight_dirs[0])
    base.update(kw)
    return EngineOptions(**base)


#: the engines' context length (``TinyConfig(context_length=1024)``), as a producer sets it
CONTEXT = 1024


def client_for(url: str, **cfg: Any) -> SGLangClient:
    return SGLangClient(
        [url], config=ClientConfig(max_retries=1, backoff_base_s=0.05, **cfg)
    )


def assert_recompute_matches(
    sample: Sample, weight_dirs: dict[int, Path], temperature: float
) -> None:
    """Each token's rollout log-prob equals the teacher-forced one under its version's weights."""
    checked = 0
    for version in np.unique(sample.versions):
        model = load_weights(weight_dirs[int(version)])
        lp = recompute_logprobs(
            model, sample.prompt_ids, sample.response_ids, temperature=temperature
        )
        sel = sample.versions == version
        np.testing.assert_allclose(sample.logprobs[sel], lp[sel], atol=1e-4, rtol=0)
        checked += int(sel.sum())
    assert checked == sample.response_length > 0


def test_complete_with_stop_token_and_text_trim() -> None:
    async def go() -> None:
        async with running_engine(opts()) as url, client_for(url) as c:
            greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
            ref = await c.generate(PROMPT, greedy)
            assert ref.finish_reason == {"type": "length", "length": 6}
            stop_tok = int(ref.output_ids[2])
            k = ref.output_ids.tolist().index(stop_tok)
            # ignore_eos would switch stop_token_ids off too (SGLang 0.5.23)
            r = await c.generate(
                PROMPT, {**greedy, "ignore_eos": False, "stop_token_ids": [stop_tok]}
            )
            assert r.finish_reason == {"type": "stop", "matched": stop_tok}
            assert (
                r.output_ids.tolist() == ref.output_ids.tolist()[: k + 1]
            )  # stop token kept in ids
            assert r.text == "".join(
                f" {t}" for t in r.output_ids.tolist()[:-1]
            )  # trimmed in text only
            r2 = await c.generate(
                PROMPT,
                {**greedy, "ignore_eos": False, "stop_token_ids": [stop_tok], "no_stop_trim": True},
            )
            assert r2.text.endswith(f" {stop_tok}")
            sample = Sample.new(
                "s",
                PROMPT,
                SamplerParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(stop_tok,)),
            )
            await step_sample(c, sample, context_length=CONTEXT)
            assert sample.status is SampleStatus.COMPLETED and sample.response_ids[-1] == stop_tok

    run(go())


def test_length_truncated_and_greedy_logprobs(weight_dirs: dict[int, Path]) -> None:
    async def go() -> Sample:
        async with running_engine(opts(weight_dirs)) as url, client_for(url) as c:
            s = Sample.new(
                "t", PROMPT, SamplerParams(max_new_tokens=9, temperature=0.0, ignore_eos=True)
            )
            r = await step_sample(c, s, context_length=CONTEXT)
            assert r is not None and r.finish_reason == {"type": "length", "length": 9}
            return s

    s = run(go())
    assert s.status is SampleStatus.TRUNCATED and s.response_length == 9
    assert_recompute_matches(s, weight_dirs, temperature=0.0)


def test_seeded_resume_equals_uninterrupted() -> None:
    async def go() -> None:
        async with running_engine(opts()) as url, client_for(url) as c:
            sp = {"temperature": 0.9, "top_p": 0.95, "sampling_seed": 1234, "ignore_eos": True}
            full = await c.generate(PROMPT, {**sp, "max_new_tokens": 12})
            first = await c.generate(PROMPT, {**sp, "max_new_tokens": 5})
            rest = await c.generate(PROMPT + first.output_ids.tolist(), {**sp, "max_new_tokens": 7})
            assert first.output_ids.tolist() + rest.output_ids.tolist() == full.output_ids.tolist()
            np.testing.assert_allclose(
                np.concatenate([first.logprobs, rest.logprobs]), full.logprobs, atol=1e-4
            )
            again = await c.generate(PROMPT, {**sp, "max_new_tokens": 12})
            assert again.output_ids.tolist() == full.output_ids.tolist()

    run(go())


def test_abort_running_and_waiting_shapes() -> None:
    async def go() -> None:
        async with running_engine(opts(max_running=2)) as url, client_for(url) as c:
            samples = [Sample.new(f"s{i}", PROMPT, SamplerParams(**LONG)) for i in range(3)]
            tasks = [
                asyncio.create_task(step_sample(c, s, rid=f"req-{i}",
                                                context_length=CONTEXT))
                for i, s in enumerate(samples)
            ]
            await wait_until(lambda: _counts_are(c, url, (2, 1)))
            await c.abort(abort_all=True)
            results = await asyncio.gather(*tasks)
            running = [r for r in results if not r.is_waiting_abort]
            waiting = [r for r in results if r.is_waiting_abort]
            assert len(running) == 2 and len(waiting) == 1
            for r in running:
                assert r.finish_reason["message"] == "Aborted" and 0 < len(r.output_ids) < 900
                assert len(r.logprobs) == len(r.output_ids) == r.completion_tokens
            w = waiting[0]
            assert (
                len(w.output_ids) == 0
                and "prompt_tokens" not in w.meta_info
                and w.prompt_tokens is None
            )
            assert all(s.status is SampleStatus.ABORTED for s in samples)
            assert await c.num_requests(url) == 0

    run(go())


async def _counts_are(c: SGLangClient, url: str, expected: tuple[int, int]) -> bool:
    return await load_counts(c, url) == expected


def test_abort_by_exact_rid_only() -> None:
    """SGLang 0.5.23 drops a rid prefix; the client selects the live rids itself."""

    async def go() -> None:
        async with running_engine(opts()) as url, client_for(url) as c:
            a = asyncio.create_task(c.generate(PROMPT, LONG, rid="grpA-0"))
            b = asyncio.create_task(
                c.generate(PROMPT, {"max_new_tokens": 40, "ignore_eos": True}, rid="grpB-0")
            )
            await wait_until(lambda: _counts_are(c, url, (2, 0)))
            await c.abort("grpA")  # a prefix: a no-op, as on the real server
            assert await load_counts(c, url) == (2, 0)
            assert await c.abort_matching("grpA") == ["grpA-0"]
            ra, rb = await asyncio.gather(a, b)
            assert ra.is_abort and not rb.is_abort and rb.finish_reason["type"] == "length"
            assert len(rb.output_ids) == 40

    run(go())


@pytest.mark.slow
def test_pause_abort_update_resume_logprobs_per_version(weight_dirs: dict[int, Path]) -> None:
    temperature = 0.8

    async def go() -> Sample:
        async with running_engine(opts(weight_dirs)) as url, client_for(url) as c:
            s = Sample.new(
                "w",
                PROMPT,
                SamplerParams(
                    max_new_tokens=300, temperature=temperature, top_k=64, seed=7, ignore_eos=True
                ),
            )
            t = asyncio.create_task(step_sample(c, s, context_length=CONTEXT))
            await wait_until(lambda: _counts_are(c, url, (1, 0)))
            await asyncio.sleep(0.05)
            await c.pause_generation("abort")
            r = await t
            assert r is not None and r.is_abort and s.status is SampleStatus.ABORTED
            n_old = s.response_length
            assert 0 < n_old < 300
            assert await c.flush_cache(deadline_s=5) is None
            await c.update_weights_from_disk(str(weight_dirs[1]), weight_version=1)
            assert await c.weight_version(url) == 1
            await c.continue_generation()
            r2 = await step_sample(c, s, context_length=CONTEXT)
            assert r2 is not None and r2.finish_reason == {"type": "length", "length": 300 - n_old}
            assert (
                s.status is SampleStatus.TRUNCATED
                and s.response_length == 300
                and s.num_segments == 2
            )
            assert s.versions[:n_old].tolist() == [0] * n_old and s.versions[n_old:].tolist() == [
                1
            ] * (300 - n_old)
            return s

    s = run(go())
    assert_recompute_matches(s, weight_dirs, temperature)
    assert mask_offpolicy_prefix(s, 1) == int((s.versions == 0).sum())
    assert s.loss_mask.tolist() == (s.versions == 1).astype(np.uint8).tolist()


@pytest.mark.slow
def test_pause_retract_keeps_request_and_reprefills_new_weights(
    weight_dirs: dict[int, Path],
) -> None:
    async def go() -> Sample:
        async with running_engine(opts(weight_dirs)) as url, client_for(url) as c:
            s = Sample.new("r", PROMPT, SamplerParams(max_new_tokens=200, seed=3, ignore_eos=True))
            t = asyncio.create_task(step_sample(c, s, context_length=CONTEXT))
            await wait_until(lambda: _counts_are(c, url, (1, 0)))
            await c.pause_generation("retract")
            assert await load_counts(c, url) == (0, 1)
            await c.flush_cache(deadline_s=5)  # allowed after retract
            await c.update_weights_from_disk(str(weight_dirs[1]), weight_version=1)
            await c.continue_generation()
            r = await t
            assert r is not None and r.finish_type == "length" and r.num_retractions == 1
            spans = r.meta_info["weight_versions"]
            assert [sp["version"] for sp in spans] == ["0", "1"] and spans[1]["end"] == 200
            assert s.status is SampleStatus.TRUNCATED and s.num_segments == 1
            return s

    assert_recompute_matches(run(go()), weight_dirs, 1.0)


@pytest.mark.slow
def test_pause_in_place_blocks_new_requests_and_rejects_flush(weight_dirs: dict[int, Path]) -> None:
    async def go() -> None:
        async with running_engine(opts(weight_dirs)) as url, client_for(url) as c:
            t = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 150, "ignore_eos": True}))
            await wait_until(lambda: _counts_are(c, url, (1, 0)))
            await c.pause_generation("in_place")
            late = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 3}))
            async with aiohttp.ClientSession() as http, http.get(url + "/ready") as resp:
                assert resp.status == 503
            assert await load_counts(c, url) == (1, 0)  # the late request waits at the gate
            assert not late.done()
            with pytest.raises(EngineTimeout, match="not idle"):
                await c.flush_cache(deadline_s=0.2, poll_s=0.1)
            with pytest.raises(EngineRequestError, match="cache was not flushed"):
                await c.update_weights_from_disk(str(weight_dirs[1]), weight_version=1)
            # SGLang 0.5.23: weights applied and later tokens stamped 1, label left stale
            assert await c.weight_version(url) == 0
            await c.continue_generation()
            r, r_late = await asyncio.gather(t, late)
            assert r.finish_type == "length" and set(r.versions.tolist()) == {0, 1}
            assert r_late.versions.tolist() == [1] * len(r_late.output_ids)

    run(go())


def test_unpaused_update_waits_for_inflight_then_applies(weight_dirs: dict[int, Path]) -> None:
    async def go() -> None:
        async with running_engine(opts(weight_dirs)) as url, client_for(url) as c:
            order: list[str] = []

            async def gen() -> Any:
                r = await c.generate(PROMPT, {"max_new_tokens": 120, "ignore_eos": True})
                order.append("generate")
                return r

            async def update() -> None:
                await c.update_weights_from_disk(str(weight_dirs[1]), weight_version=1)
                order.append("update")

            g = asyncio.create_task(gen())
            await wait_until(lambda: _counts_are(c, url, (1, 0)))
            r, _ = await asyncio.gather(g, update())
            assert order == ["generate", "update"]
            assert r.finish_type == "length" and r.versions.tolist() == [0] * 120
            after = await c.generate(PROMPT, {"max_new_tokens": 4})
            assert after.versions.tolist() == [1] * len(after.output_ids)
            # with abort_all_requests the in-flight request is aborted instead
            g2 = asyncio.create_task(c.generate(PROMPT, LONG))
            await wait_until(lambda: _counts_are(c, url, (1, 0)))
            await c.update_weights_from_disk(
                str(weight_dirs[0]), weight_version=2, abort_all_requests=True
            )
            r2 = await g2
            assert r2.is_abort and set(r2.versions.tolist()) <= {1}

    run(go())


def test_flush_cache_waits_until_idle_and_weight_version_endpoint() -> None:
    async def go() -> None:
        async with running_engine(opts()) as url, client_for(url) as c:
            t = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 60, "ignore_eos": True}))
            await wait_until(lambda: _counts_are(c, url, (1, 0)))
            async with aiohttp.ClientSession() as http, http.post(url + "/flush_cache") as resp:
                assert resp.status == 400 and "Flush cache failed" in await resp.text()
            await c.flush_cache(deadline_s=30, poll_s=0.05)
            assert (await t).finish_type == "length"
            g = asyncio.create_task(c.generate(PROMPT, LONG))
            await wait_until(lambda: _counts_are(c, url, (1, 0)))
            reply = await c.update_weight_version(5)  # aborts in-flight by default
            assert next(iter(reply.values()))["new_version"] == "5"
            r = await g
            assert r.is_abort and r.weight_version == 5
            assert await c.weight_version(url) == 5
            assert await c.health_generate(url)

    run(go())


def test_request_validation_like_sglang() -> None:
    async def go() -> None:
        async with running_engine(opts()) as url, client_for(url) as c:
            with pytest.raises(EngineRequestError, match="unknown field `max_tokens`"):
                await c.generate(PROMPT, {"max_tokens": 3})
            with pytest.raises(EngineRequestError, match="context length"):
                await c.generate(PROMPT, {"max_new_tokens": 1020})
            ok = await c.generate(PROMPT, {"max_new_tokens": 2}, extra={"some_future_field": 1})
            assert len(ok.output_ids) <= 2
            many = await c.generate_many(
                PROMPT, {"max_new_tokens": 3, "n": 2, "ignore_eos": True}, rid="grp"
            )
            # n>1 becomes n requests with their own exact rids (SGLang's sub-rids are random)
            assert [r.rid for r in many] == ["grp#0.", "grp#1."]
            zero = await c.generate(PROMPT, {"max_new_tokens": 0})
            assert (
                zero.finish_reason == {"type": "length", "length": 0} and len(zero.output_ids) == 0
            )
            async with aiohttp.ClientSession() as http:
                async with http.post(
                    url + "/generate", json={"input_ids": [], "sampling_params": {}}
                ) as resp:
                    assert resp.status == 400
                    assert (await resp.json())["error"]["message"] == "input_ids cannot be empty."
                async with http.post(url + "/abort_request", json={"rid": "nothing"}) as resp:
                    assert resp.status == 200 and await resp.read() == b""

    run(go())
