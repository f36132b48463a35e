"""The control channel with two writers (docs/design.md, invariant 8): every announcement is an
exclusive create of a name that carries its version, and the state is the newest version of each
kind, so a second writer — a restarted trainer repeating its bracket, a stale one waking after a
newer bracket closed, ``strawq bracket abort`` beside the trainer — can neither reopen a closed
bracket nor close a newer one."""

from __future__ import annotations

from strawq.storage import MemoryStorage
from strawq.weights.control import Control


def test_a_stale_writer_cannot_reopen_a_closed_bracket() -> None:
    storage = MemoryStorage()
    live, stale = Control(storage), Control(storage)
    live.pause(5)
    live.resume(5)
    stale.pause(3)  # an older trainer wakes up and announces its (old) bracket
    st = Control(storage).state()
    assert not st.paused and st.pause_version == 5 and st.resume_version == 5


def test_a_stale_resume_cannot_close_a_newer_bracket() -> None:
    storage = MemoryStorage()
    live, stale = Control(storage), Control(storage)
    live.pause(6)
    stale.resume(4)
    assert Control(storage).state().paused


def test_repeated_announcements_by_two_writers_are_one() -> None:
    storage = MemoryStorage()
    a, b = Control(storage), Control(storage)
    a.pause(2)
    b.pause(2)
    a.ack(2, "p1")
    b.ack(2, "p1")
    st = Control(storage).state()
    assert st.paused and st.acks == frozenset({"p1"})
    assert len(storage.list("control")) == 2
    b.resume(2)
    a.resume(2)
    assert not Control(storage).state().paused
