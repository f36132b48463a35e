"""The release model, the passes: which row of which source each task index of each pass
is (``Source``, ``ModelRow``, ``ModelPass``, ``ReleaseModel``).

Part of ``strawq.testing.release_model`` (the statement, and every public name).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from strawq.data.mixture import Layout, integer_weights

#: ``filter(task, rewards) -> reason | None``: a mixture source's filter
#: (``strawq.collector.mixing``: ``task`` holds ``id``, ``index`` and ``source``; the
#: rewards are the group's valid ones)
FilterFn = Callable[[dict[str, Any], list[float]], "str | None"]
STOPPING_STRATEGIES = ("first_exhausted", "all_exhausted")


@dataclass(frozen=True)
class Source:
    """One source of the dataset (a plain dataset is one)."""

    name: str
    #: L_k: its rows, bad ones included
    rows: int
    #: its weight (made integer by ``strawq.data.mixture.integer_weights``, as the mixture does)
    weight: float = 1.0
    #: its rows that cannot become a task (never released)
    bad: frozenset[int] = frozenset()
    #: its filter, or None
    filter: FilterFn | None = None


@dataclass(frozen=True)
class ModelRow:
    """One row of one pass."""

    #: the task index
    index: int
    #: the pass (0-based)
    pass_no: int
    #: its mixture row in the pass
    position: int
    #: the source's number and name
    source: int
    name: str
    #: its row in the source
    source_row: int
    bad: bool

    @property
    def key(self) -> tuple[int, int]:
        """(source, source row): the row whatever the pass."""
        return self.source, self.source_row

    def __str__(self) -> str:
        return (f"pass {self.pass_no} row {self.position} (task index {self.index}, "
                f"{self.name} row {self.source_row})")


@dataclass(frozen=True)
class ModelPass:
    number: int
    #: the task index of its mixture row 0
    base: int
    #: o_k(e): each source's first row in this pass
    offsets: tuple[int, ...]
    rows: tuple[ModelRow, ...]


class ReleaseModel:
    """The rows of every pass over ``sources`` (see the module's docstring)."""

    def __init__(self, sources: Sequence[Source], *, stopping_strategy: str = "first_exhausted",
                 passes: int = 1, base: int = 0, plain: bool = False) -> None:
        if not sources:
            raise ValueError("a dataset has at least one source")
        if any(s.rows < 1 for s in sources):
            raise ValueError("every source has at least one row")
        if stopping_strategy not in STOPPING_STRATEGIES:
            raise ValueError(f"stopping_strategy must be one of {STOPPING_STRATEGIES}")
        if passes < 1:
            raise ValueError("a run makes at least one pass")
        if plain and len(sources) != 1:
            raise ValueError("a plain dataset is one source")
        self.sources = list(sources)
        self.stopping_strategy = stopping_strategy
        self.num_passes = passes
        self.base = base
        #: a plain dataset: its tasks carry no ``source``
        self.plain = plain
        self.layout = Layout(integer_weights([s.weight for s in sources]))
        self.passes = self._passes()
        self.rows: dict[int, ModelRow] = {r.index: r for p in self.passes for r in p.rows}
        self._appear: dict[tuple[int, int], list[int]] = {}
        for p in self.passes:
            for r in p.rows:
                seen = self._appear.setdefault(r.key, [])
                if not seen or seen[-1] != p.number:
                    seen.append(p.number)

    # -- the passes ------------------------------------------------------------------------
    def pass_length(self, offsets: Sequence[int]) -> int:
        """N_e for a pass whose sources start at ``offsets``."""
        if self.stopping_strategy == "first_exhausted":
            return min(self.layout.position(k, s.rows - offsets[k])
                       for k, s in enumerate(self.sources))
        return max(self.layout.position(k, s.rows - 1) for k, s in enumerate(self.sources)) + 1

    def _passes(self) -> list[ModelPass]:
        out = []
        offsets = [0] * len(self.sources)
        base = self.base
        for e in range(self.num_passes):
            n = self.pass_length(offsets)
            rows = []
            for r in range(n):
                k, j = self.layout.locate(r)
                src = self.sources[k]
                row = (offsets[k] + j) % src.rows
                rows.append(ModelRow(index=base + r, pass_no=e, position=r, source=k,
                                     name=src.name, source_row=row, bad=row in src.bad))
            out.append(ModelPass(e, base, tuple(offsets), tuple(rows)))
            offsets = [(offsets[k] + self.layout.count(n, k)) % s.rows
                       for k, s in enumerate(self.sources)]
            base += n
        return out

    @property
    def epoch_bases(self) -> list[int]:
        return [p.base for p in self.passes]

    @property
    def epoch_offsets(self) -> list[list[int]]:
        return [list(p.offsets) for p in self.passes]

    @property
    def end(self) -> int:
        """The task index after the last pass's last row."""
        return self.base + sum(len(p.rows) for p in self.passes)

    def consumed(self) -> list[int]:
        """C_k: the rows each source gave over all passes."""
        return [sum(self.layout.count(len(p.rows), k) for p in self.passes)
                for k in range(len(self.sources))]

    def unread(self) -> dict[str, list[int]]:
        """``{source: [C_k, L_k]}`` for each source whose rows ``[C_k, L_k)`` no pass
        reached (the final cursor's ``unread``)."""
        return {s.name: [c, s.rows] for s, c in zip(self.sources, self.consumed(), strict=True)
                if c < s.rows}

    def row_at(self, index: int) -> ModelRow | None:
        return self.rows.get(index)

    def appearances(self, key: tuple[int, int]) -> list[int]:
        """The passes in which (source, source row) ``key`` comes up."""
        return list(self._appear.get(key, []))

    def ago(self, key: tuple[int, int], then: int, now: int) -> int:
        """How many appearances of ``key`` ago pass ``then`` is, seen from pass ``now``:
        the passes from ``then`` up to ``now`` (excluded) in which the row came up."""
        return sum(1 for e in self.appearances(key) if then <= e < now)

    def source_named(self, name: str) -> int | None:
        return next((k for k, s in enumerate(self.sources) if s.name == name), None)
