"""The dataset cursor's key family: the one place its names are spelled and parsed, and
its records read and checked (``strawq.data.feeder`` writes them).

Records::

    cursor/<seq>/<seq>.<next_index>   CURSOR record: the compare-and-swap directory
                                      ``cursor/<seq>`` (one writer wins each number), the
                                      file name repeats where the release ended
    cursor/<seq>.<next_index>         the same, flat (runs written before the directories)
    staging/c-<seq>.<nonce>/          a cursor commit being prepared

A record's metadata: ``seq``, ``next_index``, ``staging`` (the release directory it names),
``exhausted``, ``fingerprint``, ``recent`` (the bad-row window), the passes (``epoch_bases``,
``epoch_offsets``: ``strawq.data.planner``) and, in the last cursor of a run, ``unread``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strawq.errors import CorruptRecord, NotFound
from strawq.ondisk import records
from strawq.ondisk.numbered import Numbered
from strawq.ondisk.records import Kind
from strawq.storage import Storage

#: the cursor records' directory
CURSOR_DIR = "cursor"
KEEP_CURSORS = 4
#: prefix of a cursor commit being prepared in ``staging/`` (renamed to ``cursor/<seq>``)
COMMIT_PREFIX = "c-"
#: ``staging/c-<seq>.<nonce>``
PREPARED = Numbered(COMMIT_PREFIX, sep=".")
#: ``cursor/<seq>`` (the compare-and-swap directory) and ``<seq>.<next_index>`` in it
CURSOR_DIRS = Numbered()
CURSORS = Numbered(sep=".")
@dataclass(frozen=True)
class Cursor:
    seq: int
    next_index: int
    staging: str | None
    exhausted: bool
    fingerprint: dict[str, Any]
    #: key of a cursor record that failed its checks (recover() repairs it)
    corrupt: str | None = None
    #: (rows, bad rows) released since the bad-row window opened (``judge_release``)
    recent: tuple[int, int] = (0, 0)
    #: the task-index base of every pass over this dataset, oldest first (empty: the first
    #: pass; ``QueueConfig.num_epochs``)
    epoch_bases: tuple[int, ...] = ()
    #: per pass, where it starts each mixture source (``strawq.data.planner``; empty: all at 0)
    epoch_offsets: tuple[tuple[int, ...], ...] = ()

    @property
    def epoch(self) -> int:
        """The pass over the dataset this cursor is in (0: the first)."""
        return max(len(self.epoch_bases) - 1, 0)


def cursor_name(seq: int, next_index: int) -> str:
    """``<seq>.<next_index>``: the name alone says where the cursor stands, so a cursor
    record whose content is damaged still tells how far the dataset was released."""
    return CURSORS.name(seq, next_index)


def list_cursors(storage: Storage, *, newest_only: bool = False) -> list[tuple[int, int, str]]:
    """(seq, next_index, path under ``cursor/``) of every cursor record, oldest first.

    A record lives at ``cursor/<seq>/<seq>.<next>``: the directory ``cursor/<seq>`` is the
    compare-and-swap (one writer wins each sequence number), the file name repeats where
    the release ended. Flat ``cursor/<seq>.<next>`` records of older runs are read too.
    """
    names = storage.list(CURSOR_DIR)
    out = [(*pair, n) for n in names if (pair := CURSORS.pair(n)) is not None]
    for seq in reversed(CURSOR_DIRS.numbers(names)):
        d = CURSOR_DIRS.name(seq)
        inner = [(p, f) for f in storage.list(cursor_key(d))
                 if (p := CURSORS.pair(f)) is not None and p[0] == seq]
        out += [(seq, p[1], f"{d}/{f}") for p, f in inner]
        if inner and newest_only:
            break
    out.sort()
    return out[-1:] if newest_only else out


def newest_seq(storage: Storage) -> int:
    """The highest committed (or claimed) cursor sequence number; 0 for a fresh run."""
    names = storage.list(CURSOR_DIR)
    flat = [seq for seq, _next in CURSORS.pairs(names)]
    return max([*CURSOR_DIRS.numbers(names), *flat], default=0)


def _recent(meta: dict[str, Any]) -> tuple[int, int]:
    """The bad-row window a cursor record carries ((0, 0) for records written before it)."""
    got = meta.get("recent")
    if isinstance(got, (list, tuple)) and len(got) == 2 and all(isinstance(x, int) for x in got):
        return int(got[0]), int(got[1])
    return 0, 0


def int_list(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and all(type(b) is int and b >= 0 for b in x)


def _epoch_bases(meta: dict[str, Any]) -> tuple[int, ...]:
    """The passes' bases a cursor record carries (checked by ``check_cursor_meta``)."""
    return tuple(meta.get("epoch_bases") or ())


def _epoch_offsets(meta: dict[str, Any]) -> tuple[tuple[int, ...], ...]:
    """The passes' source offsets a cursor record carries (``check_cursor_meta``)."""
    return tuple(tuple(o) for o in meta.get("epoch_offsets") or ())


def cursor_of(m: dict[str, Any]) -> Cursor:
    """The cursor a checked record's metadata holds (``check_cursor_meta``)."""
    return Cursor(m["seq"], m["next_index"], m.get("staging"), m.get("exhausted", False),
                  m.get("fingerprint", {}), recent=_recent(m), epoch_bases=_epoch_bases(m),
                  epoch_offsets=_epoch_offsets(m))


def check_cursor_meta(meta: dict[str, Any], key: str) -> None:
    """``CorruptRecord`` unless a cursor record's metadata has the fields and types a
    feeder reads (a record with a valid checksum may still hold anything)."""
    fp = meta.get("fingerprint", {})
    problems = [f for f, ok in (
        ("seq", type(meta.get("seq")) is int and meta["seq"] >= 0),
        ("next_index", type(meta.get("next_index")) is int and meta["next_index"] >= 0),
        ("staging", isinstance(meta.get("staging"), (str, type(None)))),
        ("exhausted", isinstance(meta.get("exhausted", False), bool)),
        ("fingerprint", isinstance(fp, dict) and type(fp.get("base", 0) or 0) is int),
        ("epoch_bases", int_list(meta.get("epoch_bases") or ())),
        ("epoch_offsets", isinstance(meta.get("epoch_offsets") or [], list)
         and all(int_list(o) for o in meta.get("epoch_offsets") or [])),
    ) if not ok]
    if problems:
        raise CorruptRecord(f"{key}: cursor metadata has no valid {', '.join(problems)}")


def read_cursor_state(storage: Storage) -> dict[str, Any] | None:
    """The newest cursor as ``Feeder.state_dict()``, read-only (no recovery side effects)."""
    cursors = list_cursors(storage, newest_only=True)
    if not cursors:
        return None
    seq, nxt, name = cursors[-1]
    state: dict[str, Any] = {"seq": seq, "next_index": nxt, "fingerprint": {}, "exhausted": False}
    try:
        key = cursor_key(name)
        rec = records.decode(storage.read(key), expect=Kind.CURSOR, name=key)
        check_cursor_meta(rec.meta, key)
        state["fingerprint"] = rec.meta.get("fingerprint", {})
        state["exhausted"] = bool(rec.meta.get("exhausted", False))
        state["recent"] = _recent(rec.meta)
        for key in ("epoch_bases", "epoch_offsets", "unread"):
            if rec.meta.get(key):
                state[key] = rec.meta[key]
    except (CorruptRecord, NotFound) as exc:
        state["error"] = str(exc)
    return state


def cursor_key(name: str) -> str:
    """The key of ``name`` under ``cursor/`` (a record ``<seq>/<seq>.<next>`` or a
    directory ``<seq>``)."""
    return f"{CURSOR_DIR}/{name}"


def cursor_at(storage: Storage, name: str) -> tuple[int, int] | None:
    """(seq, next index) that a name listed in ``cursor/`` stands for: a flat record
    ``<seq>.<next>``, the record inside the directory ``<seq>``, or a record named ``<seq>``
    (its content says; None: not a cursor's name, or a directory whose record is not there
    yet)."""
    pair = CURSORS.pair(name)
    if pair is not None:
        return pair
    seq = CURSOR_DIRS.parse(name)
    if seq is None:
        return None
    key = cursor_key(name)
    if not storage.is_dir(key):  # a record named by its number alone: its content says
        meta = records.decode(storage.read(key), expect=Kind.CURSOR, name=key).meta
        return int(meta["seq"]), int(meta["next_index"])
    inner = [p for f in storage.list(key)
             if (p := CURSORS.pair(f)) is not None and p[0] == seq]
    return inner[0] if inner else None
