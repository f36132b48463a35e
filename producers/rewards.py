"""Built-in rewards and filters.

* ``math_answer`` — exact or numeric match of a final answer against the task's label,
  read from ``\\boxed{...}`` or a trailing ``#### answer`` line.
* ``count_task`` — the demo's task (see ``demo_task``): emit the target token exactly
  ``k`` times, then stop. Rewarded by how close the response comes.
* ``difficulty_task`` — the lab's task of fixed difficulty: each response is solved with
  the row's probability ``p_solve``, decided by a hash of its tokens (all-solved and
  all-failed rows give groups whose rewards all agree).
* ``zero_variance`` — the DAPO filter: drop a group whose rewards are all equal (it
  carries no GRPO signal).

Text-based rewards need the response decoded; the local engines' detokenizer is plain
(``strawq.producers.engines``), real deployments pass text through the task's tokenizer in the
reward plugin itself.
"""

from __future__ import annotations

import hashlib
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
    """The demo task: write exactly ``count`` (k) tokens, then stop (EOS).

    Reward = max(0, 1 - |L - k| / max(k, 4)), L = tokens before the EOS (or all of them
    when the response never stopped). What the model emits decides when it stops, so a
    fresh model's lengths are long-tailed (it rarely samples EOS) and a trained one's follow
    k — whose own distribution has a long tail (see ``strawq.demo.task``).
    """
    row = task.get("row", task)
    k = int(row["count"])
    eos = int(row.get("eos", 2))
    stopped = bool(response_ids) and response_ids[-1] == eos
    length = len(response_ids) - 1 if stopped else len(response_ids)
    return max(0.0, 1.0 - abs(length - k) / max(k, 4))


def solve_draw(response_ids: list[int]) -> float:
    """A uniform number in [0, 1) that is a pure function of the response's tokens."""
    data = b"".join(int(t).to_bytes(8, "little", signed=True) for t in response_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") / 2.0 ** 64


def difficulty_task(task: dict[str, Any], response_ids: list[int],
                    meta: dict[str, Any]) -> float:
    """A task of fixed difficulty (``strawq lab``'s history case): 1.0 when the response
    "solves" the row, with probability ``task['row']['p_solve']``, else 0.0.

    Whether it solves is decided by ``solve_draw(response_ids) < p_solve``, so it is
    deterministic: the same response always gets the same reward. A row at ``p_solve`` 0
    (never solved) or 1 (always solved) gives a group whose rewards all agree, on every
    pass; a row in between agrees only by chance (``p^G + (1 - p)^G``).
    """
    row = task.get("row", task)
    p = float(row["p_solve"])
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"difficulty_task: p_solve must be in [0, 1], got {p}")
    return 1.0 if solve_draw(response_ids) < p else 0.0


def zero_variance(task: dict[str, Any], rewards: list[float]) -> str | None:
    """Drop groups whose rewards are all equal (reason ``zero_variance``)."""
    if len(rewards) > 1 and max(rewards) - min(rewards) < 1e-12:
        return "zero_variance"
    return None
