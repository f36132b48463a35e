"""Built-in rewards and filters.

* ``math_answer`` — exact or numeric match of a final answer against the task's label,
  read from ``\\boxed{...}`` or a trailing ``#### answer`` line.
* ``count_task`` — the demo's task (see ``demo_task``): emit the target token exactly
  ``k`` times, then stop. Rewarded by how close the response comes.
* ``zero_variance`` — the DAPO filter: drop a group whose rewards are all equal (it
  carries no GRPO signal).

Text-based rewards need the response decoded; the local engines' detokenizer is plain
(``producers.engines``), real deployments pass text through the task's tokenizer in the
reward plugin itself.
"""

from __future__ import annotations

import math
import re
from typing import Any

_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_HASHES = re.compile(r"####\s*([^\n]+)")
_NUM = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")


def extract_answer(text: str) -> str | None:
    """The final answer in ``text``: the last ``\\boxed{}``, else the last ``#### x``."""
    boxed = _BOXED.findall(text)
    if boxed:
        return str(boxed[-1]).strip()
    hashes = _HASHES.findall(text)
    if hashes:
        return str(hashes[-1]).strip()
    return None


def _normalise(ans: str) -> str:
    ans = ans.strip().strip("$").replace(",", "").replace(" ", "")
    return ans.rstrip(".")


def answers_match(pred: str | None, label: Any) -> bool:
    if pred is None or label is None:
        return False
    a, b = _normalise(str(pred)), _normalise(str(label))
    if a == b:
        return True
    if _NUM.match(a) and _NUM.match(b):
        x, y = float(a), float(b)
        return math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9)
    return False


def math_answer(task: dict[str, Any], response_ids: list[int], meta: dict[str, Any]) -> float:
    """1.0 when the response's final answer matches ``task['row']['answer']`` (or label)."""
    row = task.get("row", task)
    label = row.get("answer", row.get("label"))
    text = meta.get("text")
    if text is None:
        raise ValueError("math_answer needs the response text in sample meta['text']")
    return 1.0 if answers_match(extract_answer(str(text)), label) else 0.0


def count_task(task: dict[str, Any], response_ids: list[int], meta: dict[str, Any]) -> float:
    """The demo task: the row holds ``target`` (a token id) and ``count`` (k).

    Reward = fraction of the first k tokens equal to ``target`` (0..0.5) + 0.5 when the
    response stops right after them (EOS at k, or exactly k tokens). A model that never
    stops earns at most 0.5; the tail of long responses is what the task teaches away.
    """
    row = task.get("row", task)
    target, k = int(row["target"]), int(row["count"])
    eos = int(row.get("eos", 0))
    body = [t for t in response_ids if t != eos]
    stopped = bool(response_ids) and response_ids[-1] == eos
    hits = sum(1 for t in body[:k] if t == target)
    length_ok = len(body) == k and (stopped or len(response_ids) == k)
    return 0.5 * hits / k + (0.5 if length_ok and hits == k else 0.0)


def zero_variance(task: dict[str, Any], rewards: list[float]) -> str | None:
    """Drop groups whose rewards are all equal (reason ``zero_variance``)."""
    if len(rewards) > 1 and max(rewards) - min(rewards) < 1e-12:
        return "zero_variance"
    return None
