"""Sample: invariants, segment application, off-policy masking, serialisation."""

from __future__ import annotations

import dataclasses
import json

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strawq.config import Config, field_docs
from strawq.errors import ConfigError

from strawq.producers.sample import (
    Sample,
    SampleError,
    SamplerParams,
    SampleStatus,
    Segment,
    apply_segment,
    mask_offpolicy_prefix,
    received,
)

pytestmark = pytest.mark.timeout(60)


def seg(ids: list[int], kind: str = "abort", version: int = 0) -> Segment:
    finish = {"type": kind} if kind != "length" else {"type": "length", "length": len(ids)}
    return Segment(
        token_ids=np.asarray(ids, np.int32),
        logprobs=-np.linspace(0.1, 1.0, len(ids)).astype(np.float32),
        versions=np.full(len(ids), version, np.int64),
        finish_reason=finish,
    )


def new(max_new: int = 10) -> Sample:
    return Sample.new("u1", [1, 2, 3], SamplerParams(max_new_tokens=max_new, seed=4))


def test_apply_segments_statuses_and_alignment() -> None:
    s = new()
    assert apply_segment(s, seg([5, 6], "abort", 0)) == 2
    assert s.status is SampleStatus.ABORTED and not s.is_final
    apply_segment(s, seg([], "abort", 0))  # waiting-queue abort: nothing appended
    assert s.response_length == 2 and s.num_segments == 1
    apply_segment(s, seg([7, 2], "stop", 1))
    assert s.status is SampleStatus.COMPLETED and s.num_segments == 2
    assert s.response_ids.tolist() == [5, 6, 7, 2] and s.versions.tolist() == [0, 0, 1, 1]
    assert s.loss_mask.tolist() == [1, 1, 1, 1] and len(s.logprobs) == 4
    with pytest.raises(SampleError, match="already completed"):
        apply_segment(s, seg([9]))


def test_received_applies_the_streamed_segment_to_a_copy_only() -> None:
    s = new()
    apply_segment(s, seg([5, 6], "abort", 0))
    assert received(s).response_ids.tolist() == [5, 6]  # nothing streaming: the same tokens
    s.streamed = seg([7, 8, 9], "abort", 1)
    got = received(s)
    assert got.response_ids.tolist() == [5, 6, 7, 8, 9] and got.versions.tolist() == [0, 0, 1, 1, 1]
    assert got.status is SampleStatus.ABORTED and got.streamed is None
    assert s.response_ids.tolist() == [5, 6] and s.streamed is not None  # the original is untouched
    assert "streamed" not in s.to_dict()


def test_overrun_is_rejected_and_sample_untouched() -> None:
    s = new(max_new=3)
    apply_segment(s, seg([5, 6], "abort"))
    before = s.to_dict()
    with pytest.raises(SampleError, match="overrun"):
        apply_segment(s, seg([7, 8], "length"))
    assert s.to_dict() == before


def test_check_catches_unequal_arrays() -> None:
    s = new()
    apply_segment(s, seg([5, 6]))
    s.loss_mask = s.loss_mask[:1]
    with pytest.raises(SampleError, match="differ in length"):
        s.check()


def test_segment_rejects_mismatched_arrays() -> None:
    with pytest.raises(SampleError):
        Segment(
            token_ids=np.zeros(2, np.int32),
            logprobs=np.zeros(1, np.float32),
            versions=np.zeros(2, np.int64),
            finish_reason={"type": "stop"},
        )
    with pytest.raises(SampleError):
        Segment(
            token_ids=np.zeros(0, np.int32),
            logprobs=np.zeros(0, np.float32),
            versions=np.zeros(0, np.int64),
            finish_reason={"type": "eos"},
        )


def test_remaining_budget_and_zero_budget_truncation() -> None:
    s = Sample.new("u", list(range(10)), SamplerParams(max_new_tokens=8))
    assert s.remaining_budget() == 8
    assert s.remaining_budget(context_length=16) == 5  # 16 - 1 - 10
    apply_segment(s, seg([1, 1, 1, 1, 1]))
    assert s.remaining_budget(context_length=16) == 0
    s.finish_without_request()
    assert s.status is SampleStatus.TRUNCATED and s.finish_reason == {"type": "length", "length": 0}


def test_mask_offpolicy_prefix() -> None:
    s = new()
    apply_segment(s, seg([5, 6], "abort", 3))
    apply_segment(s, seg([7], "abort", 4))
    apply_segment(s, seg([8, 9], "length", 5))
    assert mask_offpolicy_prefix(s, 5) == 3
    assert s.loss_mask.tolist() == [0, 0, 0, 1, 1]
    assert mask_offpolicy_prefix(s, 5) == 0
    assert len(s.loss_mask) == len(s.response_ids)


def test_to_dict_roundtrip_msgpack_and_json() -> None:
    s = new()
    apply_segment(s, seg([5, 6], "abort", 3))
    s.reward = 1.0
    s.extra["group"] = "g1"
    d = s.to_dict()
    for blob in (msgpack.packb(d), json.dumps(d).encode()):
        back = Sample.from_dict(msgpack.unpackb(blob) if blob[:1] != b"{" else json.loads(blob))
        assert back.to_dict() == d
        assert back.logprobs.dtype == np.float32 and back.versions.dtype == np.int64
        assert back.loss_mask.dtype == np.uint8 and back.response_ids.dtype == np.int32
    with pytest.raises(SampleError, match="unknown"):
        Sample.from_dict({**d, "surprise": 1})
    with pytest.raises(SampleError, match="schema"):
        Sample.from_dict({**d, "schema": 99})


def test_sampler_params_validation() -> None:
    with pytest.raises(ConfigError, match="max_new_tokens must be >= 0"):
        SamplerParams(max_new_tokens=-1)
    with pytest.raises(ConfigError, match=r"top_p must be in \(0, 1\]"):
        SamplerParams(max_new_tokens=4, top_p=0.0)
    with pytest.raises(ConfigError, match="top_k must be -1"):
        SamplerParams(max_new_tokens=4, top_k=0)
    with pytest.raises(ConfigError, match=r"SamplerParams: unknown key\(s\) \['n'\]; known keys"):
        SamplerParams.from_dict({"max_new_tokens": 3, "n": 2})
    sp = SamplerParams(max_new_tokens=5, stop_token_ids=[2], seed=1).to_sglang(max_new_tokens=3)
    assert (
        sp["max_new_tokens"] == 3
        and sp["no_stop_trim"] is True
        and sp["stop_token_ids"] == [2]
        and sp["sampling_seed"] == 1
    )


def test_sampler_params_follow_the_config_rules() -> None:
    """A config section like every other: types from the annotations (no bool for an int,
    no string for a float), keyword-only, every field documented, a JSON round trip."""
    assert issubclass(SamplerParams, Config) and "from_dict" not in vars(SamplerParams)
    with pytest.raises(ConfigError, match=r"SamplerParams\.max_new_tokens: expected int, "
                                          r"found bool True"):
        SamplerParams(max_new_tokens=True)
    with pytest.raises(ConfigError, match=r"SamplerParams\.temperature: expected float"):
        SamplerParams.from_dict({"temperature": "0.7"})
    with pytest.raises(ConfigError, match=r"SamplerParams\.seed: expected int or None"):
        SamplerParams.from_dict({"seed": 1.5})
    with pytest.raises(ConfigError, match="stop_token_ids must be non-negative"):
        SamplerParams(stop_token_ids=(2, -1))
    with pytest.raises(TypeError):
        SamplerParams(8)  # type: ignore[misc]
    assert set(field_docs(SamplerParams)) == {f.name for f in dataclasses.fields(SamplerParams)}
    sp = SamplerParams(max_new_tokens=7, stop_token_ids=[3, 4], seed=2, top_k=5)
    assert sp.stop_token_ids == (3, 4)
    assert SamplerParams.from_dict(json.loads(json.dumps(sp.to_dict()))) == sp


def test_a_record_with_bad_params_is_a_sample_error() -> None:
    d = new().to_dict()
    with pytest.raises(SampleError, match="params are invalid.*top_p"):
        Sample.from_dict({**d, "params": {**d["params"], "top_p": 2.0}})


@settings(max_examples=200, deadline=None)
@given(
    max_new=st.integers(0, 40),
    chunks=st.lists(
        st.tuples(st.integers(0, 12), st.sampled_from(["abort", "stop", "length"])), max_size=8
    ),
)
def test_property_segments_keep_alignment_and_budget(
    max_new: int, chunks: list[tuple[int, str]]
) -> None:
    s = Sample.new("p", [1], SamplerParams(max_new_tokens=max_new))
    version = 0
    for n, kind in chunks:
        version += 1
        if s.is_final:
            with pytest.raises(SampleError):
                apply_segment(s, seg([3] * n, kind, version))
            continue
        before = s.response_length
        if before + n > max_new:
            with pytest.raises(SampleError):
                apply_segment(s, seg([3] * n, kind, version))
            assert s.response_length == before
        else:
            apply_segment(s, seg([3] * n, kind, version))
        assert (
            len(s.response_ids) == len(s.logprobs) == len(s.versions) == len(s.loss_mask) <= max_new
        )
        assert np.all(np.diff(s.versions) >= 0)
    assert mask_offpolicy_prefix(s, version) == int((s.versions < version).sum())
    assert len(s.loss_mask) == len(s.response_ids)
