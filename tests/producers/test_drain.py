"""The zero-waste drain: SIGTERM to ``strawq producer`` with long generations in flight keeps
every token the engine generated, exits 0, and the next producer resumes without waste; a
drain past the grace period exits 3; a second SIGINT exits 130, a second SIGTERM does not."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from strawq.producers.drain import EXIT_DRAIN_OVERRUN, EXIT_INTERRUPTED, Drain
from strawq.tasks.queue import Lease, RunQueue
from tests.producers.helpers import ids, make_run, names
from tests.producers.journal_helpers import saved_prefix

PLUGINS = "tests.producers.plugins_for_tests"
REPO = Path(__file__).resolve().parents[2]
CLI = "import sys; sys.modules['ray'] = None; from strawq.app.cli import main; " \
      "sys.exit(main(sys.argv[1:]))"


# -- the drain's decisions (no process) ---------------------------------------------------------
def recording_drain(grace_s: float = 60.0) -> tuple[Drain, list[str], list[int]]:
    stops: list[str] = []
    codes: list[int] = []

    def exit_(code: int) -> None:
        codes.append(code)

    return Drain(lambda: stops.append("stop"), grace_s, who="producer p", exit=exit_), \
        stops, codes


def test_the_first_signal_drains_a_second_sigterm_does_not_exit_a_second_sigint_does() -> None:
    drain, stops, codes = recording_drain()
    drain.on_signal(signal.SIGTERM)
    assert stops == ["stop"] and drain.draining and drain.why == "SIGTERM"
    drain.on_signal(signal.SIGTERM)
    assert stops == ["stop"] and codes == []  # the drain goes on
    drain.on_signal(signal.SIGINT)
    assert codes == [EXIT_INTERRUPTED]
    drain.finish()


def test_a_signal_after_the_drain_finished_does_nothing() -> None:
    drain, stops, codes = recording_drain()
    drain.begin("--max-seconds")
    drain.begin("again")  # once
    assert drain.finish() is not None
    drain.on_signal(signal.SIGINT)
    assert stops == ["stop"] and codes == [] and drain.why == "--max-seconds"


def test_a_drain_past_the_grace_period_exits_3_and_a_finished_one_stands_the_watchdog_down() \
        -> None:
    exited = threading.Event()
    codes: list[int] = []

    def exit_(code: int) -> None:
        codes.append(code)
        exited.set()

    drain = Drain(lambda: None, 0.05, who="producer p", exit=exit_)
    drain.begin("SIGTERM")
    assert exited.wait(30), "the watchdog never fired"
    assert codes == [EXIT_DRAIN_OVERRUN]

    done = Drain(lambda: None, 3600.0, who="producer q", exit=exit_)
    done.begin("SIGTERM")
    timer = done._timer
    assert timer is not None and timer.is_alive()
    done.finish()
    timer.join(30)
    assert not timer.is_alive() and codes == [EXIT_DRAIN_OVERRUN]


# -- real processes, real signals ---------------------------------------------------------------
#: about 200 tokens a second per sequence, responses of 300 to 700 tokens: every response is
#: still generating a second after the start
PACED = {"step_base_ms": 5, "step_per_req_ms": 0, "len_median": 450, "len_sigma": 0.25,
         "len_cap": 700, "cap_prob": 0, "time_scale": 1.0}


@pytest.fixture
def paced_engine() -> Iterator[Any]:
    from strawq.producers.engines.testing import start_engine_subprocess

    eng = start_engine_subprocess("sim", max_running_requests=64, **PACED)
    try:
        yield eng
    finally:
        eng.stop()


def engine_state(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/strawq/live_requests", timeout=10) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    return out


def producer(run: Path, url: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CLI, "producer", str(run), "--engine", url, "--reward",
         f"{PLUGINS}.length_reward", "--slots", "2", "--set", "sampling.max_new_tokens=2000",
         "--set", "timing.idle_poll_s=0.02", "--json", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)})


def wait_until(proc: subprocess.Popen[str], cond: Any, what: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"the producer exited ({proc.returncode}) before {what}: "
                                 f"{proc.stderr.read() if proc.stderr else ''}")
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.05)


def partials(q: RunQueue) -> dict[str, Any]:
    out = {}
    for t in names(q, "pending"):
        if Lease(t, {}).has_partial:
            g = saved_prefix(q, t)  # its .partial, or the journal it was parked into
            assert g is not None
            out[t.id] = g
    return out


def samples(group: Any) -> list[np.ndarray]:
    cuts = np.cumsum([0, *group.sample_lens])
    return [np.asarray(group.tokens[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


def stop(proc: subprocess.Popen[str], sig: int, timeout_s: float) -> tuple[str, str]:
    proc.send_signal(sig)
    try:
        return proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.slow
@pytest.mark.process
def test_sigterm_keeps_every_generated_token_exits_0_and_the_next_producer_wastes_none(
        tmp_path: Path, paced_engine: Any) -> None:
    run = tmp_path / "run"
    q = make_run(str(run), 4, group_size=2, release_batch=4)
    grace = 20.0
    first = producer(run, paced_engine.url, "--grace-period", str(grace))
    # two groups (4 sequences) generating long responses, each well under way
    wait_until(first, lambda: (lambda live: len(live) == 4 and
                               all(r["output_tokens"] >= 50 for r in live))(
        engine_state(paced_engine.url)["requests"]), "4 sequences 50 tokens deep")
    out, err = stop(first, signal.SIGTERM, grace + 30)
    assert first.returncode == 0, err
    assert "Traceback" not in err and "drained in" in err
    stats = json.loads(out)
    assert stats["groups_yielded"] == 2 and stats["groups_completed"] == 0
    assert ids(q, "leased") == []
    generated = engine_state(paced_engine.url)["generated_tokens"]
    saved = partials(q)
    assert len(saved) == 2
    # 100 % of the tokens the engine generated for the drained sequences are saved
    assert sum(g.num_tokens for g in saved.values()) == generated > 4 * 50

    second = producer(run, paced_engine.url)
    wait_until(second, lambda: len(ids(q, "ready")) == 4, "4 ready groups")
    _, err = stop(second, signal.SIGTERM, grace + 30)
    assert second.returncode == 0, err
    ready = {t.id: q.read_group(t.id, t.gen) for t in names(q, "ready")}
    # the resumed samples continue their saved prefixes, and nothing was generated twice:
    # every token the engine ever generated is in exactly one trained sample
    for task_id, part in saved.items():
        for before, after in zip(samples(part), samples(ready[task_id]), strict=True):
            assert np.array_equal(after[:len(before)], before)
    assert engine_state(paced_engine.url)["generated_tokens"] == \
        sum(g.num_tokens for g in ready.values())


@pytest.mark.slow
@pytest.mark.process
def test_a_drain_that_cannot_end_exits_3_at_the_grace_period_and_keeps_the_run_sound(
        tmp_path: Path, paced_engine: Any) -> None:
    """The reward hangs, so a group whose samples are final cannot be completed: the drain
    overruns, the process exits 3 by itself (the caller does not kill it), and the leases
    it did not hand back stay for the grantor to expire; no task is lost."""
    run = tmp_path / "run"
    q = make_run(str(run), 2, group_size=1, release_batch=2)
    hang = producer(run, paced_engine.url, "--grace-period", "2", "--reward",
                    f"{PLUGINS}.hanging_reward", "--slots", "1")
    wait_until(hang, lambda: engine_state(paced_engine.url)["generated_tokens"] > 0 and
               not engine_state(paced_engine.url)["requests"], "a sample generated")
    _, err = stop(hang, signal.SIGTERM, 60)
    assert hang.returncode == EXIT_DRAIN_OVERRUN, err
    assert "grace period" in err and "Traceback" not in err
    held = ids(q, "leased")  # not handed back: the grantor expires them
    assert held and sorted(held + ids(q, "pending")) == ["i000000000000", "i000000000001"]


@pytest.mark.slow
@pytest.mark.process
def test_the_demos_producer_process_drains_on_sigterm(tmp_path: Path, paced_engine: Any) -> None:
    """``ProducerProcesses.terminate``: the demo's producer process drains like
    ``strawq producer`` (every generated token saved in its partials, exit 0)."""
    from strawq.demo.assembly import ProducerProcesses

    run = tmp_path / "run"
    q = make_run(str(run), 2, group_size=2, release_batch=2)
    procs = ProducerProcesses([{
        "run_dir": str(run), "producer_id": "lab-0", "engine": {"workers": [paced_engine.url]},
        "plugins": {"reward": f"{PLUGINS}.length_reward"}, "budget": {"slots": 2},
        "sampling": {"max_new_tokens": 2000}, "timing": {"grace_period_s": 20.0}}])
    child = procs.procs[0]
    try:
        wait_until(child, lambda: (lambda live: len(live) == 4 and
                                   all(r["output_tokens"] >= 50 for r in live))(
            engine_state(paced_engine.url)["requests"]), "4 sequences 50 tokens deep")
        procs.terminate(0)
        assert child.wait(60) == 0
        (stats,) = procs.finish()
    finally:
        if child.poll() is None:
            child.kill()
    assert stats["groups_yielded"] == 2 and ids(q, "leased") == []
    assert sum(g.num_tokens for g in partials(q).values()) == \
        engine_state(paced_engine.url)["generated_tokens"]


@pytest.mark.slow
@pytest.mark.process
def test_an_agentic_drain_with_tool_calls_in_flight_keeps_every_generated_token(
        tmp_path: Path, paced_engine: Any) -> None:
    """Trajectories with a slow tool call after each turn: SIGTERM while calls run (they are
    left to finish, the sample halts at once) and others generate. Every model token the
    engine generated is in the partials (tool tokens are not the engine's: loss mask 0), the
    producer exits 0, and the next producer finishes every trajectory generating nothing
    twice."""
    run = tmp_path / "run"
    ledger = tmp_path / "ledger"
    q = make_run(str(run), 4, group_size=2, release_batch=4)
    agent = ["--set", "plugins.generate=tests.producers.trajectory_plugins.tool_agent",
             "--set", "plugins.generate_args=" + json.dumps(
                 {"ledger": str(ledger), "turns": 2, "slow_s": 3.0}),
             "--set", "tools.timeout_s=30"]
    first = producer(run, paced_engine.url, "--grace-period", "20", *agent)
    wait_until(first, lambda: ledger.is_dir() and any(ledger.iterdir()) and bool(
        engine_state(paced_engine.url)["requests"]), "a tool call running beside generations")
    out, err = stop(first, signal.SIGTERM, 50)
    assert first.returncode == 0, err
    assert json.loads(out)["tool_calls_detached"] >= 1  # a call was running at the drain
    generated = engine_state(paced_engine.url)["generated_tokens"]
    saved = partials(q)
    assert saved and sum(int(g.loss_mask.sum()) for g in saved.values()) + sum(
        int(g.loss_mask.sum()) for g in ready_of(q).values()) == generated > 0

    second = producer(run, paced_engine.url, *agent)
    wait_until(second, lambda: len(ids(q, "ready")) == 4, "4 ready groups")
    _, err = stop(second, signal.SIGTERM, 50)
    assert second.returncode == 0, err
    assert engine_state(paced_engine.url)["generated_tokens"] == \
        sum(int(g.loss_mask.sum()) for g in ready_of(q).values())


def ready_of(q: RunQueue) -> dict[str, Any]:
    return {t.id: q.read_group(t.id, t.gen) for t in names(q, "ready")}
