"""Extension points named by dotted path: reward functions and group filters.

A user's function is resolved and signature-checked at start-up (slime's
``--*-function-path``), not at the first sample, so a typo fails the launch with a message
that says what was expected. ``check_reward_fn`` / ``check_filter_fn`` are the contract
tests a user can run on their own function.

Contracts::

    reward(task: dict, response_ids: list[int], sample_meta: dict) -> float   # or async def
    filter(task: dict, rewards: list[float]) -> str | None   # a drop reason, or None to keep
    tokenizer: "hf:<dir or name>", or a dotted path to (text) -> list[int], or to an object /
               class with encode_prompt(prompt, row) and decode(ids) (strawq.data.tokenize)

With ``reward_args`` the reward path names a *factory*: it is called once with those keyword
arguments and returns the reward function (``strawq.producers.reward_remote.remote_reward``,
``strawq.producers.reward_slime.slime_rm``, ``strawq.producers.reward_verl.verl_score``).
An async reward runs on the producer's event loop; a plain one on the reward threads.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from strawq.data.tokenize import FunctionTokenizer, HFTokenizer, PromptTokenizer
from strawq.dotted import import_attr as import_attr  # re-exported: the plugins' API
from strawq.dotted import resolve as resolve
from strawq.errors import ConfigError
from strawq.producers.offload import Offload

RewardFn = Callable[[dict[str, Any], list[int], dict[str, Any]], "float | Awaitable[float]"]
FilterFn = Callable[[dict[str, Any], list[float]], "str | None"]


def resolve_with_args(path: str, args: Mapping[str, Any] | None, *, what: str, arity: int,
                      args_key: str, takes: str) -> Any:
    """The callable at ``path`` taking ``arity`` positional arguments; with ``args``, what
    the factory at ``path`` returns when called with them (checked the same way). Errors
    name ``what`` (e.g. "reward"), the config key ``args_key`` and the expected ``takes``."""
    if args is None:
        return resolve(path, what=f"{what} function", arity=arity)
    factory = import_attr(path, what=f"{what} factory")
    if not callable(factory):
        raise ConfigError(f"{what} factory: {path!r} is a {type(factory).__name__}, "
                          "not a callable")
    try:
        fn = factory(**args)
    except (TypeError, ValueError, ConfigError) as exc:
        raise ConfigError(f"{what} factory {path}: bad {args_key} {sorted(args)}: "
                          f"{exc}") from exc
    try:
        inspect.signature(fn).bind(*([None] * arity))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what} factory {path} returned {fn!r}, which does not take "
                          f"{takes}: {exc}") from exc
    return fn


def load_reward(path: str, args: Mapping[str, Any] | None = None) -> RewardFn:
    """The reward function at ``path``; with ``args``, what the factory at ``path`` returns
    when called with them."""
    fn: RewardFn = resolve_with_args(path, args, what="reward", arity=3, args_key="reward_args",
                                     takes="(task, response_ids, sample_meta)")
    return fn


def is_async(fn: Any) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))  # noqa: B004 - a callable object's method


def finite_reward(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"reward function returned {value!r}; expected a finite float")
    return float(value)


async def call_reward(fn: RewardFn, threads: Offload, task: dict[str, Any],
                      response_ids: list[int], meta: dict[str, Any],
                      decode: Callable[[list[int]], str] | None = None) -> float:
    """Call a reward (async on the loop, plain on ``threads``) and check its value.

    With ``decode``, ``meta['text']`` is the decoded response ids (what the trainer trains
    on: generated turns and appended tokens alike); decoding runs on ``threads``. Without
    it (no tokenizer, or one that cannot decode) the producer passes no ``text``
    (``GroupRun.sample_meta``): never the engine's segment texts stitched together, which
    split characters and merges at every resume and leave out appended tokens. A reward
    that needs text says so (``math_answer``, ``verl_score``, ``slime_rm`` raise: the
    sample's reward fails with that message)."""
    if decode is not None:
        meta = {**meta, "text": await threads.call(decode, response_ids)}
    if is_async(fn):
        value: Any = await fn(task, response_ids, meta)  # type: ignore[misc]
    else:
        value = await threads.call(fn, task, response_ids, meta)
        if inspect.isawaitable(value):
            value = await value
    return finite_reward(value)


def load_tokenizer(spec: str | None, args: Mapping[str, Any] | None = None
                   ) -> PromptTokenizer | None:
    """``hf:<dir or hub name>`` (``HFTokenizer(source, **args)``), or a dotted path to a
    ``(text) -> ids`` function, a tokenizer object, or a class / factory called with args."""
    if spec is None:
        return None
    args = dict(args or {})
    if spec.startswith("hf:"):
        try:
            return HFTokenizer(spec[3:], **args)
        except TypeError as exc:
            raise ConfigError(f"tokenizer {spec}: bad tokenizer_args: {exc}") from exc
    obj = import_attr(spec, what="tokenizer")
    if inspect.isclass(obj) or args:
        try:
            obj = obj(**args)
        except TypeError as exc:
            raise ConfigError(f"tokenizer {spec}: bad tokenizer_args: {exc}") from exc
    if isinstance(obj, PromptTokenizer):
        return obj
    if callable(obj):
        return FunctionTokenizer(obj)
    raise ConfigError(f"tokenizer {spec}: expected a (text) -> ids function or an object with "
                      f"encode_prompt(prompt, row) and decode(ids), found {type(obj).__name__}")


def load_filter(path: str | None) -> FilterFn | None:
    return None if path is None else resolve(path, what="filter function", arity=2)


def check_reward_fn(fn: RewardFn, task: dict[str, Any], response_ids: list[int],
                    sample_meta: dict[str, Any] | None = None) -> float:
    """Call a reward function (plain or async) once and check it returns a finite float."""
    value: Any = fn(task, response_ids, dict(sample_meta or {}))
    if inspect.isawaitable(value):
        async def _await() -> Any:
            return await value
        value = asyncio.run(_await())
    try:
        return finite_reward(value)
    except TypeError as exc:
        raise ConfigError(str(exc)) from exc


def check_filter_fn(fn: FilterFn, task: dict[str, Any], rewards: list[float]) -> str | None:
    """Call a filter once and check it returns None or a valid reason string."""
    from strawq.ondisk.names import validate_id

    out = fn(task, rewards)
    if out is not None:
        validate_id(out, "filter drop reason")
    return out
