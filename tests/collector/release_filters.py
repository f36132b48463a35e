"""Mixture source filters for the release combinations (``tests/collector/release_driver.py``):
each ``filter(task, rewards) -> reason | None`` decides by the rewards alone, so the release
model can say what it does to any row."""

from __future__ import annotations

from typing import Any


def drop_solved(task: dict[str, Any], rewards: list[float]) -> str | None:
    """Too easy: every reward 1."""
    return "too_easy" if rewards and all(r == 1.0 for r in rewards) else None


def drop_failed(task: dict[str, Any], rewards: list[float]) -> str | None:
    """Too hard: every reward 0."""
    return "too_hard" if rewards and all(r == 0.0 for r in rewards) else None


def drop_all(task: dict[str, Any], rewards: list[float]) -> str | None:
    """Every group of the source."""
    return "filtered_all"


#: the filters by name (a scenario names one per source)
FILTERS = {"drop_solved": drop_solved, "drop_failed": drop_failed, "drop_all": drop_all}
