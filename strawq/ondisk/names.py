"""File names that carry a task's state counters.

A task record's *content* never changes after it is published (docs/design.md, invariant 2). What
changes as it moves — generation, attempts, which partial prefix to resume from, who holds it — is
carried in its *name*, so every transition is a single atomic rename.

    <key>~<id>~g<gen>~a<attempts>[.<regenerations>]~r<resume>[~<producer>]

* ``key`` orders the queue: ``a<minver:012>.<order:012>`` for partial tasks (oldest
  weight version first), ``b000000000000.<order:012>`` for fresh tasks returned to the
  queue, ``c<rank:012>.<order:012>`` for fresh tasks in a release directory (``rank``: 0,
  or the claim rank of a release staged by predicted length: its release version, then
  the longest predicted first, ``fresh_key``). Ready groups
  use ``<minver:012>.<order:012>``.
* ``gen`` is the lease generation: bumped every time the task goes back to the queue, so
  a result from an older generation has nothing left to rename (fencing).
* ``attempts`` is counted at claim and refunded by ``yield``/``release`` and by a
  regeneration: it is the failure budget (``max_attempts``), which only failures spend.
* ``regenerations`` counts the times the task was sent back past the staleness bound
  (``eta_mode="regenerate"``, ``strawq.tasks.eta``) to be generated afresh; it caps those cycles
  (``regenerate_or_train``). Written only when non-zero.
* ``resume`` is the generation whose partial record (``data/<id>~g<resume>.partial``) holds
  the saved prefixes; ``-1`` for none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from strawq.errors import ConfigError
from strawq.ondisk.numbered import Numbered

#: Stage letters of a queued task's key: they sort partial work first, then tasks returned
#: to the queue, then fresh ones. The only place these letters are spelled.
STAGE_PARTIAL = "a"
STAGE_REQUEUED = "b"
STAGE_FRESH = "c"
STAGES = STAGE_PARTIAL + STAGE_REQUEUED + STAGE_FRESH

ID_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
_NAME_RE = re.compile(
    rf"(?P<key>[{STAGES}]?\d{{12}}\.\d{{12}})~(?P<id>[A-Za-z0-9_.-]+)~g(?P<gen>\d+)"
    r"~a(?P<att>\d+)(?:\.(?P<regen>\d+))?~r(?P<res>-1|\d+)(?:~(?P<producer>[A-Za-z0-9_.-]+))?",
    re.ASCII,  # \d: 0-9 only
)
MAX_VERSION = 10**12 - 1
#: ``i<index>``: the id of dataset row ``index``'s task
TASK_IDS = Numbered("i")
#: ``<version>.<order>``: a queue key after its stage letter (a ready key has none)
QUEUE_KEYS = Numbered(sep=".")
#: ``<counter>`` of a heartbeat name ``hb/<producer>~<counter>``
COUNTERS = Numbered(width=16)


def validate_id(value: str, what: str = "task id") -> str:
    if not isinstance(value, str) or not ID_RE.fullmatch(value):
        raise ConfigError(f"invalid {what} {value!r}: expected 1-128 characters of "
                          "[A-Za-z0-9_.-], not starting with '.'")
    return value


def dataset_task_id(index: int) -> str:
    return TASK_IDS.name(index)


def clamp_version(v: int) -> int:
    return min(max(int(v), 0), MAX_VERSION)


def queue_key(stage: str, version: int, order: int) -> str:
    return f"{stage}{QUEUE_KEYS.name(clamp_version(version), order % 10**12)}"


#: A claim rank's length digits: lengths up to ``RANK_LENGTHS − 2`` tokens are told apart
RANK_LENGTHS = 10**6


def fresh_key(order: int, predicted: float | None = None, version: int = 0) -> str:
    """A fresh task's key in its release directory. ``predicted``: its predicted response
    length in tokens (a release staged longest-predicted-first, ``queue.longest_first``),
    released at weight ``version``: the key's version slot holds the claim rank
    ``version·RANK_LENGTHS + (RANK_LENGTHS − 1 − length)``, so keys sort by release version
    (the collector bounds a fresh task's oldest token by it: the earlier deadline first),
    then longest predicted first, across releases too (``claim_rank``). None: rank 0,
    dataset order (a fresh task has no token yet, so the slot holds no version)."""
    if predicted is None:
        return queue_key(STAGE_FRESH, 0, order)
    length = min(max(int(round(predicted)), 0), RANK_LENGTHS - 2)
    v = min(max(int(version), 0), MAX_VERSION // RANK_LENGTHS - 1)
    return queue_key(STAGE_FRESH, v * RANK_LENGTHS + RANK_LENGTHS - 1 - length, order)


def claim_rank(name: TaskName) -> int:
    """A fresh task's claim rank (``fresh_key``; smaller first, 0 for dataset order);
    0 for any other key."""
    return name.version if name.key.startswith(STAGE_FRESH) else 0


def ready_key(min_version: int, order: int) -> str:
    return QUEUE_KEYS.name(clamp_version(min_version), order % 10**12)


@dataclass(frozen=True)
class TaskName:
    key: str
    id: str
    gen: int
    attempts: int
    resume: int = -1
    producer: str | None = None
    regenerations: int = 0
    #: where a task leased in a chunk lies inside ``leased/``: ``<chunk>/<entry>`` (a
    #: range claim, ``ChunkName``); None for a lease of its own, and for every other state.
    #: Not part of the name: ``with_`` drops it unless given.
    chunk: str | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        regen = f".{self.regenerations}" if self.regenerations else ""
        base = f"{self.key}~{self.id}~g{self.gen}~a{self.attempts}{regen}~r{self.resume}"
        return f"{base}~{self.producer}" if self.producer else base

    @classmethod
    def parse(cls, name: str) -> TaskName:
        m = _NAME_RE.fullmatch(name)
        if m is None:
            raise ConfigError(f"not a task name: {name!r}")
        return cls(key=m["key"], id=m["id"], gen=int(m["gen"]), attempts=int(m["att"]),
                   resume=int(m["res"]), producer=m["producer"],
                   regenerations=int(m["regen"] or 0))

    @classmethod
    def try_parse(cls, name: str) -> TaskName | None:
        m = _NAME_RE.fullmatch(name)
        if m is None:
            return None
        return cls(key=m["key"], id=m["id"], gen=int(m["gen"]), attempts=int(m["att"]),
                   resume=int(m["res"]), producer=m["producer"],
                   regenerations=int(m["regen"] or 0))

    @property
    def order(self) -> int:
        return int(self.key.rsplit(".", 1)[1])

    @property
    def version(self) -> int:
        return int(self.key.rsplit(".", 1)[0].lstrip(STAGES) or 0)

    def with_(self, **changes: object) -> TaskName:
        changes.setdefault("chunk", None)  # a new name is a move: it leaves the chunk
        return replace(self, **changes)  # type: ignore[arg-type]


#: Prefix of a chunk directory (a range claim, ``release_chunk > 1``): ``k-<j>~n<size>``
#: inside a release directory, ``k-<seq>.<j>~n<size>~<producer>`` in ``leased/``.
CHUNK_PREFIX = "k-"
#: ``k-<j>`` (in ``pending/r-<seq>/``) and ``k-<seq>.<j>`` (in ``leased/``)
CHUNKS = Numbered(CHUNK_PREFIX, sep=".")
#: The record of a chunk's task rows, inside its directory (never a task name)
CHUNK_ROWS = "rows"
_CHUNK_RE = re.compile(
    r"(?P<head>k-\d+(?:\.\d+)?)~n(?P<size>\d+)(?:~(?P<producer>[A-Za-z0-9_.-]+))?", re.ASCII)


@dataclass(frozen=True)
class ChunkName:
    """A chunk directory: ``size`` fresh tasks of release ``seq`` released together
    (``release_chunk``), claimed whole by one rename (docs/protocol.md §5, range claims).

    Queued in ``pending/r-<seq>/k-<index>~n<size>``; held, ``leased/k-<seq>.<index>~n<size>
    ~<producer>``. Inside: one entry per task, each today's task record under its queued name
    (so a task that leaves the chunk is an ordinary task wherever it goes), and the record
    of all the rows (``CHUNK_ROWS``), which a claim of the whole chunk reads once.
    ``size`` is what was released: an upper bound of what it holds (single tasks may have
    been claimed out of it, or have left it)."""

    seq: int
    index: int
    size: int
    producer: str | None = None

    def queued(self) -> str:
        """The name inside its release directory."""
        return f"{CHUNKS.name(self.index)}~n{self.size}"

    def __str__(self) -> str:
        """The name in ``leased/`` (held), else in its release directory (queued)."""
        if self.producer is None:
            return self.queued()
        return f"{CHUNKS.name(self.seq, self.index)}~n{self.size}~{self.producer}"

    @classmethod
    def try_parse(cls, name: str, seq: int | None = None) -> ChunkName | None:
        """A chunk directory's name: held (``seq`` None) or queued in release ``seq``."""
        m = _CHUNK_RE.fullmatch(name)
        if m is None:
            return None
        if seq is None:
            pair = CHUNKS.pair(m["head"])
            if pair is None or m["producer"] is None:
                return None
            return cls(pair[0], pair[1], int(m["size"]), m["producer"])
        index = CHUNKS.parse(m["head"])
        if index is None or "." in m["head"] or m["producer"] is not None:
            return None
        return cls(seq, index, int(m["size"]))

    def held_by(self, producer: str) -> ChunkName:
        return replace(self, producer=producer)

    def task(self, entry: TaskName) -> TaskName:
        """The lease of ``entry`` (its queued name) in this held chunk: the claim's attempt
        counted, the holder named, where it lies recorded (``TaskName.chunk``)."""
        return replace(entry, attempts=entry.attempts + 1, producer=self.producer,
                       chunk=f"{self}/{entry}")


def requeued_name(name: TaskName, *, refund: bool, drop_prefix: bool = False,
                  regenerated: bool = False) -> TaskName:
    """The name a task takes when it goes back to the queue: gen + 1, no holder.

    ``refund`` gives back the attempt counted at claim (a release, a yield; not a failure).
    ``regenerated`` (sent back past the staleness bound) refunds it too and counts one
    regeneration instead: a regeneration never spends the failure budget.
    A leased task keeps its key, except that a fresh one (stage ``c``, in a release
    directory) moves to stage ``b`` at its dataset order. With ``drop_prefix`` (a ready
    group sent back by the staleness bound, or a claimed partial task past it:
    ``RunQueue.regenerate``) the key's version resets to 0 and the task
    starts from scratch (``resume = -1``); one that had resumed a prefix keeps the
    partial stage's priority.
    """
    key = name.key
    resume = name.resume
    if drop_prefix:
        stage = STAGE_PARTIAL if name.resume >= 0 else STAGE_REQUEUED
        key, resume = queue_key(stage, 0, name.order), -1
    elif key.startswith(STAGE_FRESH):
        key = queue_key(STAGE_REQUEUED, 0, name.order)
    return name.with_(key=key, gen=name.gen + 1, producer=None, resume=resume,
                      attempts=max(name.attempts - 1, 0) if refund or regenerated
                      else name.attempts,
                      regenerations=name.regenerations + int(regenerated))


#: suffix of an idle producer's heartbeat name (``hb/<producer>~<counter>.idle``)
IDLE_SUFFIX = ".idle"


def heartbeat_key(producer: str, counter: int, idle: bool = False) -> str:
    """``hb/<producer>~<counter>``: the name is the counter (the body, written by a process's
    first beat and kept by the renames, names the process: ``strawq.liveness``). An idle
    producer (no leases, nothing claimable) beats ``hb/<producer>~<counter>.idle``: a
    weight-update bracket does not wait for its ack (it leaves the mark, with a beat,
    before it reads ``control/`` and claims again)."""
    return f"hb/{producer}~{COUNTERS.name(counter)}{IDLE_SUFFIX if idle else ''}"


def parse_heartbeat_state(name: str) -> tuple[str, int, bool] | None:
    """(producer, counter, idle) of a file name in ``hb/``; None for anything else."""
    idle = name.endswith(IDLE_SUFFIX)
    if idle:
        name = name[:-len(IDLE_SUFFIX)]
    producer, _, digits = name.rpartition("~")
    counter = COUNTERS.parse(digits)
    if not producer or counter is None:
        return None
    return producer, counter, idle


def parse_heartbeat(name: str) -> tuple[str, int] | None:
    """(producer, counter) of a file name in ``hb/``; None for anything else."""
    hb = parse_heartbeat_state(name)
    return None if hb is None else hb[:2]


def note_key(task_id: str, gen: int, kind: str, reason: str) -> str:
    """The note a drop or failure leaves: keyed by reason too, so that two movers racing
    to drop one generation (a crashed holder, then the grantor) each keep their own note
    and the dropped entry's reason always names an existing one."""
    return f"data/{task_id}~g{gen}.{kind}.{reason}"


def data_key(task_id: str, gen: int, suffix: str) -> str:
    """The immutable record a lease of generation ``gen`` writes (group/partial/fail/drop)."""
    return f"data/{task_id}~g{gen}.{suffix}"
