"""An engine's ``/generate`` reply applied onto a sample (the producer's reply checks,
per-token extras included): a hostile reply is an ``EngineProtocolError`` (or a
``SampleError``) and leaves the sample as it was, never another exception."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st

from strawq.producers.extras_protocol import segment_for
from strawq.producers.sample import Sample, SamplerParams, apply_segment
from strawq.producers.sglang_protocol import GenerateResult, parse_generate_response
from tests.fuzz.helpers import clean
from tests.fuzz.test_text_fuzz import json_values

ints = st.integers(-2**70, 2**70)
extras_meta = st.fixed_dictionaries({}, optional={
    "routed_experts": json_values | st.lists(ints, max_size=12) | st.text(max_size=16),
    "output_token_sampling_mask": json_values | st.lists(st.lists(ints, max_size=3),
                                                         max_size=4),
    "output_token_sampling_ids": json_values | st.lists(ints, max_size=6),
    "output_token_sampling_offsets": json_values | st.lists(ints, max_size=6)})

GOOD: dict[str, Any] = {"output_ids": [5, 6], "meta_info": {
    "id": "r1", "finish_reason": {"type": "length", "length": 2}, "weight_version": "0",
    "completion_tokens": 2, "prompt_tokens": 3,
    "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]]}}


def _sample() -> Sample:
    return Sample(uid="u", prompt_ids=np.array([1, 2, 3], np.int32),
                  params=SamplerParams(max_new_tokens=8),
                  want_extras=("routed_experts", "top_p_token_ids"))


@given(extras_meta, st.lists(ints, max_size=4))
@example({"routed_experts": [2**70]}, [5, 6])  # OverflowError from numpy
@example({"output_token_sampling_mask": [[2**70], [1]]}, [5, 6])
def test_replies_applied_onto_a_sample(extra: dict[str, Any], ids: list[int]) -> None:
    body: dict[str, Any] = {**GOOD, "meta_info": {**GOOD["meta_info"], **extra}}
    result = clean(parse_generate_response, body, url="http://e")
    if not isinstance(result, GenerateResult):
        return
    if ids:
        result = dataclasses.replace(result, output_ids=np.array(
            [i % 2**31 for i in ids], np.int32)[:len(result.output_ids)])
    sample = _sample()
    seg = clean(segment_for, result, sample)
    if not isinstance(seg, Exception):
        if isinstance(clean(apply_segment, sample, seg), Exception):
            assert sample.response_length == 0 and sample.num_segments == 0
