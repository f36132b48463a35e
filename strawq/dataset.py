"""Prompt datasets: JSONL or Parquet, read through fsspec and pyarrow.

Rows are addressed by their 0-based index, which becomes the task id (``i<index>``) and the
dataset cursor's unit. A malformed row is not an exception for the whole run: it comes back
as a ``BadRow`` that the feeder records as *dropped* with the reason, so every index stays
accounted for (invariant 1).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import msgpack

from strawq.errors import DatasetError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BadRow:
    index: int
    message: str


Row = dict[str, Any]


def _check_row(index: int, row: Any, prompt_key: str, where: str) -> Row | BadRow:
    if not isinstance(row, dict):
        return BadRow(index, f"{where}: expected a JSON object, found {type(row).__name__}")
    prompt = row.get(prompt_key)
    if isinstance(prompt, str):
        if not prompt:
            return BadRow(index, f"{where}: {prompt_key!r} is an empty string")
    elif isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                 for t in prompt):
            return BadRow(index, f"{where}: {prompt_key!r} must be a non-empty list of "
                                 "non-negative token ids")
    else:
        return BadRow(index, f"{where}: missing {prompt_key!r} (a string or a list of token "
                             f"ids); keys present: {sorted(row)[:10]}")
    try:
        msgpack.packb(row, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        return BadRow(index, f"{where}: row is not serialisable as data: {exc}")
    return row


class Dataset:
    """Random-access-by-cursor reader over a JSONL or Parquet file (any fsspec URL)."""

    def __init__(self, url: str, *, prompt_key: str = "prompt", fmt: str | None = None) -> None:
        self.url = url
        self.prompt_key = prompt_key
        self.fmt = fmt or ("parquet" if url.endswith((".parquet", ".pq")) else "jsonl")
        if self.fmt not in ("jsonl", "parquet"):
            raise DatasetError(f"unknown dataset format {self.fmt!r}; expected jsonl or parquet")
        try:
            self._fs, self._path = fsspec.core.url_to_fs(url)
            info = self._fs.info(self._path)
        except FileNotFoundError:
            raise DatasetError(f"dataset {url!r} does not exist") from None
        except Exception as exc:
            raise DatasetError(f"cannot open dataset {url!r}: {exc}") from exc
        self.fingerprint = {"url": url, "size": int(info.get("size") or 0), "format": self.fmt}
        self._len: int | None = None

    def __len__(self) -> int:
        if self._len is None:
            self._len = sum(1 for _ in self._iter_raw(0))
        return self._len

    def _iter_raw(self, start: int) -> Iterator[tuple[int, Row | BadRow]]:
        if self.fmt == "parquet":
            yield from self._iter_parquet(start)
            return
        with self._fs.open(self._path, "rb") as f:
            index = 0
            for raw in f:
                line = raw.strip()
                if not line:
                    continue  # blank lines are not rows
                if index >= start:
                    where = f"{self.url} row {index}"
                    try:
                        row = json.loads(line)
                    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                        yield index, BadRow(index, f"{where}: invalid JSON: {exc}")
                    else:
                        yield index, _check_row(index, row, self.prompt_key, where)
                index += 1

    def _iter_parquet(self, start: int) -> Iterator[tuple[int, Row | BadRow]]:
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(self._fs.open(self._path, "rb"))
        except Exception as exc:
            raise DatasetError(f"{self.url}: not a readable Parquet file: {exc}") from exc
        base = 0
        for rg in range(pf.num_row_groups):
            n = pf.metadata.row_group(rg).num_rows
            if base + n <= start:
                base += n
                continue
            for i, row in enumerate(pf.read_row_group(rg).to_pylist()):
                index = base + i
                if index >= start:
                    yield index, _check_row(index, row, self.prompt_key,
                                            f"{self.url} row {index}")
            base += n

    def read(self, start: int, count: int) -> list[tuple[int, Row | BadRow]]:
        """Rows ``start .. start+count-1`` (fewer at the end of the dataset)."""
        out: list[tuple[int, Row | BadRow]] = []
        if count <= 0:
            return out
        for item in self._iter_raw(start):
            out.append(item)
            if len(out) >= count:
                break
        return out


class DatasetCursorReader:
    """Keeps one open iterator so sequential releases do not rescan the file."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self._it: Iterator[tuple[int, Row | BadRow]] | None = None
        self._next = -1

    def read(self, start: int, count: int) -> list[tuple[int, Row | BadRow]]:
        if self._it is None or self._next != start:
            self._it = self.dataset._iter_raw(start)
            self._next = start
        out: list[tuple[int, Row | BadRow]] = []
        for item in self._it:
            out.append(item)
            self._next = item[0] + 1
            if len(out) >= count:
                break
        return out
