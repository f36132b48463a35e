"""Read a run directory and check the queue invariants (docs/design.md, invariants 1 and 2,
docs/architecture.md).

``audit_run(storage)`` lists every state directory and decodes every visible record;
``Audit.check(released, ...)`` then returns a list of human-readable problems (empty when
the run is consistent). ``check_total_queue`` is the Jepsen total-queue checker
(``jepsen/checker.clj``): lost, unexpected and duplicated elements after a drain.

The auditor is read-only: it never quarantines or repairs anything, so it can look at the
exact state a crash left behind.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from strawq.delivery.batches import batch_seqs, manifest_key
from strawq.errors import CorruptRecord, NotFound
from strawq.ondisk import records
from strawq.ondisk.groups import GroupData
from strawq.ondisk.names import CHUNK_ROWS, ChunkName, TaskName, data_key, note_key
from strawq.ondisk.records import Kind
from strawq.storage import Storage
from strawq.tasks.journal import find_writer, journaled
from strawq.tasks.states import RELEASES

#: Where a task can be. "quarantined" is reported, never silent (docs/design.md, invariant 2).
STATES = ("pending", "partial", "leased", "ready", "batched", "dropped", "quarantined")


@dataclass(frozen=True)
class Entry:
    state: str
    key: str
    name: TaskName


@dataclass
class Audit:
    entries: dict[str, list[Entry]] = field(default_factory=dict)
    #: (key, message) of visible records that failed to decode or are missing
    corrupt: list[tuple[str, str]] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)
    #: manifest seq -> task ids it references
    manifests: dict[int, list[str]] = field(default_factory=dict)
    acked: set[int] = field(default_factory=set)
    cursor_next: int = 0
    staging: list[str] = field(default_factory=list)
    #: the newest committed cursor's sequence number
    cursor_seq: int = 0
    tmp: list[str] = field(default_factory=list)
    #: (key, message) of payloads cut off mid-write that no entry names: a lease's payload
    #: is written in place before its fencing rename (``RunQueue.complete``), so a crash
    #: leaves such a file, swept once the task moves on; not a problem
    uncommitted: list[tuple[str, str]] = field(default_factory=list)
    #: reason recorded for each dropped task (from its note)
    drop_reasons: dict[str, str] = field(default_factory=dict)
    #: task ids a release skipped by the history's rule (``strawq.data.prompt_policy``): their
    #: row was accounted for in that pass without a task
    skipped: set[str] = field(default_factory=set)
    #: task ids whose drop was folded into the drop audit
    #: (``strawq.delivery.retention.compact_drops``: the entry is deleted, the history records the
    #: dropped attempt with its reason)
    compacted: set[str] = field(default_factory=set)

    def state_of(self, task_id: str) -> str | None:
        e = self.entries.get(task_id, [])
        return e[0].state if len(e) == 1 else None

    def name_of(self, task_id: str) -> TaskName:
        e = self.entries.get(task_id, [])
        if len(e) != 1:
            raise AssertionError(f"task {task_id} is in {len(e)} places: {e}")
        return e[0].name

    def ids(self, *states: str) -> set[str]:
        return {tid for tid, es in self.entries.items() for e in es if e.state in states}

    def counts(self) -> dict[str, int]:
        c: Counter[str] = Counter(e.state for es in self.entries.values() for e in es)
        return {s: c.get(s, 0) for s in STATES}

    def check(self, released: Iterable[str], *, trained: Collection[str] = (),
              recovered: bool = True, extra_ok: Collection[str] = (),
              strict_reasons: bool = True) -> list[str]:
        """Problems with this state, given the task ids known to be released.

        ``trained``: ids whose batch was acked and may have been garbage-collected (absent,
        or still batched). ``recovered``: recovery ran, so no staging directory and no
        ready group named by a manifest may remain. ``extra_ok``: ids that may be present
        although not released (rows a crashed release recorded as bad before its commit).
        ``strict_reasons``: a dropped entry's reason must match its note's.
        """
        problems: list[str] = []
        released = set(released)
        trained = set(trained)
        for tid in sorted(released):
            es = self.entries.get(tid, [])
            if tid in self.skipped:
                if es:
                    problems.append(f"skipped {tid} was released too: {[e.key for e in es]}")
                continue
            if not es and tid not in trained and tid not in self.compacted:
                problems.append(f"lost: {tid} is in no state")
            if len(es) > 1:
                problems.append(f"duplicated: {tid} is in {[e.key for e in es]}")
            if tid in trained and any(e.state not in ("batched",) for e in es):
                problems.append(f"trained task {tid} is back in {[e.key for e in es]}")
        for tid in sorted(set(self.entries) - released - set(extra_ok)):
            problems.append(f"unexpected: {tid} was never released but is in "
                            f"{[e.key for e in self.entries[tid]]}")
        for key, msg in self.corrupt:
            problems.append(f"torn or corrupt record visible: {key}: {msg}")
        seen: dict[str, int] = {}
        for seq, ids in sorted(self.manifests.items()):
            for tid in ids:
                if tid in seen:
                    problems.append(f"{tid} is in batches {seen[tid]} and {seq}")
                seen[tid] = seq
        for tid in self.ids("batched"):
            if tid not in seen:
                problems.append(f"{tid} is batched but no manifest names it")
        if recovered:
            for tid in self.ids("ready", "pending", "partial", "leased"):
                if tid in seen:
                    problems.append(f"{tid} is in batch {seen[tid]} but still "
                                    f"{self.state_of(tid)}")
            # Staging above the newest committed cursor may be another writer's release in
            # progress (or one that died before its commit): invisible, and discarded by the
            # next commit. At or below it, recovery must have removed it.
            left = [s for s in self.staging
                    if not (s[2:].partition(".")[0].isdigit()
                            and int(s[2:].partition(".")[0]) > self.cursor_seq)]
            if left:
                problems.append(f"staging directories left after recovery: {left}")
        for tid in self.ids("dropped"):
            name = self.name_of(tid) if len(self.entries[tid]) == 1 else None
            reason = self.drop_reasons.get(tid)
            if name is None or reason is None:
                problems.append(f"dropped {tid} has no readable reason note")
            elif strict_reasons and reason != name.producer:
                problems.append(f"dropped {tid}: entry says reason {name.producer!r}, its "
                                f"note says {reason!r}")
        return problems


def _decode(storage: Storage, key: str, audit: Audit, *kinds: Kind) -> records.Record | None:
    try:
        rec = records.decode(storage.read(key), name=key)
    except NotFound:
        audit.corrupt.append((key, "missing"))
        return None
    except CorruptRecord as exc:
        audit.corrupt.append((key, str(exc)))
        return None
    if kinds and rec.kind not in kinds:
        expected = "/".join(k.name for k in kinds)
        audit.corrupt.append((key, f"kind {rec.kind.name}, expected {expected}"))
        return None
    return rec


def _uncommitted_payload(a: Audit, n: str) -> bool:
    """Whether ``data/<n>`` is a group or partial payload that no entry names (its task's
    entries as collected so far: every state's, before ``data/`` is read)."""
    tid, sep, rest = n.partition("~g")
    gen_s, _, suffix = rest.partition(".")
    if not sep or not gen_s.isdigit() or suffix not in ("group", "partial"):
        return False
    gen = int(gen_s)
    for e in a.entries.get(tid, []):
        if suffix == "group" and e.state in ("ready", "batched") and e.name.gen == gen:
            return False
        if suffix == "partial" and e.name.resume == gen:
            return False
    return True


def audit_run(storage: Storage) -> Audit:
    """A read-only snapshot of a run, with every visible record decoded."""
    a = Audit()
    if storage.exists("run.meta"):
        _decode(storage, "run.meta", a, Kind.RUN)

    def add(state: str, key: str, chunk: ChunkName | None = None) -> None:
        name = TaskName.try_parse(key.rsplit("/", 1)[1])
        if name is None:
            a.corrupt.append((key, "not a task name"))
            return
        if chunk is not None:  # leased in a held chunk: the holder is in the chunk's name
            name = chunk.task(name)
        a.entries.setdefault(name.id, []).append(Entry(state, key, name))

    def chunk_keys(directory: str) -> list[str]:
        """The task keys in a chunk directory (range claims); its rows record decoded."""
        listed = storage.list(directory)
        if CHUNK_ROWS in listed:
            _decode(storage, f"{directory}/{CHUNK_ROWS}", a, Kind.TASK)
        return [f"{directory}/{m}" for m in listed if m != CHUNK_ROWS]

    for n in storage.list("pending"):
        if n.startswith("r-"):
            for m in storage.list(f"pending/{n}"):
                if ChunkName.try_parse(m, RELEASES.parse(n)) is not None:
                    for key in chunk_keys(f"pending/{n}/{m}"):
                        add("pending", key)
                    continue
                add("pending", f"pending/{n}/{m}")
        else:
            add("partial" if n.startswith("a") else "pending", f"pending/{n}")
    for state in ("leased", "ready", "batched", "dropped"):
        for n in storage.list(state):
            held = ChunkName.try_parse(n) if state == "leased" else None
            if held is not None:
                for key in chunk_keys(f"leased/{n}"):
                    add(state, key, held)
                continue
            add(state, f"{state}/{n}")
    for n in storage.list("quarantine"):
        a.quarantined.append(n)
        name = TaskName.try_parse(n.rpartition("+")[2])
        if name is not None and n.split("+", 1)[0] in ("pending", "leased", "ready",
                                                        "batched", "dropped"):
            a.entries.setdefault(name.id, []).append(Entry("quarantined", f"quarantine/{n}",
                                                           name))
    for n in storage.list("data"):
        bad = len(a.corrupt)
        _decode(storage, f"data/{n}", a)
        if len(a.corrupt) > bad and _uncommitted_payload(a, n):
            a.uncommitted.append(a.corrupt.pop())
    seqs, a.acked = batch_seqs(storage)
    named: set[str] = set()
    for seq in seqs:
        rec = _decode(storage, manifest_key(seq), a, Kind.MANIFEST)
        if rec is not None:
            ids = [TaskName.parse(g).id for g in rec.meta["groups"]]
            a.manifests[seq] = ids
            named.update(rec.meta["groups"])
    # a batch leaves its groups' entries in ready/: a ready entry a manifest names is batched
    for tid, es in a.entries.items():
        a.entries[tid] = [Entry("batched", e.key, e.name)
                          if e.state == "ready" and str(e.name) in named else e for e in es]
    consumed = {tid for seq in a.acked for tid in a.manifests.get(seq, [])}
    in_journal: dict[str, dict[tuple[str, int], int]] = {}

    def journal_holds(e: Entry) -> bool:
        """Whether a journal holds the prefix of ``e``'s resume generation: its queued
        name's writer's (the holder slot), or, for a lease (its slot names its holder, not
        the writer it resumed from), any writer's (``strawq.tasks.journal``)."""
        if e.state in ("pending", "partial") and e.name.producer is not None:
            w = e.name.producer
            if w not in in_journal:
                in_journal[w] = journaled(storage, w)
            return (e.name.id, e.name.resume) in in_journal[w]
        return find_writer(storage, e.name.id, e.name.resume) is not None

    for es in a.entries.values():
        for e in es:
            if e.state == "quarantined":
                continue
            rec = _decode(storage, e.key, a, Kind.TASK, Kind.DROP)
            if rec is None:
                continue
            if e.state in ("pending", "partial", "leased") and e.name.resume >= 0:
                pkey = data_key(e.name.id, e.name.resume, "partial")
                if storage.exists(pkey) or not journal_holds(e):  # a park into the journal
                    _decode(storage, pkey, a, Kind.PARTIAL)
            if e.state == "ready" or (e.state == "batched" and e.name.id not in consumed):
                # an acked batch's payloads may already be garbage-collected
                gkey = data_key(e.name.id, e.name.gen, "group")
                grec = _decode(storage, gkey, a, Kind.GROUP)
                if grec is not None:
                    try:
                        g = GroupData.from_record(grec)
                    except CorruptRecord as exc:
                        a.corrupt.append((gkey, str(exc)))
                    else:
                        if g.task_id != e.name.id:
                            a.corrupt.append((gkey, f"payload of {g.task_id}"))
            if e.state == "dropped":
                note = _decode(storage, note_key(e.name.id, e.name.gen, "drop",
                                                 e.name.producer or ""), a, Kind.DROP)
                if note is not None:
                    a.drop_reasons[e.name.id] = str(note.meta.get("reason"))
    from strawq.data.cursor import cursor_key, list_cursors

    for seq, nxt, n in list_cursors(storage):
        a.cursor_seq = max(a.cursor_seq, seq)
        rec = _decode(storage, cursor_key(n), a, Kind.CURSOR)
        if rec is not None:
            a.cursor_next = max(a.cursor_next, int(rec.meta["next_index"]), nxt)
    a.staging = storage.list("staging")
    a.tmp = storage.list("tmp")
    from strawq.data.history import load_history

    history = load_history(storage)
    a.skipped = {tid for tid, st in history.prompts.items() if st.skipped}
    a.compacted = {tid for tid, st in history.prompts.items() if st.dropped}
    return a


@dataclass(frozen=True)
class QueueCheck:
    """Jepsen's total-queue verdict: valid iff nothing is lost, unexpected or duplicated."""

    lost: frozenset[str]
    unexpected: frozenset[str]
    duplicated: dict[str, int]

    @property
    def valid(self) -> bool:
        return not (self.lost or self.unexpected or self.duplicated)


def check_total_queue(enqueued: Iterable[str], dequeued: Iterable[str]) -> QueueCheck:
    """``enqueued``: ids whose enqueue succeeded; ``dequeued``: every successful dequeue
    (with repeats). Each element must come out exactly once."""
    enq = set(enqueued)
    deq = Counter(dequeued)
    return QueueCheck(lost=frozenset(enq - set(deq)), unexpected=frozenset(set(deq) - enq),
                      duplicated={k: v for k, v in deq.items() if v > 1})
