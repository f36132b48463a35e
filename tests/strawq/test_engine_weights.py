"""engines/: the notes producers leave for the trainer about engines on other weights."""

from __future__ import annotations

import pytest

from strawq.engine_weights import ENGINES_DIR, EngineWeights, url_key
from strawq.errors import StrawqError
from strawq.storage import MemoryStorage


def test_notes_by_engine_and_who_clears_them() -> None:
    st = MemoryStorage()
    ew = EngineWeights(st)
    assert ew.needing() == {}
    a, b = "http://h:1", "http://h:2/"
    ew.mark(a, writer="p1", engine_version=1, run_version=3, reason="replied with 1")
    ew.mark(a, writer="p2", engine_version=2, run_version=4, reason="reports 2")
    ew.mark(b, writer="trainer", engine_version=None, run_version=4, reason="push failed")
    need = ew.needing()
    assert set(need) == {a, "http://h:2"}  # one URL, however it was spelled
    assert need[a].writer == "p2" and need[a].engine_version == 2  # the newest note
    assert url_key(b) == url_key("http://h:2")
    # a producer clears only its own notes; the trainer up to the version it pushed
    assert ew.clear(a, writer="p1") == 1
    assert ew.clear(a, up_to_version=3) == 0 and set(ew.needing()) == {a, "http://h:2"}
    assert ew.clear(a, up_to_version=4) == 1
    assert set(ew.needing()) == {"http://h:2"}
    # a torn note is skipped (logged), never fatal
    st.publish(f"{ENGINES_DIR}/{url_key(a)}~p9~torn", b"junk")
    assert set(ew.needing()) == {"http://h:2"}
    with pytest.raises(StrawqError):
        ew.mark(a, writer="../x", engine_version=1, run_version=1, reason="")
