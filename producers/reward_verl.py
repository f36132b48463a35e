"""Call a verl ``compute_score``-style function unchanged.

verl's reward managers call ``compute_score(data_source, solution_str, ground_truth,
extra_info)`` on the decoded response and take a number, or a mapping with ``score``.
``PluginsConfig(reward="strawq.producers.reward_verl.verl_score",
reward_args={"path": "my_pkg.scores.compute_score"})`` (the producer's ``plugins`` section)
does the same from a strawq row in
verl's dataset layout:

* ``data_source``  ← ``row["data_source"]``
* ``solution_str`` ← the response ids decoded by the producer's tokenizer
* ``ground_truth`` ← ``row["reward_model"]["ground_truth"]`` (verl's parquet layout), else
  ``row[ground_truth_key]``
* ``extra_info``   ← ``row["extra_info"]`` (passed only when the function takes it)

Without ``path`` it uses ``verl.utils.reward_score.default_compute_score`` (verl installed).
A coroutine function is awaited; a plain one runs on the producer's reward threads.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from strawq.producers.plugins import finite_reward, import_attr


def verl_args(task: Mapping[str, Any], text: str, *,
              ground_truth_key: str = "ground_truth") -> dict[str, Any]:
    row = task.get("row", {})
    row = row if isinstance(row, Mapping) else {}
    rm = row.get("reward_model")
    truth = rm.get("ground_truth") if isinstance(rm, Mapping) and "ground_truth" in rm \
        else row.get(ground_truth_key)
    return {"data_source": row.get("data_source"), "solution_str": text,
            "ground_truth": truth, "extra_info": row.get("extra_info")}


def _score(value: Any) -> float:
    if isinstance(value, Mapping):
        if "score" not in value:
            raise ValueError(f"compute_score returned a mapping without 'score': {sorted(value)}")
        value = value["score"]
    return finite_reward(value)


def verl_score(path: str | None = None, *, ground_truth_key: str = "ground_truth"
               ) -> Callable[..., Any]:
    """Reward factory: ``(task, response_ids, meta) -> float`` (async if ``path`` is)."""
    fn = import_attr(path or "verl.utils.reward_score.default_compute_score",
                     what="verl compute_score")
    if not callable(fn):
        raise ValueError(f"{path} is not callable")
    params = inspect.signature(fn).parameters
    takes_extra = "extra_info" in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def kwargs_for(task: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, Any]:
        if meta.get("text") is None:
            raise ValueError("verl_score needs the decoded response: configure the producer's "
                             "tokenizer")
        kw = verl_args(task, str(meta["text"]), ground_truth_key=ground_truth_key)
        if not takes_extra:
            kw.pop("extra_info")
        return kw

    if inspect.iscoroutinefunction(fn):
        async def areward(task: dict[str, Any], response_ids: list[int],
                          meta: dict[str, Any]) -> float:
            return _score(await fn(**kwargs_for(task, meta)))
        return areward

    def reward(task: dict[str, Any], response_ids: list[int], meta: dict[str, Any]) -> float:
        return _score(fn(**kwargs_for(task, meta)))
    return reward
