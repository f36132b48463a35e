"""Prompt datasets: JSONL or Parquet, one file, a directory or a glob of shards, through fsspec.

Rows are addressed by their 0-based index over the whole dataset (shards in sorted path
order, rows in file order), which becomes the task id (``i<index>``) and the dataset
cursor's unit. A malformed row is not an exception for the whole run: it comes back as a
``BadRow`` that the feeder records as *dropped* with the reason, so every index stays
accounted for (docs/design.md, invariant 1).

A row's prompt (``row[prompt_key]``) is one of

* token ids: a non-empty list of non-negative ints, sent as they are;
* text: a non-empty string, tokenized by the producer's tokenizer plugin;
* chat messages: a non-empty list of ``{"role": str, "content": str | list | None, ...}``,
  rendered by the tokenizer plugin's chat template (``strawq.data.tokenize``).

The *fingerprint* names what the cursor counts over: the shards' paths (relative to the
dataset's root), their sizes and the format, digested. It does not depend on the URL, so
the same files under another mount point match; the feeder refuses to release from a
dataset whose fingerprint differs from the run's (``docs/datasets.md``).

A dataset that holds no row (a failed export) is refused before it can bind a run
(``EmptyDataset``), and so is one that is not the run's, unless the operator says it is the
run's dataset with rows appended and its fingerprint agrees (``check_binding``).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import posixpath
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import xxhash

from strawq.errors import DatasetError

log = logging.getLogger(__name__)

FORMATS = ("jsonl", "parquet")
EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl",
              ".jsonl.gz": "jsonl", ".json.gz": "jsonl", ".ndjson.gz": "jsonl",
              ".parquet": "parquet", ".pq": "parquet"}
#: the compression an extension ending names (read through fsspec's codec of that name)
COMPRESSIONS = {".gz": "gzip"}
_GLOB_CHARS = "*?["


@dataclass(frozen=True)
class BadRow:
    """A row that cannot become a task: its task index, and what is wrong, where."""

    index: int
    #: ``<file> line <n>: <what is wrong>`` (JSONL) or ``<file> row <n>: ...`` (Parquet)
    message: str
    #: the shard file the row is in
    shard: str = ""
    #: its 1-based line in a JSONL file (blank lines counted), or None
    line: int | None = None
    #: its 0-based row in a Parquet file, or None
    row: int | None = None
    #: what is wrong, in a few words: the refusal of a release groups bad rows by it
    cause: str = ""
    #: the keys the row holds, when the prompt key is missing from it
    keys: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """What ``--json`` output and the drop record say about the row."""
        out: dict[str, Any] = {"index": self.index, "message": self.message,
                               "shard": self.shard, "cause": self.cause}
        if self.line is not None:
            out["line"] = self.line
        if self.row is not None:
            out["row"] = self.row
        if self.keys:
            out["keys"] = list(self.keys)
        return out


Row = dict[str, Any]


def format_of(path: str) -> str | None:
    """The format a shard's extension names (``.jsonl.gz`` names JSONL), or None."""
    stem, ext = posixpath.splitext(path.lower())
    if ext in COMPRESSIONS:
        ext = posixpath.splitext(stem)[1] + ext
    return EXTENSIONS.get(ext)


def compression_of(path: str) -> str | None:
    """The compression a shard's extension names (``"gzip"`` for ``.gz``), or None."""
    return COMPRESSIONS.get(posixpath.splitext(path.lower())[1])


def prompt_kind(prompt: Any) -> str | None:
    """``"ids"``, ``"text"`` or ``"chat"`` for a valid prompt, None otherwise."""
    if isinstance(prompt, str):
        return "text" if prompt else None
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        return "ids"
    if all(isinstance(m, dict) for m in prompt):
        return "chat" if _chat_problem(prompt) is None else None
    return None


def _chat_problem(messages: list[dict[str, Any]]) -> str | None:
    for j, m in enumerate(messages):
        role = m.get("role")
        if not isinstance(role, str) or not role:
            return f"message {j} has no 'role' string (keys: {sorted(m)[:6]})"
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            return (f"message {j} ({role}): 'content' must be a string, a list of parts or "
                    f"null, found {type(content).__name__}")
    return None


def _check_row(index: int, row: Any, prompt_key: str, where: str) -> Row | BadRow:
    """``row`` if it can become a task, else a ``BadRow`` whose message starts with
    ``where`` (the file and the place in it)."""
    def bad(cause: str, what: str, keys: tuple[str, ...] = ()) -> BadRow:
        return BadRow(index, f"{where}: {what}", cause=cause, keys=keys)

    if not isinstance(row, dict):
        return bad("not a JSON object", f"expected a JSON object, found {type(row).__name__}")
    prompt = row.get(prompt_key)
    if isinstance(prompt, str):
        if not prompt:
            return bad(f"{prompt_key!r} is empty", f"{prompt_key!r} is an empty string")
    elif isinstance(prompt, list):
        if not prompt:
            return bad(f"{prompt_key!r} is empty", f"{prompt_key!r} is an empty list")
        if all(isinstance(m, dict) for m in prompt):
            problem = _chat_problem(prompt)
            if problem is not None:
                return bad(f"{prompt_key!r} has bad chat messages",
                           f"{prompt_key!r} chat messages: {problem}")
        elif prompt_kind(prompt) is None:
            return bad(f"{prompt_key!r} is not a prompt",
                       f"{prompt_key!r} must be a list of non-negative token ids or a list of "
                       "chat messages {role, content}")
    else:
        keys = tuple(sorted(str(k) for k in row))
        what = (f"missing {prompt_key!r}" if prompt_key not in row
                else f"{prompt_key!r} is a {type(prompt).__name__}")
        return bad(what, f"{what} (expected text, token ids or chat messages); keys present: "
                         f"{list(keys[:10])}", keys if prompt_key not in row else ())
    try:
        msgpack.packb(row, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        return bad("not serialisable", f"row is not serialisable as data: {exc}")
    return row


@dataclass(frozen=True)
class Shard:
    path: str  # the filesystem's path
    rel: str  # relative to the dataset's root: what the fingerprint names
    size: int  # bytes on the filesystem (compressed, for a compressed shard)
    fmt: str
    #: the codec the file is read through (``"gzip"``: a ``.jsonl.gz`` file), or None
    compression: str | None = None


def _shard(path: str, rel: str, size: int, fmt: str) -> Shard:
    """A shard; a JSONL file whose name ends in ``.gz`` is read through gzip."""
    return Shard(path, rel, size, fmt, compression_of(path) if fmt == "jsonl" else None)


def shard_digest(shards: Sequence[tuple[str, int]]) -> str:
    """The fingerprint's digest of (relative path, size) pairs, in the dataset's order."""
    digest = xxhash.xxh3_64()
    for rel, size in shards:
        digest.update(f"{rel}\0{size}\n".encode())
    return digest.hexdigest()


class EmptyDataset(DatasetError):
    """The dataset holds no row: an empty file, a file of blank lines, a Parquet file of 0
    rows, a shard set whose every file is one of those, or a mixture with such a source.
    Refused before it binds a run (its cursor would be committed exhausted at its first
    row, and the real data refused afterwards as another dataset)."""


class Dataset:
    """Sequential-by-cursor reader over JSONL or Parquet shards (any fsspec URL).

    ``url`` is one file, a directory (every ``.jsonl/.json/.ndjson/.parquet/.pq`` file
    below it, and the JSONL ones gzip'd as ``.jsonl.gz`` etc., hidden and ``_``-prefixed
    names skipped) or a glob (``data/train-*.parquet``). Shards are read in sorted path
    order. ``fmt`` forces the format of every shard; otherwise each shard's extension
    decides, and other extensions (``.csv``) are refused.
    """

    def __init__(self, url: str, *, prompt_key: str = "prompt", fmt: str | None = None) -> None:
        self.url = url
        self.prompt_key = prompt_key
        if fmt is not None and fmt not in FORMATS:
            raise DatasetError(f"unknown dataset format {fmt!r}; expected jsonl or parquet")
        import fsspec  # on first use: reading a run's cursor needs no filesystem layer

        try:
            self._fs, path = fsspec.core.url_to_fs(url)
            self.shards = self._list_shards(url, path.rstrip("/") or path, fmt)
        except DatasetError:
            raise
        except FileNotFoundError:
            raise DatasetError(f"dataset {url!r} does not exist") from None
        except OSError as exc:  # in words, with what to do (no "[Errno 13]")
            from strawq.errors import os_error_text

            raise DatasetError(f"dataset {url!r}: {os_error_text(exc, 'open')}") from exc
        except Exception as exc:
            raise DatasetError(f"cannot open dataset {url!r}: {exc}") from exc
        formats = sorted({s.fmt for s in self.shards})
        if len(formats) > 1:
            raise DatasetError(f"dataset {url!r} mixes formats {formats}; keep one format per "
                               "dataset (or pass fmt=)")
        self.fmt = formats[0]
        self.fingerprint: dict[str, Any] = {
            "url": url, "format": self.fmt, "shards": len(self.shards),
            "size": sum(s.size for s in self.shards),
            "digest": shard_digest([(s.rel, s.size) for s in self.shards])}
        self._len: int | None = None

    def _list_shards(self, url: str, path: str, fmt: str | None) -> list[Shard]:
        fs = self._fs
        if any(c in path for c in _GLOB_CHARS):
            root = path[:min(path.index(c) for c in _GLOB_CHARS if c in path)]
            root = root.rpartition("/")[0]
            found = {p: fs.info(p) for p in fs.glob(path)}
        else:
            info = fs.info(path)
            if info.get("type") != "directory":
                sfmt = fmt or format_of(path)
                if sfmt is None:
                    raise DatasetError(
                        f"cannot tell the format of {url!r} from its extension; strawq reads "
                        f"JSONL ({', '.join(k for k, v in EXTENSIONS.items() if v == 'jsonl')})"
                        " and Parquet (.parquet, .pq); pass fmt='jsonl' or fmt='parquet' if "
                        "the file is one of those (CSV is not supported: convert it)")
                rel = posixpath.basename(path)
                return [_shard(path, rel, int(info.get("size") or 0), sfmt)]
            root = path
            found = fs.find(path, detail=True)
        shards = []
        for p, info in sorted(found.items()):
            if info.get("type") == "directory":
                continue
            rel = posixpath.relpath(p, root) if root else p
            if any(part.startswith((".", "_")) for part in rel.split("/")):
                continue  # hidden files, _SUCCESS, _metadata
            sfmt = fmt or format_of(p)
            if sfmt is None:
                continue
            shards.append(_shard(p, rel, int(info.get("size") or 0), sfmt))
        if not shards:
            raise DatasetError(f"dataset {url!r} has no JSONL or Parquet files "
                               f"({', '.join(EXTENSIONS)})")
        return shards

    def __len__(self) -> int:
        if self._len is None:
            self._len = sum(self._shard_len(s) for s in self.shards)
        return self._len

    def _shard_len(self, shard: Shard) -> int:
        if shard.fmt == "parquet":
            n = int(self._parquet_meta(shard).num_rows)
            if n < 0:  # damaged footer metadata
                raise DatasetError(f"{shard.path}: not a readable Parquet file: its footer "
                                   f"says {n} rows")
            return n
        return sum(1 for raw in self._lines(shard) if raw.strip())

    def _lines(self, shard: Shard) -> Iterator[bytes]:
        """A JSONL shard's lines, through its codec (a ``.jsonl.gz`` reads as JSONL); a
        compressed file that cannot be decompressed is a ``DatasetError`` naming it."""
        try:
            with self._fs.open(shard.path, "rb", compression=shard.compression) as f:
                yield from f
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
            if shard.compression is None:
                raise
            raise DatasetError(f"{shard.path}: not a readable {shard.compression} file "
                               f"({exc}): a truncated or damaged export? Fix or replace "
                               "it") from exc

    # -- empty datasets ------------------------------------------------------------------------
    def is_empty(self) -> bool:
        """Whether the dataset holds no row. Reads each shard only up to its first row (a
        JSONL file to its first line that is not blank, a Parquet file's footer), so a
        dataset that has rows costs one line or one footer."""
        return self.emptiness() is not None

    def emptiness(self) -> str | None:
        """None when the dataset holds a row; else what is empty, in words: the empty file
        and how (0 bytes, only blank lines, a Parquet file of 0 rows), or every file of a
        shard set (``require_rows`` makes it the refusal)."""
        why: list[str] = []
        for shard in self.shards:
            problem = self._shard_emptiness(shard)
            if problem is None:
                return None
            why.append(problem)
        if len(why) == 1:
            return why[0]
        shown = "; ".join(why[:5]) + (f"; and {len(why) - 5} more" if len(why) > 5 else "")
        return f"all its {len(why)} files are empty: {shown}"

    def _shard_emptiness(self, shard: Shard) -> str | None:
        """None when ``shard`` holds a row (read up to it), else how it is empty."""
        if shard.fmt == "parquet":
            try:
                n = int(self._parquet_meta(shard).num_rows)
            except DatasetError:
                if shard.size == 0:  # no footer to read: a file that was never written
                    return f"{shard.rel} is empty (0 bytes)"
                raise
            return f"{shard.rel} is a Parquet file of 0 rows" if n == 0 else None
        read = 0
        for raw in self._lines(shard):
            if raw.strip():
                return None
            read += len(raw)
        what = "holds only blank lines" if read else "is empty"
        if shard.compression and shard.size:
            return f"{shard.rel} {what} once decompressed"
        return f"{shard.rel} {what}" + ("" if read else " (0 bytes)")

    def _parquet_meta(self, shard: Shard) -> Any:
        import pyarrow.parquet as pq

        try:
            with self._fs.open(shard.path, "rb") as f:
                return pq.ParquetFile(f).metadata
        except Exception as exc:
            raise DatasetError(f"{shard.path}: not a readable Parquet file: {exc}") from exc

    def _iter_raw(self, start: int) -> Iterator[tuple[int, Row | BadRow]]:
        base = 0
        for shard in self.shards:
            if shard.fmt == "parquet" and start > base:
                # skip whole shards by their footers, without reading rows
                n = int(self._parquet_meta(shard).num_rows)
                if base + n <= start:
                    base += n
                    continue
            it = (self._iter_parquet if shard.fmt == "parquet" else self._iter_jsonl)(
                shard, base, start)
            yield from it
            base = it.end

    def _iter_jsonl(self, shard: Shard, base: int, start: int) -> _Counted:
        def gen(c: _Counted) -> Iterator[tuple[int, Row | BadRow]]:
            index = base
            for lineno, raw in enumerate(self._lines(shard), 1):
                line = raw.strip()
                if not line:
                    continue  # blank lines are not rows
                if index >= start:
                    where = f"{shard.path} line {lineno}"
                    try:
                        got: Row | BadRow = _check_row(index, json.loads(line),
                                                       self.prompt_key, where)
                    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                        got = BadRow(index, f"{where}: invalid JSON: {exc}",
                                     cause="invalid JSON")
                    if isinstance(got, BadRow):
                        got = dataclasses.replace(got, shard=shard.path, line=lineno)
                    yield index, got
                index += 1
                c.end = index
        return _Counted(gen, base)

    def _iter_parquet(self, shard: Shard, base: int, start: int) -> _Counted:
        import pyarrow.parquet as pq

        def gen(c: _Counted) -> Iterator[tuple[int, Row | BadRow]]:
            with self._fs.open(shard.path, "rb") as f:
                try:
                    pf = pq.ParquetFile(f)
                except Exception as exc:
                    raise DatasetError(f"{shard.path}: not a readable Parquet file: "
                                       f"{exc}") from exc
                b = base
                for rg in range(pf.num_row_groups):
                    n = pf.metadata.row_group(rg).num_rows
                    if b + n > start:
                        try:
                            rows = pf.read_row_group(rg).to_pylist()
                        except Exception as exc:  # pyarrow: OSError, ArrowInvalid, ...
                            raise DatasetError(f"{shard.path}: row group {rg} is not readable "
                                               f"Parquet ({exc}); fix or replace the file"
                                               ) from exc
                        for i in range(max(0, start - b), len(rows)):
                            index, r = b + i, b + i - base  # r: the row in this file
                            got = _check_row(index, rows[i], self.prompt_key,
                                             f"{shard.path} row {r} (0-based)")
                            if isinstance(got, BadRow):
                                got = dataclasses.replace(got, shard=shard.path, row=r)
                            yield index, got
                    b += n
                    c.end = b
        return _Counted(gen, base)

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

    def shard_paths(self) -> Sequence[str]:
        return [s.path for s in self.shards]

    def source_of(self, row: int) -> str | None:
        """The source dataset of row ``row`` in a mixture (``strawq.data.mixture``); None here."""
        return None

    # -- passes (``strawq.data.planner``): one source, read whole by every pass --------------------
    @property
    def source_count(self) -> int:
        """The datasets this one interleaves (1; a mixture's sources)."""
        return 1

    def pass_len(self, offsets: Sequence[int] = ()) -> int:
        """Rows in a pass that starts each source at ``offsets`` (here: every row)."""
        return len(self)

    def iter_pass(self, start: int, offsets: Sequence[int] = ()
                  ) -> Iterator[tuple[int, Row | BadRow]]:
        """The pass's rows from its row ``start`` to its end."""
        return self._iter_raw(start)

    def next_offsets(self, offsets: Sequence[int], rows: int) -> tuple[int, ...]:
        """Where each source starts the pass after one of ``rows`` rows."""
        return (0,)

    def locate_row(self, row: int, offsets: Sequence[int] = ()) -> tuple[str | None, int]:
        """(source, row within it) of the pass's row ``row``."""
        return None, row

    def appearances(self, source: str | None, source_row: int, offsets: Sequence[int],
                    rows: int) -> list[int]:
        """The rows of a pass of ``rows`` rows (starting at ``offsets``) that hold
        ``source_row`` of ``source``, ascending."""
        return [source_row] if 0 <= source_row < rows else []


class _Counted:
    """An iterator over one shard's rows that knows the index after its last row."""

    def __init__(self, gen: Any, base: int) -> None:
        self.end = base
        self._it: Iterator[tuple[int, Row | BadRow]] = gen(self)

    def __iter__(self) -> Iterator[tuple[int, Row | BadRow]]:
        return self._it

    def __next__(self) -> tuple[int, Row | BadRow]:
        return next(self._it)
