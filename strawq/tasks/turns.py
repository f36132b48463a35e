"""Turn checkpoints: a leased task's group saved between turns, the lease kept.

A multi-turn group is persisted at weight updates and stops (``RunQueue.yield_partial``:
the lease is given up). Between those, its holder saves a *turn checkpoint* at turn
boundaries without giving the lease up, so a holder killed mid-trajectory loses only the
work since its last checkpoint: when the grantor re-leases the task, the new holder loads
the last checkpoint an older generation wrote and resumes from it.

Layout: ``turns/<task_id>/<seq>`` (``seq`` zero-padded, one sequence per task shared by
every generation). A record is a PARTIAL group record whose ``meta["checkpoint"]`` says
who wrote it (``gen``: the lease generation; ``resume``, ``regenerations``: the lease's
name, so a checkpoint that a later partial or a regeneration superseded is never used), or
a small STATE record, a *fence*, that a new holder writes before it reads anything.

Fencing (docs/design.md, invariants 3 and 8). Every record is published by exclusive
create, so two writers never both own a ``seq``. A holder writes its records at increasing
``seq``; when a create finds the name taken it reads that record: one of a newer generation
means a newer holder owns the task (``LeaseLost``: nothing was written); one of an older
generation is a stale holder's, and the writer steps past it. A new holder first publishes
its fence above every record it lists, then loads the newest usable record below the fence.
A stale holder's next write lands at or below a record of the newer generation (it only
ever steps one past its own last record), so it either hits it and stops, or fills a gap
below it, where no loader looks: a loader takes the record with the highest ``seq``, and
the newest generation's latest record is never deleted before a newer one exists. A save
from an older generation is therefore never used once a newer holder fenced it; and a save
lists the directory after publishing, so one that filled such a gap fails too (its record
deleted, ``LeaseLost``) and the stale holder never goes on live past it (a tool call of a
lease it lost).

Bounded (invariant 6): a holder deletes its previous records after each save, a loader the
records below the one it loaded, and the producer deletes the task's records once the lease
is handed back (``TurnLog.clear``). Recovery reads one listing of the task's directory and
the newest records in it. Every operation is counted (``TurnStats``): a save is one publish
(create + write + fsync + rename + directory fsync), one listing and one delete.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from strawq.errors import AlreadyExists, CorruptRecord, LeaseLost, NotFound
from strawq.ondisk import records
from strawq.ondisk.names import TaskName, validate_id
from strawq.ondisk.numbered import Numbered
from strawq.ondisk.records import Kind
from strawq.storage import Storage

if TYPE_CHECKING:
    from strawq.ondisk.groups import GroupData

TURNS_DIR = "turns"
SEQ_DIGITS = 10
#: ``turns/<task_id>/<seq>``
TURNS = Numbered(width=SEQ_DIGITS)


def turn_dir(task_id: str) -> str:
    validate_id(task_id, "task id")
    return f"{TURNS_DIR}/{task_id}"


def turn_key(task_id: str, seq: int) -> str:
    return f"{turn_dir(task_id)}/{TURNS.name(seq)}"


@dataclass
class TurnStats:
    """Storage operations and bytes of one ``TurnLog`` (or summed over many)."""

    saves: int = 0
    fences: int = 0
    publishes: int = 0
    bytes: int = 0
    deletes: int = 0
    lists: int = 0
    reads: int = 0
    conflicts: int = 0

    def add(self, other: TurnStats) -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))

    def to_dict(self) -> dict[str, int]:
        return {k: int(getattr(self, k)) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class Checkpoint:
    """A loaded turn checkpoint: the group and who wrote it."""

    group: GroupData
    gen: int
    seq: int


def _header(rec: records.Record) -> dict[str, Any]:
    if rec.kind is Kind.STATE:
        h = rec.meta.get("checkpoint")
    elif rec.kind is Kind.PARTIAL:
        h = (rec.meta.get("group") or {}).get("meta", {}).get("checkpoint")
    else:
        h = None
    if not isinstance(h, dict) or not isinstance(h.get("gen"), int):
        raise CorruptRecord(f"turn checkpoint of kind {rec.kind.name} has no checkpoint header")
    return h


def warm_up() -> None:
    """Encode a tiny group record once: the first encode in a process loads pyarrow's IPC
    machinery (half a second on a loaded box), which a producer would otherwise pay inside
    its first turn checkpoint, while its first turns wait undurable."""
    import numpy as np

    from strawq.ondisk.groups import GroupData

    z = np.zeros(1)
    GroupData(task_id="warm-up", index=0, prompt_ids=np.zeros(1), sample_lens=[1], tokens=z,
              logprobs=z, versions=z, loss_mask=z, rewards=[None], status=["pending"],
              meta={}).encode(Kind.PARTIAL)


class TurnLog:
    """The turn checkpoints of one lease (one task, one generation)."""

    def __init__(self, storage: Storage, name: TaskName) -> None:
        self.storage = storage
        self.name = name
        self.stats = TurnStats()
        #: the seq of this lease's newest record (fence or save); -1 before any
        self.last = -1
        self._mine: list[int] = []
        self._below: list[int] = []  # records seen at load, deleted after the first save
        self.lost = False

    # -- helpers ---------------------------------------------------------------------------
    def _seqs(self) -> list[int]:
        self.stats.lists += 1
        return TURNS.numbers(self.storage.list(turn_dir(self.name.id)))

    def _read(self, seq: int) -> records.Record | None:
        self.stats.reads += 1
        try:
            return records.decode(self.storage.read(turn_key(self.name.id, seq)),
                                  name=turn_key(self.name.id, seq))
        except (NotFound, CorruptRecord):
            return None

    def _header_fields(self) -> dict[str, Any]:
        return {"gen": self.name.gen, "resume": self.name.resume,
                "regenerations": self.name.regenerations, "at": time.time()}

    def _publish(self, chunks: list[bytes], start: int) -> int:
        """Publish at the first free ``seq`` ≥ ``start`` past older generations' records;
        ``LeaseLost`` at a newer generation's."""
        seq = start
        size = sum(len(c) for c in chunks)
        while True:
            try:
                self.storage.publish(turn_key(self.name.id, seq), chunks)
            except AlreadyExists:
                self.stats.conflicts += 1
                rec = self._read(seq)
                gen = _header(rec)["gen"] if rec is not None else None
                if gen is not None and gen > self.name.gen:
                    self.lost = True
                    raise LeaseLost(f"lease {self.name} is fenced: generation {gen} holds "
                                    f"task {self.name.id} (turn checkpoint {seq})") from None
                seq += 1
                continue
            self.stats.publishes += 1
            self.stats.bytes += size
            return seq

    def _usable(self, h: dict[str, Any]) -> bool:
        return (h["gen"] < self.name.gen and h["gen"] > self.name.resume
                and int(h.get("regenerations", 0)) == self.name.regenerations)

    # -- operations --------------------------------------------------------------------------
    def load(self) -> Checkpoint | None:
        """Fence the task's older holders, then the newest usable checkpoint below the
        fence (None when there is none). Lists once; publishes one small fence when the
        directory holds anything."""
        seqs = self._seqs()
        if not seqs:
            return None
        fence = records.encode(Kind.STATE, {"checkpoint": {**self._header_fields(),
                                                           "fence": True}})
        self.last = self._publish(fence, seqs[-1] + 1)
        self.stats.fences += 1
        self._mine.append(self.last)
        from strawq.ondisk.groups import GroupData

        found: Checkpoint | None = None
        for seq in sorted((s for s in self._seqs() if s < self.last), reverse=True):
            rec = self._read(seq)
            if rec is None or rec.kind is not Kind.PARTIAL:
                continue
            h = _header(rec)
            if self._usable(h):
                found = Checkpoint(GroupData.from_record(rec), int(h["gen"]), seq)
            break  # the newest data record decides: an older one is superseded
        self._below = [s for s in seqs if s < self.last]
        return found

    def save(self, group: GroupData) -> int:
        """Publish ``group`` as this lease's newest checkpoint, then delete the older
        records. ``LeaseLost`` when a newer generation fenced this lease."""
        if self.lost:
            raise LeaseLost(f"lease {self.name} was fenced by a newer generation")
        group.meta["checkpoint"] = self._header_fields()
        seq = self._publish(group.encode(Kind.PARTIAL), self.last + 1)
        self._refuse_gap(seq)
        self.stats.saves += 1
        old, self._mine, self._below = self._mine + self._below, [seq], []
        self.last = seq
        for s in old:
            self._delete(s)
        return seq

    def _refuse_gap(self, seq: int) -> None:
        """``LeaseLost`` (the record just published at ``seq`` deleted) when a newer
        generation holds a record above it: the save filled a gap below the newer holder's
        records (its fence is deleted after its first save). The record would never be
        loaded, but a save that returned would let this stale holder go on live — run a
        tool call of a lease it lost — until its next save."""
        for above in (s for s in self._seqs() if s > seq):
            rec = self._read(above)
            try:
                gen = _header(rec)["gen"] if rec is not None else None
            except CorruptRecord:
                continue
            if gen is not None and gen > self.name.gen:
                self.lost = True
                self._delete(seq)
                raise LeaseLost(f"lease {self.name} is fenced: generation {gen} holds task "
                                f"{self.name.id} (turn checkpoint {above})")

    def _delete(self, seq: int) -> None:
        self.stats.deletes += 1
        self.storage.delete(turn_key(self.name.id, seq))

    def clear(self) -> None:
        """Delete the task's records of this and older generations (the lease was handed
        back: its group is persisted elsewhere), and the directory once empty."""
        for seq in self._seqs():
            if seq in self._mine or seq in self._below:
                self._delete(seq)
                continue
            rec = self._read(seq)
            if rec is None:
                continue
            try:
                gen = _header(rec)["gen"]
            except CorruptRecord:
                gen = None
            if gen is None or gen <= self.name.gen:
                self._delete(seq)
        self._mine, self._below = [], []
        self.storage.rmdir(turn_dir(self.name.id))


__all__ = ["TURNS_DIR", "Checkpoint", "TurnLog", "TurnStats", "turn_dir", "turn_key",
           "warm_up"]
