"""Attestation: each engine proves which weights it serves, by a fingerprint of its loaded
parameters compared with the one the trainer published for the version it claims.

An engine's ``weight_version`` is a label the pusher sets; nothing ties it to the weights it
loaded (a restart on the wrong checkpoint, a push of the wrong directory under the right
label). A **fingerprint** is a SHA-256 over fixed slices of fixed parameters:

* the trainer computes it from the weights it publishes for version ``v``
  (:func:`fingerprint_of`) and records it beside the version, once::

      fingerprints/<v>                 the slices, the dtype and the digest of version v

* after an engine loads ``v`` (the bracket's push, a repair), the same slices are read back
  from the engine (:func:`engine_fingerprint`, SGLang's ``/get_weights_by_name``, which the
  local engines serve too) and compared (:func:`attest`); the outcome is recorded::

      attested/<v>~<url key>~<nonce>   one check of one engine at version v: ok or not, why

  The newest record of an engine at ``v`` decides (:meth:`Fingerprints.verdicts`). A
  producer keeps an engine out of rotation while its newest verdict at the run's version is
  a failure, or while it has none and the version has a fingerprint.

**Which slices** (:func:`plan_slices`). Every *kind* of parameter (its name with the layer
index taken out: ``model.layers.*.mlp.down_proj.weight``) in the first and the last layer
that holds it, plus every parameter outside the layers (norms, embeddings, head): a wrong
or partial checkpoint, a layer left unloaded, or a stale shard of one kind shows in at
least one slice, while the cost stays a few dozen reads whatever the depth. Of each
parameter the first ``rows`` rows (a 1-D parameter: the first ``rows`` values) are read:
SGLang's ``truncate_size`` cuts the first dimension, and on 0.5.23 a parameter is converted
whole to a list before the cut, so the cost follows its size; parameters of more than
``max_numel`` values (the embedding and a tied head: tens of millions of values, ~15 s on
the CPU fixture) are left out unless ``max_numel`` is raised. The first rows are on tensor-
parallel rank 0 of every sharded layout SGLang 0.5.23 uses (column-parallel: the rank's
rows; row-parallel ``o_proj``/``down_proj``: rows gathered whole), so the reading is the
same at any TP size.

**Rounding.** The engine returns the values it holds as fp32 (a bf16 engine's values are
exact in fp32); both sides cast to ``dtype`` (round to nearest even) before hashing, so a
trainer holding fp32 master weights matches an engine serving them as bf16.

What it does not guarantee: the parameters and rows outside the slices are not checked (a
change confined to them passes), and an engine restarted with the wrong weights under the
right label while in rotation is found only at its next check (its next push or repair).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from strawq.errors import AlreadyExists, CorruptRecord, NotFound, StrawqError
from strawq.ondisk import records
from strawq.ondisk.numbered import Numbered
from strawq.ondisk.records import Kind
from strawq.storage import Storage
from strawq.weights.engine_weights import url_key

FINGERPRINTS_DIR = "fingerprints"
ATTESTED_DIR = "attested"
#: ``fingerprints/<v>``
FINGERPRINTS = Numbered()
#: ``attested/<v>~<url key>~<nonce>``
VERDICTS = Numbered(sep="~")
#: fingerprints (and attestation records) kept behind the newest version
KEEP = 4
DTYPES = ("bfloat16", "float16", "float32")
#: rows (or values of a 1-D parameter) read from each parameter
ROWS = 1
#: parameters with more values are left out (SGLang 0.5.23 lists a parameter whole)
MAX_NUMEL = 4_000_000
#: seconds one read of one parameter may take
READ_TIMEOUT_S = 30.0

#: engines checked at once
PARALLEL = 32

_LAYER = re.compile(r"\.(\d+)\.")


class AttestationError(StrawqError):
    """An engine's parameters could not be read back (unreachable, no such parameter, a
    reply of the wrong shape)."""


class EngineUnreachable(AttestationError):
    """The engine did not answer at all (refused, reset, timed out): nothing is known of
    the weights it holds, so it neither passes nor fails a check."""


@dataclass(frozen=True)
class Slice:
    """The first ``rows`` rows of parameter ``name``."""

    name: str
    rows: int


@dataclass(frozen=True)
class Fingerprint:
    """What the trainer published for one version: the slices, the dtype both sides cast
    to, and the digest."""

    digest: str
    slices: tuple[Slice, ...]
    dtype: str

    def to_meta(self) -> dict[str, Any]:
        return {"digest": self.digest, "dtype": self.dtype,
                "slices": [[s.name, s.rows] for s in self.slices]}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Fingerprint:
        return cls(str(meta["digest"]),
                   tuple(Slice(str(n), int(r)) for n, r in meta["slices"]), str(meta["dtype"]))


@dataclass(frozen=True)
class Verdict:
    """One check of one engine at one version."""

    url: str
    version: int
    ok: bool
    #: the digest the engine's slices gave (None: they could not be read; ``error`` says why)
    found: str | None
    expected: str
    error: str | None = None
    seconds: float = 0.0
    at: float = 0.0
    #: False: the engine did not answer (no verdict on its weights; never recorded)
    reachable: bool = True

    def describe(self) -> str:
        if not self.reachable:
            return f"{self.url} could not be checked at version {self.version}: {self.error}"
        if self.ok:
            return f"{self.url} attested at version {self.version}"
        why = self.error or f"fingerprint {self.found} != published {self.expected}"
        return f"{self.url} failed attestation at version {self.version}: {why}"


# -- the slices and the digest ---------------------------------------------------------------
def plan_slices(shapes: Mapping[str, Sequence[int]], *, rows: int = ROWS,
                max_numel: int = MAX_NUMEL) -> tuple[Slice, ...]:
    """The fixed slices for parameters of these shapes (name -> shape): every parameter
    outside the numbered layers, and each kind of layer parameter in the first and last
    layer that holds it; none of more than ``max_numel`` values. Sorted by name."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, found {rows}")
    kinds: dict[str, list[tuple[int, str]]] = {}
    chosen: set[str] = set()
    for name, shape in shapes.items():
        if int(np.prod(shape, dtype=np.int64)) > max_numel or not len(shape):
            continue
        m = _LAYER.search(name)
        if m is None:
            chosen.add(name)
            continue
        kind = name[:m.start()] + ".*." + name[m.end():]
        kinds.setdefault(kind, []).append((int(m.group(1)), name))
    for members in kinds.values():
        members.sort()
        chosen.update({members[0][1], members[-1][1]})
    return tuple(Slice(n, rows) for n in sorted(chosen))


def cast(values: Any, dtype: str) -> np.ndarray:
    """``values`` as float32 after rounding to ``dtype`` (nearest even), as an engine
    holding ``dtype`` holds them."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, found {dtype!r}")
    a = np.ascontiguousarray(np.asarray(values, dtype=np.float32))
    if dtype == "float16":
        return a.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        bits = a.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        out = rounded.astype(np.uint32).view(np.float32)
        return np.where(np.isnan(a), a, out)
    return a


def digest(parts: Iterable[tuple[Slice, np.ndarray]]) -> str:
    """SHA-256 over each slice's name, shape and float32 little-endian values."""
    h = hashlib.sha256()
    for s, values in parts:
        a = np.ascontiguousarray(values, dtype="<f4")
        h.update(f"{s.name}:{s.rows}:{list(a.shape)}\n".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _as_array(t: Any) -> np.ndarray:
    """A tensor (torch, any dtype, any device) or array as a float32 numpy array."""
    if hasattr(t, "detach"):
        t = t.detach().float().cpu().numpy()
    return np.asarray(t, dtype=np.float32)


def fingerprint_of(weights: Mapping[str, Any], *, dtype: str = "bfloat16",
                   slices: Sequence[Slice] | None = None, rows: int = ROWS,
                   max_numel: int = MAX_NUMEL) -> Fingerprint:
    """The trainer's side: the fingerprint of ``weights`` (name -> tensor, the names the
    engine knows them by, e.g. a Hugging Face state dict) as an engine holding ``dtype``
    serves them. ``slices``: the slices to read (default :func:`plan_slices`)."""
    if slices is None:
        slices = plan_slices({n: tuple(getattr(t, "shape", np.shape(t)))
                              for n, t in weights.items()}, rows=rows, max_numel=max_numel)
    if not slices:
        raise ValueError("no parameter to fingerprint (every one is over max_numel?)")
    missing = [s.name for s in slices if s.name not in weights]
    if missing:
        raise ValueError(f"slices name parameters the weights do not hold: {missing[:5]}")
    parts = [(s, cast(_as_array(weights[s.name][:s.rows]), dtype)) for s in slices]
    return Fingerprint(digest(parts), tuple(slices), dtype)


#: safetensors dtypes a checkpoint's slices are read in (others are left out of the plan)
_SAFETENSORS: dict[str, np.dtype[Any]] = {
    "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "F64": np.dtype("<f8")}


@dataclass(frozen=True)
class _Stored:
    """One tensor of a safetensors file: where its bytes start, its dtype and shape."""

    file: Path
    start: int
    dtype: str
    shape: tuple[int, ...]

    def first_rows(self, rows: int) -> np.ndarray:
        """Its first ``rows`` rows (a 1-D tensor: values) as float32."""
        dt = _SAFETENSORS[self.dtype]
        n = min(rows, self.shape[0])
        per_row = int(np.prod(self.shape[1:], dtype=np.int64))
        with open(self.file, "rb") as f:
            f.seek(self.start)
            raw = f.read(n * per_row * dt.itemsize)
        a = np.frombuffer(raw, dtype=dt)
        if self.dtype == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        return a.astype(np.float32).reshape((n, *self.shape[1:]))


def _checkpoint_tensors(path: str | Path) -> dict[str, _Stored]:
    """Every tensor of the safetensors checkpoint at ``path`` (a directory of
    ``*.safetensors`` shards, or one file), from the files' headers alone."""
    root = Path(path)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"{root}: no safetensors checkpoint there (a directory of "
                         "*.safetensors files, or one such file)")
    out: dict[str, _Stored] = {}
    for f in files:
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            for name, entry in header.items():
                if name == "__metadata__" or entry["dtype"] not in _SAFETENSORS:
                    continue
                out[name] = _Stored(f, 8 + n + int(entry["data_offsets"][0]), entry["dtype"],
                                    tuple(int(d) for d in entry["shape"]))
        except (struct.error, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{f}: not a readable safetensors file ({exc})") from None
    return out


def fingerprint_of_checkpoint(path: str | Path, *, dtype: str = "bfloat16",
                              slices: Sequence[Slice] | None = None, rows: int = ROWS,
                              max_numel: int = MAX_NUMEL) -> Fingerprint:
    """:func:`fingerprint_of` the weights of a Hugging Face safetensors checkpoint (the
    directory an engine loads with ``update_weights_from_disk``, or one file): the same
    digest as of its state dict, read from the files' headers and each slice's first rows
    only (a few KB whatever the model's size). Tensors of other dtypes than F32, F16, BF16
    and F64 are left out."""
    stored = _checkpoint_tensors(path)
    if slices is None:
        slices = plan_slices({n: t.shape for n, t in stored.items()}, rows=rows,
                             max_numel=max_numel)
    if not slices:
        raise ValueError(f"{path}: no parameter to fingerprint (every one is over max_numel "
                         "or of another dtype?)")
    missing = [s.name for s in slices if s.name not in stored]
    if missing:
        raise ValueError(f"slices name parameters the checkpoint does not hold: {missing[:5]}")
    parts = [(s, cast(stored[s.name].first_rows(s.rows), dtype)) for s in slices]
    return Fingerprint(digest(parts), tuple(slices), dtype)


# -- the engine's side -----------------------------------------------------------------------
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def read_parameter(url: str, name: str, rows: int, *, timeout_s: float = READ_TIMEOUT_S,
                   api_key: str | None = None) -> np.ndarray:
    """``POST {url}/get_weights_by_name`` (``name``, ``truncate_size=rows``): the first
    ``rows`` rows of the parameter as the engine holds it, as float32. Raises
    :class:`AttestationError` saying why not."""
    body = json.dumps({"name": name, "truncate_size": int(rows)}).encode()
    req = urllib.request.Request(f"{url.rstrip('/')}/get_weights_by_name", data=body,
                                 method="POST", headers={"Content-Type": "application/json"})
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with _OPENER.open(req, timeout=timeout_s) as resp:
            value = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read(300).decode("utf-8", "replace")
        raise AttestationError(f"{url}: /get_weights_by_name {name!r} answered HTTP "
                               f"{exc.code} ({detail.strip()})") from None
    except (urllib.error.URLError, OSError) as exc:
        raise EngineUnreachable(f"{url}: /get_weights_by_name {name!r}: cannot reach it "
                                f"({getattr(exc, 'reason', exc)})") from None
    except ValueError as exc:
        raise AttestationError(f"{url}: /get_weights_by_name {name!r} is not JSON: "
                               f"{exc}") from None
    if not isinstance(value, list) or not value:
        raise AttestationError(f"{url}: /get_weights_by_name {name!r} returned "
                               f"{str(value)[:120]}, expected a list of values or rows")
    try:
        a = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise AttestationError(f"{url}: /get_weights_by_name {name!r} returned ragged or "
                               f"non-numeric rows ({exc})") from None
    return a[:rows]


def engine_fingerprint(url: str, fp: Fingerprint, *, timeout_s: float = READ_TIMEOUT_S,
                       api_key: str | None = None) -> str:
    """The digest of ``fp``'s slices as read back from the engine at ``url`` (cast to
    ``fp.dtype``); raises :class:`AttestationError` when a slice cannot be read."""
    parts = [(s, cast(read_parameter(url, s.name, s.rows, timeout_s=timeout_s,
                                     api_key=api_key), fp.dtype)) for s in fp.slices]
    return digest(parts)


def attest(url: str, version: int, fp: Fingerprint, *, timeout_s: float = READ_TIMEOUT_S,
           api_key: str | None = None) -> Verdict:
    """Compare the engine's fingerprint with ``fp`` (published for ``version``); never
    raises: an engine whose parameters cannot be read fails, saying why; one that does not
    answer at all is ``reachable=False`` (and not ok)."""
    t0 = time.monotonic()
    reachable = True
    try:
        found: str | None = engine_fingerprint(url, fp, timeout_s=timeout_s, api_key=api_key)
        error = None
    except AttestationError as exc:
        found, error = None, str(exc)
        reachable = not isinstance(exc, EngineUnreachable)
    return Verdict(url.rstrip("/"), int(version), found == fp.digest, found, fp.digest, error,
                   time.monotonic() - t0, time.time(), reachable)


# -- the records -----------------------------------------------------------------------------
class Fingerprints:
    """``fingerprints/<v>`` and ``attested/`` on the run's storage."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def publish(self, version: int, fp: Fingerprint) -> None:
        """Record ``fp`` as version ``version``'s (once: a retried publish of the same
        digest is a no-op; another digest for a recorded version is refused)."""
        self.storage.makedirs(FINGERPRINTS_DIR)
        key = f"{FINGERPRINTS_DIR}/{FINGERPRINTS.name(int(version))}"
        try:
            self.storage.publish(key, records.encode(Kind.STATE, {
                "version": int(version), **fp.to_meta(), "at": time.time()}))
        except AlreadyExists:
            old = self.get(version)
            if old is not None and old.digest != fp.digest:
                raise StrawqError(
                    f"version {version} already has the fingerprint {old.digest}; a "
                    f"different one ({fp.digest}) cannot replace it: publish the weights "
                    "as a new version") from None
        names = self.storage.list(FINGERPRINTS_DIR)
        for n in FINGERPRINTS.below(names, int(version) - KEEP + 1):
            self.storage.delete(f"{FINGERPRINTS_DIR}/{n}")
        for n in VERDICTS.below(self.storage.list(ATTESTED_DIR), int(version) - KEEP + 1):
            self.storage.delete(f"{ATTESTED_DIR}/{n}")

    def get(self, version: int) -> Fingerprint | None:
        key = f"{FINGERPRINTS_DIR}/{FINGERPRINTS.name(int(version))}"
        try:
            meta = records.decode(self.storage.read(key), expect=Kind.STATE, name=key).meta
        except NotFound:
            return None
        try:
            return Fingerprint.from_meta(meta)
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptRecord(f"{key}: {exc}") from None

    def record(self, v: Verdict) -> str:
        """Write one verdict (a fresh name: never rewritten); returns its name."""
        self.storage.makedirs(ATTESTED_DIR)
        name = VERDICTS.name(int(v.version), f"{url_key(v.url)}~{uuid.uuid4().hex[:12]}")
        self.storage.publish(f"{ATTESTED_DIR}/{name}", records.encode(Kind.STATE, {
            "url": v.url, "version": v.version, "ok": v.ok, "found": v.found,
            "expected": v.expected, "error": (v.error or "")[:500], "seconds": v.seconds,
            "at": v.at or time.time()}))
        return name

    def verdicts(self, version: int,
                 urls: Iterable[str] | None = None) -> dict[str, Verdict]:
        """Engine URL -> its newest verdict at ``version``; with ``urls``, of those engines
        only (one listing, and reads of their records alone: a producer asks for its own
        engines, not for every verdict of a 10,000-GPU fleet's)."""
        keys = None if urls is None else {url_key(u) for u in urls}
        out: dict[str, Verdict] = {}
        for name in self.storage.list(ATTESTED_DIR):
            got = VERDICTS.split(name)
            if got is None or got[0] != int(version):
                continue
            if keys is not None and got[1].split("~", 1)[0] not in keys:
                continue
            key = f"{ATTESTED_DIR}/{name}"
            try:
                m = records.decode(self.storage.read(key), expect=Kind.STATE, name=key).meta
                v = Verdict(str(m["url"]), int(m["version"]), bool(m["ok"]),
                            None if m.get("found") is None else str(m["found"]),
                            str(m["expected"]), str(m.get("error") or "") or None,
                            float(m.get("seconds", 0.0)), float(m.get("at", 0.0)))
            except NotFound:
                continue
            except (CorruptRecord, KeyError, TypeError, ValueError):
                continue  # unreadable: it names no engine this code could trust
            if v.url not in out or v.at >= out[v.url].at:
                out[v.url] = v
        return out

    def attested(self, url: str, version: int) -> bool | None:
        """Whether ``url`` may serve ``version``: True when the version has no fingerprint
        (attestation off for it) or the engine's newest verdict is ok; False when it failed;
        None when the version has a fingerprint and the engine no verdict yet."""
        if self.get(version) is None:
            return True
        got = self.verdicts(version, [url]).get(url.rstrip("/"))
        return None if got is None else got.ok


def may_clear(storage: Storage, version: int) -> Callable[[str], bool]:
    """url -> whether its notes may go at ``version`` (``EngineWeights.clear_fixed``): the
    version has no fingerprint, or the engine's newest verdict is ok (read once)."""
    book = Fingerprints(storage)
    if book.get(version) is None:
        return lambda url: True
    ok = {u for u, v in book.verdicts(version).items() if v.ok}
    return lambda url: url.rstrip("/") in ok


def attest_all(storage: Storage, urls: Iterable[str], version: int, *,
               timeout_s: float = READ_TIMEOUT_S,
               api_key: str | None = None) -> dict[str, Verdict]:
    """Check every engine in ``urls`` against version ``version``'s fingerprint (all at
    once: one thread per engine, at most ``PARALLEL``) and record each verdict; {} when the
    version has none (attestation off for it). An engine that did not answer is returned
    (``reachable=False``) but not recorded: it is no verdict on its weights, and a dead
    engine would otherwise add a record at every check."""
    book = Fingerprints(storage)
    fp = book.get(version)
    todo = sorted({u.rstrip("/") for u in urls})
    if fp is None or not todo:
        return {}
    with ThreadPoolExecutor(max_workers=min(PARALLEL, len(todo)),
                            thread_name_prefix="strawq-attest") as pool:
        found = list(pool.map(lambda u: attest(u, version, fp, timeout_s=timeout_s,
                                               api_key=api_key), todo))
    for v in found:
        if v.reachable:
            book.record(v)
    return {v.url: v for v in found}
