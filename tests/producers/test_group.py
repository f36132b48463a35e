"""Pure logic: rebuilding samples from a partial record, packing, and the reconcile plan."""

from __future__ import annotations

import numpy as np
import pytest

from strawq.errors import ConfigError
from strawq.ondisk.names import TaskName
from strawq.producers.group import GroupRun, TaskError, prompt_ids_of, sample_seed
from strawq.producers.producer_config import EngineConfig, PluginsConfig, ProducerConfig
from strawq.producers.sample import SampleError, SamplerParams, SampleStatus, Segment, apply_segment
from strawq.tasks.queue import Lease


def lease(gen: int = 0, resume: int = -1) -> Lease:
    name = TaskName(key="c000000000000.000000000003", id="i000000000003", gen=gen, attempts=1,
                    resume=resume, producer="p-x")
    return Lease(name, {"index": 3, "id": "i000000000003", "row": {"prompt": [5, 6]}})


def seg(tokens: list[int], version: int, kind: str) -> Segment:
    n = len(tokens)
    return Segment(token_ids=np.array(tokens, np.int32), logprobs=-np.ones(n, np.float32) / 2,
                   versions=np.full(n, version, np.int64), finish_reason={"type": kind})


def test_partial_round_trip_keeps_finished_and_resumes_the_rest() -> None:
    params = [SamplerParams(max_new_tokens=6, seed=sample_seed(1, 3, i)) for i in range(3)]
    run = GroupRun.fresh(lease(), [5, 6], params)
    apply_segment(run.samples[0], seg([7, 8, 2], 0, "stop"))
    apply_segment(run.samples[1], seg([9, 9], 0, "abort"))
    run.rewards[0] = 0.5
    run.texts[1] = " 9 9"
    partial = run.to_group(producer="p-x", version_hint=0, partial=True)
    assert partial.status == ["completed", "aborted", "pending"]
    assert partial.rewards == [0.5, None, None]

    back = GroupRun.from_partial(lease(gen=1, resume=0), partial, lambda i: params[i])
    assert back.samples[0].is_final and back.rewards[0] == 0.5
    assert back.samples[1].status is SampleStatus.ABORTED
    assert back.samples[1].remaining_budget() == 4  # never more than max_new_tokens
    assert back.samples[1].params.seed == params[1].seed
    assert back.unfinished() == [1, 2] and back.texts[1] == " 9 9"
    apply_segment(back.samples[1], seg([4, 4, 4, 2], 1, "stop"))
    apply_segment(back.samples[2], seg([3], 1, "stop"))
    back.rewards[1:] = [1.0, 0.0]
    ready = back.to_group(producer="p-y", version_hint=1, partial=False, mask_offpolicy=True)
    assert ready.sample_lens == [3, 6, 1]
    s1 = ready.sample(1)
    assert s1["tokens"].tolist() == [9, 9, 4, 4, 4, 2]
    assert s1["versions"].tolist() == [0, 0, 1, 1, 1, 1]
    assert s1["loss_mask"].tolist() == [0, 0, 1, 1, 1, 1]  # off-policy prefix masked
    assert ready.sample(0)["loss_mask"].tolist() == [1, 1, 1]
    assert ready.min_version() == 0 and ready.num_versions() == 2
    assert "texts" not in ready.meta


def test_reward_failure_marks_the_sample_failed() -> None:
    run = GroupRun.fresh(lease(), [5], [SamplerParams(max_new_tokens=4)] * 2)
    for s in run.samples:
        apply_segment(s, seg([7, 2], 0, "stop"))
    run.rewards = [None, 1.0]
    run.reward_errors = {0: "ValueError: no"}
    g = run.to_group(producer="p", version_hint=0, partial=False)
    assert g.status == ["failed", "completed"] and g.rewards == [None, 1.0]
    assert g.meta["reward_errors"] == {"0": "ValueError: no"}


def test_rid_prefixes_never_prefix_each_other() -> None:
    a, b = GroupRun.fresh(lease(gen=1), [5], [SamplerParams(max_new_tokens=1)]), \
        GroupRun.fresh(lease(gen=10), [5], [SamplerParams(max_new_tokens=1)])
    ra, rb = a.rid_prefix("p-1"), b.rid_prefix("p-1")
    assert not rb.startswith(ra) and not ra.startswith(rb)
    assert a.next_rid("p-1", 0).startswith(ra) and not "p-10/x".startswith("p-1/")


def test_prompt_and_row_overrides() -> None:
    task = {"id": "t", "row": {"prompt": "ab"}}
    with pytest.raises(TaskError, match="tokenizer"):
        prompt_ids_of(task, "prompt", None)
    assert prompt_ids_of(task, "prompt", lambda s: [ord(c) for c in s]) == [97, 98]
    with pytest.raises(TaskError, match="non-empty"):
        prompt_ids_of({"row": {"prompt": []}}, "prompt", None)
    cfg = ProducerConfig(
        run_dir="r",
        engine=EngineConfig(workers=("http://u:1",)),
        plugins=PluginsConfig(reward="a.b"),
        sampling=SamplerParams(max_new_tokens=9))
    p = cfg.sampler_params({"max_new_tokens": 3, "temperature": 0.0}, seed=4)
    assert (p.max_new_tokens, p.temperature, p.seed) == (3, 0.0, 4)
    with pytest.raises(ConfigError):
        cfg.sampler_params({"top_p": 2.0})


def test_reconcile_plan() -> None:
    placement = pytest.importorskip("strawq.producers.placement")
    NodeView, plan = placement.NodeView, placement.plan
    nodes = [NodeView("n2", "10.0.0.2", 4), NodeView("n1", "10.0.0.1", 8),
             NodeView("head", "10.0.0.0", 0), NodeView("gone", "10.0.0.9", 8, alive=False)]
    p = plan(nodes, ["n1", "gone"], min_cpus=1, concurrency=64, engines=2, group_size=8)
    assert p.start == ["n2"] and p.retire == ["gone"]
    assert p.slots == {"n1": 8, "n2": 8}  # K = 128 // 8 = 16 -> divmod(16, 2)
    p = plan(nodes[:2] + [NodeView("n3", "10.0.0.3", 1)], [], min_cpus=1, concurrency=10,
             engines=2, group_size=4)
    assert list(p.slots.values()) == [2, 2, 1]  # K = 5 -> divmod(5, 3): first one +1 each
    with pytest.raises(ConfigError, match="C\\*E = 4\\*1 = 4 < W\\*G = 2\\*4 = 8"):
        plan(nodes, [], min_cpus=1, concurrency=4, engines=1, group_size=4)
    with pytest.raises(ConfigError, match="no eligible"):
        plan(nodes[2:], [], min_cpus=1, concurrency=4, engines=1, group_size=4)


def test_a_partial_with_damaged_sampling_params_is_a_sample_error() -> None:
    """The runner fails such a task as ``bad_task`` (it catches SampleError): the params'
    own ConfigError must not escape as another error."""
    params = [SamplerParams(max_new_tokens=6) for _ in range(2)]
    run = GroupRun.fresh(lease(), [5, 6], params)
    apply_segment(run.samples[0], seg([9, 9], 0, "abort"))
    partial = run.to_group(producer="p-x", version_hint=0, partial=True)
    partial.meta["params"][0]["top_k"] = 0
    with pytest.raises(SampleError, match=r"sample 0: .*top_k must be -1"):
        GroupRun.from_partial(lease(gen=1, resume=0), partial, lambda i: params[i])
