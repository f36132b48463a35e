"""The engine contract, generation: log-probs, stop tokens, resumes, ``n`` > 1, and the
per-token extras (routed experts, top-p kept ids, the sampling mask, teacher scores).

One area of ``strawq.testing.engine_contract.EngineContract``; the facts are SGLang 0.5.23's.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest

from strawq.ondisk.extras import ROUTED_EXPERTS, TOP_P_TOKEN_IDS
from strawq.producers.sample import Sample, SamplerParams, SampleStatus
from strawq.producers.sample_step import step_sample
from strawq.producers.sglang_client import SGLangClient
from strawq.producers.teacher import parse_teacher, teacher_payload
from strawq.testing.engine_target import GREEDY, ContractPlumbing, EngineTarget


class GenerateContract(ContractPlumbing):
    """What ``/generate`` returns: ids, log-probs, finish reasons, extras."""

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
