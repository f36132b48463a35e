"""Built-in rewards, filters and the plugin loader's start-up checks."""

from __future__ import annotations

import pytest

from strawq.errors import ConfigError
from strawq.producers.plugins import check_filter_fn, check_reward_fn, load_filter, load_reward
from strawq.producers.rewards import (
    answers_match,
    count_task,
    extract_answer,
    math_answer,
    zero_variance,
)


@pytest.mark.parametrize("text,expected", [
    ("so the answer is \\boxed{42}.", "42"),
    ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("work...\n#### 1,234\n", "1,234"),
    ("no answer here", None),
])
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize("pred,label,ok", [
    ("42", 42, True), ("1,234", "1234", True), ("0.5", "1/2", False), ("3.0", "3", True),
    ("$7$", "7", True), ("7.", "7", True), ("8", "7", False), (None, "7", False),
])
def test_answers_match(pred: str | None, label: object, ok: bool) -> None:
    assert answers_match(pred, label) is ok


def test_math_answer_reads_text_and_label() -> None:
    task = {"row": {"prompt": "2+2?", "answer": "4"}}
    assert math_answer(task, [1, 2], {"text": "#### 4"}) == 1.0
    assert math_answer(task, [1, 2], {"text": "\\boxed{5}"}) == 0.0
    with pytest.raises(ValueError, match="text"):
        math_answer(task, [1], {})


def test_count_task_rewards_stopping_at_k() -> None:
    task = {"row": {"prompt": [5], "count": 8, "eos": 2}}
    assert count_task(task, [7] * 8 + [2], {}) == 1.0
    assert count_task(task, [7] * 10 + [2], {}) == pytest.approx(0.75)   # two too many
    assert count_task(task, [7] * 6, {}) == pytest.approx(0.75)          # truncated early
    assert count_task(task, [7] * 40, {}) == 0.0                          # never stopped
    short = {"row": {"count": 2, "eos": 2}}
    assert count_task(short, [2], {}) == pytest.approx(0.5)               # |0-2| / max(2, 4)


def test_zero_variance_filter() -> None:
    assert zero_variance({}, [1.0, 1.0, 1.0]) == "zero_variance"
    assert zero_variance({}, [0.0, 1.0]) is None
    assert zero_variance({}, [1.0]) is None


def test_plugins_resolve_and_check() -> None:
    fn = load_reward("strawq.producers.rewards.count_task")
    assert check_reward_fn(fn, {"row": {"count": 1, "eos": 2}}, [1, 2]) == 1.0
    flt = load_filter("strawq.producers.rewards:zero_variance")
    assert flt is not None and check_filter_fn(flt, {}, [1.0, 1.0]) == "zero_variance"
    assert load_filter(None) is None


@pytest.mark.parametrize("path,msg", [
    ("nope.module.fn", "cannot import"),
    ("strawq.producers.rewards.missing", "no callable"),
    ("strawq.producers.rewards.extract_answer", "3 positional"),
    ("", "dotted path"),
])
def test_plugins_refuse_bad_paths(path: str, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        load_reward(path)


def test_reward_contract_rejects_non_float() -> None:
    with pytest.raises(ConfigError, match="finite float"):
        check_reward_fn(lambda t, r, m: float("nan"), {}, [])
    with pytest.raises(ConfigError, match="finite float"):
        check_reward_fn(lambda t, r, m: "1", {}, [])  # type: ignore[arg-type,return-value]


def test_without_a_decoding_tokenizer_the_reward_sees_no_stitched_text() -> None:
    """The segment texts stitched together are not what the trainer trains (a resume splits
    characters and merges; appended tokens have no engine text): without a tokenizer that
    decodes, sample_meta has no text, and a text reward says what is missing."""
    import asyncio

    from strawq.ondisk.names import TaskName
    from strawq.producers.group import GroupRun
    from strawq.producers.offload import Offload
    from strawq.producers.plugins import call_reward
    from strawq.producers.sample import SamplerParams
    from strawq.tasks.queue import Lease

    task = {"id": "i000000000000", "index": 0, "row": {"prompt": [1], "answer": "4"}}
    lease = Lease(TaskName(key="000000000000.000000000000", id="i000000000000", gen=0,
                           attempts=1, producer="p"), task)
    run = GroupRun.fresh(lease, [1], [SamplerParams(max_new_tokens=8)])
    run.texts[0] = "\\boxed{" + "4}"  # what two segments' texts stitched together read
    seen: list[dict[str, object]] = []

    def spy(task: dict[str, object], ids: list[int], meta: dict[str, object]) -> float:
        seen.append(meta)
        return 0.0

    threads = Offload(1, "rw")
    asyncio.run(call_reward(spy, threads, task, [1, 2], run.sample_meta(0)))
    assert "text" not in seen[-1] and seen[-1]["status"] == "pending"
    asyncio.run(call_reward(spy, threads, task, [1, 2], run.sample_meta(0),
                            decode=lambda ids: "ab"))
    assert seen[-1]["text"] == "ab"  # with one: the decoded ids
    with pytest.raises(ValueError, match="text"):
        asyncio.run(call_reward(math_answer, threads, task, [1], run.sample_meta(0)))


def test_the_slime_reward_adapter_refuses_to_score_without_text() -> None:
    pytest.importorskip("slime.utils.types", reason="slime not installed (docs/slime.md)")
    from strawq.producers.reward_slime import make_sample

    task = {"index": 0, "row": {"prompt": "2+2?", "label": "4"}}
    with pytest.raises(ValueError, match="tokenizer"):
        make_sample(task, [1, 2], {"status": "completed"})
    assert make_sample(task, [1, 2], {"text": "4", "status": "completed"}).response == "4"


def test_difficulty_task_solves_with_the_rows_probability_by_the_response() -> None:
    from strawq.producers.rewards import difficulty_task, solve_draw

    responses = [[3 + (i * 31 + k) % 500 for k in range(10)] + [2] for i in range(4000)]
    for p in (0.0, 1.0):  # never / always solved: every group's rewards agree
        task = {"row": {"prompt": [5], "p_solve": p}}
        assert {difficulty_task(task, r, {}) for r in responses} == {p}
    task = {"row": {"prompt": [5], "p_solve": 0.3}}
    got = [difficulty_task(task, r, {}) for r in responses]
    assert set(got) == {0.0, 1.0}
    assert abs(sum(got) / len(got) - 0.3) < 0.03
    assert got == [difficulty_task(task, r, {}) for r in responses]  # deterministic
    assert all(0.0 <= solve_draw(r) < 1.0 for r in responses[:50])
    assert solve_draw([7, 8]) != solve_draw([8, 7])
    with pytest.raises(ValueError, match="p_solve"):
        difficulty_task({"row": {"p_solve": 1.5}}, [3], {})
    assert check_reward_fn(difficulty_task, task, responses[0]) in (0.0, 1.0)
    assert load_reward("strawq.producers.rewards.difficulty_task") is difficulty_task
