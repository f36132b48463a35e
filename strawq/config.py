"""Configuration of one queue run: a frozen, keyword-only, validated dataclass.

Unknown keys are rejected with the list of known ones (``from_dict``); every field is
documented where it is declared.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from strawq.errors import ConfigError

T = TypeVar("T")


def from_dict(cls: type[T], data: Mapping[str, Any], *, where: str = "") -> T:
    """Build a config dataclass from a mapping, refusing unknown keys by name."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or cls.__name__}: expected a mapping, found "
                          f"{type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where or cls.__name__}: unknown key(s) {unknown}; known keys are "
                          f"{sorted(fields)}")
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        _check_type(f"{where or cls.__name__}.{key}", value, hints[key])
    return cls(**data)


def _check_type(where: str, value: Any, hint: Any) -> None:
    """Refuse values of the wrong type (JSON gives strings, floats and bools freely)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        errors = []
        for arg in args:
            try:
                _check_type(where, value, arg)
                return
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{where}: {value!r} matches none of {args}")
    if hint is Any or origin is not None:
        return  # containers and literals: checked by __post_init__ where it matters
    if hint is type(None):
        ok = value is None
    elif hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif isinstance(hint, type):
        ok = isinstance(value, hint)
    else:
        ok = True
    if not ok:
        name = getattr(hint, "__name__", str(hint))
        raise ConfigError(f"{where}: expected {name}, found {type(value).__name__} {value!r}")


def load_config(cls: type[T], path: str | None = None,
                overrides: Sequence[str] | None = None, *, where: str = "") -> T:
    """A config from an optional JSON file plus ``KEY=VALUE`` overrides (the CLIs' --set).

    A value is parsed as JSON when it can be (numbers, booleans, null, lists), else kept as
    a bare string; the result goes through ``from_dict`` (unknown keys and wrong types are
    refused by name).
    """
    data: dict[str, Any] = {}
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{where or cls.__name__}: cannot read {path}: {exc}") from exc
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"{where or cls.__name__}: --set takes KEY=VALUE, got {item!r}")
        try:
            data[key] = json.loads(value)
        except json.JSONDecodeError:
            data[key] = value
    return from_dict(cls, data, where=where)


def to_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)


@dataclass(frozen=True, kw_only=True)
class QueueConfig:
    #: Claims per task before it is dropped with a record (attempts are counted at claim;
    #: ``yield``/``release`` refund theirs).
    max_attempts: int = 3
    #: Seconds without a heartbeat-counter change, on the grantor's monotonic clock,
    #: after which a producer's leases expire and their tasks are re-queued.
    lease_timeout_s: float = 60.0
    #: Producer heartbeat cadence. Producers stop work at ``lease_timeout_s - margin``.
    heartbeat_interval_s: float = 5.0
    #: Prompts released per cursor advance (one cursor record per release).
    release_batch: int = 64
    #: Key of the prompt in a dataset row (a string or a list of token ids).
    prompt_key: str = "prompt"
    #: Samples per prompt group (G), recorded for readers and ``strawq status``.
    group_size: int = 8
    #: fsync files and directories (turn off only for throwaway benchmarks).
    fsync: bool = True

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.lease_timeout_s <= 0:
            raise ConfigError(f"lease_timeout_s must be > 0, got {self.lease_timeout_s}")
        if not 0 < self.heartbeat_interval_s < self.lease_timeout_s:
            raise ConfigError(
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) must be > 0 and below "
                f"lease_timeout_s ({self.lease_timeout_s}); use about a third of it")
        if self.release_batch < 1:
            raise ConfigError(f"release_batch must be >= 1, got {self.release_batch}")
        if self.group_size < 1:
            raise ConfigError(f"group_size must be >= 1, got {self.group_size}")
        if not self.prompt_key:
            raise ConfigError("prompt_key must be a non-empty string")
