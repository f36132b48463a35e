"""``strawq bracket status|finish|abort`` against real engine processes (``strawq engine
serve --kind sim``) holding weight versions: a bracket whose trainer died is finished or
undone by what the engines hold, and never aborted onto the old version while an engine
holds the new one."""

from __future__ import annotations

import json
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from strawq.app import cli
from strawq.config import QueueConfig
from strawq.producers.engines.testing import EngineProcess, start_engine_subprocess
from strawq.storage import PosixStorage
from strawq.tasks.queue import RunQueue
from strawq.weights.control import Control, read_state
from strawq.weights.engine_weights import EngineWeights

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def engines() -> Iterator[list[EngineProcess]]:
    procs = [start_engine_subprocess("sim", weight_version="3") for _ in range(2)]
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


def set_version(url: str, version: int) -> None:
    """The engine loads version ``version`` (SGLang's ``/update_weight_version``)."""
    req = urllib.request.Request(f"{url}/update_weight_version", method="POST",
                                 data=json.dumps({"new_version": str(version)}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert json.loads(resp.read())["success"]


def run_at(tmp_path: Path, version: int, urls: list[str], *, paused: int | None = None
           ) -> tuple[str, RunQueue]:
    """A run at ``version`` whose producers registered ``urls``, with the bracket for
    ``paused`` left open (acked by p1) by a trainer that died."""
    path = str(tmp_path / "run")
    q = RunQueue.create(PosixStorage(path, writer_id="setup", fsync=False),
                        QueueConfig(fsync=False))
    q.set_version(version)
    for u in urls:
        EngineWeights(q.storage).register(u)
    if paused is not None:
        control = Control(q.storage)
        control.pause(paused)
        control.ack(paused, "p1")
    return path, q


def status(path: str, capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    assert cli.main(["bracket", "status", path, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.process
def test_finish_announces_the_version_the_engines_hold_and_abort_refuses(
        tmp_path: Path, engines: list[EngineProcess], capsys: pytest.CaptureFixture[str]
) -> None:
    # the trainer paused for version 4, pushed it to every engine, and died before the end
    urls = [e.url for e in engines]
    for u in urls:
        set_version(u, 4)
    path, q = run_at(tmp_path, 3, urls, paused=4)
    st = status(path, capsys)
    assert st["open"] and st["engines"] == {u: {"version": 4, "error": None} for u in urls}
    assert st["settle"]["action"] == "finish" and st["settle"]["version"] == 4
    assert cli.main(["bracket", "status", path]) == 0
    out = capsys.readouterr().out
    assert f"{urls[0]}  holds version 4" in out and "strawq bracket finish" in out
    # abort would resume producers on 3 with every engine on 4: refused
    assert cli.main(["bracket", "abort", path]) == 1
    err = capsys.readouterr().err
    assert "refused" in err and "strawq bracket finish" in err and urls[1] in err
    assert read_state(q.storage).paused and q.current_version() == 3  # nothing changed
    assert cli.main(["bracket", "finish", path]) == 0
    assert "version 4 announced" in capsys.readouterr().out
    st2 = read_state(q.storage)
    assert not st2.paused and st2.resume_version == 4 and q.current_version() == 4
    assert cli.main(["bracket", "finish", path]) == 1
    assert "nothing to finish" in capsys.readouterr().err


def test_finish_refuses_when_the_engines_disagree_naming_which_holds_what(
        tmp_path: Path, engines: list[EngineProcess], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = (e.url for e in engines)
    set_version(a, 4)  # the push reached one engine of two
    set_version(b, 3)
    path, q = run_at(tmp_path, 3, [a, b], paused=4)
    assert cli.main(["bracket", "finish", path]) == 1
    err = capsys.readouterr().err
    assert f"version 3: {b}" in err and f"version 4: {a}" in err and "disagree" in err
    assert cli.main(["bracket", "abort", path]) == 1  # one engine holds 4 already
    assert f"{a} holds version 4" in capsys.readouterr().err
    assert read_state(q.storage).paused and q.current_version() == 3
    # --force aborts anyway (an operator who put version 3 back on it)
    assert cli.main(["bracket", "abort", path, "--force"]) == 0
    assert not read_state(q.storage).paused and q.current_version() == 3


def test_finish_undoes_an_update_that_reached_no_engine(
        tmp_path: Path, engines: list[EngineProcess], capsys: pytest.CaptureFixture[str]
) -> None:
    urls = [e.url for e in engines]
    for u in urls:
        set_version(u, 3)  # the trainer died before its push
    path, q = run_at(tmp_path, 3, urls, paused=4)
    assert status(path, capsys)["settle"]["action"] == "undo"
    assert cli.main(["bracket", "finish", path]) == 0
    assert "undid the weight update to version 4" in capsys.readouterr().out
    st = read_state(q.storage)
    assert not st.paused and q.current_version() == 3


def test_an_update_aborted_onto_the_old_version_is_finished_afterwards(
        tmp_path: Path, engines: list[EngineProcess], capsys: pytest.CaptureFixture[str]
) -> None:
    # an abort (before this check existed, or forced) resumed producers on 3 while every
    # engine holds 4: producers keep them all out of rotation; finish announces 4
    urls = [e.url for e in engines]
    for u in urls:
        set_version(u, 4)
    path, q = run_at(tmp_path, 3, urls, paused=4)
    Control(q.storage).resume(4)
    assert status(path, capsys)["settle"]["action"] == "finish"
    assert cli.main(["bracket", "finish", path]) == 0
    assert q.current_version() == 4


def test_unreachable_engines_are_reported_not_waited_for(
        tmp_path: Path, engines: list[EngineProcess], capsys: pytest.CaptureFixture[str]
) -> None:
    good = engines[0].url
    set_version(good, 4)
    refused = "http://127.0.0.1:9"  # nothing listens there
    with socket.socket() as hung:  # accepts connections, never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        silent = f"http://127.0.0.1:{hung.getsockname()[1]}"
        path, q = run_at(tmp_path, 3, [silent], paused=4)
        st = status(path, capsys, "--timeout", "0.5", "--engine", refused)
        assert st["engines"][refused]["error"].startswith("cannot reach it")
        assert st["engines"][silent]["error"] == "no answer within 0.5s"
        # nothing answered: whether version 4 reached the engines is unknown
        assert st["settle"]["action"] == "refuse"
        assert cli.main(["bracket", "finish", path, "--timeout", "0.5"]) == 1
        assert "no engine answered" in capsys.readouterr().err
        assert read_state(q.storage).paused
        # one engine answers: finish goes by it and names the others
        assert cli.main(["bracket", "finish", path, "--timeout", "0.5", "--engine", good,
                         "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["finished"] == "finish" and out["version"] == 4
        assert silent in out["settle"]["message"]
    assert q.current_version() == 4


def test_status_writes_nothing_and_without_engines_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = run_at(tmp_path, 0, [])
    before = sorted(str(p.relative_to(path)) for p in Path(path).rglob("*"))
    assert cli.main(["bracket", "status", path]) == 0
    out = capsys.readouterr().out
    assert "no weight-update bracket is open" in out and "engines: none known" in out
    assert sorted(str(p.relative_to(path)) for p in Path(path).rglob("*")) == before


def test_status_is_shown_with_quiet_and_a_bad_timeout_is_a_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = run_at(tmp_path, 3, [])
    assert cli.main(["-q", "bracket", "status", path]) == 0
    assert "no weight-update bracket is open" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main(["bracket", "status", path, "--timeout", "0"])
    assert exc.value.code == 2
    assert "--timeout: expected a finite number > 0" in capsys.readouterr().err
