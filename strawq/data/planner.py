"""The release planner: which rows a release takes, from which source, in what order, and
where each pass over the dataset starts — decided here, once; the feeder makes the
decisions durable (``strawq.data.feeder``, ``strawq.data.release_stage``: staging;
``strawq.data.cursor_log``: the cursor's compare-and-swap, promotion).

**Passes.** Pass ``e`` over the run's dataset starts at task index ``bases[e]``, and row
``r`` of the pass is task index ``bases[e] + r`` (a new task id each pass). A plain dataset
is read whole by every pass. A mixture (``strawq.data.mixture``) is read as an interleave of its
sources, and each source carries its own row offset across passes: pass ``e`` reads source
``k`` from its row ``offsets[e][k]`` on, and the next pass starts it where this one left it
(``Dataset.next_offsets``). So with ``first_exhausted`` the rows of a big source that one
pass did not reach come first in the next, and every row is read once before any is read
twice; with ``all_exhausted`` a source that wraps within a pass rotates which of its rows
it repeats. The cursor records both lists (``epoch_bases``, ``epoch_offsets``), so a
resume — from the queue or from a trainer checkpoint — maps every task index back to its
pass, source and row (``ReleasePlanner.origin``).

**Rows a release passes over** are recorded with their reason before the cursor commits
(docs/design.md, invariant 1): a bad row is dropped (``bad_row``), a row the history's rule
skips is recorded in the history (``skipped``, ``strawq.data.prompt_policy``), and when the last
pass ends, the rows of a source that no pass reached are named in the final cursor record
(``unread``: the stopping strategy ended the run before them).

**History rules** (``strawq.data.prompt_policy``) look a row up by its identity — its source and
its row in that source — in the earlier passes, wherever the interleave put it there
(``ReleasePlanner.earlier_ids``).

``strawq.testing.release_model`` states the same rules as a plain model, and the
combination tests drive the real feeder, collector and queue against it.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from strawq.config import QueueConfig
from strawq.data.binding import DatasetCursorReader
from strawq.data.dataset import BadRow, Dataset, Row
from strawq.data.history import PromptHistory, load_history
from strawq.data.mixture import Mixture
from strawq.data.prompt_policy import HISTORY_REFRESH_S, Plan, plan_release
from strawq.errors import DatasetError
from strawq.ondisk.names import dataset_task_id
from strawq.storage import Storage

Rows = list[tuple[int, Row | BadRow]]


@dataclass(frozen=True)
class Passes:
    """The passes over the run's current dataset, as its cursor records them: pass ``e``
    starts at task index ``bases[e]`` with source ``k`` at its row ``offsets[e][k]`` (an
    empty tuple: every source at row 0)."""

    bases: tuple[int, ...]
    offsets: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, epoch_bases: Sequence[int], epoch_offsets: Sequence[Sequence[int]],
           base: int, sources: int) -> Passes:
        """From a cursor's ``epoch_bases`` and ``epoch_offsets`` (empty for the first pass,
        which starts at ``base``; records written before offsets existed: every one of the
        dataset's ``sources`` at row 0)."""
        bases = tuple(epoch_bases) or (base,)
        offs = [tuple(o) or (0,) * sources for o in epoch_offsets][:len(bases)]
        return cls(bases, tuple(offs + [(0,) * sources] * (len(bases) - len(offs))))

    @property
    def number(self) -> int:
        """The current pass (0: the first)."""
        return len(self.bases) - 1

    @property
    def base(self) -> int:
        return self.bases[-1]

    def pass_of(self, index: int) -> int:
        """The pass task ``index`` belongs to (-1: before the dataset's first pass)."""
        return bisect.bisect_right(self.bases, index) - 1

    def rows_in(self, e: int, end: int) -> int:
        """Rows pass ``e`` released (``end``: the cursor's index, for the current pass)."""
        return (self.bases[e + 1] if e + 1 < len(self.bases) else end) - self.bases[e]

    def opened(self, base: int, offsets: Sequence[int]) -> Passes:
        """These passes and a new one starting at ``base``."""
        return Passes((*self.bases, base), (*self.offsets, tuple(offsets)))

    def record(self) -> dict[str, Any]:
        """The cursor-record fields (none for a run still in its first pass)."""
        if len(self.bases) < 2:
            return {}
        return {"epoch_bases": list(self.bases), "epoch_offsets": [list(o) for o in self.offsets]}


@dataclass(frozen=True)
class Origin:
    """Where a task index comes from: its pass, its source (None: a plain dataset) and its
    row within that source."""

    pass_no: int
    source: str | None
    row: int


class ReleasePlanner:
    """The decisions of a release over ``dataset`` for a run configured by ``config``
    (passes, mixture offsets, history rules, longest-first, resumes); reads the run's
    history from ``storage``, writes nothing."""

    def __init__(self, dataset: Dataset, config: QueueConfig, storage: Storage) -> None:
        self.dataset = dataset
        self.config = config
        self.storage = storage
        #: reads the current pass's rows by task index (keeps one iterator open)
        self.reader = DatasetCursorReader(dataset)
        self._history_cache: tuple[float, PromptHistory] | None = None

    # -- rows ------------------------------------------------------------------------------------
    def read(self, passes: Passes, start: int, n: int) -> Rows:
        """Up to ``n`` rows of the current pass from task index ``start`` (fewer: the pass
        ends)."""
        self.reader.base, self.reader.offsets = passes.base, passes.offsets[-1]
        return self.reader.read(start, n)

    def rows_at(self, passes: Passes, indexes: Iterable[int]) -> Rows:
        """The rows at task ``indexes`` of any pass (a resume releases them again), each
        read in its own pass, one contiguous run at a time."""
        out: Rows = []
        by_pass: dict[int, list[int]] = {}
        for i in sorted(set(indexes)):
            by_pass.setdefault(passes.pass_of(i), []).append(i)
        for e, idx in sorted(by_pass.items()):
            if e < 0:
                raise DatasetError(f"task index {idx[0]} is before this dataset's first row "
                                   f"(index {passes.bases[0]})")
            reader = DatasetCursorReader(self.dataset)
            reader.base, reader.offsets = passes.bases[e], passes.offsets[e]
            run: list[int] = []
            for i in [*idx, -1]:
                if run and i == run[-1] + 1:
                    run.append(i)
                    continue
                if run:
                    out += reader.read(run[0], len(run))
                run = [i]
        return out

    def origin(self, passes: Passes, index: int) -> Origin:
        """The pass, source and source row of task ``index``."""
        e = passes.pass_of(index)
        source, row = self.dataset.locate_row(index - passes.bases[e], passes.offsets[e])
        return Origin(e, source, row)

    def task(self, passes: Passes, index: int, row: Row) -> dict[str, Any]:
        """The task body of the row at ``index`` (its id, row, pass and origin)."""
        o = self.origin(passes, index)
        body: dict[str, Any] = {"index": index, "id": dataset_task_id(index), "row": row,
                                "pass": o.pass_no, "source_row": o.row}
        if o.source is not None:  # a mixture's row: its dataset's name (strawq.data.mixture)
            body["source"] = o.source
        return body

    # -- passes ----------------------------------------------------------------------------------
    def next_pass(self, passes: Passes, end: int) -> Passes | None:
        """The passes with the next one opened at task index ``end`` (where the current one
        ended), or None when the run's ``num_epochs`` passes are done."""
        if passes.number + 1 >= self.config.num_epochs:
            return None
        rows = end - passes.base
        return passes.opened(end, self.dataset.next_offsets(passes.offsets[-1], rows))

    def unread(self, passes: Passes, end: int) -> dict[str, list[int]]:
        """Per source, the rows ``[first, end)`` that no pass reached, once the last pass
        ended at ``end`` (a mixture's ``first_exhausted`` stops a pass when one source runs
        out; sources are read from row 0 in order, so what no pass reached is a tail)."""
        ds = self.dataset
        if not isinstance(ds, Mixture):
            return {}  # every pass reads a plain dataset whole
        out: dict[str, list[int]] = {}
        for k, src in enumerate(ds.sources):
            read = sum(ds.layout.count(passes.rows_in(e, end), k)
                       for e in range(len(passes.bases)))
            if read < (n := ds._len_of(k)):
                out[src.name] = [read, n]
        return out

    # -- history rules ---------------------------------------------------------------------------
    def earlier_ids(self, passes: Passes, index: int) -> list[list[str]]:
        """Per earlier pass the same source row came up in, newest first, its task ids there
        (newest first), wherever the interleave put it: one appearance per pass (a row a
        wrapping ``all_exhausted`` source gives twice in one pass is one appearance; a pass
        that did not reach it is none)."""
        o = self.origin(passes, index)
        out: list[list[str]] = []
        for d in range(o.pass_no - 1, -1, -1):
            rows = passes.rows_in(d, index)
            ats = self.dataset.appearances(o.source, o.row, passes.offsets[d], rows)
            if ats:
                out.append([dataset_task_id(passes.bases[d] + at) for at in reversed(ats)])
        return out

    def plan(self, passes: Passes, rows: Rows) -> Plan:
        """Which good rows of a release to stage, in which order, and which the history's
        rules skip (``strawq.data.prompt_policy``)."""
        cfg = self.config
        good = [i for i, r in rows if not isinstance(r, BadRow)]
        on = cfg.skip_zero_variance or cfg.longest_first
        history = self.history() if on and passes.number > 0 else None
        return plan_release(good, lambda i: self.earlier_ids(passes, i), history,
                            skip_zero_variance=cfg.skip_zero_variance,
                            revisit_epochs=cfg.zero_variance_revisit_epochs,
                            longest_first=cfg.longest_first)

    def history(self) -> PromptHistory:
        """The run's history, re-read at most every ``HISTORY_REFRESH_S``."""
        now = time.monotonic()
        if self._history_cache is None or now - self._history_cache[0] > HISTORY_REFRESH_S:
            self._history_cache = (now, load_history(self.storage))
        return self._history_cache[1]
