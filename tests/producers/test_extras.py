"""Per-token extras on the producer side: SGLang's meta_info fields, resumes, partials."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
import pytest

from strawq.errors import ConfigError
from strawq.ondisk import records
from strawq.ondisk.extras import ROUTED_EXPERTS, TOP_P_TOKEN_IDS
from strawq.ondisk.groups import decode_group
from strawq.ondisk.names import TaskName, note_key
from strawq.producers.extras_protocol import ExtrasMismatch, extras_payload, segment_for
from strawq.producers.group import GroupRun
from strawq.producers.producer import Producer
from strawq.producers.producer_config import (
    BudgetConfig,
    EngineConfig,
    PluginsConfig,
    ProducerConfig,
    RecordConfig,
    TimingConfig,
)
from strawq.producers.sample import Sample, SamplerParams, SampleStatus, apply_segment
from strawq.producers.sglang_client import ClientConfig
from strawq.producers.sglang_protocol import parse_generate_response
from strawq.producers.teacher import parse_teacher, teacher_payload
from strawq.tasks.queue import Lease
from strawq.testing.real_sglang import free_port
from tests.producers.helpers import make_run, names, run_producers, wait_for

P = [5, 6, 7]


def body(ids: list[int], finish: str, **meta: Any) -> dict[str, Any]:
    """A /generate answer as SGLang 0.5.23 writes it."""
    return {"text": "", "output_ids": ids, "meta_info": {
        "id": "r", "finish_reason": {"type": finish}, "prompt_tokens": 3,
        "completion_tokens": len(ids), "weight_version": "0", "cached_tokens": 0,
        "output_token_logprobs": [[-0.5, t, None] for t in ids], **meta}}


def b64(rows: np.ndarray) -> str:
    return base64.b64encode(rows.astype("<i4").tobytes()).decode()


def routed(start: int, end: int) -> np.ndarray:
    """Rows for positions [start, end): position j routes to experts (j, j + 100)."""
    return np.array([[[j, j + 100]] for j in range(start, end)], np.int32)


def sample(*want: str) -> Sample:
    return Sample(uid="t.0", prompt_ids=np.array(P), params=SamplerParams(max_new_tokens=10),
                  want_extras=want, routed_experts_shape=(1, 2))


def step(s: Sample, b: dict[str, Any]) -> None:
    apply_segment(s, segment_for(parse_generate_response(b), s))


def test_routed_experts_resume_from_routed_experts_start_len() -> None:
    s = sample(ROUTED_EXPERTS)
    assert extras_payload(s) == {"return_routed_experts": True, "routed_experts_start_len": 0}
    step(s, body([20, 21], "abort", routed_experts=b64(routed(0, 4))))  # seq 5: rows [0, 4)
    x = s.extras[ROUTED_EXPERTS]
    assert x.rows == 5 and x.values[:4].tolist() == routed(0, 4).tolist()
    assert (x.values[4] == -1).all()  # token 21 has not been the model's input yet
    # the resume asks only for the rows not known: from position 4 (token 21) on
    assert extras_payload(s)["routed_experts_start_len"] == 4
    s.status = SampleStatus.ABORTED
    step(s, body([22, 23, 2], "stop", routed_experts=b64(routed(4, 7))))  # seq 8: [4, 7)
    x = s.extras[ROUTED_EXPERTS]
    assert x.rows == 8 and x.values[:7].tolist() == routed(0, 7).tolist()
    assert (x.values[7] == -1).all()


def test_a_tool_append_leaves_placeholders_the_next_request_fills() -> None:
    s = sample(ROUTED_EXPERTS)
    step(s, body([20, 21], "stop", routed_experts=b64(routed(0, 4))))
    s.status = SampleStatus.PENDING  # a second turn after a tool's tokens
    s.response_ids = np.concatenate([s.response_ids, np.array([30, 31], np.int32)])
    s.logprobs = np.concatenate([s.logprobs, np.zeros(2, np.float32)])
    s.versions = np.concatenate([s.versions, np.zeros(2, np.int64)])
    s.loss_mask = np.concatenate([s.loss_mask, np.zeros(2, np.uint8)])
    s.pad_extras(2)
    s.check()
    assert extras_payload(s)["routed_experts_start_len"] == 4
    step(s, body([40], "stop", routed_experts=b64(routed(4, 7))))
    assert s.extras[ROUTED_EXPERTS].values[:7].tolist() == routed(0, 7).tolist()


@pytest.mark.parametrize("meta, match", [
    ({"routed_experts": b64(routed(0, 3))}, "has 6 values, expected 4 rows"),
    ({}, "routed_experts is missing.*--enable-return-routed-experts"),
    ({"routed_experts": "not base64!"}, "not valid base64"),
])
def test_misaligned_or_missing_routed_experts_are_a_protocol_error(meta: dict[str, Any],
                                                                   match: str) -> None:
    s = sample(ROUTED_EXPERTS)
    with pytest.raises(ExtrasMismatch, match=match):
        step(s, body([20, 21], "length", **meta))
    assert s.response_length == 0 and s.extras == {}  # nothing appended


def test_top_p_kept_ids_from_sglang_and_from_slimes_flat_form() -> None:
    s = sample(TOP_P_TOKEN_IDS)
    assert extras_payload(s) == {"return_sampling_mask": True}
    step(s, body([20, 21], "abort", output_token_sampling_mask=[[20, 3], [21]]))
    s.status = SampleStatus.ABORTED
    step(s, body([22], "length", top_p_kept_token_ids=[22, 8, 9],
                 top_p_kept_token_offsets=[0, 3]))
    x = s.extras[TOP_P_TOKEN_IDS]
    assert x.values.tolist() == [20, 3, 21, 22, 8, 9] and x.offsets().tolist() == [0, 2, 3, 6]
    s2 = sample(TOP_P_TOKEN_IDS)
    with pytest.raises(ExtrasMismatch, match="has 1 rows but 2 tokens"):
        step(s2, body([20, 21], "length", output_token_sampling_mask=[[20]]))
    with pytest.raises(ExtrasMismatch, match="offsets"):
        step(s2, body([20], "length", top_p_kept_token_ids=[20], top_p_kept_token_offsets=[0]))


def test_a_waiting_abort_without_tokens_needs_no_extras() -> None:
    s = sample(ROUTED_EXPERTS, TOP_P_TOKEN_IDS)
    b = body([], "abort")
    b["meta_info"]["finish_reason"]["message"] = "Abort in waiting queue"
    step(s, b)
    assert s.extras == {}
    assert extras_payload(s)["routed_experts_start_len"] == 0


def lease(gen: int = 0, resume: int = -1) -> Lease:
    name = TaskName(key="c000000000000.000000000003", id="i000000000003", gen=gen, attempts=1,
                    resume=resume, producer="p-x")
    return Lease(name, {"index": 3, "id": "i000000000003", "row": {"prompt": P}})


def test_a_partial_keeps_each_samples_extras_and_gives_them_back() -> None:
    params = [SamplerParams(max_new_tokens=10) for _ in range(3)]
    run = GroupRun.fresh(lease(), P, params)
    run.want_extras((ROUTED_EXPERTS, TOP_P_TOKEN_IDS), (1, 2))
    step(run.samples[0], body([20, 2], "stop", routed_experts=b64(routed(0, 4)),
                              output_token_sampling_mask=[[20], [2, 9]]))
    step(run.samples[1], body([21], "abort", routed_experts=b64(routed(0, 3)),
                              output_token_sampling_mask=[[21, 1]]))
    # sample 2 got nothing yet: placeholder rows in the record
    data = b"".join(run.to_group(producer="p-x", version_hint=0, partial=True).encode())
    g = decode_group(data)
    assert g.extras[ROUTED_EXPERTS].rows == (3 + 2) + (3 + 1) + 3
    back = GroupRun.from_partial(lease(gen=1, resume=0), g, lambda i: params[i])
    back.want_extras((ROUTED_EXPERTS, TOP_P_TOKEN_IDS), (1, 2))
    s1 = back.samples[1]
    assert s1.extras[ROUTED_EXPERTS].values[:3].tolist() == routed(0, 3).tolist()
    assert extras_payload(s1)["routed_experts_start_len"] == 3
    step(s1, body([22, 2], "stop", routed_experts=b64(routed(3, 5)),
                  output_token_sampling_mask=[[22], [2]]))
    assert s1.extras[ROUTED_EXPERTS].values[:5].tolist() == routed(0, 5).tolist()
    assert s1.extras[TOP_P_TOKEN_IDS].values.tolist() == [21, 1, 22, 2]
    s2 = back.samples[2]
    assert extras_payload(s2)["routed_experts_start_len"] == 0  # all placeholders
    assert Sample.from_dict(s1.to_dict()).extras[ROUTED_EXPERTS].values.tolist() == \
        s1.extras[ROUTED_EXPERTS].values.tolist()


def test_config_lists_only_known_generated_extras() -> None:
    base = {"run_dir": "r", "plugins": {"reward": "a.b"}, "engine": {"workers": ["http://w"]}}
    assert ProducerConfig.from_dict({**base, "record": {"extras": ["routed_experts"]}}
                                    ).record.extras == ("routed_experts",)
    with pytest.raises(ConfigError, match="unknown per-token extra 'experts'"):
        ProducerConfig.from_dict({**base, "record": {"extras": ["experts"]}})
    with pytest.raises(ConfigError, match="teacher_logprobs in extras needs a teacher_url"):
        ProducerConfig.from_dict({**base, "record": {"extras": ["teacher_logprobs"]}})
    record = {"extras": ["teacher_logprobs"], "teacher_url": "http://t"}
    assert ProducerConfig.from_dict({**base, "record": record}).record.teacher_url == "http://t"


def test_teacher_answers_must_line_up_with_the_response() -> None:
    s = sample()
    step(s, body([20, 21], "stop"))
    ids, params, extra = teacher_payload(s)
    assert ids == [*P, 20, 21] and params["max_new_tokens"] == 0
    assert extra == {"logprob_start_len": 2}  # SGLang leaves the first entry's log-prob out

    def scored(entries: list[Any]) -> Any:
        b = body([], "length", input_token_logprobs=entries)
        return parse_teacher(parse_generate_response(b), s)

    assert scored([[None, 7, None], [-0.5, 20, None], [-1.5, 21, None]]).values.tolist() == [
        -0.5, -1.5]
    with pytest.raises(ExtrasMismatch, match="has 2 entries, expected 3"):
        scored([[None, 7, None], [-0.5, 20, None]])
    with pytest.raises(ExtrasMismatch, match="expected a log-prob of token 21"):
        scored([[None, 7, None], [-0.5, 20, None], [-1.5, 22, None]])
    with pytest.raises(ExtrasMismatch, match="not a finite value"):
        scored([[None, 7, None], [-0.5, 20, None], [None, 21, None]])


def test_a_reply_whose_extras_do_not_line_up_fails_its_sample_never_trained(
        tmp_path: Any, sim_engine: Any) -> None:
    """The sim engine routes [2 layers, top-2]; a producer told [3, 3] finds every reply
    misaligned: each sample fails with the engine-protocol error, nothing is trained."""
    q = make_run(str(tmp_path / "run"), 0, rows=[{"prompt": [4, 5]}])
    p = Producer(ProducerConfig(
        run_dir=str(tmp_path / "run"),
        engine=EngineConfig(workers=(sim_engine.url,)),
        plugins=PluginsConfig(reward="tests.producers.plugins_for_tests.length_reward"),
        sampling=SamplerParams(max_new_tokens=8),
        budget=BudgetConfig(slots=1),
        record=RecordConfig(extras=(ROUTED_EXPERTS,), routed_experts_shape=(3, 3)),
        timing=TimingConfig(control_poll_s=0.02, idle_poll_s=0.02)))
    asyncio.run(run_producers([p], lambda: wait_for(lambda: bool(names(q, "dropped")), 30,
                                                    "dropped")))
    (dropped,) = names(q, "dropped")
    assert dropped.producer == "sample_failed" and not names(q, "ready")
    note = records.decode(q.storage.read(note_key(dropped.id, dropped.gen, "drop",
                                                  "sample_failed")))
    assert "engine protocol error" in str(note.meta) and "routed_experts" in str(note.meta)
    assert p.stats().engine_faults == 4


def test_an_unreachable_teacher_fails_the_samples_never_made_up_values(
        tmp_path: Any, sim_engine: Any) -> None:
    q = make_run(str(tmp_path / "run"), 0, rows=[{"prompt": [4, 5]}])
    p = Producer(ProducerConfig(
        run_dir=str(tmp_path / "run"),
        engine=EngineConfig(workers=(sim_engine.url,),
                            client=ClientConfig(max_retries=0, connect_timeout_s=2.0)),
        plugins=PluginsConfig(reward="tests.producers.plugins_for_tests.length_reward"),
        sampling=SamplerParams(max_new_tokens=8),
        budget=BudgetConfig(slots=1),
        record=RecordConfig(extras=("teacher_logprobs",),
                            teacher_url=f"http://127.0.0.1:{free_port()}"),
        timing=TimingConfig(control_poll_s=0.02, idle_poll_s=0.02)))
    asyncio.run(run_producers([p], lambda: wait_for(lambda: bool(names(q, "dropped")), 30,
                                                    "dropped")))
    (dropped,) = names(q, "dropped")
    assert dropped.producer == "sample_failed" and not names(q, "ready")
    note = records.decode(q.storage.read(note_key(dropped.id, dropped.gen, "drop",
                                                  "sample_failed")))
    assert "teacher" in str(note.meta)
