"""Plugins named by dotted path in the producer tests."""

from __future__ import annotations

from typing import Any


def length_reward(task: dict[str, Any], response_ids: list[int], meta: dict[str, Any]) -> float:
    return float(len(response_ids))


def constant_reward(task: dict[str, Any], response_ids: list[int], meta: dict[str, Any]) -> float:
    return 1.0


def flaky_reward(task: dict[str, Any], response_ids: list[int], meta: dict[str, Any]) -> float:
    """Raises for sample 0 of every group; all samples of rows marked ``boom``."""
    if task["row"].get("boom") or meta["sample_index"] == 0:
        raise RuntimeError("verifier crashed")
    return float(meta["sample_index"])


def char_tokenizer(text: str) -> list[int]:
    return [3 + (ord(c) % 100) for c in text]


def missing_module_reward(task: dict[str, Any], response_ids: list[int],
                          meta: dict[str, Any]) -> float:
    """A reward whose backend is not installed on this node."""
    raise ModuleNotFoundError("No module named 'verifier_backend'")


def stuck_reward(task: dict[str, Any], response_ids: list[int], meta: dict[str, Any]) -> float:
    """A verifier that never answers in time: its samples stay final, unrewarded."""
    import time

    time.sleep(600)
    return 0.0


def hanging_reward(task: dict[str, Any], response_ids: list[int], meta: dict[str, Any]) -> float:
    """A verifier that never answers (an hour): a group waiting for it cannot complete."""
    import time

    time.sleep(3600)
    return 0.0
