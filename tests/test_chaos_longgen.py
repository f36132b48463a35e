"""The long-generation chaos workload's arithmetic (``bench/chaos_longgen.py``): the token
RPO of a sequence is what it had generated at the fault less what the next request for its
sample resumes with; a drain keeps what the next holder resumes with."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from chaos_longgen import line, token_rpo  # noqa: E402 (bench/)


@dataclass
class F:
    victim: str
    kind: str
    at: float
    running: dict[str, int] = field(default_factory=dict)


def test_rpo_counts_what_the_next_request_does_not_resume_with() -> None:
    faults = [
        # a producer kill at t=10: sample 0 of t1 had 100 resumed + 40 generated, the next
        # holder resumes with 100 (the partial): 40 lost; sample 1 resumed with all 60
        F("producer0", "kill9", 10.0, {"p.r0/t1.g0/0.3": 40, "p.r0/t1.g0/1.2": 60}),
        # an engine kill at t=20: the producer retries with what it had received: 25 lost
        F("engine1", "kill9", 20.0, {"q.r0/t2.g0/0.0": 25}),
        F("collector", "kill9", 30.0, {}),
    ]
    requests = [(5.0, "p.r0/t1.g0/0.3", 100), (6.0, "p.r0/t1.g0/1.2", 0),
                (13.0, "p.r1/t1.g1/0.0", 100), (13.1, "p.r1/t1.g1/1.0", 60),
                (15.0, "q.r0/t2.g0/0.0", 7), (20.5, "q.r0/t2.g0/0.1~retry1", 7)]
    fig = token_rpo(faults, requests, [], {})  # type: ignore[arg-type]
    assert sorted(fig["rpo"]) == [0, 25, 40]
    assert fig["p50"] == 25 and fig["p99"] == 40
    assert fig["regenerated_per_fault"] == (40 + 25 + 0) / 3
    assert math.isnan(fig["drain_kept"])


def test_a_drain_keeps_what_the_next_holder_resumes_with() -> None:
    faults = [F("producer1", "sigterm", 10.0, {"p.r0/t1.g0/0.0": 30, "p.r0/t1.g0/1.0": 50})]
    requests = [(5.0, "p.r0/t1.g0/0.0", 0), (5.0, "p.r0/t1.g0/1.0", 0),
                (12.0, "p.r1/t1.g1/0.0", 35)]
    # sample 0 was aborted with 35 tokens and resumed with all of them; sample 1 ended by
    # itself at 52 (final in its group, kept)
    answers = [(10.5, "p.r0", "t1", 0, 35, "p.r0/t1.g0/0.0"),
               (10.2, "p.r0", "t1", 0, 52, "p.r0/t1.g0/1.0")]
    finishes = {"p.r0/t1.g0/0.0": "abort", "p.r0/t1.g0/1.0": "stop"}
    fig = token_rpo(faults, requests, answers, finishes)  # type: ignore[arg-type]
    assert fig["drain_kept"] == 100.0 and fig["drain_tokens"] == 87
    # a next holder that resumed with less: the drain lost tokens
    short = [*requests[:2], (12.0, "p.r1/t1.g1/0.0", 20)]
    assert token_rpo(faults, short, answers, finishes)["drain_kept"] == \
        100.0 * (20 + 52) / 87  # type: ignore[arg-type]
    assert line(fig).endswith("drain kept = 100 %; extra meta ops per producer-second = 0.00")


def test_the_journal_watch_counts_records_from_their_numbers(tmp_path: Path) -> None:
    """F's count: an incarnation has published its highest record number + 1, even when the
    superseded ones are already deleted; a name that is not a record is not counted."""
    from chaos_longgen import META_OPS_PER_RECORD, JournalWatch

    from strawq.tasks.journal import RECORDS

    for writer, inc, numbers in (("producer0.r0", 1, [7, 9]), ("producer0.r1", 1, [0]),
                                 ("producer1.r0", 2, [4])):
        d = tmp_path / "journal" / writer
        d.mkdir(parents=True)
        for n in numbers:
            (d / RECORDS.name(inc, n)).write_bytes(b"x")
    (tmp_path / "journal" / "producer1.r0" / "tmp.abc").write_bytes(b"x")

    @dataclass
    class P:
        def alive(self) -> bool:
            return True

    @dataclass
    class Ch:
        run_a: str
        procs: dict[str, P]

    watch = JournalWatch(Ch(str(tmp_path), {"producer0": P(), "producer1": P()}))
    got = watch.stop()
    assert got["records"] == 10 + 1 + 5
    assert META_OPS_PER_RECORD == 3
    assert got["meta_ops"] == 16 * 3


def test_the_journal_watch_counts_a_segments_frames(tmp_path: Path) -> None:
    """A writer appending to segments: its highest number is the newest segment's first
    plus its intact frames less one (a torn tail not counted); each segment costs a
    record's operations, each other record an append's."""
    from chaos_longgen import META_OPS_PER_APPEND, META_OPS_PER_RECORD, JournalWatch

    from strawq.tasks.journal import SEGMENTS, frame

    d = tmp_path / "journal" / "producer0.r0"
    d.mkdir(parents=True)
    (d / SEGMENTS.name(3, 0)).write_bytes(b"".join(frame([b"r"]) * 32))  # superseded
    whole = b"".join(b"".join(frame([b"r%d" % i])) for i in range(5))
    (d / SEGMENTS.name(3, 32)).write_bytes(whole + whole[:7])  # five frames, a torn tail

    @dataclass
    class P:
        def alive(self) -> bool:
            return True

    @dataclass
    class Ch:
        run_a: str
        procs: dict[str, P]

    watch = JournalWatch(Ch(str(tmp_path), {"producer0": P(), "producer1": P()}))
    got = watch.stop()
    assert got["records"] == 32 + 5
    assert got["meta_ops"] == 2 * META_OPS_PER_RECORD + 35 * META_OPS_PER_APPEND
