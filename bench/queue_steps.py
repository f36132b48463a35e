"""One group's life, step by step: what each protocol step costs in storage calls and, on
JuiceFS, in metadata operations (``docs/protocol.md`` §5, "Where the operations go").

Run sequentially in one process, with no polling: one release of ``--groups`` tasks, then
for each task one claim and one complete (a heartbeat every 16 groups, as
``bench/queue_ops.py``'s producers beat), then the collector's scan of ``ready/``, its read
of each payload, one batch, the trainer's ack and one GC. Every storage call is counted
(the counting storage: which call, in which directory), and on a JuiceFS mount the client's
own counters (``<mount>/.stats``) are read around each call, so each metadata operation is
charged to the step and the storage call that sent it.

    python bench/queue_steps.py                  # local directory (storage calls only)
    python bench/queue_steps.py --juicefs MOUNT  # on a JuiceFS mount too
    python bench/queue_steps.py --up             # bring the SQLite-backed test volume up
    python bench/queue_steps.py --quick          # CI-sized
    python bench/queue_steps.py --release-chunk 16  # range claims: chunks of 16, claimed 16
                                                    # at a time (a producer with 16 free slots)
    python bench/queue_steps.py --claim 16          # one file per task, claims of 16

The same for the limit (``bench/queue_ops.py``'s bare durable protocol: publish each
record, list once, read and delete each), the anchor. The last line is ``queue_steps: local
X storage calls/group, the limit's Y, ratio X/Y`` and, on JuiceFS, the same in metadata
operations.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from queue_ops import limit_record, make_columns, meta_ops, write_dataset  # noqa: E402
from redis_meta import Unavailable, test_volume  # noqa: E402

from strawq.config import QueueConfig  # noqa: E402
from strawq.data.dataset import Dataset  # noqa: E402
from strawq.data.feeder import Feeder  # noqa: E402
from strawq.delivery.batches import BatchStore  # noqa: E402
from strawq.ondisk.groups import GroupData  # noqa: E402
from strawq.ondisk.records import Kind, decode  # noqa: E402
from strawq.storage import PosixStorage  # noqa: E402
from strawq.tasks.queue import RunQueue  # noqa: E402

#: the storage calls a step may make (each counted once, at its outermost call)
CALLS = ("publish", "read", "read_prefix", "rename", "list", "delete", "rmdir", "exists",
         "is_dir", "makedirs", "sync_dirs", "size")


class StepStorage(PosixStorage):
    """A ``PosixStorage`` that charges each call, and the JuiceFS metadata operations sent
    while it ran, to the step now running and the call's directory."""

    def __init__(self, root: str, mount: str | None, **kwargs: Any) -> None:
        super().__init__(root, **kwargs)
        self.mount = mount
        self.step = "setup"
        self.calls: dict[str, Counter[str]] = defaultdict(Counter)
        self.meta: dict[str, Counter[str]] = defaultdict(Counter)
        self._depth = 0

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        if name not in CALLS:
            return attr
        return self._wrap(name, attr)

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            first = args[0] if args else ""
            where = (first if isinstance(first, str) else "dirs").split("/", 1)[0]
            label = f"{name} {where}/"
            self.calls[self.step][label] += 1
            before = meta_ops(self.mount)
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                after = meta_ops(self.mount)
                for k, v in after.items():
                    d = v - before.get(k, 0.0)
                    if d:
                        self.meta[self.step][f"{label}:{k}"] += int(d)
        return counted

    @contextmanager
    def at(self, step: str) -> Iterator[None]:
        prev, self.step = self.step, step
        try:
            yield
        finally:
            self.step = prev


STEPS = ("release", "claim", "heartbeat", "complete", "collector scan", "collector read",
         "batch", "ack", "gc")


def life(base: str, mount: str | None, groups: int, samples: int, tokens: int,
         chunk: int = 1, claim: int = 1) -> StepStorage:
    """One release of ``groups`` tasks through claim, complete, batch, ack and GC.
    ``chunk``: ``queue.release_chunk``; ``claim``: tasks each claim asks for."""
    root = os.path.join(base, f"steps-{secrets.token_hex(3)}")
    os.makedirs(root)
    ds = os.path.join(root, "ds.jsonl")
    write_dataset(ds, groups)
    st = StepStorage(os.path.join(root, "run"), mount, writer_id="c")
    cfg = QueueConfig(release_batch=groups, lease_timeout_s=600, heartbeat_interval_s=10,
                      release_chunk=chunk)
    q = RunQueue.create(st, cfg)
    feeder = Feeder(q, Dataset(ds))
    cols = make_columns(samples, tokens, 0)
    bs = BatchStore(q)
    seq = bs.next_seq()
    with st.at("release"):
        released = feeder.release()
    if released != groups:
        raise RuntimeError(f"released {released} of {groups}")
    held: list[Any] = []
    for i in range(groups):
        if not held:
            with st.at("claim"):
                held = q.claim("p0", claim)
            if not held:
                raise RuntimeError(f"nothing to claim after {i} of {groups}")
        lease = held.pop(0)
        if i % 16 == 0:
            with st.at("heartbeat"):
                q.heartbeat("p0")
        g = GroupData(task_id=lease.task_id, index=lease.task["index"], prompt_ids=[1, 2, 3],
                      sample_lens=[tokens] * samples, rewards=[1.0] * samples,
                      status=["completed"] * samples, **cols)
        with st.at("complete"):
            q.complete(lease, g)
    with st.at("collector scan"):
        names = bs.scan_ready()
    with st.at("collector read"):
        for name in names:
            q.read_group(name.id, name.gen)
    if len(names) != groups:
        raise RuntimeError(f"{len(names)} ready of {groups}")
    with st.at("batch"):
        bs.publish_batch(seq, names)
    with st.at("ack"):
        bs.ack(seq)
    with st.at("gc"):
        bs.gc()
    shutil.rmtree(root, ignore_errors=True)
    return st


LIMIT_STEPS = ("limit publish", "limit list", "limit read", "limit delete")


def limit_life(base: str, mount: str | None, groups: int, samples: int, tokens: int
               ) -> StepStorage:
    """The bare durable protocol on the same records (``bench/queue_ops.py``'s limit):
    publish each (temporary file, fsync, rename, directory fsync), one listing, then read and
    delete each."""
    root = os.path.join(base, f"limit-{secrets.token_hex(3)}")
    st = StepStorage(root, mount, writer_id="c")
    st.makedirs("ready")
    cols = make_columns(samples, tokens, 0)
    with st.at("limit publish"):
        for i in range(groups):
            st.publish(f"ready/g{i:012d}", limit_record(0, i, samples, tokens, cols))
    with st.at("limit list"):
        names = st.list("ready")
    for name in names:
        with st.at("limit read"):
            decode(st.read(f"ready/{name}"), expect=Kind.GROUP, name=name)
        with st.at("limit delete"):
            st.delete(f"ready/{name}")
    shutil.rmtree(root, ignore_errors=True)
    return st


def report(loc: str, st: StepStorage, groups: int, steps: Sequence[str] = STEPS
           ) -> tuple[float, float]:
    """Print one location's table; return (meta ops, storage calls) per group."""
    total_meta = total_calls = 0.0
    print(f"\n{loc}: per group ({groups} groups, one release, one batch)")
    print(f"{'step':<16}{'calls':>7}{'meta':>7}  detail (storage call: metadata ops by kind)")
    for step in steps:
        calls = st.calls.get(step, Counter())
        meta = st.meta.get(step, Counter())
        nc, nm = sum(calls.values()) / groups, sum(meta.values()) / groups
        total_calls += nc
        total_meta += nm
        by_call: dict[str, list[str]] = defaultdict(list)
        for key, v in sorted(meta.items()):
            label, _, kind = key.partition(":")
            by_call[label].append(f"{kind} {v / groups:.2f}")
        detail = "; ".join(
            f"{label} x{n / groups:.2f}" + (f" [{', '.join(by_call[label])}]"
                                           if by_call.get(label) else "")
            for label, n in sorted(calls.items()))
        print(f"{step:<16}{nc:>7.2f}{nm:>7.2f}  {detail}")
    print(f"{'total':<16}{total_calls:>7.2f}{total_meta:>7.2f}")
    return total_meta, total_calls


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    ap.add_argument("--groups", type=int, default=None, help="tasks in the release (64)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--juicefs", default=os.environ.get("STRAWQ_JUICEFS_A"),
                    help="a JuiceFS mount to count on too (default $STRAWQ_JUICEFS_A)")
    ap.add_argument("--up", action="store_true",
                    help="bring the SQLite-backed test volume up for this run")
    ap.add_argument("--release-chunk", type=int, default=1, metavar="K",
                    help="queue.release_chunk (range claims; default 1: a file per task)")
    ap.add_argument("--claim", type=int, default=None, metavar="N",
                    help="tasks each claim asks for (a producer's free slots; default: "
                         "--release-chunk)")
    args = ap.parse_args(argv)
    if args.release_chunk < 1:
        ap.error(f"--release-chunk must be >= 1, got {args.release_chunk}")
    claim = args.release_chunk if args.claim is None else args.claim
    if claim < 1:
        ap.error(f"--claim must be >= 1, got {claim}")
    groups = args.groups or (16 if args.quick else 64)
    tokens = 16 if args.quick else args.tokens
    with ExitStack() as stack:
        if args.up:
            try:
                args.juicefs = stack.enter_context(test_volume("sqlite")).a
            except Unavailable as e:
                print(f"queue_steps: --up needs the JuiceFS test volume: {e}")
                return 2
        locations: list[tuple[str, str, str | None]] = [
            ("local", tempfile.mkdtemp(prefix="strawq-steps-"), None)]
        if args.juicefs and os.path.isdir(args.juicefs):
            jd = os.path.join(args.juicefs, f"steps-{secrets.token_hex(3)}")
            os.makedirs(jd)
            locations.append(("jfs", jd, args.juicefs))
        lines = []
        for loc, base, mount in locations:
            st = life(base, mount, groups, args.samples, tokens, args.release_chunk, claim)
            meta, calls = report(loc, st, groups)
            lim = limit_life(base, mount, groups, args.samples, tokens)
            lmeta, lcalls = report(f"{loc}, the limit", lim, groups, LIMIT_STEPS)
            shutil.rmtree(base, ignore_errors=True)
            what = (f"{meta:.1f} meta ops/group, the limit's {lmeta:.1f}, "
                    f"ratio {meta / lmeta:.2f}" if lmeta else
                    f"{calls:.1f} storage calls/group, the limit's {lcalls:.1f}, "
                    f"ratio {calls / lcalls:.2f}")
            lines.append(f"{loc} {what} (release_chunk {args.release_chunk}, claims of "
                         f"{claim})")
        print("queue_steps: " + ", ".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
