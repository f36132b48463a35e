"""Reward functions written the way slime and verl users write them, for the adapter tests,
and strawq rewards that show what the producer hands a reward."""

from __future__ import annotations

import asyncio
from typing import Any


async def async_text_length(task: dict[str, Any], response_ids: list[int],
                            meta: dict[str, Any]) -> float:
    """An async reward: the length of the response text it was given."""
    await asyncio.sleep(0)
    return float(len(meta["text"]))


# -- slime: --custom-rm-path functions take (args, sample) --------------------------------
async def slime_custom_rm(args: Any, sample: Any) -> dict[str, float]:
    from slime.utils.types import Sample

    assert isinstance(sample, Sample)
    correct = sample.response.strip().endswith(str(sample.label))
    return {"acc": float(correct) * args.scale, "len": float(sample.response_length)}


def slime_sync_rm(args: Any, sample: Any) -> float:
    return float(len(sample.tokens))


# -- verl: compute_score(data_source, solution_str, ground_truth, extra_info=None) ----------
def verl_compute_score(data_source: str, solution_str: str, ground_truth: str,
                       extra_info: dict[str, Any] | None = None) -> dict[str, Any]:
    if data_source != "openai/gsm8k":
        raise NotImplementedError(f"no scorer for {data_source}")
    answer = solution_str.split("####")[-1].strip()
    bonus = (extra_info or {}).get("bonus", 0.0)
    return {"score": (1.0 if answer == ground_truth else 0.0) + bonus, "pred": answer}


def verl_old_style(data_source: str, solution_str: str, ground_truth: str) -> float:
    return float(ground_truth in solution_str)


async def verl_async_score(data_source: str, solution_str: str, ground_truth: str,
                           extra_info: dict[str, Any] | None = None) -> float:
    await asyncio.sleep(0)
    return 0.5


def length_at_least(*, threshold: int) -> Any:
    """A reward factory whose argument is required and keyword-only (``reward_args``)."""
    def reward(task: dict[str, Any], response_ids: list[int], meta: dict[str, Any]) -> float:
        return float(len(response_ids) >= threshold)
    return reward
