"""Task states, where each lives on disk, the legal transitions, and the one move between them.

::

    dataset ─release─▶ PENDING ─claim─▶ LEASED ─complete─▶ READY ─batch─▶ BATCHED ─gc─▶ TRAINED
                        ▲  ▲              │ │ ▲              │ │ ▲           │
                        │  └──release,────┘ │ │              │ │ └─recover───┘
                        │   fail, expire    │ claim          │ │  (its manifest lost)
                        │   (gen+1)  yield, │ │              │ │
                        │      regenerate   ▼ │              │ │
                        │                PARTIAL ◀─requeue───┘ │
                        └───────requeue (η bound, gen+1)───────┘

    TRAINED ◀── retire_lease (from LEASED): the lease holder's framework trained the group
                itself and its checkpoint holds it (slime's data source).
    DROPPED ◀── drop, fail or expire after max_attempts (from LEASED); drop for the η bound
                at claim (LEASED) or at batch time, or a corrupt payload (READY); drop_from
                (BATCHED); a bad dataset row.
    DROPPED ─compact─▶ COMPACTED   folded into the drop audit (``strawq.delivery.retention``); its
                                   task record is kept in ``audit/kept/`` for a window
    COMPACTED ─requeue─▶ PENDING   ``strawq requeue`` of a compacted drop still kept
    DROPPED ─requeue─▶ PENDING     an operator's ``strawq requeue`` (``strawq.delivery.requeue``):
                                   gen + 1, attempts 0, no prefix; the drop note stays

LEASED → TRAINED is for a framework that trains the groups it was handed itself, without
``ready/`` and batches (slime's data source, ``strawq.collector.integrations.slime``): the
lease holder retires its lease once the framework's checkpoint holds the group
(``retire_lease``: fenced — a lease no longer at its key is ``NotFound``, the holder's
``LeaseLost`` — and the deletion fsync'd). An older strawq recorded such groups as DROPPED
with reason ``trained`` (``LEGACY_TRAINED``): those entries still count as trained, never
as dropped: no DROPPED listing returns them, so status, the drop audit and ``strawq
requeue`` leave them alone.

The η bound on a partial task is applied by the producer that claims it (``strawq.tasks.eta``):
past η, ``regenerate`` discards the prefix (LEASED → PARTIAL at version 0 without a prefix,
gen + 1, the claim's attempt counted) and ``drop`` drops it with reason ``stale_eta``, both
before a token is spent on it; ``train`` resumes it, counted.

PENDING and PARTIAL share ``pending/``: the stage letter of a name's key tells them apart
(``a`` partial, ``b`` returned, ``c`` fresh; see ``strawq.ondisk.names``). Fresh tasks
arrive a whole release at a time in ``pending/r-<seq>/`` (one directory rename by the
feeder); bad dataset rows are published straight into ``dropped/``. TRAINED and COMPACTED have
no directory (``RETIRED``): ``gc`` deletes a BATCHED entry once the trainer acked its batch
(``delete_trained``), and ``compact_drops`` moves a DROPPED entry out of ``dropped/`` once the drop
audit holds it (into ``audit/kept/``, which no state listing reads).

BATCHED has no directory of its own: a batch's manifest (``batches/<seq>``,
``strawq.delivery.batches``) names its groups, whose entries stay in ``ready/``; a READY entry
a present manifest names is BATCHED, and every reader that tells the two apart lists
``batches/`` first (``BatchStore.batched_names``). ``batched/`` (``LEGACY_BATCHED``) holds
only the entries an older strawq renamed there, read, recovered and collected as before.

Every other arrow is one atomic rename, made by ``move``, which checks the transition against
``TRANSITIONS`` first. Only the holder of a lease — or the grantor, after expiry — moves a
LEASED task; a stale holder finds its file gone and gets ``LeaseLost``.

An adapter whose records are not tasks declares its store here too (``Store``, ``STORES``):
verl's durable queue (``VERL_SAMPLES``: a sample READY, handed out BATCHED, committed
TRAINED, or DROPPED) and its saved prefixes (``VERL_PREFIXES``: PARTIAL, held LEASED): each
store's directories, its legal moves, and ``move`` / ``retire`` checked against them, so no
key family or move is defined only inside an adapter.

``depths`` counts tasks per state from directory listings, in the direction work flows, so a
task that moves on between two listings is counted twice, never zero times.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace

from strawq.errors import AlreadyExists, NotFound, StrawqError
from strawq.ondisk.names import CHUNK_PREFIX, CHUNK_ROWS, STAGE_PARTIAL, ChunkName, TaskName
from strawq.ondisk.numbered import Numbered
from strawq.storage import Storage

log = logging.getLogger(__name__)


class TaskState(str, enum.Enum):
    PENDING = "pending"
    PARTIAL = "partial"
    LEASED = "leased"
    READY = "ready"
    BATCHED = "batched"
    DROPPED = "dropped"
    #: acked and garbage-collected: no directory, the entry is deleted
    TRAINED = "trained"
    #: a drop folded into the drop audit (``strawq.delivery.retention``): no directory either
    COMPACTED = "compacted"


S = TaskState

#: The directory that holds each state's entries (PENDING and PARTIAL share one). A
#: BATCHED group's entry stays in ``ready/``; ``batched/`` holds an older strawq's only.
DIRS: dict[TaskState, str] = {
    S.PENDING: "pending", S.PARTIAL: "pending", S.LEASED: "leased", S.READY: "ready",
    S.BATCHED: "batched", S.DROPPED: "dropped",
}
#: Where an older strawq moved a batch's groups (``ready/`` -> ``batched/``, one rename each);
#: a batch now leaves them in ``ready/``, named by its manifest alone.
LEGACY_BATCHED = DIRS[S.BATCHED]
#: States without a directory: reaching one deletes the entry (``retire``).
RETIRED = frozenset({S.TRAINED, S.COMPACTED})
#: The reason an older strawq recorded for a group a framework trained itself (LEASED ->
#: DROPPED, before LEASED -> TRAINED existed): such an entry is trained, not dropped.
LEGACY_TRAINED = "trained"
#: Prefix of a release directory inside ``pending/`` (fresh tasks, dataset order).
RELEASE_PREFIX = "r-"
#: ``pending/r-<seq>``, and ``staging/r-<seq>.<nonce>`` while the feeder prepares it
RELEASES = Numbered(RELEASE_PREFIX, sep=".")

#: (from, to) -> the operation that performs it, and who may call it.
TRANSITIONS: dict[tuple[TaskState, TaskState], str] = {
    (S.PENDING, S.LEASED): "claim (producer)",
    (S.PARTIAL, S.LEASED): "claim (producer)",
    (S.LEASED, S.READY): "complete (lease holder)",
    (S.LEASED, S.PARTIAL): "yield_partial (lease holder); release/fail/expire of a task "
                           "claimed from PARTIAL (it keeps its stage); regenerate (lease "
                           "holder: a claimed partial past the η bound, prefix discarded)",
    (S.LEASED, S.PENDING): "release / fail retryable (lease holder); expire (grantor)",
    (S.LEASED, S.DROPPED): "drop / fail after max_attempts (holder; drop stale_eta: a "
                           "claimed partial past the η bound); expire after max (grantor)",
    (S.READY, S.BATCHED): "publish_batch (collector): the manifest names it; the entry "
                          "stays in ready/ (an older strawq renamed it to batched/)",
    (S.READY, S.DROPPED): "drop_ready (collector: staleness bound, corrupt payload)",
    (S.READY, S.PENDING): "requeue_ready (collector, staleness bound)",
    (S.READY, S.PARTIAL): "requeue_ready of a group that had a prefix (collector)",
    (S.BATCHED, S.READY): "recover, when the manifest naming it is lost (collector): "
                          "nothing names it any more (a batched/ entry: renamed back)",
    (S.BATCHED, S.DROPPED): "drop_from batched (collector)",
    (S.BATCHED, S.TRAINED): "ack (trainer) then gc (collector): the entry is deleted",
    (S.LEASED, S.TRAINED): "retire_lease (lease holder: a framework that trained the group "
                           "itself, slime's data source, once its checkpoint holds it): the "
                           "entry is deleted, fenced and fsync'd",
    (S.DROPPED, S.COMPACTED): "compact_drops (collector GC, strawq gc): the drop audit holds "
                              "it; the entry moves to audit/kept/"
                              " (strawq.delivery.retention) until "
                              "it expires",
    (S.COMPACTED, S.PENDING): "requeue_dropped of a compacted drop still kept (operator: "
                              "strawq requeue): as from DROPPED",
    (S.DROPPED, S.PENDING): "requeue_dropped (operator: strawq requeue): a fresh generation, "
                            "attempts 0, no prefix; the drop note is kept",
}


class IllegalTransition(StrawqError, ValueError):
    """A move that the state machine does not allow (a bug in the caller)."""


def check_transition(src: TaskState, dst: TaskState) -> str:
    """Return the name of the operation for ``src -> dst``; ``IllegalTransition`` if none."""
    try:
        return TRANSITIONS[(src, dst)]
    except KeyError:
        raise IllegalTransition(f"illegal task transition {src.value} -> {dst.value}; the "
                                "legal ones are listed in"
                                " strawq.tasks.states.TRANSITIONS") from None


def queued_state(name: TaskName) -> TaskState:
    """PARTIAL or PENDING, from the stage letter of a queued task's key."""
    return S.PARTIAL if name.key.startswith(STAGE_PARTIAL) else S.PENDING


def key_of(state: TaskState, name: TaskName) -> str:
    """The storage key of ``name`` in ``state`` (queued tasks: the top of ``pending/``)."""
    if state in RETIRED:
        raise IllegalTransition(f"a {state.value} task has no entry on disk")
    if state in (S.PENDING, S.PARTIAL) and queued_state(name) is not state:
        raise IllegalTransition(f"{name} cannot be {state.value}: its key's stage letter says "
                                f"{queued_state(name).value}")
    if state is S.LEASED and name.chunk is not None:
        return f"{DIRS[state]}/{name.chunk}"  # leased in a chunk (a range claim)
    return f"{DIRS[state]}/{name}"


def chunk_key(chunk: ChunkName) -> str:
    """The directory of a held chunk in ``leased/`` (a range claim)."""
    return f"{DIRS[S.LEASED]}/{chunk}"


def release_dir(seq: int) -> str:
    """The directory of release ``seq``'s fresh tasks."""
    return f"{DIRS[S.PENDING]}/{RELEASES.name(seq)}"


def move(storage: Storage, name: TaskName, src: TaskState, dst: TaskState,
         new: TaskName | None = None, *, src_key: str | None = None,
         sync_dir: bool = True) -> str:
    """Move a task ``src -> dst`` (renamed to ``new``): one atomic rename. Returns its key.

    ``src_key`` names the source when it is not the default place (a fresh task inside a
    release directory). ``NotFound`` means another mover won (the caller decides whether
    that is ``LeaseLost`` or a lost race); ``IllegalTransition`` means a bug.
    """
    check_transition(src, dst)
    if dst in RETIRED:
        raise IllegalTransition(f"use retire() to move a task to {dst.value}: its entry is "
                                "deleted")
    dst_key = key_of(dst, name if new is None else new)
    storage.rename(src_key or key_of(src, name), dst_key, sync_dir=sync_dir)
    return dst_key


def retire(storage: Storage, name: TaskName, src: TaskState, dst: TaskState, *,
           keep_at: str | None = None) -> None:
    """``src -> dst`` for a ``dst`` without a directory (``RETIRED``): the entry is deleted,
    or with ``keep_at`` moved there, out of every state listing (a compacted drop's task
    record, kept for ``strawq requeue``: ``strawq.delivery.retention``). Idempotent: a missing entry
    is a no-op — but for a lease (LEASED -> TRAINED, ``retire_lease``), where it is
    ``NotFound``: the lease is no longer the caller's."""
    check_transition(src, dst)
    if dst not in RETIRED:
        raise IllegalTransition(f"retire() deletes entries; {dst.value} has a directory: "
                                "use move()")
    if src is S.LEASED:  # a lease: fenced, not idempotent-silent
        retire_lease(storage, name)
        return
    if keep_at is None:
        storage.delete(key_of(src, name))
        return
    try:
        storage.rename(key_of(src, name), keep_at, sync_dir=False)
    except (NotFound, AlreadyExists):
        pass  # moved (or requeued) by another mover first


def retire_lease(storage: Storage, name: TaskName, *, sync_dir: bool = True) -> None:
    """LEASED -> TRAINED by the lease holder: its group was trained by the framework that
    holds it (slime's data source), so the lease entry is deleted.

    Fenced like every LEASED move: only the holder's name is at ``leased/<name>`` (an
    expired lease was renamed away, gen + 1), so a missing entry is ``NotFound`` — the
    holder's ``LeaseLost`` — never a silent success. Durable when it returns: ``leased/``
    is fsync'd (``sync_dir=False``: the caller syncs it once after several). Idempotent:
    a retried call changes nothing (it finds the entry gone); a crash before the deletion
    leaves the lease, which the holder's recovery retires again.
    """
    check_transition(S.LEASED, S.TRAINED)
    key = key_of(S.LEASED, name)
    storage.delete(key, missing_ok=False)
    if name.chunk is not None:
        # Leased in a chunk: its directory is fsync'd here (the caller's batched fsync is of
        # leased/), then removed once it holds no task (rmdir refuses it before).
        directory = key.rsplit("/", 1)[0]
        storage.sync_dirs([directory])
        drop_drained_chunk(storage, directory, storage.list(directory))
    elif sync_dir:
        storage.sync_dirs([DIRS[S.LEASED]])


def delete_trained(storage: Storage, name: TaskName, *, legacy: bool = False) -> None:
    """BATCHED -> TRAINED: the entry of a group whose batch was acked is deleted, in
    ``ready/`` where it stayed when the batch named it; with ``legacy`` (the run holds
    entries an older strawq moved to ``batched/``) in ``batched/`` too. Idempotent."""
    check_transition(S.BATCHED, S.TRAINED)
    storage.delete(key_of(S.READY, name))
    if legacy:
        retire(storage, name, S.BATCHED, S.TRAINED)


# -- listings ------------------------------------------------------------------------------
#: stray files already warned about, per store (bounded: a flood of junk keeps warning)
_warned: set[tuple[str, str]] = set()


def _parse(storage: Storage, key: str) -> TaskName | None:
    """The task name of a listed key; a stray file is skipped with one warning."""
    name = TaskName.try_parse(key.rsplit("/", 1)[1])
    if name is None and (storage.describe(), key) not in _warned:
        if len(_warned) < 10_000:
            _warned.add((storage.describe(), key))
        log.warning("ignoring a file that is not a task in the queue: %s", key)
    return name


def list_queued(storage: Storage, limit: int | None = None) -> list[str]:
    """Keys in ``pending/`` in claim order: partial, returned, then fresh by release (in
    listing order: a claimer takes the fresh tasks of ranked releases by their claim rank,
    ``strawq.tasks.claims.by_rank``); the tasks of a chunk directory (``release_chunk``)
    where it lies in its release.

    A drained release directory is removed on the way, so listings stay proportional to
    work in flight: rmdir refuses a non-empty directory, and a release directory is never
    refilled (every release gets a new sequence number). So is a drained chunk directory
    (``drop_drained_chunk``).
    """
    return _queued(storage, limit, expand=True)[0]


def _queued(storage: Storage, limit: int | None, *, expand: bool) -> tuple[list[str], int]:
    """``list_queued``'s keys; with ``expand=False`` a chunk directory is not listed but
    counted by the size its name gives (an upper bound), returned second."""
    top = DIRS[S.PENDING]
    listed = storage.list(top)
    out = [f"{top}/{n}" for n in listed if not n.startswith(RELEASE_PREFIX)]
    unlisted = 0
    for d in (n for n in listed if n.startswith(RELEASE_PREFIX)):
        if limit is not None and len(out) >= limit:
            break
        inside = storage.list(f"{top}/{d}")
        if not inside:
            storage.rmdir(f"{top}/{d}")
            continue
        seq = RELEASES.parse(d)
        for n in inside:
            chunk = ChunkName.try_parse(n, seq) if n.startswith(CHUNK_PREFIX) else None
            if chunk is None:
                out.append(f"{top}/{d}/{n}")
            elif not expand:
                unlisted += chunk.size
            else:
                out += queued_chunk_keys(storage, f"{top}/{d}/{n}")
    return (out if limit is None else out[:limit]), unlisted


def queued_chunk_keys(storage: Storage, directory: str) -> list[str]:
    """The task keys in a queued chunk directory (``pending/r-<seq>/k-<j>~n<k>``); one
    drained of its tasks (claimed one by one) is removed (``drop_drained_chunk``)."""
    inside = storage.list(directory)
    keys = [f"{directory}/{n}" for n in inside if n != CHUNK_ROWS]
    if not keys:
        drop_drained_chunk(storage, directory, inside)
    return keys


def drop_drained_chunk(storage: Storage, directory: str, listed: list[str]) -> bool:
    """Remove a chunk directory whose listing ``listed`` holds no task: its rows record,
    then the directory. Safe at any time: no step adds a task to a chunk, so a listing
    without one stays without (a concurrent claim of the whole chunk renamed it: then the
    deletion finds nothing, and the claimer removes it)."""
    if any(n != CHUNK_ROWS for n in listed):
        return False
    if CHUNK_ROWS in listed:
        storage.delete(f"{directory}/{CHUNK_ROWS}")
    return storage.rmdir(directory)


def held_chunks(storage: Storage, listed: Iterable[str] | None = None) -> list[ChunkName]:
    """The chunk directories in ``leased/`` (range claims), from its listing: no chunk is
    listed (what they hold: ``chunk_leases``)."""
    if listed is None:
        listed = storage.list(DIRS[S.LEASED])
    return [c for n in listed
            if n.startswith(CHUNK_PREFIX) and (c := ChunkName.try_parse(n)) is not None]


def chunk_leases(storage: Storage, chunk: ChunkName,
                 listed: list[str] | None = None) -> list[TaskName]:
    """The leases a held chunk still holds (one listing of it, or ``listed``); each
    name's ``chunk`` says where it lies."""
    if listed is None:
        listed = storage.list(chunk_key(chunk))
    out = []
    for n in listed:
        if n == CHUNK_ROWS:
            continue
        entry = _parse(storage, f"{chunk_key(chunk)}/{n}")
        if entry is not None:
            out.append(chunk.task(entry))
    return out


def entries(storage: Storage, state: TaskState, *, listed: Iterable[str] | None = None
            ) -> list[tuple[str, TaskName]]:
    """(key, name) of every task in ``state``, in listing order; stray files are skipped,
    and so are an older run's trained groups in ``dropped/`` (``LEGACY_TRAINED``).
    ``listed``: the names of the state's directory the caller listed (and filtered)."""
    if state in (S.PENDING, S.PARTIAL):
        keys: Iterable[str] = list_queued(storage)
    elif state in RETIRED:
        return []
    elif state is S.LEASED:
        return _leased_entries(storage)
    else:
        names = storage.list(DIRS[state]) if listed is None else listed
        keys = (f"{DIRS[state]}/{n}" for n in names)
    out = []
    for key in keys:
        name = _parse(storage, key)
        if name is None or (state is S.DROPPED and name.producer == LEGACY_TRAINED):
            continue  # a stray file; an older run's trained group (LEGACY_TRAINED)
        if state not in (S.PENDING, S.PARTIAL) or queued_state(name) is state:
            out.append((key, name))
    return out


def _leased_entries(storage: Storage) -> list[tuple[str, TaskName]]:
    """LEASED entries: the leases of their own, then each held chunk's (one listing per
    chunk: for readers off the hot path; the grantor lists a chunk only to expire it)."""
    top = DIRS[S.LEASED]
    listed = storage.list(top)
    out = []
    for n in listed:
        if n.startswith(CHUNK_PREFIX) and ChunkName.try_parse(n) is not None:
            continue
        name = _parse(storage, f"{top}/{n}")
        if name is not None:
            out.append((f"{top}/{n}", name))
    for chunk in held_chunks(storage, listed):
        out += [(key_of(S.LEASED, t), t) for t in chunk_leases(storage, chunk)]
    return out


def names_in(storage: Storage, state: TaskState) -> list[TaskName]:
    """The tasks in ``state`` (READY lists oldest minimum version first: names sort so)."""
    return [name for _key, name in entries(storage, state)]


def dropped_by_reason(storage: Storage) -> dict[str, int]:
    """Dropped tasks per recorded reason (a dropped entry's last name field is its reason)."""
    out: dict[str, int] = {}
    for name in names_in(storage, S.DROPPED):
        reason = name.producer or "unknown"
        out[reason] = out.get(reason, 0) + 1
    return out


@dataclass(frozen=True)
class Depths:
    """Tasks per state, counted from directory listings."""

    pending: int = 0
    partial: int = 0
    leased: int = 0
    ready: int = 0
    batched: int = 0

    @property
    def running(self) -> int:
        return self.pending + self.partial + self.leased

    @property
    def untrained(self) -> int:
        return self.ready + self.batched


def upstream_depths(storage: Storage) -> Depths:
    """PENDING, PARTIAL and LEASED: what flows into ``ready/``, listed in that order."""
    keys, in_chunks = _queued(storage, None, expand=False)
    queued = [name for key in keys if (name := _parse(storage, key)) is not None]
    partial = sum(1 for n in queued if queued_state(n) is S.PARTIAL)
    return Depths(pending=len(queued) - partial + in_chunks, partial=partial,
                  leased=count_leased(storage))


def count_leased(storage: Storage) -> int:
    """Tasks in ``leased/``, a held chunk counted by the size its name gives (an upper
    bound: some of its tasks may have left it; admission errs on the side of releasing
    too little, as with a task counted twice) — one listing, no chunk listed."""
    listed = storage.list(DIRS[S.LEASED])
    chunks = held_chunks(storage, listed)
    held = {str(c) for c in chunks}
    singles = sum(1 for n in listed
                  if n not in held and _parse(storage, f"{DIRS[S.LEASED]}/{n}") is not None)
    return singles + sum(c.size for c in chunks)


def depths(storage: Storage, *, upstream: Depths | None = None,
           ready: int | None = None, batched: int = 0) -> Depths:
    """Tasks per state, listed in the direction work flows (pending, leased, ready, batched).

    A task that moves on between two listings is counted twice, never zero times, so
    admission errs on the side of releasing too little. A caller that scans ``ready/``
    itself lists ``upstream_depths`` first, then passes both in, with ``batched``: the
    entries of its ``ready/`` listing a manifest names (a BATCHED group's entry stays in
    ``ready/``; ``strawq.delivery.batches.queue_depths`` counts them). ``batched/`` holds
    only what an older strawq moved there (``LEGACY_BATCHED``), counted too.
    """
    up = upstream_depths(storage) if upstream is None else upstream
    n_ready = len(names_in(storage, S.READY)) if ready is None else ready
    return replace(up, ready=n_ready, batched=batched + len(names_in(storage, S.BATCHED)))


# -- adapters' stores, declared here -------------------------------------------------------
@dataclass(frozen=True)
class Store:
    """An adapter's own records, declared in the core's table: the directory each state's
    records live in and the legal moves between states, checked the way ``TRANSITIONS``
    is. A state without a directory here is an exit: reaching it deletes the record.

    The names inside a store's directories are the adapter's (its own numbering); their
    directories, the moves and where each record goes are spelled here only.
    """

    name: str
    dirs: dict[TaskState, str]
    transitions: dict[tuple[TaskState, TaskState], str]
    #: the store's other directories: records in no state (a verl queue's commits)
    others: tuple[str, ...] = ()

    def check(self, src: TaskState, dst: TaskState) -> str:
        """The operation for ``src -> dst`` in this store; ``IllegalTransition`` if none."""
        try:
            return self.transitions[(src, dst)]
        except KeyError:
            raise IllegalTransition(f"illegal move in the {self.name} store: {src.value} -> "
                                    f"{dst.value}; the legal ones are declared in "
                                    "strawq.tasks.states") from None

    def directories(self) -> list[str]:
        """Every directory of the store, each once."""
        return list(dict.fromkeys([*self.dirs.values(), *self.others]))

    def dir_of(self, state: TaskState) -> str:
        if state not in self.dirs:
            raise IllegalTransition(f"a {state.value} record of the {self.name} store has "
                                    "no entry on disk")
        return self.dirs[state]

    def key(self, state: TaskState, name: str) -> str:
        """The storage key of record ``name`` in ``state``."""
        return f"{self.dir_of(state)}/{name}"

    def other_key(self, directory: str, name: str) -> str:
        """The key of ``name`` in one of the store's other directories."""
        if directory not in self.others:
            raise IllegalTransition(f"{directory!r} is not a directory of the {self.name} "
                                    "store")
        return f"{directory}/{name}"

    def move(self, storage: Storage, name: str, src: TaskState, dst: TaskState,
             new: str | None = None, *, sync_dir: bool = True) -> str:
        """``src -> dst``: one atomic rename (``NotFound``: another mover won). Returns the
        new key."""
        self.check(src, dst)
        if dst not in self.dirs:
            raise IllegalTransition(f"use retire() to move a {self.name} record to "
                                    f"{dst.value}: it is deleted")
        dst_key = self.key(dst, name if new is None else new)
        storage.rename(self.key(src, name), dst_key, sync_dir=sync_dir)
        return dst_key

    def retire(self, storage: Storage, name: str, src: TaskState, dst: TaskState) -> None:
        """``src -> dst`` for a ``dst`` without a directory here: the record is deleted.
        Idempotent: a missing record is a no-op."""
        self.check(src, dst)
        if dst in self.dirs:
            raise IllegalTransition(f"{dst.value} records of the {self.name} store have a "
                                    "directory: use move()")
        storage.delete(self.key(src, name))


#: verl's durable ``MessageQueue`` (``strawq.collector.integrations.verl.samples``): a verl
#: ``RolloutSample`` its putter wrote itself waits, PENDING, in ``incoming/`` until the queue
#: names it; it is a finished group (READY) in ``samples/<seq>~<id>``, or one of a batch
#: file's, ``samples/<first seq>~<last seq>~batch`` (the puts of one write); handed out to
#: verl's trainer it is BATCHED, its record left where it is (the hand-out is held in memory
#: and re-derived from ``samples/`` and the newest commit at a restart); a checkpoint's
#: ``commits/<n>`` covers it, TRAINED, and the record is deleted.
VERL_SAMPLES = Store(
    name="verl sample",
    dirs={S.PENDING: "incoming", S.READY: "samples", S.BATCHED: "samples", S.DROPPED: "drops"},
    transitions={
        (S.PENDING, S.READY): "a put its putter wrote (put_written): the record, durable in "
                              "incoming/, renamed to samples/<seq>~<id> by the queue; a "
                              "putter's batch file (put_written_batches) to samples/<first "
                              "seq>~<last seq>~batch; recover names those no put named",
        (S.PENDING, S.TRAINED): "a written put of a sample the queue holds or recently "
                                "committed (a duplicate), or one the queue's process cannot "
                                "see (the putter sends the bytes instead): deleted",
        (S.READY, S.BATCHED): "get (the queue): handed out to verl's trainer, in put order; "
                              "no file operation (the record stays in samples/)",
        (S.BATCHED, S.READY): "rewind, or a restart of the queue: every hand-out no commit "
                              "covers is handed out again, oldest first",
        (S.BATCHED, S.TRAINED): "commit(consumed) (a trainer checkpoint holds it): "
                                "commits/<n> is published first, then the record deleted "
                                "(a batch file: once every sample in it is gone)",
        (S.READY, S.TRAINED): "commit of hand-outs of an earlier life of the queue, and "
                              "recovery finishing a commit's deletions",
        (S.READY, S.DROPPED): "put past max_queue_size (the oldest not handed out: "
                              "queue_full), an unreadable record (corrupt), drop_all "
                              "(cleared): renamed to drops/<name>~<reason> (a sample in a "
                              "batch file: copied to drops/<seq>~<id>~<reason>; an "
                              "unreadable batch file: renamed whole); a place of a batch "
                              "file whose sample is held already (duplicate): a record of "
                              "the drop only",
    },
    others=("commits",))

#: verl's partial rollout (``strawq.collector.integrations.verl.partial``): the prefix of
#: a request aborted at a parameter sync, a PARTIAL record in ``partials/<key>~<n>`` until
#: a request for the same prompt claims it (LEASED, in ``held/``); the request's finish
#: retires it: its tokens are in the sample verl puts, READY in ``VERL_SAMPLES``.
VERL_PREFIXES = Store(
    name="verl prefix",
    dirs={S.PARTIAL: "partials", S.LEASED: "held"},
    transitions={
        (S.PARTIAL, S.LEASED): "claim (a rollout request for the prompt): rename "
                               "partials/ -> held/, one winner",
        (S.LEASED, S.PARTIAL): "release (the request failed), recover (the queue starts: no "
                               "rollout process is alive)",
        (S.LEASED, S.LEASED): "save (the holder, aborted again): the new record is "
                              "published first, then the one it replaces deleted",
        (S.LEASED, S.READY): "finish (the holder): the request finished, its tokens are in "
                             "the sample verl puts; the record is deleted",
        (S.LEASED, S.DROPPED): "claim of an unreadable record: deleted, logged",
    })

#: The adapters' stores, each declared above.
STORES = (VERL_SAMPLES, VERL_PREFIXES)
