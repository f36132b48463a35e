"""What the in-flight journal costs the metadata server: storage calls per producer-second
while generating, and per group at a park, against the same run's ``.partial`` saves.

A producer holding ``--groups`` groups of G samples receives tokens at ``--tok-s`` tokens a
second per sample (time is simulated: the flusher's clock is stepped, the records are real
files on a local disk); its journal writes a record per window (``--every-tokens`` /
``--every-s``), appended to its open segment or a file each (``--format``). Then every
held group is parked, once with the journal (one record, the leases renamed) and once with
a ``.partial`` per group (the anchor, the same run), and resumed by another producer; and
once held through the pause (``timing.hold_through_pause``: ``GroupHalts.hold_all``, one
record, no lease renamed, nothing to resume).
Storage calls are counted at the ``Storage`` interface (a publish is one create + write +
fsync + rename + directory fsync, an append a write + fsync of a file held open; on
JuiceFS each call becomes the metadata operations of docs/protocol.md §5).

    python bench/journal_ops.py            # 24 groups x G=16, 60 s simulated
    python bench/journal_ops.py --quick    # 4 groups x G=4, 10 s simulated
    python bench/journal_ops.py --format records   # a file per window, not segments
    python bench/journal_ops.py --hold     # also a pause that holds the groups
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from strawq.producers.bracket import EngineAborter  # noqa: E402
from strawq.producers.handback import HandBack  # noqa: E402
from strawq.producers.held import GroupHalts, GroupTable  # noqa: E402
from strawq.producers.journal_flush import load_prefix  # noqa: E402
from strawq.producers.sample import SamplerParams  # noqa: E402
from strawq.producers.slots import SlotPool  # noqa: E402
from strawq.storage import PosixStorage  # noqa: E402
from strawq.tasks.journal import JournalReader  # noqa: E402
from strawq.tasks.queue import RunQueue  # noqa: E402
from strawq.testing.faults import FaultyStorage  # noqa: E402
from tests.producers.journal_helpers import flusher, hold, run_with_tasks, stream  # noqa: E402

OPS = ("publish", "append", "rename", "delete", "read", "list")


class ReadBytes:
    """The bytes the reads of ``storage`` returned, and its ``size`` calls (a stat: not a
    ``FaultyStorage`` count)."""

    def __init__(self, storage: FaultyStorage) -> None:
        self.bytes = 0
        self.sizes = 0
        for name in ("read", "read_prefix", "read_range"):
            self._wrap(storage, name)
        inner_size = storage.size

        def size(key: str) -> int:
            self.sizes += 1
            return inner_size(key)

        storage.size = size  # type: ignore[method-assign]

    def _wrap(self, storage: FaultyStorage, name: str) -> None:
        inner = getattr(storage, name)

        def counted(*args: Any) -> bytes:
            out: bytes = inner(*args)
            self.bytes += len(out)
            return out

        setattr(storage, name, counted)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _calls(f: FaultyStorage) -> dict[str, int]:
    return {k: f.counts.get(k, 0) for k in OPS}


def _delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a[k] for k in OPS}


def one(args: argparse.Namespace, root: Path, journal: bool, *, held: bool = False
        ) -> dict[str, Any]:
    """One arm: ``journal`` (a park into the journal, else ``.partial`` saves); ``held``
    (with ``journal``): the pause holds the groups instead of parking them."""
    arm = "h" if held else "j" if journal else "p"
    inner = PosixStorage(str(root / arm), fsync=False)
    (root / f"d{arm}").mkdir()
    run_with_tasks(inner, root / f"d{arm}", args.groups, group_size=args.g)
    f = FaultyStorage(inner)
    q = RunQueue(f)
    table = GroupTable()
    groups = hold(q, table, "p1", args.groups)
    j, io, book = flusher(q, table, "p1", tokens=args.every_tokens, seconds=args.every_s,
                          segments=args.format == "segments")
    clock = Clock()
    j.clock = clock
    j._flushed_at = 0.0
    hb = HandBack(q, io, book)
    if journal:
        hb.journal = j
    out: dict[str, Any] = {}

    async def go() -> None:
        io.start()
        step = 0.05
        start = _calls(f)
        while clock.t < args.seconds:
            clock.t += step
            n = max(1, round(args.tok_s * clock.t))
            for a in groups:
                assert a.run is not None
                for s in a.run.samples:
                    stream(s, n)
            if journal and j.due():
                await j.flush()
        out["steady"] = _delta(start, _calls(f))
        before = _calls(f)
        if held:  # what a holding producer's pause writes; its resume reads nothing
            halts = GroupHalts(table, producer_id="p1",
                               pool=SlotPool(args.groups, args.g, eager=True, clock=clock),
                               aborter=EngineAborter(lambda: None, "p1", poll_s=0.5,
                                                     deadline_s=1.0, clock=clock),
                               book=book)
            assert await halts.hold_all("pause", durable=j.flush) == 0
            out["park"] = _delta(before, _calls(f))
            out["resume"] = _delta(before, before)
            out["resume_bytes"], out["resume_sizes"] = 0, 0
            out["records"] = book.get("journal_records")
            io.shutdown()
            return
        for a in groups:
            a.parking = True
        await asyncio.gather(*(hb.yield_partial(a.lease, a.run.to_group(
            producer="p1", version_hint=0, partial=True)) for a in groups if a.run))
        out["park"] = _delta(before, _calls(f))
        before = _calls(f)
        q2 = RunQueue(f)
        reader = JournalReader(f)  # the claiming producer's, kept between its claims
        counted = ReadBytes(f)
        for lease in q2.claim("p2", args.groups):
            if lease.journal is None:
                q2.load_partial(lease)
            else:
                load_prefix(q2, lease, lambda i: SamplerParams(max_new_tokens=10**9),
                            reader=reader)
        out["resume"] = _delta(before, _calls(f))
        out["resume_bytes"], out["resume_sizes"] = counted.bytes, counted.sizes
        out["records"] = book.get("journal_records")
        io.shutdown()

    asyncio.run(go())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=24)
    p.add_argument("--g", type=int, default=16)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--tok-s", type=float, default=30.0)
    p.add_argument("--every-tokens", type=int, default=256)
    p.add_argument("--every-s", type=float, default=2.0)
    p.add_argument("--format", choices=("records", "segments"), default="segments",
                   help="segments: each window appended to the open segment (a store that "
                        "can append); records: a file published per window")
    p.add_argument("--hold", action="store_true",
                   help="also count a pause that holds the groups (timing.hold_through_pause)")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.g, args.seconds = 4, 4, 10.0
    with tempfile.TemporaryDirectory() as tmp:
        jr = one(args, Path(tmp), True)
        pr = one(args, Path(tmp), False)
        hr = one(args, Path(tmp), True, held=True) if args.hold else None
    steady = sum(jr["steady"].values()) / args.seconds
    park_j = (sum(jr["park"].values()) + sum(jr["resume"].values())) / args.groups
    park_p = (sum(pr["park"].values()) + sum(pr["resume"].values())) / args.groups
    pub_j = (jr["park"]["publish"]) / args.groups
    pub_p = (pr["park"]["publish"]) / args.groups
    print(f"steady ({args.format}): {jr['steady']} over {args.seconds:.0f} s "
          f"({args.groups} groups x G={args.g}, {args.tok_s:g} tok/s a sample)")
    print(f"park+resume, journal: {jr['park']} + {jr['resume']}")
    print(f"park+resume, partials: {pr['park']} + {pr['resume']}")
    print(f"journal_ops: extra storage calls per producer-second = {steady:.2f} "
          f"(window {args.every_tokens} tok / {args.every_s:g} s); park+resume calls per "
          f"group = {park_j:.2f} (partials: {park_p:.2f}, ratio {park_j / park_p:.2f}); "
          f"publishes per group at a park = {pub_j:.3f} (partials: {pub_p:.3f})")
    print(f"journal_ops: resume reads per claim = {jr['resume']['read'] / args.groups:.2f} "
          f"reads + {jr['resume_sizes'] / args.groups:.2f} stats, "
          f"{jr['resume_bytes'] / args.groups / 1024:.1f} KiB (partials: "
          f"{pr['resume']['read'] / args.groups:.2f} reads, "
          f"{pr['resume_bytes'] / args.groups / 1024:.1f} KiB)")
    if hr is not None:
        update_h = sum(hr["park"].values()) + sum(hr["resume"].values())
        update_j = sum(jr["park"].values()) + sum(jr["resume"].values())
        print(f"pause+resume, held: {hr['park']} + {hr['resume']}")
        print(f"journal_ops: calls per update per producer holding {args.groups} groups: "
              f"held = {update_h} (parked into the journal: {update_j}, partials: "
              f"{sum(pr['park'].values()) + sum(pr['resume'].values())})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
