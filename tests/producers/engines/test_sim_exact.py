"""The sim engine is exact: where a request's prompt ends never depends on a coincidence.

The sim engine finds a resumed prefix by matching trailing input tokens against its seed's
own tokens. A prompt whose last token happens to be the seed's token at that position (1 in
``vocab - 3``) used to be taken as one token shorter, so the answer ended one token early.
The client now declares the resumed prefix (``custom_params.strawq_resumed_tokens``); the
prompts below are built to end in the matching token, so each case is deterministic.
The real SGLang server ignores the field; the real sglang-router 0.3.2 drops it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tests.producers.engine_helpers import run

from strawq.producers.engine_errors import EngineRequestError
from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.sim_backend import SimConfig, sim_token, target_length
from strawq.producers.engines.testing import EngineThread, running_engine
from strawq.producers.sample import Sample, SamplerParams, SampleStatus
from strawq.producers.sample_step import resumed_tokens, step_sample
from strawq.producers.sglang_client import ClientConfig, SGLangClient
from strawq.producers.sglang_protocol import RESUMED_TOKENS_KEY
from tests.sglang_fixtures import RealServer, start_router

pytestmark = pytest.mark.timeout(120)

CFG = SimConfig(step_base_ms=0.0, step_per_req_ms=0.0, len_median=20, len_sigma=0.5,
                len_cap=200, cap_prob=0.0)
OPTS = EngineOptions(kind="sim", max_running=8, sim=CFG)
SEED = next(s for s in range(1000) if 12 <= target_length(s, CFG) <= 60)
TARGET = target_length(SEED, CFG)
PARAMS = SamplerParams(max_new_tokens=150, seed=SEED)


def own(pos: int) -> int:
    return sim_token(SEED, pos, CFG.vocab_size)


def matching_prompt(n: int = 5) -> list[int]:
    """A prompt whose last token is the seed's own token at that position."""
    return [101 + i for i in range(n - 1)] + [own(n - 1)]


def client(url: str) -> SGLangClient:
    return SGLangClient([url], config=ClientConfig(max_retries=0))


def expected(prompt_len: int) -> list[int]:
    """The uninterrupted answer to a prompt of ``prompt_len`` tokens: TARGET tokens, EOS last."""
    return [own(prompt_len + i) for i in range(TARGET - 1)] + [CFG.eos_token_id]


def aborted(prompt: list[int], response: list[int], mask: list[int]) -> Sample:
    n = len(response)
    return Sample(uid="s", prompt_ids=np.asarray(prompt), params=PARAMS,
                  response_ids=np.asarray(response), logprobs=np.full(n, -1.0),
                  versions=np.zeros(n), loss_mask=np.asarray(mask),
                  status=SampleStatus.ABORTED, finish_reason={"type": "abort"}, num_segments=1)


def test_a_fresh_prompt_ending_in_the_seeds_token_gets_its_whole_answer() -> None:
    prompt = matching_prompt()

    async def go() -> None:
        async with running_engine(OPTS) as url, client(url) as c:
            s = Sample.new("s", prompt, PARAMS)
            await step_sample(c, s)
            assert s.status is SampleStatus.COMPLETED
            assert s.response_ids.tolist() == expected(len(prompt))

    run(go())


@pytest.mark.parametrize("k", [1, 7])
def test_a_resumed_answer_continues_exactly_when_the_prompt_ends_in_the_seeds_token(
    k: int,
) -> None:
    prompt = matching_prompt()
    ref = expected(len(prompt))

    async def go() -> None:
        async with running_engine(OPTS) as url, client(url) as c:
            s = aborted(prompt, ref[:k], [1] * k)
            assert resumed_tokens(s) == k
            await step_sample(c, s)
            assert s.status is SampleStatus.COMPLETED
            assert s.response_ids.tolist() == ref

    run(go())


def test_after_an_appended_token_that_matches_the_next_turn_starts_there() -> None:
    """Turn 1, its EOS, a tool's tokens (the last one the seed's own token at its position),
    then turn 2 aborted after 3 tokens: the resume ends where turn 2 alone would."""
    prompt = [101, 102, 103]
    turn1 = [own(len(prompt) + i) for i in range(TARGET - 1)] + [CFG.eos_token_id]
    start = len(prompt) + len(turn1)
    tool = [7, 8, own(start + 2)]
    turn2_start = start + len(tool)
    turn2 = [own(turn2_start + i) for i in range(TARGET - 1)] + [CFG.eos_token_id]
    response = turn1 + tool + turn2[:3]
    mask = [1] * len(turn1) + [0] * len(tool) + [1] * 3

    async def go() -> None:
        async with running_engine(OPTS) as url, client(url) as c:
            s = aborted(prompt, response, mask)
            assert resumed_tokens(s) == 3
            await step_sample(c, s)
            assert s.response_ids.tolist() == turn1 + tool + turn2

    run(go())


def test_a_resume_after_an_eos_ended_turn_starts_at_that_turn() -> None:
    """No token appended between two turns: the declared prefix spans both, and the scan
    stops at the EOS that ended the first (the seed's tokens never include EOS)."""
    prompt = matching_prompt()
    turn1 = expected(len(prompt))
    turn2_start = len(prompt) + len(turn1)
    turn2 = [own(turn2_start + i) for i in range(TARGET - 1)] + [CFG.eos_token_id]

    async def go() -> None:
        async with running_engine(OPTS) as url, client(url) as c:
            s = aborted(prompt, turn1 + turn2[:4], [1] * (len(turn1) + 4))
            await step_sample(c, s)
            assert s.response_ids.tolist() == turn1 + turn2

    run(go())


def test_a_bad_resumed_prefix_is_a_clear_400() -> None:
    prompt = matching_prompt()

    async def go() -> None:
        async with running_engine(OPTS) as url, client(url) as c:
            for value, words in ((-1, "integer >= 0"), ("3", "integer >= 0"),
                                 (len(prompt), "less than the 5 input tokens")):
                sp: dict[str, Any] = {"max_new_tokens": 4,
                                      "custom_params": {RESUMED_TOKENS_KEY: value}}
                with pytest.raises(EngineRequestError, match=words):
                    await c.generate(prompt, sp)
            with pytest.raises(EngineRequestError, match="custom_params must be an object"):
                await c.generate(prompt, {"max_new_tokens": 4, "custom_params": [1]})

    run(go())


@pytest.mark.sglang_real
@pytest.mark.timeout(300)
def test_the_real_server_ignores_the_resumed_prefix(sglang_real: RealServer) -> None:
    """The same greedy request, with and without the field: the same answer."""
    prompt = [1, 504, 3458, 314, 260, 1345]

    async def go() -> None:
        cfg = ClientConfig(max_retries=0, api_key=sglang_real.api_key)
        async with SGLangClient([sglang_real.url], config=cfg) as c:
            sp = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
            plain = await c.generate(prompt, sp)
            for k in (0, 3):
                hinted = await c.generate(
                    prompt, {**sp, "custom_params": {RESUMED_TOKENS_KEY: k}})
                assert hinted.output_ids.tolist() == plain.output_ids.tolist()
                assert hinted.finish_reason == plain.finish_reason
                assert hinted.prompt_tokens == plain.prompt_tokens == len(prompt)

    run(go(), 240)


@pytest.mark.sglang_real
@pytest.mark.timeout(240)
def test_the_real_router_drops_custom_params_so_the_sim_behind_it_falls_back(
    sglang_router_cmd: list[str], tmp_path: Any
) -> None:
    """sglang-router 0.3.2 re-serialises ``sampling_params`` from its own typed struct, which
    has no ``custom_params``: the sim engine behind it never sees the resumed prefix and
    falls back to matching, so this prompt's answer ends one token early. When a router
    release forwards the field this test fails: the docs' router caveat can then go."""
    prompt = matching_prompt()
    engine = EngineThread(OPTS)
    router = start_router(sglang_router_cmd, [engine.url], log=tmp_path / "router.log")

    async def go() -> None:
        async with SGLangClient(router_url=router.url, config=ClientConfig(max_retries=0)) as c:
            s = Sample.new("s", prompt, PARAMS)
            await step_sample(c, s)
            full = expected(len(prompt))
            assert s.response_ids.tolist() == full[:-2] + [CFG.eos_token_id]

    try:
        run(go(), 200)
    finally:
        router.stop()
        engine.stop()
