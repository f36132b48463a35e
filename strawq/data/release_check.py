"""Judging a release's rows before it is written: the share of bad rows it would drop
(``judge_release``, ``max_bad_row_share``: a release that would drop too many is refused,
``BadRowsRefused``, and the cursor does not move) and what a release would do, read-only
(``preview``, ``strawq release --dry-run``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from strawq.data.binding import DatasetCursorReader, fingerprints_match, mismatch_message
from strawq.data.dataset import BadRow, Dataset, prompt_kind
from strawq.errors import DatasetError


class BadRowsRefused(DatasetError):
    """A release would drop more of its rows as bad than the run allows
    (``QueueConfig.max_bad_row_share``); nothing was released and the cursor did not move."""

    def __init__(self, message: str, bad: Sequence[BadRow], rows: int, next_index: int) -> None:
        super().__init__(message)
        self.bad = tuple(bad)
        self.rows = rows
        self.next_index = next_index


def judge_release(rows: int, bad: Sequence[BadRow], *, max_share: float, window: int,
                  recent: tuple[int, int] = (0, 0), first: bool = False
                  ) -> tuple[str | None, tuple[int, int]]:
    """Whether a release of ``rows`` rows, ``bad`` of them bad, may go ahead.

    Refused (the reason is returned) when the bad rows of the releases in the current window
    (``recent``: rows and bad rows since the window opened, counted on the cursor), this one
    included, exceed ``max_share`` of ``max(rows in the window, window)`` — so a small
    release is judged against a whole batch, not against itself — or when the first release
    from this dataset (``first``) holds only bad rows. ``max_share >= 1`` never refuses.
    Returns ``(refusal or None, the window's counts after this release)``; a window that
    holds ``window`` rows or more starts afresh."""
    r, b = recent if recent[0] < window else (0, 0)
    r, b = r + rows, b + len(bad)
    if bad and max_share < 1 and ((first and len(bad) == rows)
                                  or b > max_share * max(r, window)):
        return (f"{len(bad)} of its {rows} rows are bad"
                + (f" ({b} of the last {r} rows released)" if r > rows else "")
                + f", over max_bad_row_share={max_share:g}"
                + (" (and the first release of a dataset may not be all bad)"
                   if first and len(bad) == rows else "")), (r, b)
    return None, (r, b)


def refusal_message(why: str, bad: Sequence[BadRow], start: int, end: int,
                    prompt_key: str) -> str:
    """The one message of a refused release: the causes, where they are, what to do."""
    causes: dict[str, int] = {}
    for x in bad:
        causes[x.cause or "bad row"] = causes.get(x.cause or "bad row", 0) + 1
    shown = ", ".join(f"{n} {cause}" for cause, n in
                      sorted(causes.items(), key=lambda kv: -kv[1])[:4])
    keys = sorted({k for x in bad for k in x.keys})
    missing = f"missing {prompt_key!r}" in causes
    lines = (f"refusing to release task indices {start}..{end - 1}: {why}: {shown}"
             + (f" (keys present in those rows: {keys[:12]})" if keys else "")
             + (f"; first: {bad[0].message}" if bad else "")
             + f". Nothing was released; the cursor stays at index {start}. ")
    fix = ("Fix the dataset, or create the run with the prompt key its rows use "
           "(strawq init --set prompt_key=KEY)" if missing else "Fix those rows")
    return (lines + fix + ", or release them anyway, each bad row dropped with reason "
            "bad_row: strawq release RUN DATASET --max-bad-row-share 1 (docs/datasets.md)")


@dataclass(frozen=True)
class ReleasePreview:
    """What a release of ``count`` rows would do (``strawq release --dry-run``)."""

    count: int
    start: int
    end: int
    good: int
    bad: tuple[BadRow, ...]
    kinds: dict[str, int]
    exhausted: bool
    #: why the release would be refused (dataset mismatch, cursor exhausted, too many bad
    #: rows: ``judge_release``), or None
    refused: str | None = None
    #: per source (a mixture's names; ``dataset`` for one), the rows it would ``release``,
    #: ``skip`` (the history's rule, ``strawq.data.prompt_policy``) and drop as ``bad``
    sources: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        bad = [f"  drop {b.message}" for b in self.bad[:20]]
        if len(self.bad) > 20:
            bad.append(f"  ... and {len(self.bad) - 20} more bad rows")
        if self.refused:
            return "\n".join([f"dry run: would release nothing: {self.refused}", *bad])
        lines = [f"dry run: would release {self.good} rows and drop {len(self.bad)} bad rows "
                 f"(indices {self.start}..{self.end - 1}); cursor would move to {self.end}"
                 + (" (dataset exhausted)" if self.exhausted else "")
                 + "; prompts: " + (", ".join(f"{k} {v}" for k, v in sorted(self.kinds.items()))
                                    or "none"), *bad]
        if self.end == self.start:
            lines.append("  (no rows at the cursor)")
        for name, n in self.sources.items():
            lines.append(f"  {name}: release {n.get('release', 0)}, skip "
                         f"{n.get('skip', 0)} (history), drop {n.get('bad', 0)} bad")
        return "\n".join(lines)


def preview(dataset: Dataset, fingerprint: dict[str, Any], next_index: int, exhausted: bool,
            count: int, *, max_share: float = 1.0, window: int = 0,
            recent: tuple[int, int] = (0, 0), offsets: Sequence[int] = ()) -> ReleasePreview:
    """Validate the rows a release of ``count`` would take; reads only, writes nothing.
    ``max_share``, ``window``, ``recent``: the release's judgement of its bad rows
    (``judge_release``); a release it refuses is reported as ``refused``. ``offsets``: where
    the pass starts each source (``strawq.data.planner``)."""
    reader = DatasetCursorReader(dataset)
    reader.offsets = offsets
    empty = ReleasePreview(count, next_index, next_index, 0, (), {}, exhausted)
    if not fingerprints_match(fingerprint, dataset.fingerprint):
        return dataclasses.replace(
            empty, refused=mismatch_message(fingerprint, dataset, next_index))
    if exhausted:
        return dataclasses.replace(empty, refused=f"the cursor is exhausted at index "
                                                  f"{next_index}")
    reader.adopt(fingerprint)
    rows = reader.read(next_index, count)
    bad = tuple(r for _, r in rows if isinstance(r, BadRow))
    kinds: dict[str, int] = {}
    for _, r in rows:
        if not isinstance(r, BadRow):
            kind = prompt_kind(r.get(dataset.prompt_key)) or "?"
            kinds[kind] = kinds.get(kind, 0) + 1
    end = rows[-1][0] + 1 if rows else next_index
    why, _ = judge_release(len(rows), bad, max_share=max_share, window=window, recent=recent,
                           first=next_index == reader.base)
    refused = None if why is None else refusal_message(why, bad, next_index, end,
                                                       dataset.prompt_key)
    return ReleasePreview(count, next_index, end, len(rows) - len(bad), bad, kinds,
                          len(rows) < count, refused)
