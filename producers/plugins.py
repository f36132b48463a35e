"""Extension points named by dotted path: reward functions and group filters.

A user's function is resolved and signature-checked at start-up (slime's
``--*-function-path``), not at the first sample, so a typo fails the launch with a message
that says what was expected. ``check_reward_fn`` / ``check_filter_fn`` are the contract
tests a user can run on their own function.

Contracts::

    reward(task: dict, response_ids: list[int], sample_meta: dict) -> float
    filter(task: dict, rewards: list[float]) -> str | None   # a drop reason, or None to keep
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable
from typing import Any

from strawq.errors import ConfigError

RewardFn = Callable[[dict[str, Any], list[int], dict[str, Any]], float]
FilterFn = Callable[[dict[str, Any], list[float]], "str | None"]


def resolve(path: str, *, what: str, arity: int) -> Callable[..., Any]:
    """Import ``pkg.module:attr`` or ``pkg.module.attr`` and check it takes ``arity`` args."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{what}: expected a dotted path like 'mypkg.rewards.score', got "
                          f"{path!r}")
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{what}: {path!r} is not 'module.function' or 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{what}: cannot import module {module_name!r} ({exc}); is it on "
                          "PYTHONPATH on every node?") from exc
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ConfigError(f"{what}: {module_name!r} has no callable {attr!r}")
    try:
        sig = inspect.signature(fn)
        sig.bind(*([None] * arity))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what}: {path} must accept {arity} positional arguments; its "
                          f"signature is {sig if 'sig' in locals() else '?'} ({exc})") from exc
    return fn  # type: ignore[no-any-return]


def load_reward(path: str) -> RewardFn:
    return resolve(path, what="reward function", arity=3)


def load_filter(path: str | None) -> FilterFn | None:
    return None if path is None else resolve(path, what="filter function", arity=2)


def check_reward_fn(fn: RewardFn, task: dict[str, Any], response_ids: list[int]) -> float:
    """Call a reward function once and check it returns a finite float."""
    value = fn(task, response_ids, {})
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"reward function returned {value!r}; expected a finite float")
    return float(value)


def check_filter_fn(fn: FilterFn, task: dict[str, Any], rewards: list[float]) -> str | None:
    """Call a filter once and check it returns None or a valid reason string."""
    from strawq.names import validate_id

    out = fn(task, rewards)
    if out is not None:
        validate_id(out, "filter drop reason")
    return out
