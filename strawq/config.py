"""The one configuration base, and the queue's own section.

Every configuration class of the project is a frozen, keyword-only dataclass that inherits
:class:`Config`; sections nest (a field typed with another ``Config`` class) and the root
of a run is :class:`strawq.app.run_config.RunConfig` (torchtitan's job config is the model).

One validation path, run on every construction (``__init__``, ``from_dict``,
``dataclasses.replace``): each field's value is checked against its annotation (``int``,
``float``, ``bool``, ``str``, ``X | None``, ``tuple[X, ...]``, ``Literal[...]``, nested
sections), then the class's :meth:`Config.validate` checks the value rules. Mappings are
turned into configs only by :meth:`Config.from_dict`, which refuses unknown keys by name and
lists the known ones (a key that moved to another section is refused naming its new place:
``Config._moved_keys``); every field is documented where it is declared (a ``#:`` comment
above it, or an entry of a ``Fields:`` block in the class docstring): :func:`field_docs`
reads those, and :func:`keys_help` turns them into the key list that ``--help`` shows for
``--set`` (:func:`add_keys_help`).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import math
import numbers
import re
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

from strawq.errors import ConfigError

if TYPE_CHECKING:
    import argparse

C = TypeVar("C", bound="Config")

_HINTS: dict[tuple[type, str], Any] = {}


class Config:
    """Base of every configuration class: type-checked fields, ``validate``, dict round trip.

    Subclasses are ``@dataclass(frozen=True, kw_only=True)``; they put their value rules in
    :meth:`validate` (raising :class:`ConfigError`; a ``ValueError`` is turned into one) and
    never define ``__post_init__`` or a ``from_dict`` of their own.
    """

    #: Section types that cannot be imported where the class is defined (the root run
    #: config names sections whose modules import Ray or HTTP clients): resolved on first use.
    _lazy_types: ClassVar[Mapping[str, str]] = {}
    #: Keys that moved to another section: old key -> its new spelling. ``from_dict``
    #: refuses an old key with a message naming the new one (docs/changes.md lists them).
    _moved_keys: ClassVar[Mapping[str, str]] = {}

    def __post_init__(self) -> None:
        cls = type(self)
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is f.default:
                continue  # a declared default is valid (and its section type stays unloaded)
            coerced = _check(f"{cls.__name__}.{f.name}", value, _hint(cls, f.name))
            if coerced is not value:
                object.__setattr__(self, f.name, coerced)
        try:
            self.validate()
        except ConfigError:
            raise
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc

    def validate(self) -> None:
        """Value rules across fields (ranges, choices); the types are already checked."""

    @classmethod
    def from_dict(cls: type[C], data: Mapping[str, Any], *, where: str = "") -> C:
        """Build from a mapping (parsed JSON); unknown keys are refused, listing the known."""
        where = where or cls.__name__
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected a mapping, found {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - set(fields))
        moved = [k for k in unknown if k in cls._moved_keys]
        if moved:
            raise ConfigError(f"{where}: " + "; ".join(
                f"{k!r} moved to {cls._moved_keys[k]}" for k in moved)
                + ": write it there instead (docs/changes.md lists the moved keys)")
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; known keys are "
                              f"{sorted(fields)}")
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            hint = _hint(cls, key)
            section = _section_type(hint)
            if section is not None and isinstance(value, Mapping):
                value = section.from_dict(value, where=f"{where}.{key}")
            else:
                value = _check(f"{where}.{key}", value, hint)
            kwargs[key] = value
        missing = sorted(n for n, f in fields.items() if n not in kwargs and f.init
                         and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)
        if missing:
            raise ConfigError(f"{where}: missing required key(s) {missing}")
        try:
            return cls(**kwargs)
        except ConfigError as exc:
            msg = str(exc)
            raise ConfigError(msg if msg.startswith(where) else f"{where}: {msg}") from exc

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (sections as mappings, tuples as lists); ``from_dict`` inverts it."""
        fields = dataclasses.fields(self)  # type: ignore[arg-type]
        return {f.name: _plain(getattr(self, f.name)) for f in fields}


def _plain(value: Any) -> Any:
    if isinstance(value, Config):
        return value.to_dict()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _hint(cls: type, name: str) -> Any:
    """The resolved annotation of one field (cached), importing lazy section types on use."""
    key = (cls, name)
    if key not in _HINTS:
        owner = next(k for k in cls.__mro__ if name in k.__dict__.get("__annotations__", {}))
        annotation = owner.__dict__["__annotations__"][name]
        lazy: Mapping[str, str] = getattr(cls, "_lazy_types", {})
        localns: dict[str, Any] = {}
        for type_name, target in lazy.items():
            if isinstance(annotation, str) and re.search(rf"\b{type_name}\b", annotation):
                module, _, attr = target.partition(":")
                localns[type_name] = getattr(importlib.import_module(module), attr)

        def probe() -> None: ...

        probe.__annotations__ = {name: annotation}
        globalns = vars(sys.modules[owner.__module__])
        _HINTS[key] = typing.get_type_hints(probe, globalns=globalns, localns=localns)[name]
    return _HINTS[key]


def _section_type(hint: Any) -> type[Config] | None:
    """The config class of a section field (``Section`` or ``Section | None``), else None."""
    if isinstance(hint, type) and issubclass(hint, Config):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        found = [a for a in typing.get_args(hint) if isinstance(a, type) and issubclass(a, Config)]
        if len(found) == 1:
            return found[0]
    return None


def _type_name(hint: Any) -> str:
    if hint is type(None):
        return "None"
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "")


#: Config keys that hold secrets: their values are never shown (errors, dumps, reprs).
_SECRET_KEY = re.compile(r"(api_key|secret|password)\W*$")


def is_secret_key(name: str) -> bool:
    """Whether a config key (or an error's ``where`` ending in one) names a secret."""
    return _SECRET_KEY.search(name) is not None


def redact(data: Any) -> Any:
    """``data`` (a config's ``to_dict``) with the values of secret keys replaced."""
    if isinstance(data, Mapping):
        return {k: ("<redacted>" if is_secret_key(str(k)) and v is not None else redact(v))
                for k, v in data.items()}
    if isinstance(data, list):
        return [redact(v) for v in data]
    return data


def _check(where: str, value: Any, hint: Any) -> Any:
    """Refuse a value of the wrong type; return it (a list for a tuple field as a tuple).

    JSON gives strings, floats and bools freely, so ``"3"`` is no int, ``True`` no number
    and ``2.5`` no int; an int is a valid float.
    """
    origin = typing.get_origin(hint)
    shown = "<redacted>" if is_secret_key(where) else repr(value)  # keys never in errors
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        for arg in args:
            try:
                return _check(where, value, arg)
            except ConfigError:
                continue
        names = " or ".join(_type_name(a) for a in args)
        raise ConfigError(f"{where}: expected {names}, found {type(value).__name__} {shown}")
    if origin is Literal:
        choices = typing.get_args(hint)
        if not any(value == c and type(value) is type(c) for c in choices):
            raise ConfigError(f"{where}: expected one of {list(choices)}, found {shown}")
        return value
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            raise ConfigError(f"{where}: expected a list, found {type(value).__name__} "
                              f"{shown}")
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            items = [_check(f"{where}[{i}]", v, args[0]) for i, v in enumerate(value)]
        elif args:
            if len(value) != len(args):
                raise ConfigError(f"{where}: expected {len(args)} items, found {len(value)}")
            pairs = enumerate(zip(value, args, strict=True))
            items = [_check(f"{where}[{i}]", v, a) for i, (v, a) in pairs]
        else:
            items = list(value)
        return tuple(items)
    if origin is not None:  # other generics (dict[...], list[...]): the container only
        if not isinstance(value, origin):
            raise ConfigError(f"{where}: expected {_type_name(hint)}, found "
                              f"{type(value).__name__} {shown}")
        return value
    if hint is type(None):
        ok = value is None
    elif hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if ok and not math.isfinite(value):  # JSON's 1e400 is inf; NaN passes every range
            raise ConfigError(f"{where}: expected a finite number, found {shown}")
    elif isinstance(hint, type):
        ok = isinstance(value, hint)
    else:
        ok = True
    if not ok:
        raise ConfigError(f"{where}: expected {_type_name(hint)}, found "
                          f"{type(value).__name__} {shown}")
    return value


def from_dict(cls: type[C], data: Mapping[str, Any], *, where: str = "") -> C:
    """``cls.from_dict(data)``: a config from a mapping, refusing unknown keys by name."""
    return cls.from_dict(data, where=where)


def to_dict(obj: Config) -> dict[str, Any]:
    return obj.to_dict()


def parse_overrides(overrides: Sequence[str] | None, *, where: str) -> dict[str, Any]:
    """``KEY=VALUE`` items (the CLIs' ``--set``) as a nested mapping.

    A value is parsed as JSON when it can be (numbers, booleans, null, lists), else kept as
    a bare string; a dotted key (``producer.engine.client.max_retries=5``) sets a nested
    section.
    """
    data: dict[str, Any] = {}
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{where}: --set takes KEY=VALUE, got {item!r}")
        try:
            parsed: Any = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        *parents, leaf = key.split(".")
        node = data
        for p in parents:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{where}: --set {item!r}: {p!r} is not a section")
            node = child
        node[leaf] = parsed
    return data


def merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` laid over it, section by section."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(cls: type[C], path: str | None = None,
                overrides: Sequence[str] | None = None, *, where: str = "") -> C:
    """A config from an optional JSON file plus ``KEY=VALUE`` overrides (the CLIs' --set).

    The result goes through ``cls.from_dict`` (unknown keys and wrong types are refused by
    name).
    """
    name = where or cls.__name__
    data: dict[str, Any] = read_json_object(path, what=name) if path else {}
    data = merge(data, parse_overrides(overrides, where=name))
    return cls.from_dict(data, where=where)


def read_json_file(path: str, *, what: str) -> Any:
    """The parsed JSON of ``path``; a :class:`ConfigError` that says in words what is wrong
    (a missing or unreadable file, or where the JSON breaks) otherwise."""
    from strawq.errors import os_error_text

    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise ConfigError(f"{what}: {os_error_text(exc, 'read', path)}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what}: {path} is not UTF-8 text (byte {exc.start}); expected "
                          "a JSON file") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what}: {path} is not valid JSON: {exc.msg} at line {exc.lineno}, "
                          f"column {exc.colno}; fix the file") from exc
    except RecursionError:
        raise ConfigError(f"{what}: {path} nests JSON too deeply for a config file; fix "
                          "the file") from None


def read_json_object(path: str, *, what: str) -> dict[str, Any]:
    """:func:`read_json_file` for a file that must hold one JSON object (a config)."""
    data = read_json_file(path, what=what)
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {path} must hold a JSON object, found "
                          f"{type(data).__name__}")
    return data


# -- field documentation and the generated key list ---------------------------------------

_DOCS: dict[type, dict[str, str]] = {}
#: An entry of a ``Fields:`` block: ``name: text`` or ``a / b: text`` (shared text).
_FIELD_ENTRY = re.compile(r"^(\w+(?:\s*/\s*\w+)*):\s*(.*)$")


def field_docs(cls: type) -> dict[str, str]:
    """Each field's documentation, by name: the ``#:`` comment lines just above its
    declaration, else its entry in a ``Fields:`` block of the class docstring (inherited
    fields included). A field without either is missing from the result."""
    if cls in _DOCS:
        return _DOCS[cls]
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or "__annotations__" not in vars(klass):
            continue
        docs.update(_docstring_fields(klass))
        docs.update(_comment_fields(klass))
    if dataclasses.is_dataclass(cls):  # fields only, not class variables
        names = {f.name for f in dataclasses.fields(cls)}
        docs = {k: v for k, v in docs.items() if k in names}
    _DOCS[cls] = docs
    return docs


def _comment_fields(klass: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):  # no source (a frozen or generated class)
        return {}
    lines = source.splitlines()
    node = ast.parse(source).body[0]
    out: dict[str, str] = {}
    for stmt in getattr(node, "body", []):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            i, doc = stmt.lineno - 2, list[str]()
            while i >= 0 and lines[i].strip().startswith("#:"):
                doc.insert(0, lines[i].strip()[2:].strip())
                i -= 1
            if doc:
                out[stmt.target.id] = " ".join(doc)
    return out


def _docstring_fields(klass: type) -> dict[str, str]:
    doc = inspect.cleandoc(vars(klass).get("__doc__") or "")
    lines = doc.splitlines()
    if "Fields:" not in (line.strip() for line in lines):
        return {}
    out: dict[str, str] = {}
    names: list[str] = []
    indent = None
    for line in lines[[line.strip() for line in lines].index("Fields:") + 1:]:
        if not line.strip():
            continue
        here = len(line) - len(line.lstrip())
        if indent is None:
            indent = here
        if here < indent:
            break
        match = _FIELD_ENTRY.match(line.strip()) if here == indent else None
        if match:
            names = [n.strip() for n in match.group(1).split("/")]
            for n in names:
                out[n] = match.group(2)
        elif names:
            for n in names:
                out[n] = f"{out[n]} {line.strip()}".strip()
    return out


def _first_sentence(text: str) -> str:
    end = re.search(r"(?<!e\.g)(?<!i\.e)(?<!Dr)\.(\s|$)", text)
    return text[: end.start() + 1] if end else text


def _key_type(hint: Any) -> str:
    """A field's type as the key list shows it: ``a|b`` for a choice, ``list of int``."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "|".join(str(c) for c in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_key_type(a) for a in typing.get_args(hint))
    if origin is tuple:
        args = typing.get_args(hint)
        return f"list of {_key_type(args[0])}" if args else "list"
    if origin is not None:
        return _type_name(origin)
    return "null" if hint is type(None) else _type_name(hint)


def _default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return json.dumps(_plain(f.default), default=str)
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "{...}" if isinstance(value, Config) else json.dumps(_plain(value), default=str)
    return "required"


def config_keys(cls: type[Config], prefix: str = "") -> list[tuple[str, str, str, str]]:
    """``(key, type, default, doc)`` for every key of ``cls``, sections flattened into
    dotted keys (``client.max_retries``), in declaration order."""
    docs = field_docs(cls)
    out: list[tuple[str, str, str, str]] = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not f.init:
            continue
        hint = _hint(cls, f.name)
        section = _section_type(hint)
        key = f"{prefix}{f.name}"
        if section is not None:
            out.extend(config_keys(section, prefix=f"{key}."))
            continue
        out.append((key, _key_type(hint), _default_text(f), docs.get(f.name, "")))
    return out


def keys_help(cls: type[Config], *, width: int = 92) -> str:
    """The keys of ``cls`` as ``--help`` lists them: key, type, default, then the first
    sentence of the field's documentation."""
    lines = textwrap.wrap(f"{cls.__name__} keys (--set KEY=VALUE; a dotted KEY reaches into "
                          f"a section):", width)
    for key, type_name, default, doc in config_keys(cls):
        lines.append(f"  {key}: {type_name} = {default}")
        if doc:
            lines.extend(textwrap.wrap(_first_sentence(doc), width, initial_indent="      ",
                                       subsequent_indent="      "))
    return "\n".join(lines)


def _resolve(target: str) -> type[Config]:
    module, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, Config)):
        raise TypeError(f"{target} is not a Config class")
    return cls


def add_keys_help(parser: argparse.ArgumentParser, target: str | type[Config]) -> None:
    """Append the key list of a config class (``"module:Class"`` or the class) to
    ``parser``'s ``--help``; built when the help is shown, so the class's module is imported
    only then."""
    plain: Callable[[], str] = parser.format_help

    def format_help() -> str:
        try:
            cls = _resolve(target) if isinstance(target, str) else target
            keys = keys_help(cls)
        except ImportError as exc:
            keys = f"(the config keys cannot be listed here: {exc})"
        return f"{plain().rstrip()}\n\n{keys}\n"

    setattr(parser, "format_help", format_help)  # noqa: B010 - an instance override


#: The longest duration a config accepts, in seconds (a year): longer ones overflow timers.
MAX_SECONDS = 365 * 24 * 3600.0


@dataclass(frozen=True, kw_only=True)
class QueueConfig(Config):
    """The queue's settings, recorded in ``run.meta`` when the run is created."""

    #: Claims per task before it is dropped with a record (attempts are counted at claim;
    #: ``yield``/``release`` refund theirs).
    max_attempts: int = 3
    #: Seconds without a heartbeat-counter change, on the grantor's monotonic clock,
    #: after which a producer's leases expire and their tasks are re-queued.
    lease_timeout_s: float = 60.0
    #: Producer heartbeat cadence. Producers stop work at ``lease_timeout_s - margin``.
    heartbeat_interval_s: float = 5.0
    #: Heartbeat silence after which a producer (or a collector) is judged dead for the
    #: purpose of *waiting*: a weight-update bracket stops waiting for its ack, and a new
    #: collector takes over (if ``takeover_timeout_s`` is longer). Its leases still expire
    #: only after ``lease_timeout_s``. A writer on this host whose pid is gone is judged
    #: dead at once. None: three heartbeats (``3 * heartbeat_interval_s``), at most
    #: ``lease_timeout_s``. Must be above ``heartbeat_interval_s`` and at most
    #: ``lease_timeout_s``.
    liveness_timeout_s: float | None = None
    #: Prompts released per cursor advance (one cursor record per release).
    release_batch: int = 64
    #: Key of the prompt in a dataset row (a string or a list of token ids).
    prompt_key: str = "prompt"
    #: G: samples per prompt group. The one place a run declares it: producers and
    #: placement read it from here (recorded in ``run.meta`` for readers and ``strawq status``).
    group_size: int = 8
    #: fsync files and directories (turn off only for throwaway benchmarks).
    fsync: bool = True
    #: Largest share (0..1) of bad rows a release may drop; past it the release is refused,
    #: nothing is released and the cursor stays (a small release is judged against a whole
    #: ``release_batch``, and a dataset's first release may not be all bad). 1: never refuse.
    max_bad_row_share: float = 0.05
    #: Passes over the dataset (slime's ``--num-epoch``, verl's ``trainer.total_epochs``).
    #: Each pass releases every row again under new task ids (the run's index space goes
    #: on, as after a dataset switch); the dataset is exhausted after the last pass.
    num_epochs: int = 1
    #: From the second pass on, skip a row whose newest trained group's rewards all agreed
    #: (no advantage to train on), until ``zero_variance_revisit_epochs`` passes after that
    #: group (``strawq.data.prompt_policy``; each skip is recorded in the history).
    skip_zero_variance: bool = False
    #: Passes after a zero-variance group at which its row is released again (2: skipped
    #: by the next pass, back in the one after).
    zero_variance_revisit_epochs: int = 2
    #: From the second pass on, stage each release longest-predicted-first (the row's
    #: newest recorded mean response length; without one, the run's median), and give each
    #: task that claim rank: producers claim by it across releases (``strawq.tasks.claims``).
    #: Off by default: under hard η on the lab it measured within noise of off (a group's
    #: tail is mostly a response at the cap by chance, docs/design.md).
    longest_first: bool = False
    #: Tasks per chunk directory of a release (range claims, docs/protocol.md §5): a
    #: producer with that many free slots leases a whole chunk by one rename and reads its
    #: rows once; each task still leaves its chunk by its own rename (fencing unchanged).
    #: 1: one file per task, the layout of every earlier run.
    release_chunk: int = 1

    def validate(self) -> None:
        if self.num_epochs < 1:
            raise ConfigError(f"num_epochs must be >= 1, got {self.num_epochs}")
        if self.zero_variance_revisit_epochs < 2:
            raise ConfigError(f"zero_variance_revisit_epochs must be >= 2 (1 would never "
                              f"skip), got {self.zero_variance_revisit_epochs}")
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not 0 < self.lease_timeout_s <= MAX_SECONDS:
            raise ConfigError(f"lease_timeout_s must be > 0 and at most {MAX_SECONDS:.0f} "
                              f"(a year), got {self.lease_timeout_s}")
        if not 0 < self.heartbeat_interval_s < self.lease_timeout_s:
            raise ConfigError(
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) must be > 0 and below "
                f"lease_timeout_s ({self.lease_timeout_s}); use about a third of it")
        if self.liveness_timeout_s is not None and not (
                self.heartbeat_interval_s < self.liveness_timeout_s <= self.lease_timeout_s):
            raise ConfigError(
                f"liveness_timeout_s ({self.liveness_timeout_s}) must be above "
                f"heartbeat_interval_s ({self.heartbeat_interval_s}) and at most "
                f"lease_timeout_s ({self.lease_timeout_s}); use a few heartbeats, or leave it "
                "unset (3 heartbeats)")
        if self.release_batch < 1:
            raise ConfigError(f"release_batch must be >= 1, got {self.release_batch}")
        if self.release_chunk < 1:
            raise ConfigError(f"release_chunk must be >= 1 (1: one file per task), got "
                              f"{self.release_chunk}")
        if self.release_chunk > 1 and self.longest_first:
            raise ConfigError("release_chunk > 1 does not combine with longest_first: a "
                              "chunk is claimed whole, in release order, not by claim rank; "
                              "set one of them only")
        if self.group_size < 1:
            raise ConfigError(f"group_size must be >= 1, got {self.group_size}")
        if not self.prompt_key:
            raise ConfigError("prompt_key must be a non-empty string")
        if not 0 <= self.max_bad_row_share <= 1:
            raise ConfigError(f"max_bad_row_share must be a share between 0 and 1, got "
                              f"{self.max_bad_row_share}")

    @property
    def liveness_s(self) -> float:
        """The liveness timeout in effect (``liveness_timeout_s``, or three heartbeats)."""
        if self.liveness_timeout_s is not None:
            return self.liveness_timeout_s
        return min(3 * self.heartbeat_interval_s, self.lease_timeout_s)
