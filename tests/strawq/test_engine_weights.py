"""engines/: the notes producers leave for the trainer about engines on other weights."""

from __future__ import annotations

import pytest

from strawq.errors import StrawqError
from strawq.storage import MemoryStorage
from strawq.weights.engine_weights import (
    ENGINES_DIR,
    EngineProbe,
    EngineWeights,
    probe_version,
    probe_versions,
    url_key,
)


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


def test_known_engines_are_registered_once_and_forgotten_with_their_notes() -> None:
    st = MemoryStorage()
    ew = EngineWeights(st)
    assert ew.known() == []
    assert ew.register("http://h:1/") and not ew.register("http://h:1")  # one per URL
    ew.mark("http://h:2", writer="p1", engine_version=1, run_version=3, reason="r")
    assert ew.known() == ["http://h:1", "http://h:2"]  # registered, or named by a note
    assert ew.forget("http://h:2") == 1 and ew.forget("http://h:1") == 0
    assert ew.known() == [] and ew.needing() == {}


def test_notes_on_an_engine_found_on_the_run_version_clear_whoever_wrote_them() -> None:
    st = MemoryStorage()
    ew = EngineWeights(st)
    fixed, behind, unheard = "http://h:1", "http://h:2", "http://h:3"
    for url in (fixed, behind, unheard):
        ew.mark(url, writer="p-gone", engine_version=2, run_version=3, reason="r")
    ew.mark(fixed, writer="trainer", engine_version=None, run_version=3, reason="push failed")
    probes = {fixed: EngineProbe(fixed, 3), behind: EngineProbe(behind, 2),
              unheard: EngineProbe(unheard, None, "cannot reach it")}
    assert ew.clear_fixed(3, probes) == [fixed]
    assert set(ew.needing()) == {behind, unheard}
    # a note written for a newer run version than the probe's is not the probe's to clear
    ew.mark(fixed, writer="p1", engine_version=3, run_version=4, reason="r")
    assert ew.clear_fixed(3, probes) == [] and fixed in ew.needing()


def test_probe_reads_the_engines_weight_version_and_says_why_it_cannot() -> None:
    from strawq.producers.engines.launch import EngineOptions
    from strawq.producers.engines.testing import EngineThread

    on_7 = EngineThread(EngineOptions(kind="sim", weight_version="7"))
    default = EngineThread(EngineOptions(kind="sim", weight_version="default"))
    keyed = EngineThread(EngineOptions(kind="sim", weight_version="7", api_key="k"))
    try:
        found = probe_versions([on_7.url + "/", default.url, keyed.url, "http://127.0.0.1:9"],
                               timeout_s=2.0)
        assert found[on_7.url] == EngineProbe(on_7.url, 7)
        assert found[default.url].version is None
        assert "'default' is not an integer" in str(found[default.url].error)
        assert "HTTP 401" in str(found[keyed.url].error) and "api-key" in str(
            found[keyed.url].error)
        assert str(found["http://127.0.0.1:9"].error).startswith("cannot reach it")
        assert probe_version(keyed.url, api_key="k").version == 7
    finally:
        for e in (on_7, default, keyed):
            e.stop()
