"""Per-token extra columns: routed experts (R3), top-p kept token ids, teacher log-probs.

Besides the four token columns (``strawq.ondisk.groups.TOKEN_COLUMNS``) a sample may carry extra
per-token data that a trainer replays. Each extra is a column of *rows*:

* a **response** extra has one row per response token (``teacher_logprobs``);
* a **prompt** extra has one row per position of prompt + response (``routed_experts``:
  the routing of each token when it was the model's input). Rows not computed yet are
  placeholders of -1 (never an expert id): the last row of a sample (its token has not
  been fed to the model yet) and the rows of tokens appended by a tool. The next request
  asks from the first placeholder on (SGLang's ``routed_experts_start_len``) and fills
  them;
* a row is a fixed shape (``[]``: one value, ``[layers, top_k]``), or **ragged**: a list of
  values of any length per row (``top_p_token_ids``: the ids kept by top-p sampling),
  stored as ``counts`` [rows] plus the flat ``values`` [sum(counts)].

An :class:`Extra` holds one sample's (or a group's, samples concatenated) rows of one
extra; :data:`SPECS` names the known extras and their dtypes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from strawq.errors import StrawqError

ROUTED_EXPERTS = "routed_experts"
TOP_P_TOKEN_IDS = "top_p_token_ids"
TEACHER_LOGPROBS = "teacher_logprobs"


class ExtraError(StrawqError, ValueError):
    """An extra column does not line up with its tokens (or cannot be built)."""


@dataclass(frozen=True)
class ExtraSpec:
    """What kind of column an extra is (see the module docstring)."""

    dtype: np.dtype[Any]
    #: rows cover prompt + response positions (else the response tokens only)
    prompt: bool = False
    #: a list of values per row (``counts`` + flat ``values``)
    ragged: bool = False
    #: value of a placeholder row (ragged: an empty list)
    fill: float = 0


#: the extras strawq records from SGLang's ``meta_info`` and maps onto slime's ``Sample``
SPECS: dict[str, ExtraSpec] = {
    ROUTED_EXPERTS: ExtraSpec(np.dtype(np.int32), prompt=True, fill=-1),
    TOP_P_TOKEN_IDS: ExtraSpec(np.dtype(np.int32), ragged=True),
    TEACHER_LOGPROBS: ExtraSpec(np.dtype(np.float32)),
}


def spec_of(name: str) -> ExtraSpec:
    try:
        return SPECS[name]
    except KeyError:
        raise ExtraError(f"unknown per-token extra {name!r}; known: {sorted(SPECS)}") from None


def check_names(names: Sequence[str]) -> tuple[str, ...]:
    """Validated, de-duplicated extra names (a config's list)."""
    out = tuple(dict.fromkeys(str(n) for n in names))
    for n in out:
        spec_of(n)
    return out


@dataclass(eq=False)
class Extra:
    """Rows of one extra column: ``values`` [rows, *shape], or flat values + ``counts``."""

    values: np.ndarray
    #: ragged only: int32 [rows], values per row
    counts: np.ndarray | None = None

    @property
    def ragged(self) -> bool:
        return self.counts is not None

    @property
    def rows(self) -> int:
        if self.counts is not None:
            return int(self.counts.shape[0])
        return int(self.values.shape[0])

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of one row (``()`` for ragged or scalar rows)."""
        return () if self.counts is not None else tuple(int(x) for x in self.values.shape[1:])

    def check(self, what: str) -> None:
        if self.counts is not None:
            if self.counts.ndim != 1 or self.values.ndim != 1:
                raise ExtraError(f"{what}: a ragged extra needs 1-d counts and values")
            if (self.counts < 0).any() or int(self.counts.sum()) != self.values.shape[0]:
                raise ExtraError(f"{what}: counts sum to {int(self.counts.sum())} but there "
                                 f"are {self.values.shape[0]} values")
        elif self.values.ndim < 1:
            raise ExtraError(f"{what}: values must have a row axis")

    def offsets(self) -> np.ndarray:
        """Ragged: int64 [rows + 1], row r is ``values[offsets[r]:offsets[r + 1]]``."""
        counts = self.counts if self.counts is not None else np.zeros(0, np.int32)
        return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])

    def take(self, a: int, b: int) -> Extra:
        """Rows ``[a, b)`` (views where possible)."""
        if self.counts is None:
            return Extra(self.values[a:b])
        off = self.offsets()
        return Extra(self.values[int(off[a]):int(off[b])], self.counts[a:b])

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"values": self.values.tolist(),
                               "shape": list(self.values.shape[1:])}
        if self.counts is not None:
            out["counts"] = self.counts.tolist()
        return out

    @classmethod
    def from_dict(cls, name: str, data: Mapping[str, Any]) -> Extra:
        dt = spec_of(name).dtype
        shape = [int(x) for x in data.get("shape") or []]
        values = np.asarray(data.get("values") or [], dtype=dt).reshape([-1, *shape])
        counts = data.get("counts")
        if counts is not None:
            return cls(values.reshape(-1), np.asarray(counts, dtype=np.int32))
        return cls(values)


def empty(name: str, shape: Sequence[int] = ()) -> Extra:
    spec = spec_of(name)
    if spec.ragged:
        return Extra(np.zeros(0, spec.dtype), np.zeros(0, np.int32))
    return Extra(np.zeros((0, *shape), spec.dtype))


def placeholder(name: str, rows: int, shape: Sequence[int] = ()) -> Extra:
    """``rows`` placeholder rows (``ExtraSpec.fill``; ragged: empty lists)."""
    spec = spec_of(name)
    if spec.ragged:
        return Extra(np.zeros(0, spec.dtype), np.zeros(rows, np.int32))
    return Extra(np.full((rows, *shape), spec.fill, spec.dtype))


def first_placeholder(name: str, x: Extra) -> int:
    """Index of the first placeholder row of a prompt extra (``x.rows`` when none)."""
    if x.ragged or not x.rows:
        return x.rows
    hole = (x.values.reshape(x.rows, -1) == spec_of(name).fill).all(axis=1)
    idx = np.flatnonzero(hole)
    return int(idx[0]) if idx.size else x.rows


def cat(parts: Sequence[Extra]) -> Extra:
    """Rows of ``parts`` one after another (all ragged or all of one row shape)."""
    if not parts:
        raise ExtraError("cannot concatenate no extras")
    if any(p.ragged != parts[0].ragged for p in parts):
        raise ExtraError("cannot concatenate ragged and fixed rows of one extra")
    shapes = {p.shape for p in parts if p.rows}
    if len(shapes) > 1:
        raise ExtraError(f"rows of one extra differ in shape: {sorted(shapes)}")
    if len(parts) == 1:
        return parts[0]
    if parts[0].ragged:
        return Extra(np.concatenate([p.values for p in parts]),
                     np.concatenate([p.counts for p in parts if p.counts is not None]))
    shape = next(iter(shapes)) if shapes else parts[0].shape
    return Extra(np.concatenate([p.values.reshape(-1, *shape) for p in parts]))


def rows_for(name: str, prompt_len: int, response_len: int) -> int:
    """Rows one sample holds of extra ``name``."""
    return prompt_len + response_len if spec_of(name).prompt else response_len


def cat_samples(per_sample: Sequence[Mapping[str, Extra]], prompt_len: int,
                response_lens: Sequence[int]) -> dict[str, Extra]:
    """A group's extras: every extra some sample holds, the samples' rows one after another
    (placeholder rows for a sample without it)."""
    names = dict.fromkeys(n for d in per_sample for n in d)
    out: dict[str, Extra] = {}
    for name in names:
        shapes = [d[name].shape for d in per_sample if name in d and d[name].rows]
        shape = shapes[0] if shapes else ()
        parts = []
        for d, r in zip(per_sample, response_lens, strict=True):
            x = d.get(name)
            parts.append(x if x is not None else
                         placeholder(name, rows_for(name, prompt_len, r), shape))
        out[name] = cat(parts)
    return out
