"""Dataset mixtures: several datasets in one run, each with its weight, staleness bound and
filter (``docs/datasets.md``, "Mixtures").

A mixture is read as one dataset whose rows interleave its sources' rows in the ratio of
their weights, so the cursor, the task ids, the passes and every crash guarantee of a single
dataset hold unchanged (docs/design.md, invariant 1: a task index is a mixture row).

The interleave is a fixed pattern, not a random draw: the weights become integers ``w_k``
(a resolution of 1/1000, reduced by their common divisor) and one period of ``P = sum w_k``
rows holds exactly ``w_k`` rows of source ``k``, spread evenly (smooth weighted round
robin, the order nginx gives weighted upstreams). Row ``i`` of the mixture is source
``pattern[i mod P]``, and that source's row ``(i div P) * w_k + (rows of k before i mod P
in the pattern)``: any row is found in O(1), so a resume or a release reads only the rows
it takes, and any P consecutive rows hold each source's exact share.

A pass ends as Hugging Face's ``interleave_datasets`` names it (``stopping_strategy``):

* ``first_exhausted`` (the default): when a source has no row left; the others' remaining
  rows wait for the next pass;
* ``all_exhausted``: when every source has given every row once; a source that runs out
  before starts its rows again (oversampled), so the shares hold to the end of the pass.

Each source carries its own row offset across passes (``Mixture.next_offsets``): the next
pass starts every source where this one left it, which is how the rows that wait are read
(``strawq.data.planner`` keeps the offsets in the cursor; rows above are a pass's rows).

The fingerprint names every source's fingerprint, name and integer weight, and the
strategy: changing a weight is changing the dataset, refused like any other change unless
it is switched to on purpose (``Feeder.switch_dataset``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import posixpath
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any, Literal, get_args

import xxhash

from strawq.config import Config, from_dict, read_json_object
from strawq.data.dataset import BadRow, Dataset, Row, Shard
from strawq.errors import ConfigError, DatasetError
from strawq.ondisk.names import validate_id

StoppingStrategy = Literal["first_exhausted", "all_exhausted"]
STOPPING_STRATEGIES: tuple[str, ...] = get_args(StoppingStrategy)
#: the file-name ending that makes a dataset argument a mixture spec (``open_dataset``)
MIXTURE_SUFFIX = ".mixture.json"
#: the weights' resolution: each becomes an integer share of this many rows
WEIGHT_RESOLUTION = 1000


@dataclass(frozen=True, kw_only=True)
class MixtureSource(Config):
    """One dataset of a mixture."""

    #: its name in metrics, logs and ``strawq inspect`` (letters, digits, ``_.-``)
    name: str
    #: the dataset (``strawq.data.dataset.Dataset``): a file, a directory or a glob, any fsspec
    #: URL; a relative path is relative to the mixture file's directory
    path: str
    #: its share of the mixture's rows (any positive number; the weights are normalised)
    weight: float = 1.0
    #: η for this dataset's groups (None: the run's ``collector.max_staleness``); at most
    #: the run's, since admission is sized by the run's
    max_staleness: int | None = None
    #: group filter applied by the collector to this dataset's ready groups, dotted path
    #: ``filter(task, rewards) -> reason | None`` (as the producers' ``plugins.filter``;
    #: ``task`` holds ``id``, ``index`` and ``source``); a reason drops the group with it
    filter: str | None = None
    #: the dataset's format (None: from each file's extension)
    format: str | None = None

    def validate(self) -> None:
        validate_id(self.name, "mixture source name")
        if not self.path:
            raise ConfigError(f"mixture source {self.name!r}: path is empty")
        if not self.weight > 0:
            raise ConfigError(f"mixture source {self.name!r}: weight must be > 0, got "
                              f"{self.weight}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(f"mixture source {self.name!r}: max_staleness must be >= 0 or "
                              f"null, got {self.max_staleness}")


@dataclass(frozen=True, kw_only=True)
class MixtureSpec(Config):
    """A mixture file: ``{"sources": [...], "stopping_strategy": ...}``."""

    #: the datasets, each a ``MixtureSource`` object; their order is the pattern's tie order
    sources: tuple[Any, ...]
    #: when a pass over the mixture ends: ``first_exhausted`` or ``all_exhausted``
    stopping_strategy: StoppingStrategy = "first_exhausted"

    def validate(self) -> None:
        if not self.sources:
            raise ConfigError("a mixture needs at least one source")
        srcs = self.parsed()
        names = [s.name for s in srcs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"mixture source names must differ; repeated: {dup}")

    def parsed(self) -> list[MixtureSource]:
        out = []
        for i, s in enumerate(self.sources):
            if isinstance(s, MixtureSource):
                out.append(s)
            elif isinstance(s, Mapping):
                out.append(from_dict(MixtureSource, s, where=f"mixture sources[{i}]"))
            else:
                raise ConfigError(f"mixture sources[{i}]: expected an object with name, path "
                                  f"and weight, found {type(s).__name__}")
        return out


def integer_weights(weights: Sequence[float], resolution: int = WEIGHT_RESOLUTION
                    ) -> list[int]:
    """The weights as integers in their ratio: shares of ``resolution`` by the largest
    remainder, each at least 1, reduced by their greatest common divisor."""
    total = sum(weights)
    exact = [w / total * resolution for w in weights]
    ints = [max(1, math.floor(x)) for x in exact]
    rest = resolution - sum(ints)
    for i in sorted(range(len(exact)), key=lambda i: -(exact[i] - math.floor(exact[i]))):
        if rest <= 0:
            break
        ints[i] += 1
        rest -= 1
    g = reduce(math.gcd, ints)
    return [w // g for w in ints]


def pattern_of(weights: Sequence[int]) -> list[int]:
    """One period of the interleave: source ``k`` exactly ``weights[k]`` times, spread
    evenly (smooth weighted round robin; ties go to the lower source)."""
    total = sum(weights)
    current = [0] * len(weights)
    out = []
    for _ in range(total):
        for k, w in enumerate(weights):
            current[k] += w
        k = max(range(len(weights)), key=lambda j: (current[j], -j))
        current[k] -= total
        out.append(k)
    return out


class Layout:
    """Where mixture row ``i`` comes from: (source, that source's row), in O(1)."""

    def __init__(self, weights: Sequence[int]) -> None:
        self.weights = list(weights)
        self.pattern = pattern_of(weights)
        self.period = len(self.pattern)
        #: before[o][k]: rows of source k in the pattern before offset o
        self.before: list[list[int]] = [[0] * len(weights)]
        for k in self.pattern:
            nxt = list(self.before[-1])
            nxt[k] += 1
            self.before.append(nxt)

    def locate(self, i: int) -> tuple[int, int]:
        """(source, how many rows of that source come before mixture row ``i``)."""
        q, o = divmod(i, self.period)
        k = self.pattern[o]
        return k, q * self.weights[k] + self.before[o][k]

    def count(self, i: int, k: int) -> int:
        """Rows of source ``k`` among mixture rows ``0 .. i-1``."""
        q, o = divmod(i, self.period)
        return q * self.weights[k] + self.before[o][k]

    def position(self, k: int, j: int) -> int:
        """The mixture row of source ``k``'s ``j``-th row (0-based)."""
        q, r = divmod(j, self.weights[k])
        offsets = [o for o, s in enumerate(self.pattern) if s == k]
        return q * self.period + offsets[r]


class Mixture(Dataset):
    """Several datasets read as one (see the module's docstring). Sources are
    ``MixtureSource``; ``base_dir`` resolves their relative paths."""

    def __init__(self, sources: Sequence[MixtureSource], *, prompt_key: str = "prompt",
                 stopping_strategy: StoppingStrategy = "first_exhausted",
                 url: str = "mixture", base_dir: str | None = None) -> None:
        # a Dataset made of Datasets: no fsspec listing of its own
        if stopping_strategy not in STOPPING_STRATEGIES:
            raise DatasetError(f"unknown stopping_strategy {stopping_strategy!r}; expected one "
                               f"of {list(STOPPING_STRATEGIES)}")
        if not sources:
            raise DatasetError("a mixture needs at least one source")
        self.url = url
        self.prompt_key = prompt_key
        self.fmt = "mixture"
        self.stopping_strategy: StoppingStrategy = stopping_strategy
        self.sources = list(sources)
        self.datasets = [Dataset(_resolve(s.path, base_dir), prompt_key=prompt_key,
                                 fmt=s.format) for s in self.sources]
        self.layout = Layout(integer_weights([s.weight for s in self.sources]))
        total = sum(self.layout.weights)
        #: each source's share of the mixture's rows, as the layout gives it
        self.weights = {s.name: w / total for s, w in zip(self.sources, self.layout.weights,
                                                          strict=True)}
        self.shards = [Shard(sh.path, f"{s.name}/{sh.rel}", sh.size, sh.fmt, sh.compression)
                       for s, d in zip(self.sources, self.datasets, strict=True)
                       for sh in d.shards]
        digest = xxhash.xxh3_64()
        digest.update(stopping_strategy.encode())
        for s, d, w in zip(self.sources, self.datasets, self.layout.weights, strict=True):
            digest.update(f"\0{s.name}\0{w}\0{d.fingerprint['format']}\0"
                          f"{d.fingerprint['digest']}".encode())
        self.fingerprint = {
            "url": url, "format": "mixture", "shards": len(self.shards),
            "size": sum(sh.size for sh in self.shards), "digest": digest.hexdigest(),
            "sources": {s.name: w for s, w in zip(self.sources, self.layout.weights,
                                                  strict=True)},
            "stopping_strategy": stopping_strategy}
        self._len: int | None = None
        self._source_len: list[int | None] = [None] * len(self.sources)

    @classmethod
    def from_spec(cls, spec: MixtureSpec, *, prompt_key: str = "prompt", url: str = "mixture",
                  base_dir: str | None = None) -> Mixture:
        return cls(spec.parsed(), prompt_key=prompt_key,
                   stopping_strategy=spec.stopping_strategy, url=url, base_dir=base_dir)

    # -- where rows come from ------------------------------------------------------------------
    def source_of(self, row: int) -> str | None:
        """The name of the source mixture row ``row`` comes from."""
        return self.sources[self.layout.locate(row)[0]].name if row >= 0 else None

    def source(self, name: str) -> MixtureSource | None:
        return next((s for s in self.sources if s.name == name), None)

    def emptiness(self) -> str | None:
        """None when every source holds a row; else the first that does not, named (a pass
        over the mixture needs rows of every source: the first one without ends it)."""
        for s, d in zip(self.sources, self.datasets, strict=True):
            what = d.emptiness()
            if what is not None:
                return f"its source {s.name!r} ({d.url}) has no rows: {what}"
        return None

    def _len_of(self, k: int) -> int:
        n = self._source_len[k]
        if n is None:
            n = self._source_len[k] = len(self.datasets[k])
        return n

    def __len__(self) -> int:
        """Rows in one pass (reads every source's length)."""
        if self._len is None:
            lens = [self._len_of(k) for k in range(len(self.sources))]
            if self.stopping_strategy == "first_exhausted":
                self._len = min(self.layout.position(k, n) if n else 0
                                for k, n in enumerate(lens))
            else:
                self._len = max(self.layout.position(k, n - 1) + 1 if n else 0
                                for k, n in enumerate(lens))
        return self._len

    # -- passes (``strawq.data.planner``): each source carries its own offset ---------------------
    @property
    def source_count(self) -> int:
        return len(self.sources)

    def _offs(self, offsets: Sequence[int]) -> tuple[int, ...]:
        if not offsets:
            return (0,) * len(self.sources)
        if len(offsets) != len(self.sources) or any(o < 0 for o in offsets):
            raise DatasetError(f"mixture pass offsets {list(offsets)} do not fit its "
                               f"{len(self.sources)} sources")
        return tuple(offsets)

    def pass_len(self, offsets: Sequence[int] = ()) -> int:
        """Rows in a pass that starts source ``k`` at its row ``offsets[k]``:
        ``first_exhausted`` ends it at the first row a source cannot give without starting
        over, ``all_exhausted`` once every source gave each of its rows once."""
        offs = self._offs(offsets)
        if not any(offs) or self.stopping_strategy == "all_exhausted":
            return len(self)
        return min(self.layout.position(k, self._len_of(k) - o) for k, o in enumerate(offs))

    def next_offsets(self, offsets: Sequence[int], rows: int) -> tuple[int, ...]:
        """Each source's first row in the pass after one of ``rows`` rows: where this one
        left it (rows a pass did not reach come first in the next), from 0 once it ran out."""
        offs = self._offs(offsets)
        return tuple((o + self.layout.count(rows, k)) % (self._len_of(k) or 1)
                     for k, o in enumerate(offs))

    def locate_row(self, row: int, offsets: Sequence[int] = ()) -> tuple[str | None, int]:
        k, j = self.layout.locate(row)
        j += self._offs(offsets)[k]
        if self.stopping_strategy == "all_exhausted":  # (first_exhausted never wraps)
            j %= self._len_of(k) or 1
        return self.sources[k].name, j

    def appearances(self, source: str | None, source_row: int, offsets: Sequence[int],
                    rows: int) -> list[int]:
        k = next((i for i, s in enumerate(self.sources) if s.name == source), None)
        if k is None:
            return []
        n = self._len_of(k)
        first = source_row - self._offs(offsets)[k]
        if self.stopping_strategy == "all_exhausted":
            first %= n or 1
        out = []
        while first >= 0 and (at := self.layout.position(k, first)) < rows:
            out.append(at)
            if self.stopping_strategy != "all_exhausted":
                break
            first += n
        return out

    def _iter_raw(self, start: int) -> Iterator[tuple[int, Row | BadRow]]:
        return self.iter_pass(start)

    def iter_pass(self, start: int, offsets: Sequence[int] = ()
                  ) -> Iterator[tuple[int, Row | BadRow]]:
        """Mixture rows from ``start`` to the end of the pass that starts source ``k`` at its
        row ``offsets[k]``: each source read in order, one open iterator per source."""
        offs = self._offs(offsets)
        wrap = self.stopping_strategy == "all_exhausted"
        end = self.pass_len(offs) if wrap else None
        its: dict[int, tuple[Iterator[tuple[int, Row | BadRow]], int]] = {}
        i = start
        while end is None or i < end:
            k, j = self.layout.locate(i)
            j += offs[k]
            if wrap:
                j %= self._len_of(k) or 1
            it, at = its.get(k, (None, -1))
            if it is None or at != j:
                it = self.datasets[k]._iter_raw(j)
            try:
                _, row = next(it)
            except StopIteration:
                return  # first_exhausted: this source has no row left, the pass ends
            its[k] = (it, j + 1)
            if isinstance(row, BadRow):
                row = dataclasses.replace(row, index=i,
                                          message=f"{self.sources[k].name}: {row.message}")
            yield i, row
            i += 1

    def shard_paths(self) -> Sequence[str]:
        return [d for ds in self.datasets for d in ds.shard_paths()]


def _resolve(path: str, base_dir: str | None) -> str:
    if base_dir is None or "://" in path or posixpath.isabs(path) or os.path.isabs(path):
        return path
    return os.path.join(base_dir, path)


def is_mixture_spec(url: str) -> bool:
    return url.endswith(MIXTURE_SUFFIX)


def load_mixture(path: str, *, prompt_key: str = "prompt") -> Mixture:
    """The mixture a ``*.mixture.json`` file describes; ``ConfigError`` naming the place of
    a bad key or value, ``DatasetError`` for a source that cannot be read."""
    spec = from_dict(MixtureSpec, read_json_object(path, what="mixture"), where="mixture")
    return Mixture.from_spec(spec, prompt_key=prompt_key, url=path,
                             base_dir=os.path.dirname(os.path.abspath(path)))


def open_dataset(url: str, *, prompt_key: str = "prompt", fmt: str | None = None) -> Dataset:
    """A dataset argument as every entry point reads it: a ``*.mixture.json`` file is a
    mixture of the datasets it names, anything else one dataset."""
    if is_mixture_spec(url):
        if fmt is not None:
            raise DatasetError("a mixture names each source's format itself (its 'format' "
                               "key); do not pass one for the whole mixture")
        return load_mixture(url, prompt_key=prompt_key)
    return Dataset(url, prompt_key=prompt_key, fmt=fmt)


