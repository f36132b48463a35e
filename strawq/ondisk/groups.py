"""Group records: a prompt and its G samples, packed as flat per-token columns.

The same structure is a *ready* group (every sample finished, rewards set) and a *partial*
group (some samples unfinished, their prefixes saved at a weight update). The four
per-token columns always have equal lengths and are cut per sample by ``sample_lens``
(docs/design.md, invariant 4); ``validate`` enforces it on every encode and decode.

Optional per-token extras (``strawq.ondisk.extras``: routed experts, top-p kept ids, teacher
log-probs) ride along in ``GroupData.extras``: one table ``x.<name>`` (column ``v``, the
rows flattened) and, for a ragged extra, ``x.<name>.n`` (column ``n``, values per row).
Their rows are the samples' rows one after another — response tokens only, or prompt +
response positions for a prompt extra (``sample_lens[i] + prompt_len`` rows for sample
``i``) — and the summary's ``extras`` says each one's dtype, row shape and kind. A record
without extras has no ``extras`` key, and its columns decode the same either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from strawq.errors import CorruptRecord
from strawq.ondisk import records
from strawq.ondisk.extras import Extra, ExtraError, spec_of
from strawq.ondisk.records import Kind
from strawq.ondisk.staleness import staleness as staleness  # its one definition, re-exported

if TYPE_CHECKING:  # pyarrow loads when a record's tables are read
    import pyarrow as pa

SAMPLE_STATUSES = ("completed", "truncated", "aborted", "pending", "failed")
TOKEN_COLUMNS = {"tokens": np.int32, "logprobs": np.float32, "versions": np.int64,
                 "loss_mask": np.uint8}
_TOKEN_DTYPES = tuple((c, np.dtype(t)) for c, t in TOKEN_COLUMNS.items())

@dataclass(kw_only=True)
class GroupData:
    task_id: str
    index: int
    prompt_ids: np.ndarray
    sample_lens: Sequence[int]
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    loss_mask: np.ndarray
    rewards: Sequence[float | None]
    status: Sequence[str]
    meta: dict[str, Any] = field(default_factory=dict)
    #: per-token extras (``strawq.ondisk.extras``), samples' rows one after another
    extras: dict[str, Extra] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prompt_ids = np.ascontiguousarray(self.prompt_ids, dtype=np.int32)
        for name, dtype in TOKEN_COLUMNS.items():
            setattr(self, name, np.ascontiguousarray(getattr(self, name), dtype=dtype))
        self.extras = dict(self.extras)
        self.sample_lens = [int(n) for n in self.sample_lens]
        self.rewards = [None if r is None else float(r) for r in self.rewards]
        self.status = [str(s) for s in self.status]
        self.validate()

    @property
    def num_samples(self) -> int:
        return len(self.sample_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def validate(self) -> None:
        n = self.tokens.shape[0]
        for name in TOKEN_COLUMNS:
            col = getattr(self, name)
            if col.ndim != 1 or col.shape[0] != n:
                raise CorruptRecord(f"group {self.task_id}: column {name!r} has shape "
                                    f"{col.shape}, expected ({n},) like 'tokens'")
        if sum(self.sample_lens) != n or any(x < 0 for x in self.sample_lens):
            raise CorruptRecord(f"group {self.task_id}: sample_lens {list(self.sample_lens)} "
                                f"sum to {sum(self.sample_lens)}, expected {n} tokens")
        g = len(self.sample_lens)
        if len(self.rewards) != g or len(self.status) != g:
            raise CorruptRecord(f"group {self.task_id}: {g} samples but {len(self.rewards)} "
                                f"rewards and {len(self.status)} statuses")
        bad = [s for s in self.status if s not in SAMPLE_STATUSES]
        if bad:
            raise CorruptRecord(f"group {self.task_id}: unknown sample status {bad[0]!r}; "
                                f"expected one of {SAMPLE_STATUSES}")
        for name, x in self.extras.items():
            _check_extra(f"group {self.task_id}", name, x, self.extra_rows(name))

    def extra_rows(self, name: str) -> int:
        """Rows of extra ``name`` the group holds (docs/design.md, invariant 4 for extras)."""
        return _extra_rows(name, self.num_tokens, int(self.prompt_ids.shape[0]),
                           len(self.sample_lens))

    def extra_offsets(self, name: str) -> np.ndarray:
        """Row offsets of each sample in extra ``name`` ([G + 1])."""
        p = int(self.prompt_ids.shape[0]) if spec_of(name).prompt else 0
        return np.concatenate([[0], np.cumsum([n + p for n in self.sample_lens],
                                              dtype=np.int64)])

    def sample_extras(self, i: int) -> dict[str, Extra]:
        """The extras' rows of sample ``i``."""
        out = {}
        for name, x in self.extras.items():
            off = self.extra_offsets(name)
            out[name] = x.take(int(off[i]), int(off[i + 1]))
        return out

    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.sample_lens, dtype=np.int64)])

    def sample(self, i: int) -> dict[str, np.ndarray]:
        """The per-token columns of sample ``i`` (views, no copy)."""
        off = self.offsets()
        return {name: getattr(self, name)[off[i]:off[i + 1]] for name in TOKEN_COLUMNS}

    def loss_tokens(self) -> list[int]:
        """Per sample, the tokens its loss mask trains."""
        off = self.offsets()
        csum = np.concatenate([[0], np.cumsum(self.loss_mask, dtype=np.int64)])
        return [int(n) for n in csum[off[1:]] - csum[off[:-1]]]

    def min_version(self, default: int = 0) -> int:
        if self.versions.size:
            return int(self.versions.min())
        return int(self.meta.get("version_hint", default))

    def max_version(self, default: int = 0) -> int:
        if self.versions.size:
            return int(self.versions.max())
        return int(self.meta.get("version_hint", default))

    def num_versions(self) -> int:
        if not self.versions.size:
            return 0
        lo, hi = int(self.versions.min()), int(self.versions.max())
        return 1 if lo == hi else int(np.unique(self.versions).size)

    def summary(self) -> dict[str, Any]:
        """Metadata that readers and the collector use without touching the payload."""
        return {
            "task_id": self.task_id,
            "index": self.index,
            "sample_lens": list(self.sample_lens),
            "prompt_len": int(self.prompt_ids.shape[0]),
            "rewards": list(self.rewards),
            "status": list(self.status),
            "min_version": self.min_version(),
            "max_version": self.max_version(),
            "num_versions": self.num_versions(),
            #: per sample, its trained tokens (loss_mask = 1): the whole batch's loss
            #: denominators come from the manifest without reading every payload
            "loss_tokens": self.loss_tokens(),
            "meta": self.meta,
            **({"extras": {name: _extra_info(name, x) for name, x in self.extras.items()}}
               if self.extras else {}),
        }

    def encode(self, kind: Kind = Kind.GROUP, *, run_format: int = 1) -> list[bytes]:
        """The record, in the schema ``kind`` has in ``run_format`` (the run's format:
        ``strawq.tasks.formats``)."""
        self.validate()
        tables = {
            "prompt": {"ids": self.prompt_ids},
            "tokens": {name: getattr(self, name) for name in TOKEN_COLUMNS},
        }
        for name, x in self.extras.items():
            tables[f"x.{name}"] = {"v": x.values.reshape(-1)}
            if x.counts is not None:
                tables[f"x.{name}.n"] = {"n": x.counts}
        return records.encode(kind, {"group": self.summary()}, tables, run_format=run_format)

    @classmethod
    def from_record(cls, rec: records.Record) -> GroupData:
        if rec.kind not in (Kind.GROUP, Kind.PARTIAL):
            raise CorruptRecord(f"expected a GROUP or PARTIAL record, found {rec.kind.name}")
        try:
            s = rec.meta["group"]
            fast = records.decode_tables_fast(rec.meta.get("tables", {}), rec.payload)
            if fast is not None and "tokens" in fast and "prompt" in fast:
                cols = {name: fast["tokens"][name] for name in TOKEN_COLUMNS}
                prompt = fast["prompt"]["ids"]
                flat = fast
            else:  # a stream the fast path does not take: pyarrow decodes it or says why
                tables = rec.tables()
                tok = tables["tokens"]
                cols = {name: tok.column(name).to_numpy(zero_copy_only=True)
                        for name in TOKEN_COLUMNS}
                prompt = tables["prompt"].column("ids").to_numpy(zero_copy_only=True)
                flat = _tables_numpy(tables)
            extras = _read_extras("group record", s, flat, len(cols["tokens"]),
                                  int(prompt.shape[0]))
            return cls(task_id=s["task_id"], index=s["index"], prompt_ids=prompt,
                       sample_lens=s["sample_lens"], rewards=s["rewards"], status=s["status"],
                       meta=s.get("meta", {}), extras=extras, **cols)
        except (KeyError, TypeError) as exc:
            raise CorruptRecord(f"group record is missing field {exc}") from exc
        except CorruptRecord:
            raise
        except ValueError as exc:  # pyarrow's ArrowInvalid: a column it cannot view
            raise CorruptRecord(f"group record: a column is not what it must be: {exc}") from exc


def decode_group(data: bytes | memoryview, *, name: str = "group") -> GroupData:
    rec = records.decode(data, name=name)
    return GroupData.from_record(rec)


class GroupColumns(NamedTuple):
    """A group record's summary and zero-copy numpy views of its columns."""

    #: ``meta["group"]`` as written by ``GroupData.summary``
    summary: dict[str, Any]
    #: int32 [prompt_len]
    prompt: np.ndarray
    #: the ``TOKEN_COLUMNS``, each [sum(sample_lens)] of its dtype
    columns: dict[str, np.ndarray]
    #: per-token extras (``strawq.ondisk.extras``); empty for a record without any
    extras: dict[str, Extra] = {}


def decode_group_columns(data: bytes | memoryview, *, name: str = "group",
                         expect: Kind | None = None, verify: bool = True) -> GroupColumns:
    """Verify a GROUP/PARTIAL record and view its columns without building a ``GroupData``.

    The reader's hot path: header and checksum as ``records.decode``; the Arrow streams via
    ``records.decode_tables_fast`` (falling back to ``records.decode_tables`` for any stream
    it does not take); then the checks of docs/design.md, invariant 4: every token column is
    ``sum(sample_lens)`` long with its dtype, the prompt is int32. ``CorruptRecord`` else.
    The views share ``data``'s memory (and its lifetime).
    """
    import pyarrow as pa

    rec = records.decode(data, expect=expect, name=name, verify=verify)
    if rec.kind not in (Kind.GROUP, Kind.PARTIAL):
        raise CorruptRecord(f"{name}: expected a GROUP or PARTIAL record, found {rec.kind.name}")
    try:
        summary = rec.meta["group"]
        index = rec.meta["tables"]
        lens = summary["sample_lens"]
        n = sum(lens)
        fast = records.decode_tables_fast(index, rec.payload)
        if fast is not None and "tokens" in fast and "prompt" in fast:
            tok, prompt = fast["tokens"], fast["prompt"]["ids"]
            flat = fast
        else:  # a stream the fast path does not take: pyarrow decodes it or says why not
            tables = records.decode_tables(index, rec.payload)
            tok = {c: tables["tokens"].column(c).to_numpy(zero_copy_only=True)
                   for c in TOKEN_COLUMNS}
            prompt = tables["prompt"].column("ids").to_numpy(zero_copy_only=True)
            flat = _tables_numpy(tables)
        cols = {c: tok[c] for c in TOKEN_COLUMNS}
        extras = _read_extras(name, summary, flat, n, int(prompt.shape[0])) \
            if "extras" in summary else {}
    except CorruptRecord:
        raise
    except (KeyError, TypeError) as exc:
        raise CorruptRecord(f"{name}: group record is missing field {exc}") from exc
    except (ValueError, OSError, pa.ArrowException) as exc:  # nulls, bad flatbuffers (no verify)
        raise CorruptRecord(f"{name}: group columns cannot be read: {exc}") from exc
    for c, dt in _TOKEN_DTYPES:
        col = cols[c]
        if col.shape != (n,) or col.dtype != dt:
            raise CorruptRecord(f"{name}: column {c!r} is {col.dtype}{list(col.shape)}, "
                                f"expected {dt}[{n}] (the sum of sample_lens)")
    if prompt.dtype != np.int32 or prompt.ndim != 1:
        raise CorruptRecord(f"{name}: prompt ids are {prompt.dtype}, expected int32")
    return GroupColumns(summary, prompt, cols, extras)


# -- extras in records -------------------------------------------------------------------------
def _extra_rows(name: str, tokens: int, prompt_len: int, samples: int) -> int:
    try:
        spec = spec_of(name)
    except ExtraError as exc:
        raise CorruptRecord(f"{exc} (written by a newer strawq?)") from None
    return tokens + (prompt_len * samples if spec.prompt else 0)


def _check_extra(what: str, name: str, x: Extra, rows: int) -> None:
    spec = spec_of(name)
    try:
        x.check(f"{what}: extra {name!r}")
    except ExtraError as exc:
        raise CorruptRecord(str(exc)) from None
    if x.ragged != spec.ragged or x.values.dtype != spec.dtype:
        raise CorruptRecord(f"{what}: extra {name!r} is {x.values.dtype}"
                            f"{' ragged' if x.ragged else ''}, expected {spec.dtype}"
                            f"{' ragged' if spec.ragged else ''}")
    if x.rows != rows:
        raise CorruptRecord(f"{what}: extra {name!r} has {x.rows} rows, expected {rows} "
                            f"({'prompt + ' if spec.prompt else ''}response tokens)")


def _extra_info(name: str, x: Extra) -> dict[str, Any]:
    spec = spec_of(name)
    return {"dtype": str(x.values.dtype), "shape": list(x.shape), "prompt": spec.prompt,
            "ragged": x.ragged}


def _tables_numpy(tables: dict[str, pa.RecordBatch]) -> dict[str, dict[str, np.ndarray]]:
    return {t: {c: b.column(c).to_numpy(zero_copy_only=True) for c in b.schema.names}
            for t, b in tables.items() if t.startswith("x.")}


def _read_extras(what: str, summary: dict[str, Any], tables: dict[str, dict[str, np.ndarray]],
                 tokens: int, prompt_len: int) -> dict[str, Extra]:
    """The extras a summary declares, checked against it and docs/design.md, invariant 4."""
    out: dict[str, Extra] = {}
    samples = len(summary["sample_lens"])
    for name, info in (summary.get("extras") or {}).items():
        rows = _extra_rows(name, tokens, prompt_len, samples)
        try:
            v = tables[f"x.{name}"]["v"]
            shape = tuple(int(d) for d in info["shape"])
            counts = tables[f"x.{name}.n"]["n"] if info.get("ragged") else None
        except KeyError as exc:
            raise CorruptRecord(f"{what}: extra {name!r} is declared but its column {exc} "
                                "is missing") from None
        if str(v.dtype) != info.get("dtype"):
            raise CorruptRecord(f"{what}: extra {name!r} is {v.dtype}, the summary says "
                                f"{info.get('dtype')}")
        if counts is None:
            k = int(np.prod(shape, dtype=np.int64)) if shape else 1
            if v.shape[0] != rows * k:
                raise CorruptRecord(f"{what}: extra {name!r} has {v.shape[0]} values, "
                                    f"expected {rows} rows of {list(shape)}")
            x = Extra(v.reshape(rows, *shape))
        else:
            if counts.dtype != np.int32:
                raise CorruptRecord(f"{what}: extra {name!r} counts are {counts.dtype}, "
                                    "expected int32")
            x = Extra(v, counts)
        _check_extra(what, name, x, rows)
        out[name] = x
    return out

