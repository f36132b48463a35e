"""The producer's in-flight journal: what it writes each window, what a park yields into it,
and how a claimer resumes from it (the record and its garbage: ``strawq.tasks.journal``).

``JournalFlush`` watches the groups the producer holds (``held.GroupTable``). Once
``timing.journal_every_tokens`` new tokens arrived since its last record, or
``timing.journal_every_s`` passed with new tokens, it writes ONE record holding, for every
held group whose received state moved, an entry: per changed sample the columns appended
since its last entry (tokens, log-probs, versions, loss mask, extras' rows), its status,
finish reason and reward. What a sample holds is ``received(sample)`` (its applied segments
and the segment streaming now, ``Sample.streamed``). A lease's first entry, and every entry
of a ``FULL_EVERY``-th record, is *full*: every sample from its first token, and the prompt.

The snapshot is taken on the event loop (one consistent state), the record published on
the I/O thread; what it covered counts as durable only once the publish returned.

**A park** (a weight update, a stop: ``HandBack.yield_partial`` of a parking group) asks
``park_point``: the group's state is made durable by one record shared by every group
parked at once (the first waits, ``PARK_GATHER_S`` at most, until every other parking group
asked too; its entries are full, so each next holder reads that one record), and the
lease is yielded by the rename alone (``RunQueue.yield_journaled``) instead of one
``.partial`` per group. Should the record fail, the group is yielded with
its ``.partial`` as before.

**A resume** (``load_prefix``): a claimed task whose resume generation has no ``.partial``
rebuilds its group from the journal prefix (``strawq.tasks.journal.load_chain``) and goes on
exactly as from a partial (``GroupRun.from_partial``). The producer keeps one
``JournalReader``: a segment it read for one claim is read for the next from where it
ended, and a claim reads only the frames that hold its lease.

The journal holds the engine-generated path: a multi-turn generate plugin's trajectories
and environment snapshots are the turn checkpoints' (``strawq.tasks.turns``), so a producer
with turn checkpoints keeps no journal.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from strawq.ondisk.extras import Extra, cat, first_placeholder
from strawq.producers.group import GroupRun
from strawq.producers.sample import (
    LOGPROB_DTYPE,
    MASK_DTYPE,
    TOKEN_DTYPE,
    VERSION_DTYPE,
    Sample,
    SampleError,
    SamplerParams,
    SampleStatus,
    received,
)
from strawq.tasks.journal import JournalLog, JournalReader, LeaseKey, find_writer, load_chain

if TYPE_CHECKING:
    from strawq.ondisk.groups import GroupData
    from strawq.producers.held import ActiveGroup, GroupTable
    from strawq.producers.meter import StatsBook
    from strawq.producers.offload import Offload
    from strawq.producers.producer_config import TimingConfig
    from strawq.tasks.queue import Lease, RunQueue

log = logging.getLogger(__name__)

#: how often the flusher looks at the held groups, at most, in seconds
TICK_S = 0.05
#: how long a park waits for the other parking groups to settle before its one record
PARK_GATHER_S = 1.0
PARK_POLL_S = 0.005


@dataclass
class _Cursor:
    """What the journal holds of one sample."""

    n: int
    status: str
    reward: float | None
    #: per extra, the rows before its first placeholder (they never change again)
    stable: dict[str, int] = field(default_factory=dict)


def _streaming(s: Sample) -> int:
    """Tokens of the segment streaming now that ``received`` adds to ``s``."""
    seg = s.streamed
    return len(seg.token_ids) if seg is not None and not s.is_final else 0


def _now_len(s: Sample) -> int:
    return s.response_length + _streaming(s)


def _now_status(s: Sample) -> str:
    return SampleStatus.ABORTED.value if _streaming(s) else s.status.value


def _cols(s: Sample, start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The per-token columns of ``received(s)`` from ``start`` on, without copying what
    lies before ``start`` (a long sequence is not copied whole each window)."""
    seg = s.streamed if _streaming(s) else None
    cols = [s.response_ids[start:], s.logprobs[start:], s.versions[start:],
            s.loss_mask[start:]]
    if seg is None:
        return cols[0], cols[1], cols[2], cols[3]
    skip = max(0, start - s.response_length)
    add = [np.asarray(seg.token_ids)[skip:], np.asarray(seg.logprobs)[skip:],
           np.asarray(seg.versions)[skip:], np.ones(len(seg.token_ids) - skip, MASK_DTYPE)]
    t, lp, v, m = (np.concatenate([c, x]) for c, x in zip(cols, add, strict=True))
    return t, lp, v, m


def _sample_entry(s: Sample, i: int, cur: _Cursor | None, reward: float | None,
                  whole: bool) -> tuple[dict[str, Any] | None, _Cursor]:
    """Sample ``i``'s part of an entry (what ``received(s)`` gained since ``cur``; None:
    nothing new) and its new cursor."""
    seg = s.streamed if _streaming(s) else None
    if seg is not None and (s.extras or seg.extras):
        s, seg = received(s), None  # extras: the whole copy (rows are placed per kind)
    n = _now_len(s)
    if cur is not None and (cur.n > n):
        whole = True  # restarted from its prompt
    start = 0 if whole or cur is None else cur.n
    new = _Cursor(n, _now_status(s), reward)
    for name, x in s.extras.items():
        new.stable[name] = min(first_placeholder(name, x), x.rows)
    if (not whole and cur is not None and start == n and cur.status == new.status
            and cur.reward == reward):
        return None, new
    extras = {}
    for name, x in s.extras.items():
        keep = 0 if start == 0 or cur is None else min(cur.stable.get(name, 0), x.rows)
        extras[name] = {"keep": keep, "x": x.take(keep, x.rows).to_dict()}
    tokens, logprobs, versions, mask = _cols(s, start)
    finish = seg.finish_reason if seg is not None else s.finish_reason
    out: dict[str, Any] = {
        "i": i, "start": start,
        "tokens": tokens.astype(TOKEN_DTYPE).tobytes(),
        "logprobs": logprobs.astype(LOGPROB_DTYPE).tobytes(),
        "versions": versions.astype(VERSION_DTYPE).tobytes(),
        "mask": mask.astype(MASK_DTYPE).tobytes(),
        "status": new.status,
        "finish": None if finish is None else dict(finish),
        "segments": s.num_segments + (1 if seg is not None else 0), "reward": reward,
        "extras": extras}
    if start == 0:
        out["params"] = s.params.to_dict()
    return out, new


class JournalFlush:
    """Writes the producer's journal (see the module docstring)."""

    def __init__(self, timing: TimingConfig, *, table: GroupTable, queue: RunQueue,
                 io: Offload, book: StatsBook, producer_id: str,
                 clock: Callable[[], float] = time.monotonic,
                 segments: bool | None = None) -> None:
        self.every_tokens = timing.journal_every_tokens
        self.every_s = timing.journal_every_s
        self.table = table
        self.queue = queue
        self.io = io
        self.book = book
        self.producer_id = producer_id
        self.clock = clock
        #: records appended to segments (None: where the store can append), or a file each
        self.segments = segments
        self.log: JournalLog | None = None
        self._cursors: dict[str, dict[int, _Cursor]] = {}
        #: leases handed back: never journaled again
        self._done: set[str] = set()
        #: parking leases that asked for their park point (``park_point``)
        self._parked: set[str] = set()
        self._flushed_at = clock()
        self._lock = asyncio.Lock()

    def open(self, incarnation: int) -> None:
        """Start this incarnation's records (after ``Incarnation.begin``)."""
        if self.log is not None:
            self.log.close()  # a previous incarnation's open segment: appended to no more
        self.log = JournalLog(self.queue.storage, self.producer_id, incarnation,
                              segments=self.segments)

    # -- when -------------------------------------------------------------------------------
    def _groups(self) -> list[ActiveGroup]:
        live = self.table.groups
        self._done &= set(live)
        return [a for k, a in live.items() if a.run is not None and k not in self._done]

    def unflushed_tokens(self) -> int:
        """The most tokens one held sequence received that no durable record holds yet
        (the window bounds what each sequence may lose)."""
        most = 0
        for a in self._groups():
            curs = self._cursors.get(a.lease.key, {})
            for i, s in enumerate(a.run.samples if a.run is not None else []):
                c = curs.get(i)
                most = max(most, _now_len(s) - (c.n if c is not None else 0))
        return most

    def due(self) -> bool:
        new = self.unflushed_tokens()
        if not new:
            return False
        return bool((self.every_tokens and new >= self.every_tokens)
                    or (self.every_s and self.clock() - self._flushed_at >= self.every_s))

    async def run(self) -> None:
        """The window loop (a task of ``Producer.run``)."""
        tick = min(TICK_S, self.every_s or TICK_S)
        while True:
            await asyncio.sleep(tick)
            if self.log is not None and self.due():
                await self.flush()

    # -- what -------------------------------------------------------------------------------
    def _covered(self, a: ActiveGroup) -> bool:
        run = a.run
        curs = self._cursors.get(a.lease.key)
        if run is None or curs is None:
            return False
        for i, s in enumerate(run.samples):
            c = curs.get(i)
            if (c is None or c.n != _now_len(s) or c.status != _now_status(s)
                    or c.reward != (run.rewards[i] if s.is_final else None)):
                return False
        return True

    def _entry(self, a: ActiveGroup, full: bool
               ) -> tuple[dict[str, Any] | None, dict[int, _Cursor]]:
        run = a.run
        assert run is not None
        curs = self._cursors.get(a.lease.key)
        whole = full or curs is None
        samples, new = [], {}
        mins = []
        for i, s in enumerate(run.samples):
            reward = run.rewards[i] if s.is_final else None
            part, new[i] = _sample_entry(s, i, None if curs is None else curs.get(i), reward,
                                         whole or i in run.failures)
            if part is not None:
                samples.append(part)
            if len(s.versions):
                mins.append(int(s.versions.min()))
            if _streaming(s) and s.streamed is not None:
                mins.append(int(np.asarray(s.streamed.versions).min()))
        if not samples:
            return None, new
        entry: dict[str, Any] = {
            "task": a.lease.task_id, "gen": a.lease.gen, "full": whole,
            "min_version": min(mins) if mins else int(a.version),
            "version_hint": int(a.version), "samples": samples,
            "reward_errors": {str(k): v for k, v in run.reward_errors.items()},
            "failures": {str(k): v for k, v in run.failures.items()}}
        if whole:
            entry["prompt"] = run.samples[0].prompt_ids.astype(TOKEN_DTYPE).tobytes()
            entry["size"] = run.size
        return entry, new

    async def flush(self, *, full: bool = False, unless: ActiveGroup | None = None) -> bool:
        """Write one record of every held group's news; True once it is durable (or there
        was nothing to write, or ``unless``'s state is durable already: a record another
        parking group wrote while this one waited covers it)."""
        if self.log is None:
            return False
        async with self._lock:
            if unless is not None and self._covered(unless):
                return True
            full = full or self.log.full_due()
            entries, marks = [], {}
            for a in self._groups():
                e, new = self._entry(a, full)
                if e is not None:
                    entries.append(e)
                marks[a.lease.key] = new
            self._flushed_at = self.clock()
            if not entries:
                return True
            try:
                writer = self.log
                seq = await self.io.call(lambda: writer.append(entries, full=full))
            except Exception as exc:  # noqa: BLE001 - the journal is a bound, not the state
                log.warning("producer %s: journal record failed (%s); its tokens wait for "
                            "the next one", self.producer_id, exc)
                return False
            self._cursors.update(marks)
            self.book.bump("journal_records")
            if full:
                keys = [(e["task"], int(e["gen"])) for e in entries]
                await self._supersede(keys, before=seq)
            return True

    async def _supersede(self, keys: list[LeaseKey], *, before: int | None = None,
                         keep: bool = False) -> None:
        if self.log is None or not keys:
            return
        try:
            await self.io.call(lambda: self.log.superseded(keys, before=before, keep=keep)
                               if self.log is not None else 0)
        except Exception as exc:  # noqa: BLE001 - garbage, not state: gc sweeps it
            log.warning("producer %s: superseded journal records not deleted: %s",
                        self.producer_id, exc)

    # -- hand-backs ---------------------------------------------------------------------------
    async def park_point(self, lease: Lease) -> int | None:
        """For a parking group: make its received state durable in the journal (one record
        for every group parked with it) and return the oldest weight version it holds (its
        queue key); None when it cannot (no journal, not parking, the record failed)."""
        a = self.table.groups.get(lease.key)
        if self.log is None or a is None or a.run is None or not a.parking:
            return None
        if not self._covered(a):
            self._parked.add(lease.key)
            await self._others_parked()  # one record for every group parked with it
            # full entries: each next holder reads this one record, not the windows before
            if not self._covered(a) and not await self.flush(full=True, unless=a):
                return None
            if not self._covered(a):
                return None
        vs = [int(s.versions.min()) for s in a.run.samples if len(s.versions)]
        return min(vs) if vs else int(a.version)

    async def _others_parked(self) -> None:
        """Wait (at most ``PARK_GATHER_S``) until every other parking group has asked for
        its park point or left: their samples return from their aborts and their rewards
        settle at different moments."""
        deadline = time.monotonic() + PARK_GATHER_S  # real time: a test's clock may stand
        while time.monotonic() < deadline:
            waiting = [k for k, g in self.table.groups.items()
                       if g.parking and g.run is not None and k not in self._parked
                       and k not in self._done]
            if not waiting:
                break
            await asyncio.sleep(PARK_POLL_S)
        await asyncio.sleep(0)

    async def handed_back(self, lease: Lease, *, keep: bool) -> None:
        """The lease left this producer; ``keep``: its entries are its resume point (yielded
        into the journal, or the lease was lost: the grantor may have pointed at them)."""
        self._done.add(lease.key)
        self._parked.discard(lease.key)
        if self._cursors.pop(lease.key, None) is not None:
            await self._supersede([(lease.task_id, lease.gen)], keep=keep)


# -- resume -------------------------------------------------------------------------------------

def _arr(b: Any, dtype: Any) -> np.ndarray:
    return np.frombuffer(bytes(b), dtype=dtype).copy()


def _apply(s: Sample | None, part: dict[str, Any], uid: str, prompt: np.ndarray,
           default_params: Callable[[int], SamplerParams]) -> Sample:
    """Sample ``part["i"]`` after ``part``; ``SampleError`` when it does not follow ``s``."""
    start = int(part["start"])
    have = 0 if s is None else s.response_length
    if start not in (0, have):
        raise SampleError(f"journal delta of {uid} starts at {start}, the prefix holds {have}")
    if s is not None:
        s = copy.copy(s)  # the arrays are replaced, never changed: a failed part leaves s be
    if start == 0 or s is None:
        params = (SamplerParams.from_dict(part["params"]) if part.get("params")
                  else default_params(int(part["i"])))
        s = Sample(uid=uid, prompt_ids=prompt, params=params)
    extras: dict[str, Extra] = {}
    for name, x in (part.get("extras") or {}).items():
        old = s.extras.get(name)
        keep = int(x["keep"])
        head = [old.take(0, keep)] if old is not None and keep else []
        extras[name] = cat([*head, Extra.from_dict(name, x["x"])])
    s.response_ids = np.concatenate([s.response_ids, _arr(part["tokens"], TOKEN_DTYPE)])
    s.logprobs = np.concatenate([s.logprobs, _arr(part["logprobs"], LOGPROB_DTYPE)])
    s.versions = np.concatenate([s.versions, _arr(part["versions"], VERSION_DTYPE)])
    s.loss_mask = np.concatenate([s.loss_mask, _arr(part["mask"], MASK_DTYPE)])
    s.extras = extras or s.extras
    s.status = SampleStatus(part["status"])
    s.finish_reason = part.get("finish")
    s.num_segments = int(part.get("segments") or 0)
    s.check()
    return s


def rebuild(lease: Lease, chain: list[dict[str, Any]],
            default_params: Callable[[int], SamplerParams], writer: str) -> GroupData:
    """The partial group a journal prefix holds (``chain``: its full entry, then deltas);
    a delta that does not follow ends the prefix there."""
    first = chain[0]
    prompt = _arr(first["prompt"], TOKEN_DTYPE)
    size = int(first.get("size") or len(first["samples"]))
    samples: dict[int, Sample] = {}
    rewards: dict[int, float | None] = {}
    last = first
    for n, e in enumerate(chain):
        try:
            new = dict(samples)
            got = {}
            for part in e["samples"]:
                i = int(part["i"])
                new[i] = _apply(new.get(i), part, f"{lease.task_id}.{i}", prompt, default_params)
                got[i] = part.get("reward")
        except (SampleError, KeyError, TypeError, ValueError) as exc:
            if n == 0:
                raise SampleError(f"journal prefix of {lease.task_id}: {exc}") from None
            log.warning("task %s: journal prefix ends before entry %d (%s)", lease.task_id,
                        n, exc)
            break
        samples = new
        rewards.update(got)
        last = e
    if sorted(samples) != list(range(size)):
        raise SampleError(f"journal prefix of {lease.task_id} holds samples {sorted(samples)}"
                          f" of {size}")
    run = GroupRun(lease=lease, samples=[samples[i] for i in range(size)],
                   rewards=[rewards.get(i) for i in range(size)],
                   reward_errors={int(k): str(v) for k, v in (last.get("reward_errors")
                                                              or {}).items()},
                   failures={int(k): str(v) for k, v in (last.get("failures") or {}).items()})
    return run.to_group(producer=writer, version_hint=int(last.get("version_hint") or 0),
                        partial=True)


def load_prefix(queue: RunQueue, lease: Lease,
                default_params: Callable[[int], SamplerParams], *,
                reader: JournalReader | None = None) -> GroupData | None:
    """I/O thread: the group of a claimed task's journal prefix (its resume generation's),
    or None when no journal holds one. ``reader``: the producer's, kept between claims, so
    a segment read for an earlier claim is read again only from where it ended."""
    if not lease.has_partial:
        return None
    r = lease.name.resume
    writer = lease.journal or find_writer(queue.storage, lease.task_id, r)
    if writer is None:
        return None
    chain = load_chain(queue.storage, writer, lease.task_id, r, quarantine=queue.quarantine,
                       reader=reader)
    if chain is None:
        return None
    return rebuild(lease, chain, default_params, writer)


__all__ = ["TICK_S", "JournalFlush", "load_prefix", "rebuild"]
