"""The per-prompt history: what every attempt at every prompt came to, kept for the run.

The queue is the one place that sees every attempt at a prompt across crashes, restarts
and epochs; this module keeps a bounded summary of each, so a scheduler (or a person) can
ask "how long are this prompt's answers, and did its last groups teach anything?".

What is recorded, per attempt (one group, one task generation): its status (``trained``
or ``dropped`` with the reason), the number of samples, the response tokens spent, their
lengths (min, mean, max), the rewards' mean and variance and how many of them were valid
(a group whose rewards all agree has no advantage to train on; one with a failed reward
did not agree), the weight versions that generated it and, when trained, the version it
was trained at. Samples are never stored: a row is a few dozen numbers.

Where it comes from: ``BatchStore.gc`` records the groups of the batches it retires (their
manifests hold every summary), and ``compact_drops`` the drops it folds into the drop
audit. Both record *before* they delete what the rows come from, so a crash in between
records an attempt twice, never not at all; rows are keyed by (task id, generation), and
a reader counts each key once.

The layout: ``history/seg-<seq>`` records, immutable, published with an exclusive create
(a second writer takes the next number). Past ``MAX_SEGMENTS`` they are merged into one
segment holding per prompt its totals, the newest ``KEEP_ATTEMPTS`` attempts in detail,
and the generations folded in (for the dedupe above). A merged segment names the segments
it covers; a reader skips those, so a crash between the merge's publish and the deletion
of what it covers counts nothing twice. The history is bounded by the dataset's size, not
the run's length.

Read it with ``load_history(storage)`` (``PromptHistory``) or ``strawq inspect RUN history``
/ ``strawq inspect RUN history/<task id>``.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from strawq.errors import AlreadyExists, CorruptRecord, NotFound
from strawq.ondisk import records
from strawq.ondisk.numbered import Numbered
from strawq.ondisk.records import Kind
from strawq.storage import Storage

log = logging.getLogger(__name__)

HISTORY_DIR = "history"
SEGMENT_PREFIX = "seg-"
#: ``history/seg-<seq>``
SEGMENTS = Numbered(SEGMENT_PREFIX)
#: Segments before they are merged into one.
MAX_SEGMENTS = 16
#: Attempts per prompt kept in detail by a merge (the totals are always complete).
KEEP_ATTEMPTS = 4
#: Generations per prompt a merge remembers, for counting a re-recorded attempt once.
KEEP_GENS = 64


def _key(seq: int) -> str:
    return f"{HISTORY_DIR}/{SEGMENTS.name(seq)}"


def _segments(storage: Storage) -> list[int]:
    return SEGMENTS.numbers(storage.list(HISTORY_DIR))


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) \
        and math.isfinite(x) else None


def _sum_counts(counts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))


def rewards_agreed(row: Mapping[str, Any]) -> bool:
    """An attempt's group had two or more samples, every one with a valid reward, all equal:
    all solved or all failed, no advantage to train on (the zero-variance rule's test).

    A reward that failed (None, missing, not finite: a reward error or a failed sample) is
    not agreement: a group of 4 with 3 failed rewards did not agree, whatever the fourth.
    The row says how many rewards were valid (``rewards_valid``); a row recorded before it
    did cannot say, and is judged on its variance alone (as it was recorded then)."""
    var = row.get("reward_var")
    samples = int(row.get("samples") or 0)
    if not isinstance(var, (int, float)) or samples < 2 or var != 0:
        return False
    if "rewards_valid" not in row:  # an older row: the count was not recorded
        return True
    return bool(row["rewards_valid"] == samples)


def attempt_row(summary: Mapping[str, Any], *, gen: int, status: str,
                reason: str | None = None, trained_at: int | None = None,
                at: float | None = None) -> dict[str, Any]:
    """One attempt's row, from a group summary (``GroupData.summary()``)."""
    lens = [int(n) for n in summary.get("sample_lens") or [] if isinstance(n, int)]
    rewards = [r for r in (_num(x) for x in summary.get("rewards") or []) if r is not None]
    mean = sum(rewards) / len(rewards) if rewards else None
    var = sum((r - mean) ** 2 for r in rewards) / len(rewards) if mean is not None else None
    row: dict[str, Any] = {
        "id": str(summary.get("task_id", "")), "gen": int(gen), "status": status,
        "samples": len(lens), "tokens": sum(lens),
        "len_min": min(lens, default=0), "len_max": max(lens, default=0),
        "len_mean": round(sum(lens) / len(lens), 2) if lens else 0.0,
        "reward_mean": mean, "reward_var": var,
        # the rewards that are numbers: fewer than ``samples`` when some failed
        "rewards_valid": len(rewards),
        "min_version": summary.get("min_version"), "max_version": summary.get("max_version"),
        "at": _num(at) or time.time(),
    }
    if isinstance(summary.get("index"), int):
        row["index"] = summary["index"]
    source = (summary.get("meta") or {}).get("source")
    if isinstance(source, str):
        row["source"] = source
    if reason is not None:
        row["reason"] = reason
    if trained_at is not None:
        row["trained_at"] = trained_at
    return row


def attempt_summary(summary: Mapping[str, Any]) -> dict[str, Any]:
    """What ``attempt_row`` reads of a group summary, for a drop's note: the drop audit
    keeps notes in detail, and the rest of a summary (sampling parameters, trajectories)
    says nothing about the attempt's rewards or lengths."""
    out = {k: summary[k] for k in ("task_id", "index", "sample_lens", "rewards",
                                   "min_version", "max_version") if k in summary}
    source = (summary.get("meta") or {}).get("source")
    if isinstance(source, str):
        out["meta"] = {"source": source}
    return out


@dataclass
class PromptStats:
    """One prompt's history: totals over every attempt, and its newest attempts."""

    id: str
    index: int | None = None
    attempts: int = 0
    trained: int = 0
    dropped: int = 0
    tokens: int = 0
    #: attempts whose group had two or more rewards, all equal (nothing to learn from)
    zero_variance: int = 0
    #: releases that skipped this task (``strawq.data.prompt_policy``: not attempts)
    skipped: int = 0
    #: skips by the reward the skipped row's groups agreed on (``"1.0"``: all solved)
    skipped_rewards: dict[str, int] = field(default_factory=dict)
    #: the mixture dataset the prompt comes from (``strawq.data.mixture``; None: one dataset)
    source: str | None = None
    #: the newest attempts in detail (rows of ``attempt_row``), oldest first
    last: list[dict[str, Any]] = field(default_factory=list)
    #: generations counted (the newest ``KEEP_GENS``)
    gens: list[int] = field(default_factory=list)

    def add(self, row: Mapping[str, Any]) -> bool:
        """Count one attempt; False if its generation was counted already."""
        gen = int(row["gen"])
        if gen in self.gens:
            return False
        if row.get("status") == "skipped":  # a release's decision, not an attempt
            self.gens = sorted([*self.gens, gen])[-KEEP_GENS:]
            self.skipped += 1
            reward = _num(row.get("reward_mean"))
            key = "unknown" if reward is None else f"{reward:g}"
            self.skipped_rewards[key] = self.skipped_rewards.get(key, 0) + 1
            if self.index is None and isinstance(row.get("index"), int):
                self.index = row["index"]
            return True
        self.gens = sorted([*self.gens, gen])[-KEEP_GENS:]
        if self.index is None and isinstance(row.get("index"), int):
            self.index = row["index"]
        if self.source is None and isinstance(row.get("source"), str):
            self.source = row["source"]
        self.attempts += 1
        self.trained += row.get("status") == "trained"
        self.dropped += row.get("status") == "dropped"
        self.tokens += int(row.get("tokens") or 0)
        if rewards_agreed(row):
            self.zero_variance += 1
        self.last = sorted([*self.last, dict(row)], key=lambda r: r["gen"])[-KEEP_ATTEMPTS:]
        return True

    @property
    def mean_length(self) -> float | None:
        """The mean response length over the attempts kept in detail."""
        rows = [r for r in self.last if r.get("samples")]
        n = sum(r["samples"] for r in rows)
        return sum(r["len_mean"] * r["samples"] for r in rows) / n if n else None

    @property
    def last_zero_variance(self) -> bool:
        """The newest attempt's rewards all agreed (all solved, or all failed)."""
        if not self.last:
            return False
        r = self.last[-1]
        return rewards_agreed(r)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PromptStats:
        try:
            return cls(id=str(d["id"]), index=d.get("index"), attempts=int(d["attempts"]),
                       trained=int(d["trained"]), dropped=int(d["dropped"]),
                       tokens=int(d["tokens"]), zero_variance=int(d["zero_variance"]),
                       skipped=int(d.get("skipped", 0)),
                       skipped_rewards={str(k): int(v) for k, v in
                                        dict(d.get("skipped_rewards") or {}).items()},
                       source=d["source"] if isinstance(d.get("source"), str) else None,
                       last=[dict(r) for r in d.get("last", [])],
                       gens=[int(g) for g in d.get("gens", [])])
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptRecord(f"history: a prompt's summary is malformed ({exc!r})") from None


@dataclass
class PromptHistory:
    """The whole run's history: task id -> ``PromptStats``."""

    prompts: dict[str, PromptStats] = field(default_factory=dict)
    #: segments read (for ``strawq inspect``)
    segments: int = 0
    _median: list[float | None] = field(default_factory=list, repr=False, compare=False)

    @classmethod
    def open(cls, path: str) -> PromptHistory:
        """The history of the run at ``path`` (read only)."""
        from strawq.storage import open_storage

        return load_history(open_storage(path, writer_id="history", read_only=True))

    def get(self, task_id: str) -> PromptStats | None:
        return self.prompts.get(task_id)

    def __len__(self) -> int:
        return len(self.prompts)

    def median_length(self) -> float | None:
        """The median of the prompts' mean response lengths (None: no lengths recorded);
        computed once per loaded history (``strawq.data.prompt_policy``'s fallback)."""
        if not self._median:
            known = [m for m in (s.mean_length for s in self.prompts.values()) if m is not None]
            self._median = [statistics.median(known) if known else None]
        return self._median[0]

    def totals(self) -> dict[str, Any]:
        p = self.prompts.values()
        attempts = sum(s.attempts for s in p)
        return {"prompts": len(self.prompts), "attempts": attempts,
                "trained": sum(s.trained for s in p), "dropped": sum(s.dropped for s in p),
                "tokens": sum(s.tokens for s in p),
                "zero_variance_attempts": sum(s.zero_variance for s in p),
                "zero_variance_share": round(sum(s.zero_variance for s in p) / attempts, 4)
                if attempts else 0.0,
                "skipped": sum(s.skipped for s in p),
                "skipped_by_reward": _sum_counts(s.skipped_rewards for s in p),
                "segments": self.segments,
                **({"by_source": self.by_source()} if any(s.source for s in p) else {})}

    def by_source(self) -> dict[str, dict[str, int]]:
        """Per mixture source (``strawq.data.mixture``): prompts, attempts, trained groups,
        dropped groups and trained tokens."""
        out: dict[str, dict[str, int]] = {}
        for s in self.prompts.values():
            if s.source is None:
                continue
            o = out.setdefault(s.source, {"prompts": 0, "attempts": 0, "trained": 0,
                                          "dropped": 0, "tokens": 0})
            o["prompts"] += 1
            o["attempts"] += s.attempts
            o["trained"] += s.trained
            o["dropped"] += s.dropped
            o["tokens"] += s.tokens
        return dict(sorted(out.items()))

    def _fold(self, rows: Iterable[Mapping[str, Any]]) -> None:
        for row in rows:
            tid = str(row.get("id", ""))
            if tid and isinstance(row.get("gen"), int):
                self.prompts.setdefault(tid, PromptStats(tid)).add(row)

    def _merge(self, stats: PromptStats) -> None:
        mine = self.prompts.get(stats.id)
        if mine is None:
            self.prompts[stats.id] = stats
            return
        for row in stats.last:  # (a prompt in two merged segments: a merge raced a write)
            mine.add(row)


def _read(storage: Storage, seq: int) -> dict[str, Any]:
    rec = records.decode(storage.read(_key(seq)), expect=Kind.STATE, name=_key(seq))
    m = dict(rec.meta)
    if not isinstance(m.get("rows", []), list) or not isinstance(m.get("prompts", []), list) \
            or not isinstance(m.get("covers", []), list):
        raise CorruptRecord(f"{_key(seq)}: expected rows, prompts and covers (lists)")
    return m


def load_history(storage: Storage) -> PromptHistory:
    """Every segment folded, oldest first; an unreadable segment is skipped with an error."""
    segs = _segments(storage)
    bodies: dict[int, dict[str, Any]] = {}
    for seq in segs:
        try:
            bodies[seq] = _read(storage, seq)
        except (CorruptRecord, NotFound) as exc:
            if not isinstance(exc, NotFound):  # (a merge deleted it after the listing)
                log.error("history segment %s is unreadable (%s); skipping it", _key(seq), exc)
    covered = {int(c) for b in bodies.values() for c in b.get("covers", [])}
    hist = PromptHistory()
    for seq in sorted(bodies):
        if seq in covered:
            continue
        body = bodies[seq]
        for d in body.get("prompts", []):
            try:
                hist._merge(PromptStats.from_dict(d))
            except CorruptRecord as exc:
                log.error("%s: %s", _key(seq), exc)
        hist._fold(body.get("rows", []))
        hist.segments += 1
    return hist


def _publish(storage: Storage, body: dict[str, Any]) -> int | None:
    for _ in range(3):
        seq = max(_segments(storage), default=0) + 1
        try:
            storage.publish(_key(seq), records.encode(Kind.STATE, body))
            return seq
        except AlreadyExists:
            continue  # another writer took the number: take the next one
    log.warning("history: could not publish a segment after 3 tries (a concurrent gc?)")
    return None


def trained_rows(manifests: Iterable[Any]) -> list[dict[str, Any]]:
    """The rows of the groups in retired batches (``strawq.delivery.batches.Manifest``: trained)."""
    rows = []
    for man in manifests:
        at = man.meta.get("trained_at") if isinstance(man.meta, dict) else None
        for name, summary in zip(man.groups, man.summaries, strict=False):
            if isinstance(summary, dict):
                rows.append(attempt_row({"task_id": name.id, **summary}, gen=name.gen,
                                        status="trained",
                                        trained_at=at if isinstance(at, int) else None))
    return rows


def record_attempts(storage: Storage, rows: Sequence[Mapping[str, Any]]) -> bool:
    """Publish one segment of attempt rows (before what they describe is deleted)."""
    if not rows:
        return True
    ok = _publish(storage, {"rows": [dict(r) for r in rows], "at": time.time()}) is not None
    if ok and len(_segments(storage)) > MAX_SEGMENTS:
        compact_history(storage)
    return ok


def compact_history(storage: Storage) -> int:
    """Merge every segment into one; returns how many it covered (0: nothing to merge)."""
    segs = _segments(storage)
    if len(segs) < 2:
        return 0
    hist = load_history(storage)
    body = {"prompts": [s.to_dict() for s in hist.prompts.values()], "covers": segs,
            "merged": True, "at": time.time()}
    if _publish(storage, body) is None:
        return 0
    for seq in segs:
        storage.delete(_key(seq))
    return len(segs)


def history_view(storage: Storage, task_id: str | None = None) -> dict[str, Any]:
    """``strawq inspect RUN history`` (totals and the prompts with the most attempts) or
    ``history/<task id>`` (one prompt)."""
    hist = load_history(storage)
    if task_id is not None:
        stats = hist.get(task_id)
        if stats is None:
            raise NotFound(2, f"history/{task_id}: no attempt at {task_id!r} is recorded "
                              f"(recorded when gc retires its batch or compacts its drop)")
        return {"key": f"history/{task_id}", "kind": "HISTORY", "prompt": stats.to_dict()}
    top = sorted(hist.prompts.values(), key=lambda s: (-s.attempts, s.id))[:20]
    return {"key": HISTORY_DIR, "kind": "HISTORY", "totals": hist.totals(),
            "most_attempted": [{"id": s.id, "index": s.index, "attempts": s.attempts,
                                "trained": s.trained, "dropped": s.dropped,
                                "zero_variance": s.zero_variance,
                                "mean_length": s.mean_length} for s in top]}
