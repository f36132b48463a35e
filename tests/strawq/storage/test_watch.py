"""DirWatch: wake-ups on directory changes (inotify), a plain sleep where there is none."""

from __future__ import annotations

import threading

import pytest

from strawq.storage import MemoryStorage, PosixStorage
from strawq.storage.watch import IN_MOVED_TO, DirWatch, inotify_available

needs_inotify = pytest.mark.skipif(not inotify_available(), reason="no inotify on this OS")


@needs_inotify
@pytest.mark.timeout(60)
def test_wakes_on_a_publish_from_another_thread(tmp_path):
    st = PosixStorage(str(tmp_path))
    st.makedirs("batches")
    with DirWatch(st, ("batches",)) as w:
        assert w.event_driven
        assert not w.wait(0)  # nothing yet
        threading.Timer(0.05, st.publish, args=("batches/000000000001", b"m")).start()
        # a wait far longer than the test's deadline: only the event can end it in time
        assert w.wait(3600)


@needs_inotify
def test_events_name_the_entry_and_directory(tmp_path):
    st = PosixStorage(str(tmp_path))
    for d in ("ready", "acked"):
        st.makedirs(d)
    with DirWatch(st, ("ready", "acked"), mask=IN_MOVED_TO, keep_events=True,
                  clock=lambda: 7.0) as w:
        st.publish("acked/000000000003", b"")
        st.publish("ready/x", b"")
        evs = w.take_events()
    assert [(e.directory, e.name, e.at) for e in evs] == [("acked", "000000000003", 7.0),
                                                        ("ready", "x", 7.0)]
    assert all(e.mask & IN_MOVED_TO for e in evs)


@needs_inotify
def test_unwatched_change_and_missing_directory(tmp_path):
    st = PosixStorage(str(tmp_path))
    st.makedirs("a")
    st.makedirs("b")
    with DirWatch(st, ("a", "gone")) as w:
        st.publish("b/x", b"")
        assert not w.wait(0)
        assert not w.add("also-gone")


def test_without_inotify_wait_is_the_injected_sleep():
    slept: list[float] = []
    w = DirWatch(MemoryStorage(), ("batches",), sleep=slept.append)
    assert not w.event_driven and w.fileno() is None
    assert not w.wait(0.25) and not w.drain()
    assert slept == [0.25]
    w.close()


def test_disabled_falls_back_to_sleep(tmp_path):
    slept: list[float] = []
    w = DirWatch(PosixStorage(str(tmp_path)), ("tmp",), enabled=False, sleep=slept.append)
    assert not w.event_driven and not w.wait(0.1) and slept == [0.1]


def test_dir_probe_says_changed_after_each_change_and_once_more(tmp_path):
    from strawq.storage.watch import DirProbe

    st = PosixStorage(str(tmp_path))
    st.makedirs("pending")
    t = [0.0]
    probe = DirProbe(st, ("pending",), full_every_s=10.0, clock=lambda: t[0])
    assert probe.changed()  # first look: list
    assert not probe.changed()
    st.publish("pending/x", b"")
    assert probe.changed() and probe.changed()  # the change, then once more (same tick)
    assert not probe.changed()
    st.delete("pending/x")
    assert probe.changed()
    probe.changed()
    t[0] = 20.0
    assert probe.changed()  # unchanged for full_every_s: list anyway


def test_dir_probe_without_local_paths_always_lists():
    from strawq.storage.watch import DirProbe

    probe = DirProbe(MemoryStorage(), ("pending",))
    assert all(probe.changed() for _ in range(3))
