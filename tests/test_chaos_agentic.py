"""The chaos benchmark's agentic parts on their own: the tool server (a real process) applies
a key once however often it runs, refuses a call whose caller gave up, and the key-value
agent's remote call keeps its key until a server answers; the oracle flags what it must."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from strawq.demo.agentic_kv import Fenced, counts, remote_put

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from chaos_agentic import oracle  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _server(port: int, ledger: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(REPO / "bench" / "chaos.py"), "--role",
                             "tool-server", "--port", str(port), "--ledger", str(ledger),
                             "--tool-min", "0.01", "--tool-max", "0.02"], cwd=REPO,
                            stderr=subprocess.DEVNULL)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    port, ledger = _port(), tmp_path / "ledger"
    proc = _server(port, ledger)
    url = f"http://127.0.0.1:{port}"
    try:
        remote_put(url, "warm.up", {"k": "k0", "v": 0}, {"sum": 0}, 5.0, 60.0)
        yield url, ledger
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.process
def test_the_tool_server_applies_a_key_once(served: tuple[str, Path]) -> None:
    url, ledger = served
    out: list[dict[str, int]] = []
    args = {"t": 0, "k": "k0", "v": 7}
    # two concurrent executions and a later one of the same key, the later ones with other
    # results (a re-run in a wrong world): one effect, the first applied result every time
    threads = [threading.Thread(target=lambda r=r: out.append(
        remote_put(url, "t.0.g0.e0.c0.abc", args, {"sum": r}, 5.0, 30.0))) for r in (7, 8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.append(remote_put(url, "t.0.g0.e0.c0.abc", args, {"sum": 9}, 5.0, 30.0))
    assert counts(str(ledger), "exec")["t.0.g0.e0.c0.abc"] == 3
    assert counts(str(ledger), "effect")["t.0.g0.e0.c0.abc"] == 1
    assert len({json.dumps(o) for o in out}) == 1 and out[0]["sum"] in (7, 8)


@pytest.mark.process
def test_a_call_of_a_lease_a_newer_holder_took_over_is_refused_unexecuted(
        tmp_path: Path) -> None:
    """The lease generation is a fencing token: once generation 2 of a task called the tool,
    generation 1 (a holder whose lease expired, woken after a stop) gets 409 and is not
    executed, even after the server was killed and restarted (the fence is durable)."""
    port, ledger = _port(), tmp_path / "ledger"
    url = f"http://127.0.0.1:{port}"
    args = {"t": 0, "k": "k0", "v": 1}
    proc = _server(port, ledger)
    try:
        assert remote_put(url, "a.0", args, {"sum": 1}, 5.0, 60.0, task="i7", gen=1) == \
            {"sum": 1}
        remote_put(url, "a.1", args, {"sum": 2}, 5.0, 30.0, task="i7", gen=2)
        proc.kill()
        proc.wait()
        proc = _server(port, ledger)
        with pytest.raises(Fenced):
            remote_put(url, "a.2", args, {"sum": 3}, 5.0, 60.0, task="i7", gen=1)
        assert counts(str(ledger), "exec")["a.2"] == 0
        assert counts(str(ledger), "effect")["a.2"] == 0
        assert counts(str(ledger), "fenced")["a.2"] == 1  # the refusal is recorded
        # other tasks are not fenced by it, and the same generation goes on
        remote_put(url, "b.0", args, {"sum": 4}, 5.0, 30.0, task="i8", gen=0)
        remote_put(url, "a.3", args, {"sum": 5}, 5.0, 30.0, task="i7", gen=2)
        assert counts(str(ledger), "exec")["b.0"] == 1
        assert counts(str(ledger), "exec")["a.3"] == 1
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.process
def test_a_call_whose_caller_gave_up_is_not_executed(served: tuple[str, Path]) -> None:
    url, ledger = served
    req = urllib.request.Request(f"{url}/put", data=json.dumps(
        {"key": "late.key", "args": {"k": "k0", "v": 1}, "result": {"sum": 1}}).encode(),
        headers={"X-Deadline": str(time.time() - 1)})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 504
    assert counts(str(ledger), "exec")["late.key"] == 0


@pytest.mark.process
def test_a_remote_call_keeps_its_key_until_a_server_answers(tmp_path: Path) -> None:
    port, ledger = _port(), tmp_path / "ledger"
    got: list[Any] = []
    caller = threading.Thread(target=lambda: got.append(remote_put(
        f"http://127.0.0.1:{port}", "s.1.g0.e0.c3.k", {"k": "k1", "v": 4}, {"sum": 4},
        2.0, 60.0)))
    caller.start()  # nothing listens yet: refused, tried again with the same key
    proc = _server(port, ledger)
    try:
        caller.join(90)
        assert got == [{"sum": 4}]
        assert counts(str(ledger), "effect") == {"s.1.g0.e0.c3.k": 1}
    finally:
        proc.kill()
        proc.wait()
    # no server at all: the deadline ends the call with a reason naming the key
    with pytest.raises(TimeoutError, match=r"did not answer put s\.1\.g0\.e0\.c4\.k within"):
        remote_put(f"http://127.0.0.1:{port}", "s.1.g0.e0.c4.k", {}, {}, 0.2, 0.5)


@pytest.mark.process
def test_an_abandoned_remote_call_is_not_tried_again(tmp_path: Path) -> None:
    """A call given up by its sample (halted: a new holder runs it) stops retrying, so it
    cannot reach the server after the new holder persisted the result."""
    port, ledger = _port(), tmp_path / "ledger"
    url = f"http://127.0.0.1:{port}"
    stop = threading.Event()
    errors: list[BaseException] = []

    def call() -> None:
        try:
            remote_put(url, "s.2.g0.e0.c1.k", {"k": "k1", "v": 4}, {"sum": 4}, 2.0, 60.0, stop)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            errors.append(exc)

    caller = threading.Thread(target=call)
    caller.start()  # nothing listens: it retries
    stop.set()
    caller.join(30)
    assert not caller.is_alive() and len(errors) == 1
    assert "abandoned" in str(errors[0])
    proc = _server(port, ledger)
    try:
        remote_put(url, "other.key", {"k": "k0", "v": 1}, {"sum": 1}, 5.0, 60.0)
        assert counts(str(ledger), "exec") == {"other.key": 1}
    finally:
        proc.kill()
        proc.wait()


def _write(ledger: Path, kind: str, name: str, obj: Any = None) -> None:
    os.makedirs(ledger / kind, exist_ok=True)
    (ledger / kind / name).write_text(json.dumps(obj) if obj is not None else "")


def test_the_oracle_flags_double_effects_reexecutions_and_a_wrong_world(
        tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    calls = [["a.c0", {"k": "k0", "v": 5}, {"sum": 5}], ["a.c1", {"k": "k1", "v": 3},
                                                          {"sum": 8}]]
    for key, args, result in calls:
        _write(ledger, "exec", f"{key}.1")
        _write(ledger, "effect", f"{key}.e", {"args": args, "result": result})
    lineage = [{"id": "a", "agentic": {"failures": {}, "samples": [
        {"status": "completed", "gen_tokens": 10, "tools": calls}]}}]
    ok = oracle(lineage, str(ledger), {"a.c0": 1})
    assert (ok["effects_twice"], ok["persisted_reexecuted"], ok["env_mismatches"]) == (
        [], [], 0)
    assert ok["tool_calls_trained"] == 2 and ok["trajectories"] == 1
    # a second effect, a persisted call run again, a result its store does not give
    _write(ledger, "effect", "a.c1.f00", {"args": calls[1][1], "result": {"sum": 8}})
    _write(ledger, "exec", "a.c0.2")
    bad_calls = [calls[0], ["a.c1", {"k": "k1", "v": 3}, {"sum": 3}]]
    _write(ledger, "effect", "a.c1.e", {"args": bad_calls[1][1], "result": {"sum": 3}})
    lineage[0]["agentic"]["samples"][0]["tools"] = bad_calls  # type: ignore[index]
    bad = oracle(lineage, str(ledger), {"a.c0": 1})
    assert bad["effects_twice"] == ["a.c1"]
    assert bad["persisted_reexecuted"] == ["a.c0"]
    assert bad["env_mismatches"] == 1 and "the store its calls describe gives {'sum': 8}" \
        in bad["world_mismatches"][0]
    # a trained call the world never saw
    (ledger / "effect" / "a.c0.e").unlink()
    assert any("has no effect" in m for m in oracle(lineage, str(ledger), {})
               ["world_mismatches"])
