"""A whole small run to its end, as processes: ``strawq collector``, ``strawq producer`` on a
sim engine, and a trainer loop that checkpoints and commits after every batch. Every one of
them exits 0 by itself (nobody signals them) and ``strawq status`` shows nothing batched."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from strawq.app.cluster import count_dataset

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.process]

#: the trainer: train (nothing), ack, checkpoint, commit; stop on RunFinished
TRAINER = textwrap.dedent("""
    import json, sys
    from strawq.collector.trainer.reader import BatchReader
    from strawq.errors import RunFinished

    reader = BatchReader.open(sys.argv[1])
    steps = 0
    while True:
        try:
            batch = reader.next_batch(timeout=300)
        except RunFinished as end:
            print("FINISHED", steps, end, flush=True)
            break
        reader.ack(batch)
        state = reader.state_dict()
        reader.commit(state)
        steps += 1
    reader.close()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _strawq(*args: str) -> list[str]:
    return [sys.executable, "-m", "strawq", *args]


@pytest.mark.timeout(240)
def test_a_small_run_ends_and_every_process_exits_0(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = str(tmp_path / "run")
    data = count_dataset(str(tmp_path / "data.jsonl"), 12, seed=3)
    subprocess.run(_strawq("init", run, "-q", "--set", "group_size=4",
                           "--set", "heartbeat_interval_s=0.5", "--set", "release_batch=8"),
                   check=True, env=env, cwd=tmp_path)
    port = _free_port()
    engine = subprocess.Popen(
        _strawq("engine", "serve", "--kind", "sim", "--port", str(port), "--step-base-ms", "2",
                "--len-median", "8", "--len-cap", "24", "-q"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tmp_path,
        start_new_session=True)
    logs = {name: open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115 - closed below
            for name in ("producer", "collector", "trainer")}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        procs["producer"] = subprocess.Popen(
            _strawq("producer", run, "--engine", f"http://127.0.0.1:{port}", "--slots", "2",
                    "--set", "sampling.max_new_tokens=24", "--set", "timing.idle_after_s=0.2",
                    "--set", "timing.idle_probe_s=0.5",
                    "--reward", "strawq.producers.rewards.count_task"),
            stdout=logs["producer"], stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        procs["collector"] = subprocess.Popen(
            _strawq("collector", run, data, "--set", "batch_groups=2",
                    "--set", "poll_interval_s=0.05", "--set", "gc_interval_s=0.2"),
            stdout=logs["collector"], stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        procs["trainer"] = subprocess.Popen(
            [sys.executable, "-c", TRAINER, run],
            stdout=logs["trainer"], stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        codes: dict[str, int | None] = {}
        deadline = time.monotonic() + 200
        for name, p in procs.items():
            try:
                codes[name] = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None  # still running: named below with every log's tail
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        os.killpg(engine.pid, signal.SIGKILL)
        engine.wait()
        for f in logs.values():
            f.close()
    text = {name: (tmp_path / f"{name}.log").read_text(errors="replace") for name in logs}
    assert codes == {"producer": 0, "collector": 0, "trainer": 0}, \
        (codes, {name: t[-3000:] for name, t in text.items()})
    assert "FINISHED 6" in text["trainer"], text["trainer"]  # 12 prompts, 2 per batch
    assert "the run has finished" in text["collector"], text["collector"]
    assert "the run has finished" in text["producer"], text["producer"]
    res = subprocess.run(_strawq("status", run, "--json"), capture_output=True, text=True,
                         env=env, cwd=tmp_path, check=True)
    st = json.loads(res.stdout)
    assert st["counts"]["batched"] == 0 and st["batches_unacked"] == 0, st
