"""User code named by dotted path (``pkg.module.attr`` or ``pkg.module:attr``), resolved
and signature-checked when a part starts, so a typo fails the launch with a message that
says what was expected (``strawq.producers.plugins``, the mixture's filters).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from strawq.errors import ConfigError


def import_attr(path: str, *, what: str) -> Any:
    """The object at ``pkg.module:attr`` or ``pkg.module.attr``."""
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
    if not hasattr(module, attr):
        raise ConfigError(f"{what}: {module_name!r} has no callable {attr!r}")
    return getattr(module, attr)


def resolve(path: str, *, what: str, arity: int) -> Callable[..., Any]:
    """Import ``pkg.module:attr`` or ``pkg.module.attr`` and check it takes ``arity`` args."""
    fn = import_attr(path, what=what)
    if not callable(fn):
        raise ConfigError(f"{what}: {path!r} is a {type(fn).__name__}, not a callable")
    try:
        sig = inspect.signature(fn)
        sig.bind(*([None] * arity))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what}: {path} must accept {arity} positional arguments; its "
                          f"signature is {sig if 'sig' in locals() else '?'} ({exc})") from exc
    return fn  # type: ignore[no-any-return]
