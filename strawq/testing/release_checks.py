"""The release model, checks of a run against it: what a run did (``Seen``, ``Resume``,
``Observed``), the ideal run, and each ``check_*`` (``check_run`` runs them all).

Part of ``strawq.testing.release_model`` (the statement, and every public name).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from strawq.testing.release_outcomes import (TRAINED, ZERO_VARIANCE, Behaviour, outcome,
                                             skip_reason)
from strawq.testing.release_passes import ModelRow, ReleaseModel

# -- what a run did -------------------------------------------------------------------------
@dataclass(frozen=True)
class Seen:
    """A released task as a producer saw it."""

    index: int
    #: (source name, source row) the released row really is (the row's own content)
    content: tuple[str, int]
    #: what the task body says: ``task["source"]``, ``task["source_row"]``, ``task["pass"]``
    source: str | None = None
    source_row: int | None = None
    pass_no: int | None = None


@dataclass(frozen=True)
class Resume:
    """A resume from a trainer checkpoint's cursor (the queue state was lost)."""

    #: the checkpoint's cursor index
    at: int
    #: task indexes trained, dropped and skipped by the checkpoint
    trained: frozenset[int] = frozenset()
    dropped: frozenset[int] = frozenset()
    skipped: frozenset[int] = frozenset()
    #: task indexes released after the resume
    released_after: frozenset[int] = frozenset()


@dataclass
class Observed:
    """What a run released, trained, dropped and skipped, with its final cursor."""

    #: every released task by its index
    released: dict[int, Seen] = field(default_factory=dict)
    #: the task index of every trained group (work trained after a restored checkpoint
    #: taken out: the trainer went back to the checkpoint)
    trained: list[int] = field(default_factory=list)
    #: drops of released groups (filters, producers) by task index, the same way
    dropped: dict[int, list[str]] = field(default_factory=dict)
    #: task indexes the history recorded as skipped
    skipped: set[int] = field(default_factory=set)
    #: the newest cursor record at the end (``strawq.data.feeder.read_cursor_state``)
    cursor: Mapping[str, Any] | None = None
    #: bad-row drops the final queue state counts (None: not looked at)
    bad_dropped: int | None = None
    resume: Resume | None = None


def ideal_run(model: ReleaseModel, behaviour: Behaviour) -> Observed:
    """The run the semantics describe when each row is trained or dropped before the next
    is released (the history then holds every earlier attempt): what ``check_run`` with
    ``exact_skips=True`` accepts, for a run without a resume."""
    obs = Observed(bad_dropped=0)
    attempts: list[ModelRow] = []
    for p in model.passes:
        for row in p.rows:
            if row.bad:
                obs.bad_dropped = (obs.bad_dropped or 0) + 1
                continue
            if skip_reason(model, behaviour, row, attempts) is not None:
                obs.skipped.add(row.index)
                continue
            obs.released[row.index] = Seen(row.index, (row.name, row.source_row),
                                           None if model.plain else row.name, row.source_row,
                                           row.pass_no)
            attempts.append(row)
            got = outcome(model, behaviour, row)
            if got == TRAINED:
                obs.trained.append(row.index)
            else:
                obs.dropped[row.index] = [got]
    cursor: dict[str, Any] = {"next_index": model.end, "exhausted": True}
    if model.num_passes > 1:
        cursor.update(epoch_bases=model.epoch_bases, epoch_offsets=model.epoch_offsets)
    if model.unread():
        cursor["unread"] = model.unread()
    obs.cursor = cursor
    return obs


def _content_key(model: ReleaseModel, seen: Seen) -> tuple[int, int] | None:
    k = model.source_named(seen.content[0])
    return None if k is None else (k, seen.content[1])


def check_rows(model: ReleaseModel, obs: Observed, *, require_fields: bool = True
               ) -> list[str]:
    """Every released task is the model's row at its index, and its body says so
    (``source`` for a mixture's row, ``source_row``, ``pass``). ``require_fields=False``:
    a body without ``source_row``/``pass`` is accepted (one mismatch per missing field
    otherwise, however many bodies lack it)."""
    out = []
    missing: dict[str, list[ModelRow]] = {}
    for index in sorted(obs.released):
        seen = obs.released[index]
        row = model.row_at(index)
        if row is None:
            out.append(f"[row] task index {index} ({seen.content[0]} row {seen.content[1]}) "
                       f"was released; the model has no row there (its rows are task "
                       f"indexes {model.base}..{model.end - 1})")
            continue
        if row.bad:
            out.append(f"[row] {row}: a bad row was released")
        if seen.content != (row.name, row.source_row):
            out.append(f"[row] {row}: released {seen.content[0]} row {seen.content[1]}, the "
                       f"model releases {row.name} row {row.source_row}")
        want_source = None if model.plain else row.name
        if seen.source != want_source:
            out.append(f"[field] {row}: task['source'] is {seen.source!r}, the model says "
                       f"{want_source!r}")
        for name, got, want in (("source_row", seen.source_row, row.source_row),
                                ("pass", seen.pass_no, row.pass_no)):
            if got is None:
                missing.setdefault(name, []).append(row)
            elif got != want:
                out.append(f"[field] {row}: task[{name!r}] is {got!r}, the model says {want}")
    if require_fields:
        for name, rows in missing.items():
            out.append(f"[field] {len(rows)} released task(s) carry no task[{name!r}] (the "
                       f"first: {rows[0]})")
    return out


def check_passes(model: ReleaseModel, obs: Observed) -> list[str]:
    """Every pass is complete: each good row released or skipped (not both), no bad row
    released, no skip of a row the model does not have."""
    out = []
    for p in model.passes:
        for row in p.rows:
            released, skipped = row.index in obs.released, row.index in obs.skipped
            if row.bad:
                if skipped:
                    out.append(f"[pass] {row}: a bad row was recorded as skipped")
                continue
            if not released and not skipped:
                out.append(f"[pass] {row}: neither released nor skipped")
            elif released and skipped:
                out.append(f"[pass] {row}: both released and recorded as skipped")
    for index in sorted(obs.skipped - set(model.rows)):
        out.append(f"[pass] task index {index} was recorded as skipped; the model has no "
                   f"row there")
    return out


def check_outcomes(model: ReleaseModel, behaviour: Behaviour, obs: Observed) -> list[str]:
    """Every released row's group trained exactly once, or dropped with the reason the
    model gives (and not trained)."""
    out = []
    trained = Counter(obs.trained)
    for index in sorted(obs.released):
        row = model.row_at(index)
        if row is None or row.bad:
            continue  # reported by check_rows
        want = outcome(model, behaviour, row)
        n, drops = trained.get(index, 0), obs.dropped.get(index, [])
        if want == TRAINED:
            if n != 1 or drops:
                what = f"trained {n} time(s)" + (f", dropped {drops}" if drops else "")
                out.append(f"[trained] {row}: {what}; the model trains it once")
        elif n or drops != [want]:
            out.append(f"[trained] {row}: trained {n} time(s), dropped {drops}; the model "
                       f"drops it once ({want})")
    for index in sorted(set(trained) | set(obs.dropped)):
        if index not in obs.released:
            out.append(f"[trained] task index {index} was trained or dropped and never "
                       f"released")
    return out


def _attempts(model: ReleaseModel, obs: Observed, row: ModelRow) -> list[ModelRow]:
    """The attempts the history could hold when ``row`` was planned: released rows before
    it (of the same side of a resume: a resume forgets the history)."""
    pool: Iterable[int] = obs.released
    if obs.resume is not None and row.index >= obs.resume.at:
        pool = obs.resume.released_after
    return [r for i in pool if i < row.index and (r := model.row_at(i)) is not None
            and not r.bad]


def check_skips(model: ReleaseModel, behaviour: Behaviour, obs: Observed, *,
                exact: bool = False) -> list[str]:
    """Every skip is justified by an agreeing attempt within the revisit window (of the
    same side of a cursor resume). ``exact``: each row was released only once every row
    before it was trained or dropped, so the history held every attempt but at most the
    newest one, when a filter dropped it and only skipped or bad rows lie between: each
    row released or skipped exactly as the rule says."""
    out = []
    for index in sorted(obs.skipped):
        row = model.row_at(index)
        if row is None or row.bad:
            continue  # reported by check_passes
        if not behaviour.skip_zero_variance:
            out.append(f"[skip] {row}: skipped, but skip_zero_variance is off")
        elif row.pass_no < 1:
            out.append(f"[skip] {row}: skipped in the first pass")
        elif skip_reason(model, behaviour, row, _attempts(model, obs, row),
                         newest_only=False) is None:
            out.append(f"[skip] {row}: skipped without an agreeing attempt within "
                       f"{behaviour.revisit} appearance(s)")
    if not exact or not behaviour.skip_zero_variance:
        return out
    for p in model.passes[1:]:
        for row in p.rows:
            skipped = row.index in obs.skipped
            if row.bad or (not skipped and row.index not in obs.released):
                continue  # reported by check_passes
            attempts = _attempts(model, obs, row)
            why = skip_reason(model, behaviour, row, attempts)
            allowed = {why is not None}
            # the newest release before this row, dropped by a filter and followed by
            # skipped and bad rows only, may not be in the history yet: judged without it
            last = max((a.index for a in attempts), default=None)
            if last is not None and outcome(model, behaviour, model.rows[last]) not in (
                    TRAINED, ZERO_VARIANCE) and all(
                    i in obs.skipped or model.rows[i].bad for i in range(last + 1, row.index)):
                allowed.add(skip_reason(model, behaviour, row,
                                        [a for a in attempts if a.index != last]) is not None)
            if skipped not in allowed:
                out.append(f"[skip] {row}: released, but the rule skips it: {why}" if why
                           else f"[skip] {row}: skipped, but the newest attempt of the row "
                                f"does not agree or is {behaviour.revisit} appearance(s) ago "
                                f"or more")
    return out


def check_cursor(model: ReleaseModel, cursor: Mapping[str, Any] | None) -> list[str]:
    """The final cursor: exhausted, every pass's base and per-source offsets (from the
    second pass on), and the rows no pass reached (``unread``)."""
    if cursor is None:
        return ["[cursor] the run has no cursor record"]
    out = []
    if cursor.get("error"):
        out.append(f"[cursor] the newest cursor record is unreadable: {cursor['error']}")
    if not cursor.get("exhausted"):
        out.append(f"[cursor] the final cursor is not exhausted (next index "
                   f"{cursor.get('next_index')})")
    if cursor.get("next_index") != model.end:
        out.append(f"[cursor] the final cursor is at task index {cursor.get('next_index')}, "
                   f"the model ends at {model.end}")
    for key, want in (("epoch_bases", model.epoch_bases),
                      ("epoch_offsets", model.epoch_offsets)):
        got = cursor.get(key)
        if got is None and model.num_passes < 2:
            continue  # present from the second pass on
        if got is None or [list(x) if isinstance(x, (list, tuple)) else x for x in got] != want:
            out.append(f"[cursor] {key} is {got!r}, the model says {want}")
    got_unread = cursor.get("unread") or {}
    want_unread = model.unread()
    if {k: list(v) for k, v in dict(got_unread).items()} != want_unread:
        out.append(f"[unread] the final cursor's unread is {dict(got_unread)!r}, the model "
                   f"says {want_unread}")
    return out


def check_unread(model: ReleaseModel, obs: Observed) -> list[str]:
    """Nothing unread without a recorded reason: every row never released in the whole run
    is bad, or among the final cursor's ``unread`` rows."""
    released = {key for s in obs.released.values()
                if (key := _content_key(model, s)) is not None}
    recorded = dict((obs.cursor or {}).get("unread") or {})
    out = []
    for k, src in enumerate(model.sources):
        for j in range(src.rows):
            if (k, j) in released or j in src.bad:
                continue
            span = recorded.get(src.name)
            if isinstance(span, (list, tuple)) and len(span) == 2 and span[0] <= j < span[1]:
                continue
            out.append(f"[unread] {src.name} row {j} was never released and has no recorded "
                       f"reason (not bad, not in the cursor's unread)")
    return out


def check_shares(model: ReleaseModel, behaviour: Behaviour, obs: Observed) -> list[str]:
    """Each source's trained groups: exactly the model's count once skips and drops are
    taken out (the interleave is deterministic: exact counts)."""
    got: Counter[str] = Counter()
    for index in obs.trained:
        seen = obs.released.get(index)
        if seen is not None:
            got[seen.content[0]] += 1
    out = []
    for k, src in enumerate(model.sources):
        rows = [r for p in model.passes for r in p.rows if r.source == k]
        good = [r for r in rows if not r.bad]
        skipped = [r for r in good if r.index in obs.skipped]
        dropped = [r for r in good if r.index not in obs.skipped
                   and outcome(model, behaviour, r) != TRAINED]
        want = len(good) - len(skipped) - len(dropped)
        if got[src.name] != want:
            out.append(f"[share] {src.name}: {got[src.name]} groups trained, the model "
                       f"{want} ({len(rows)} rows over the passes, {len(rows) - len(good)} "
                       f"bad, {len(skipped)} skipped, {len(dropped)} dropped)")
    return out


def check_resume(model: ReleaseModel, obs: Observed) -> list[str]:
    """After a resume from a checkpoint's cursor: every row in flight at the checkpoint
    (released before its index, not trained, dropped or skipped by it) released again,
    and nothing it trained."""
    res = obs.resume
    if res is None:
        return []
    out = []
    for index in range(model.base, min(res.at, model.end)):
        row = model.rows[index]
        done = index in res.trained or index in res.dropped or index in res.skipped
        if row.bad or done:
            if index in res.trained and index in res.released_after:
                out.append(f"[resume] {row}: trained by the checkpoint and released again "
                           f"after the resume")
            continue
        if index not in res.released_after:
            out.append(f"[resume] {row}: in flight at the checkpoint (cursor at task index "
                       f"{res.at}) and not released again after the resume")
    return out


def check_bad_rows(model: ReleaseModel, obs: Observed) -> list[str]:
    """The final queue state counts one ``bad_row`` drop per bad row it came to (after a
    resume: from the checkpoint's index on)."""
    if obs.bad_dropped is None:
        return []
    since = obs.resume.at if obs.resume is not None else model.base
    want = sum(1 for r in model.rows.values() if r.bad and r.index >= since)
    if obs.bad_dropped != want:
        return [f"[bad] {obs.bad_dropped} bad_row drops recorded, the model {want}"]
    return []


def check_run(model: ReleaseModel, behaviour: Behaviour, obs: Observed, *,
              exact_skips: bool = False, require_fields: bool = True) -> list[str]:
    """Every check above."""
    return [*check_rows(model, obs, require_fields=require_fields),
            *check_passes(model, obs),
            *check_outcomes(model, behaviour, obs),
            *check_skips(model, behaviour, obs, exact=exact_skips),
            *check_cursor(model, obs.cursor),
            *check_unread(model, obs),
            *check_shares(model, behaviour, obs),
            *check_resume(model, obs),
            *check_bad_rows(model, obs)]
