"""Partial resume through the real client against a scripted engine (Hypothesis).

The scripted engine produces a fixed "true" continuation (a pure function of absolute
position), aborts each request after a scripted number of tokens, enforces SGLang's
context rule (input + max_new_tokens < context) and stamps each request with a new
weight version. Whatever the abort points, the client must rebuild exactly the true
continuation cut at the right budget, with per-token versions of the request that
produced each token, and never ask for more than the remaining budget.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from aiohttp import web
from tests.producers.engine_helpers import AppThread, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strawq.producers.engine_errors import EngineProtocolError
from strawq.producers.sample import Sample, SamplerParams, SampleStatus
from strawq.producers.sglang_client import ClientConfig, SGLangClient
from strawq.producers.sample_step import step_sample

pytestmark = pytest.mark.timeout(120)

STOP = 2


def true_token(pos: int) -> int:
    return 3 + (pos * 7919) % 997


def true_logprob(pos: int) -> float:
    return -0.05 - (pos % 17) / 8.0


class Script:
    def __init__(self) -> None:
        self.reset(prompt_len=1, chunks=[], stop_at=None, context=10**6, overrun=0)

    def reset(
        self, *, prompt_len: int, chunks: list[int], stop_at: int | None, context: int, overrun: int
    ) -> None:
        self.prompt_len = prompt_len
        self.chunks = list(chunks)
        self.stop_at = stop_at  # response index of the stop token
        self.context = context
        self.overrun = overrun  # extra tokens a buggy engine returns
        self.requests: list[dict[str, Any]] = []


SCRIPT = Script()


async def generate(request: web.Request) -> web.Response:
    body = await request.json()
    ids = body["input_ids"]
    budget = body["sampling_params"]["max_new_tokens"]
    SCRIPT.requests.append({"input_len": len(ids), "max_new_tokens": budget})
    version = str(len(SCRIPT.requests))
    if len(ids) + budget >= SCRIPT.context:
        return web.json_response(
            {
                "error": {
                    "message": "Requested token count exceeds the model's maximum context length"
                }
            },
            status=400,
        )
    # the resumed prefix must be exactly the true continuation
    for pos in range(SCRIPT.prompt_len, len(ids)):
        if ids[pos] != true_token(pos):
            return web.json_response({"error": {"message": f"bad prefix at {pos}"}}, status=400)
    limit = SCRIPT.chunks.pop(0) if SCRIPT.chunks else None
    out: list[int] = []
    finish: dict[str, Any] | None = None
    while finish is None:
        pos = len(ids) + len(out)
        if limit is not None and len(out) >= limit:
            finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
            break
        if len(out) >= budget + SCRIPT.overrun:
            finish = {"type": "length", "length": budget}
            break
        if SCRIPT.stop_at is not None and pos - SCRIPT.prompt_len == SCRIPT.stop_at:
            out.append(STOP)
            finish = {"type": "stop", "matched": STOP}
            break
        out.append(true_token(pos))
    lps = [[true_logprob(len(ids) + i), t, None] for i, t in enumerate(out)]
    meta = {
        "id": body.get("rid", "x"),
        "finish_reason": finish,
        "prompt_tokens": len(ids),
        "completion_tokens": len(out),
        "weight_version": version,
        "weight_versions": [{"version": version, "start": 0, "end": len(out)}],
        "output_token_logprobs": lps,
    }
    return web.json_response({"text": "", "output_ids": out, "meta_info": meta})


@pytest.fixture(scope="module")
def scripted() -> Any:
    def factory() -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", generate)
        return app

    server = AppThread(factory)
    yield server
    server.stop()


async def drive(url: str, sample: Sample, context: int | None, max_calls: int = 50) -> int:
    calls = 0
    async with SGLangClient(
        [url], config=ClientConfig(max_retries=0)
    ) as client:
        while not sample.is_final and calls < max_calls:
            await step_sample(client, sample, context_length=context)
            calls += 1
    return calls


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    prompt_len=st.integers(1, 20),
    max_new=st.integers(0, 60),
    chunks=st.lists(st.integers(0, 15), max_size=6),
    stop_at=st.one_of(st.none(), st.integers(0, 70)),
    context=st.one_of(st.none(), st.integers(22, 90)),
)
def test_resume_rebuilds_true_continuation(
    scripted: AppThread,
    prompt_len: int,
    max_new: int,
    chunks: list[int],
    stop_at: int | None,
    context: int | None,
) -> None:
    SCRIPT.reset(
        prompt_len=prompt_len, chunks=chunks, stop_at=stop_at, context=context or 10**6, overrun=0
    )
    prompt = [true_token(p) + 1000 for p in range(prompt_len)]
    sample = Sample.new("h", prompt, SamplerParams(max_new_tokens=max_new))
    run(drive(scripted.url, sample, context), 30)
    room = max_new if context is None else min(max_new, context - 1 - prompt_len)
    room = max(room, 0)
    expected_len = room if stop_at is None else min(room, stop_at + 1)
    n = sample.response_length
    assert n == expected_len
    expected = [true_token(prompt_len + i) for i in range(n)]
    if stop_at is not None and n == stop_at + 1:
        expected[-1] = STOP
        assert sample.status is SampleStatus.COMPLETED
    else:
        assert sample.status is SampleStatus.TRUNCATED
    assert sample.response_ids.tolist() == expected
    np.testing.assert_allclose(
        sample.logprobs, [true_logprob(prompt_len + i) for i in range(n)], rtol=1e-6
    )
    assert len(sample.versions) == len(sample.loss_mask) == n and sample.loss_mask.sum() == n
    # per-token versions = index (1-based) of the request that produced the token
    produced: list[int] = []
    generated = 0
    for i, req in enumerate(SCRIPT.requests, start=1):
        assert req["input_len"] == prompt_len + generated
        assert req["max_new_tokens"] == (
            max_new - generated
            if context is None
            else min(max_new - generated, context - 1 - req["input_len"])
        )
        assert req["max_new_tokens"] > 0, "a zero budget must finish without a request"
        made = int((sample.versions == i).sum())
        produced += [i] * made
        generated += made
    assert sample.versions.tolist() == produced


def test_engine_returning_more_than_budget_is_rejected(scripted: AppThread) -> None:
    SCRIPT.reset(prompt_len=3, chunks=[2], stop_at=None, context=10**6, overrun=5)
    sample = Sample.new("o", [1, 2, 3], SamplerParams(max_new_tokens=6))

    async def go() -> None:
        async with SGLangClient([scripted.url], config=ClientConfig(max_retries=0)) as client:
            # aborted after 2: fine
            await step_sample(client, sample)
            assert sample.status is SampleStatus.ABORTED and sample.response_length == 2
            before = sample.to_dict()
            with pytest.raises(EngineProtocolError, match="budget of 4"):
                await step_sample(client, sample)
            assert sample.to_dict() == before

    run(go(), 30)


def test_zero_budget_finishes_without_request(scripted: AppThread) -> None:
    SCRIPT.reset(prompt_len=3, chunks=[], stop_at=None, context=10**6, overrun=0)
    sample = Sample.new("z", [1, 2, 3], SamplerParams(max_new_tokens=0))
    calls = run(drive(scripted.url, sample, None), 30)
    assert calls == 1 and SCRIPT.requests == []
    assert sample.status is SampleStatus.TRUNCATED and sample.response_length == 0
