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
  rendered by the tokenizer plugin's chat template (``strawq.tokenize``).

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


def _digest(shards: Sequence[tuple[str, int]]) -> str:
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
            "digest": _digest([(s.rel, s.size) for s in self.shards])}
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
        """The source dataset of row ``row`` in a mixture (``strawq.mixture``); None here."""
        return None

    # -- passes (``strawq.planner``): one source, read whole by every pass --------------------
    def pass_len(self, offsets: Sequence[int] = ()) -> int:
        """Rows in a pass that starts each source at ``offsets`` (here: every row)."""
        return len(self)

    def iter_pass(self, start: int, offsets: Sequence[int] = ()
                  ) -> Iterator[tuple[int, Row | BadRow]]:
        """The pass's rows from its row ``start`` to its end."""
        return self._iter_raw(start)

    def next_offsets(self, offsets: Sequence[int], rows: int) -> tuple[int, ...]:
        """Where each source starts the pass after one of ``rows`` rows (() : all at 0)."""
        return ()

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
    if not 0 <= last <= shards[n - 1].size or _digest(
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
    ``strawq.cursor.read_cursor_state`` reads it, None for a run without one), unless
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
    #: ``skip`` (the history's rule, ``strawq.prompt_policy``) and drop as ``bad``
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
    the pass starts each source (``strawq.planner``)."""
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
