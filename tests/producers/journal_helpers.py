"""Helpers of the in-flight journal tests: held groups without engines, tokens by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from strawq.producers.group import GroupRun
from strawq.producers.handback import HandBack
from strawq.producers.held import ActiveGroup, GroupTable
from strawq.ondisk.groups import GroupData
from strawq.ondisk.names import TaskName
from strawq.producers.journal_flush import JournalFlush, load_prefix
from strawq.producers.meter import ProducerStats, StatsBook
from strawq.producers.offload import Offload
from strawq.producers.producer_config import TimingConfig
from strawq.producers.sample import Sample, SamplerParams, Segment, apply_segment
from strawq.storage import Storage
from strawq.tasks.claims import Lease
from strawq.tasks.queue import RunQueue
from tests.strawq.queue_helpers import make_feeder, make_queue

PROMPT = [11, 12, 13]


def run_with_tasks(storage: Storage, tmp_path: Path, n: int, *, group_size: int = 2
                   ) -> RunQueue:
    q = make_queue(storage, group_size=group_size)
    make_feeder(q, tmp_path, n).release(n)
    return q


def hold(q: RunQueue, table: GroupTable, producer: str, n: int, *, version: int = 0
         ) -> list[ActiveGroup]:
    """Claim ``n`` tasks as ``producer`` and hold them as fresh groups in ``table``."""
    out = []
    for lease in q.claim(producer, n):
        params = [SamplerParams(max_new_tokens=10_000, seed=i) for i in
                  range(q.config.group_size)]
        a = ActiveGroup(lease, version=version)
        a.run = GroupRun.fresh(lease, PROMPT, params)
        table.groups[lease.key] = a
        out.append(a)
    return out


def segment(n: int, *, first: int = 0, version: int = 0, finish: str = "abort") -> Segment:
    ids = np.arange(first, first + n, dtype=np.int32)
    return Segment(token_ids=ids, logprobs=-0.01 * (ids + 1).astype(np.float32),
                   versions=np.full(n, version, np.int64),
                   finish_reason={"type": finish, **({"length": n} if finish == "length"
                                                     else {})})


def generate(s: Sample, n: int, *, version: int = 0, finish: str = "abort") -> None:
    """``n`` more tokens applied to ``s`` (an ended segment)."""
    apply_segment(s, segment(n, first=1000 + s.response_length, version=version,
                             finish=finish))


def stream(s: Sample, n: int, *, version: int = 0) -> None:
    """``n`` tokens of a segment still streaming (``Sample.streamed``)."""
    s.streamed = segment(n, first=1000 + s.response_length, version=version)


def flusher(q: RunQueue, table: GroupTable, producer: str, *, incarnation: int = 1,
            tokens: int = 64, seconds: float = 0.0, segments: bool | None = None,
            ) -> tuple[JournalFlush, Offload, StatsBook]:
    """A journal writer of ``producer``'s held groups; ``segments``: None, as the store
    can (what a producer does: segments on memory and POSIX stores), False: a record file
    per window (a store that cannot append, or a run written before segments), True:
    segments."""
    io = Offload(1, f"{producer}-io")
    book = StatsBook(ProducerStats(producer_id=producer))
    j = JournalFlush(TimingConfig(journal_every_tokens=tokens, journal_every_s=seconds),
                     table=table, queue=q, io=io, book=book, producer_id=producer,
                     segments=segments)
    j.open(incarnation)
    return j, io, book


def parking(q: RunQueue, producer: str, n: int, *, segments: bool | None = None
            ) -> tuple[GroupTable, list[ActiveGroup], JournalFlush, Offload, StatsBook,
                       HandBack]:
    """``n`` groups held by ``producer``, its journal writer and a hand-back that parks
    into that journal (what a producer's park does)."""
    table = GroupTable()
    groups = hold(q, table, producer, n)
    j, io, book = flusher(q, table, producer, segments=segments)
    hb = HandBack(q, io, book)
    hb.journal = j
    return table, groups, j, io, book, hb


def saved_prefix(q: RunQueue, t: TaskName) -> GroupData | None:
    """The prefix queued partial task ``t`` resumes from: its ``.partial``, or, when its
    name's holder slot names a journal's writer (a park yielded into the journal, the
    default), that journal's prefix."""
    if t.resume < 0:
        return None
    if t.producer is None:
        return q.load_partial(Lease(t, {}))
    return load_prefix(q, Lease(t, {}, t.producer),
                       lambda i: SamplerParams(max_new_tokens=10**9))
