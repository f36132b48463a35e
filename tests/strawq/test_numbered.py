"""``strawq.ondisk.numbered``: the one spelling of numbered names, and the names it spells on disk.

The golden names are a live-run format: a run written before a change must read the same
after it, so any change to them fails here first."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strawq.data import cursor, history
from strawq.delivery import batches, commits, packed, requeue, retention
from strawq.ondisk import names
from strawq.ondisk.numbered import Numbered
from strawq.storage import MemoryStorage
from strawq.tasks import epochs, eta, queue, states, turns
from strawq.weights import control

GOLDEN = {
    "manifest": (batches.manifest_key(7), "batches/000000000007"),
    "ack": (batches.ack_key(7), "acked/000000000007"),
    "delivered": (batches.DELIVERIES.name(4, 5), "000000000004~000000000005"),
    "high water": (batches.HIGH_WATER.name(3), "bseq-000000000003"),
    "committed": (commits.COMMITS.name(9), "000000000009"),
    "pause": (control.PAUSES.name(3), "pause-000000000003"),
    "control ack": (control.ACKS.name(3, "node-1"), "ack-000000000003~node-1"),
    "resume": (control.RESUMES.name(3), "resume-000000000003"),
    "epoch": (epochs.epoch_key(2), "collector/epoch-000000000002"),
    "closed": (epochs.closed_key(2), "collector/closed-000000000002"),
    "closed name": (epochs.closed_name(2), "closed-000000000002"),
    "epoch heartbeat": (epochs.heartbeat_key(3, 9), "collector/hb-000000000003~0000000000000009"),
    "epoch start": (epochs.start_key(3, 12), "collector/start-000000000003~000000000012"),
    "policy": (eta.POLICIES.name(4), "policy-000000000004"),
    "cursor": (cursor.cursor_name(2, 50), "000000000002.000000000050"),
    "cursor dir": (cursor.CURSOR_DIRS.name(2), "000000000002"),
    "cursor commit": (cursor.PREPARED.name(2, "abcd1234"), "c-000000000002.abcd1234"),
    "release": (states.release_dir(3), "pending/r-000000000003"),
    "release staging": (states.RELEASES.name(3, "abcd1234"), "r-000000000003.abcd1234"),
    "history": (history.SEGMENTS.name(1), "seg-000000000001"),
    "drop audit": (retention.SEGMENTS.name(1), "drops-000000000001"),
    "requeue audit": (requeue._segment_key(2), "audit/drops-000000000002"),
    "shard": (packed.shard_key(5, "abc123", 2, 1), "packed/000000000005~abc123~w2~r1"),
    "version": (queue.VERSIONS.name(3), "000000000003"),
    "turn": (turns.turn_key("t1", 3), "turns/t1/0000000003"),
    "task id": (names.dataset_task_id(7), "i000000000007"),
    "queue key": (names.queue_key("a", 3, 10**12 + 5), "a000000000003.000000000005"),
    "fresh key": (names.fresh_key(5), "c000000000000.000000000005"),
    # claim rank: release version 2, then 999999 − 300 predicted tokens (longest first)
    "ranked fresh key": (names.fresh_key(5, 300.4, version=2), "c000002999699.000000000005"),
    # a prediction past the rank's digits is the longest it can tell: rank 1, never 0
    "longest ranked key": (names.fresh_key(5, 5e9), "c000000000001.000000000005"),
    "ready key": (names.ready_key(3, 5), "000000000003.000000000005"),
    "producer heartbeat": (names.heartbeat_key("p", 42), "hb/p~0000000000000042"),
    "idle heartbeat": (names.heartbeat_key("p", 42, idle=True), "hb/p~0000000000000042.idle"),
}


@pytest.mark.parametrize("family", sorted(GOLDEN))
def test_golden_names(family: str) -> None:
    got, want = GOLDEN[family]
    assert got == want


def test_golden_names_as_written_to_storage() -> None:
    st_ = MemoryStorage()
    batches.mark_delivered(st_, 4, 5)
    batches.mark_high_water(st_, 3)
    commits.commit(st_, 9)
    c = control.Control(st_)
    c.pause(3)
    c.ack(3, "node-1")
    c.resume(3)
    q = queue.RunQueue.create(MemoryStorage())
    q.set_version(3)
    assert st_.list("delivered") == ["000000000004~000000000005"]
    assert st_.list("collector") == ["bseq-000000000003"]
    assert st_.list("committed") == ["000000000009"]
    assert st_.list("control") == ["ack-000000000003~node-1", "pause-000000000003",
                                   "resume-000000000003"]
    assert q.storage.list("versions") == ["000000000003"]


def test_the_owners_read_their_names_back() -> None:
    names_ = ["epoch-000000000002", "hb-000000000002~0000000000000009",
              "start-000000000002~000000000012", "closed-000000000001", "bseq-000000000005",
              "policy-000000000002", "tmp.x"]
    assert epochs.epochs(names_) == [2]
    assert epochs.heartbeat_counter(names_, 2) == 9
    assert epochs.epoch_starts(MemoryStorage(), names_) == [(2, 12)]
    assert names.parse_heartbeat_state("p~0000000000000042.idle") == ("p", 42, True)
    assert names.parse_heartbeat_state("p~x") is None
    assert packed.parse_shard_name("000000000005~abc123~w2~r1") == (5, "abc123", 2, 1)
    assert packed.parse_shard_name("000000000005") is None


# -- foreign and odd names -------------------------------------------------------------------
FAMILIES = [Numbered(), Numbered("bseq-"), Numbered(sep="~"), Numbered("hb-", sep="~",
                                                                    tail_width=16),
            Numbered("r-", sep="."), Numbered(width=10)]
ODD = ["", "tmp", ".tmp.abc", "000000000001.tmp", "²", "１２", "-1", "+1", " 1", "1 ", "1_000",
       "0x1", "bseq-", "bseq-abc", "bseq-1x", "bseq-²", "r-", "r-.x", "r-x.1", "hb-~1", "~1",
       "000000000001\n", "i000000000001", "epoch-000000000001"]


@pytest.mark.parametrize("family", FAMILIES, ids=repr)
def test_foreign_names_are_not_of_the_family(family: Numbered) -> None:
    assert [n for n in ODD if family.split(n) is not None or family.pair(n) is not None] == []
    assert family.numbers(ODD) == [] and family.newest(ODD) is None
    assert family.below(ODD, 10**13) == [] and family.prune(ODD, 0) == []


def test_odd_names_read_as_none() -> None:
    plain, high = Numbered(), Numbered("bseq-")
    assert [plain.parse(n) for n in ("000000000001.tmp", "²", "１２", "-1", "+1", " 1",
                                     "1_000", "")] == [None] * 8
    assert [high.parse(n) for n in ("bseq-", "bseq-x", "bseq-1~2", "seq-1", "1")] == [None] * 5
    pair = Numbered(sep="~")
    assert pair.pair("000000000001") is None and pair.pair("000000000001~x") is None
    assert pair.pair("000000000001~") is None and pair.pair("x~000000000001") is None
    assert Numbered().pair("000000000001~000000000002") is None  # no separator: no tail


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=30))
def test_parsing_never_raises(text: str) -> None:
    for family in FAMILIES:
        got = family.split(text)
        family.pair(text)
        if got is not None:
            assert family.split(family.name(*got)) == got


# -- round trips -----------------------------------------------------------------------------
NUMBERS = st.integers(min_value=0, max_value=10**20)


@settings(max_examples=200, deadline=None)
@given(NUMBERS, NUMBERS, st.text(max_size=12))
def test_round_trip(n: int, m: int, tail: str) -> None:
    for family in FAMILIES:
        assert family.parse(family.name(n)) == n
        if family.sep:
            assert family.pair(family.name(n, m)) == (n, m)
            assert family.split(family.name(n, tail)) == (n, tail)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10**12 - 1), min_size=1, max_size=20))
def test_names_sort_in_number_order(numbers: list[int]) -> None:
    """Zero-padded to the width, a sorted listing (``Storage.list``) is in number order."""
    for family in FAMILIES:
        fits = [n for n in numbers if n < 10**family.width]
        listing = sorted(family.name(n) for n in fits)
        assert [family.parse(n) for n in listing] == sorted(fits)


def test_a_name_that_cannot_be_read_back_is_refused() -> None:
    with pytest.raises(ValueError):
        Numbered().name(-1)
    with pytest.raises(ValueError):
        Numbered(sep="~").name(1, -1)
    with pytest.raises(ValueError):
        Numbered().name(1, "x")  # no separator for a tail
    with pytest.raises(ValueError):
        Numbered(sep="1")
    assert Numbered(sep="~").name(1, "") == "000000000001"


# -- listings ----------------------------------------------------------------------------------
def test_newest_below_and_prune() -> None:
    family = Numbered("policy-")
    listing = [family.name(n) for n in (5, 1, 9, 3)] + ["tmp", "policy-x", "seg-000000000010"]
    random.Random(0).shuffle(listing)
    assert family.numbers(listing) == [1, 3, 5, 9]
    assert family.newest(listing) == 9
    assert family.newest(["tmp"]) is None and family.newest([], 0) == 0
    assert family.below(listing, 5) == ["policy-000000000001", "policy-000000000003"]
    assert family.below(listing, 0) == []
    assert family.prune(listing, 2) == ["policy-000000000001", "policy-000000000003"]
    assert family.prune(listing, 4) == [] and family.prune(listing, 10) == []
    assert family.prune(listing, 0) == [family.name(n) for n in (1, 3, 5, 9)]
    with pytest.raises(ValueError):
        family.prune(listing, -1)


def test_prune_keeps_numbers_not_names() -> None:
    """A number with several names (``ack-<v>~<producer>``) is kept or pruned whole."""
    family = Numbered("ack-", sep="~")
    listing = [family.name(2, "a"), family.name(2, "b"), family.name(1, "a"),
               family.name(3, "a")]
    assert family.prune(listing, 2) == ["ack-000000000001~a"]
    assert family.named(listing) == [(1, "ack-000000000001~a"), (2, "ack-000000000002~a"),
                                     (2, "ack-000000000002~b"), (3, "ack-000000000003~a")]
    assert family.pairs([Numbered(sep="~").name(2, 7), "000000000001~000000000009"]) == []
    assert Numbered(sep="~").pairs(["000000000002~000000000007", "000000000001~000000000009",
                                    "000000000003~x"]) == [(1, 9), (2, 7)]


def test_numbers_of_other_widths_still_read() -> None:
    """A name written with another width (a hand-made one, an older run) reads its number."""
    assert Numbered().numbers(["7", "000000000012", "0000000000000000003"]) == [3, 7, 12]
    assert Numbered(width=16).parse("000000000042") == 42
