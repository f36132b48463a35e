"""What a run's cursor binds to: the dataset it counts over, checked before a release or a
collector writes anything.

The fingerprint a cursor records names the data (``Dataset.fingerprint``, plus the task
index of row 0 after a switch). A dataset whose fingerprint differs is refused
(``DatasetMismatch``) with what differs, unless it is the run's dataset with rows appended
and the operator says so (``--dataset-grew``, ``growth_problem``); a dataset without rows is
refused before anything is written (``require_rows``, ``EmptyDataset``).
``DatasetCursorReader`` reads a bound dataset's rows by task index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

from strawq.data.dataset import BadRow, Dataset, EmptyDataset, Row, shard_digest
from strawq.errors import DatasetError


def fingerprints_match(recorded: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether a cursor's recorded fingerprint names the same data as ``current``.

    Fingerprints written before shards were digested (``url, size, format``) are compared
    by size and format, since their URL may name the same file under another mount."""
    if not recorded:
        return True
    if "digest" in recorded:
        return all(recorded.get(k) == current.get(k) for k in ("format", "digest"))
    return all(recorded.get(k) == current.get(k) for k in ("format", "size"))


class DatasetMismatch(DatasetError):
    """The dataset given is not the one the run's cursor counts over (or its prompt key
    differs from the run's)."""


def _describe(fp: dict[str, Any]) -> str:
    if not fp:
        return "(none recorded)"
    parts = [f"url {fp.get('url')!r}", f"format {fp.get('format')}"]
    if "digest" in fp:
        parts += [f"{fp.get('shards')} shard(s)", f"{fp.get('size')} bytes",
                  f"digest {fp.get('digest')}"]
    else:
        parts.append(f"{fp.get('size')} bytes")
    if fp.get("base"):
        parts.append(f"its row 0 is task index {fp['base']}")
    return ", ".join(parts)


#: the operator's statement that the dataset given is the run's with rows appended
#: (``strawq release``, ``strawq collector``; ``check_binding(grew=True)``)
GREW_FLAG = "--dataset-grew"


def growth_problem(recorded: dict[str, Any], dataset: Dataset) -> str | None:
    """None when ``dataset`` may be the dataset the fingerprint ``recorded`` names with rows
    appended; else why it may not, in words.

    The fingerprint keeps the shards' count, total size and a digest of their names and
    sizes, so this is told from names and sizes, not contents: the recorded shards must be
    the first of ``dataset``'s, in its order, each unchanged (same name, same size) but the
    last, whose size may only have grown; later shards are new. Rows appended anywhere else
    would renumber rows the run has released. That the first rows are unchanged is the
    operator's word (``GREW_FLAG``). A mixture cannot be judged (its fingerprint does not
    keep each source's files), nor a fingerprint written before shards were digested."""
    if recorded.get("format") == "mixture" or dataset.fmt == "mixture":
        return ("a mixture's fingerprint does not keep each source's files, so its growth "
                "cannot be checked")
    if "digest" not in recorded:
        return "the run's fingerprint predates shard digests, so growth cannot be checked"
    if recorded.get("format") != dataset.fmt:
        return f"its format is {dataset.fmt}, the run's dataset is {recorded.get('format')}"
    try:
        n, size = int(recorded["shards"]), int(recorded["size"])
    except (KeyError, TypeError, ValueError):
        return "the run's fingerprint has no shard count or size"
    shards = dataset.shards
    if not 0 < n <= len(shards):
        return f"it has {len(shards)} file(s), the run's dataset had {n}"
    kept = [(s.rel, s.size) for s in shards[:n - 1]]
    last = size - sum(sz for _, sz in kept)
    if not 0 <= last <= shards[n - 1].size or shard_digest(
            [*kept, (shards[n - 1].rel, last)]) != recorded.get("digest"):
        return (f"the run's {n} file(s) ({size} bytes) are not its first {n}, unchanged but "
                "for the last one's appended bytes")
    return None


def mismatch_message(recorded: dict[str, Any], dataset: Dataset, next_index: int) -> str:
    head = (f"refusing to release from {dataset.url!r}: it is not the run's dataset "
            f"(the cursor, at index {next_index}, counts over {_describe(recorded)}; this "
            f"dataset is {_describe(dataset.fingerprint)}). ")
    problem = growth_problem(recorded, dataset)
    if problem is None:
        return head + (
            "Its files say it is the run's dataset with rows appended (the run's files come "
            "first, unchanged but for the last one, which grew). If its first rows are the "
            f"run's, continue the run over the new rows, task ids continuing from index "
            f"{next_index}: strawq release RUN DATASET {GREW_FLAG} (or strawq collector RUN "
            f"DATASET {GREW_FLAG}; from Python, Feeder(queue, dataset, check_dataset=False)"
            ".continue_grown()). Otherwise release from the run's dataset (docs/datasets.md)")
    return head + (
        "Release from the run's dataset; to switch datasets on purpose (the new rows continue "
        "the run's task indices), call Feeder(queue, dataset, check_dataset=False)"
        f".switch_dataset() (docs/datasets.md). It is not the run's dataset with rows "
        f"appended, which {GREW_FLAG} would continue: {problem}")


def require_rows(dataset: Dataset) -> None:
    """``EmptyDataset``, naming the empty file, shard set or mixture source, unless the
    dataset holds a row (``Dataset.emptiness``: reads up to the first row)."""
    what = dataset.emptiness()
    if what is not None:
        raise EmptyDataset(
            f"refusing dataset {dataset.url!r}: {what}. A dataset without rows would bind the "
            "run: its cursor would be committed exhausted at its first row and the real data "
            "refused afterwards as another dataset. Nothing was written to the run; check the "
            "export that made it and pass a dataset that holds rows (docs/datasets.md, "
            "Empty datasets)")


def check_binding(dataset: Dataset, cursor: dict[str, Any] | None, *,
                  grew: bool = False) -> bool:
    """Refuse, before anything is written to the run, a dataset that must not bind it.

    ``EmptyDataset`` when it holds no row (``require_rows``); ``DatasetMismatch`` when it is
    not the dataset the run's cursor counts over (``cursor``: the run's newest cursor as
    ``strawq.data.cursor.read_cursor_state`` reads it, None for a run without one), unless
    ``grew`` (the operator's ``GREW_FLAG``) and it is that dataset with rows appended
    (``growth_problem``). Returns True in that case: the caller continues the cursor over
    it (``Feeder.continue_grown``) before it releases."""
    require_rows(dataset)
    recorded = dict((cursor or {}).get("fingerprint") or {})
    if fingerprints_match(recorded, dataset.fingerprint):
        return False
    next_index = int((cursor or {}).get("next_index") or 0)
    if not grew:
        raise DatasetMismatch(mismatch_message(recorded, dataset, next_index))
    problem = growth_problem(recorded, dataset)
    if problem is not None:
        raise DatasetMismatch(
            f"refusing to continue {dataset.url!r} as the run's dataset grown ({GREW_FLAG}): "
            f"{problem} (the cursor, at index {next_index}, counts over "
            f"{_describe(recorded)}; this dataset is {_describe(dataset.fingerprint)}). "
            "Release from the run's dataset, or switch datasets on purpose with "
            "Feeder(queue, dataset, check_dataset=False).switch_dataset() (docs/datasets.md)")
    return True


class DatasetCursorReader:
    """Keeps one open iterator so sequential releases do not rescan the file.

    Task indices are ``base + row``: ``base`` is 0 unless the run switched datasets on
    purpose (the new dataset's rows continue the run's index space; names are never
    reused). It is part of the fingerprint the cursor records."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self.base = 0
        #: where the current pass starts each source (``Dataset.iter_pass``; (): all at 0)
        self._offsets: tuple[int, ...] = ()
        self._it: Iterator[tuple[int, Row | BadRow]] | None = None
        self._next = -1

    @property
    def fingerprint(self) -> dict[str, Any]:
        """What the cursor records: the dataset's fingerprint and the base, when not 0."""
        return {**self.dataset.fingerprint, **({"base": self.base} if self.base else {})}

    @property
    def offsets(self) -> tuple[int, ...]:
        return self._offsets

    @offsets.setter
    def offsets(self, value: Sequence[int]) -> None:
        if tuple(value) != self._offsets:
            self._offsets = tuple(value)
            self._it = None  # the rows of another pass

    def adopt(self, recorded: dict[str, Any], next_index: int = 0) -> None:
        """Check a cursor's recorded fingerprint against this dataset and take its base;
        ``DatasetMismatch`` when they differ."""
        if not fingerprints_match(recorded, self.dataset.fingerprint):
            raise DatasetMismatch(mismatch_message(recorded, self.dataset, next_index))
        self.base = int(recorded.get("base", 0) or 0)

    def read(self, start: int, count: int) -> list[tuple[int, Row | BadRow]]:
        """Rows at task indices ``start .. start+count-1`` (fewer at the end)."""
        if start < self.base:
            raise DatasetError(f"task index {start} is before this dataset's first row "
                               f"(index {self.base})")
        row_start = start - self.base
        if self._it is None or self._next != row_start:
            self._it = self.dataset.iter_pass(row_start, self.offsets)
            self._next = row_start
        out: list[tuple[int, Row | BadRow]] = []
        if count <= 0:
            return out
        for index, row in self._it:
            self._next = index + 1
            if self.base:
                index += self.base
                if isinstance(row, BadRow):
                    row = dataclasses.replace(row, index=index)
            out.append((index, row))
            if len(out) >= count:
                break
        return out
