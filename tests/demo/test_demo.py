"""The main job end to end, at a reduced size: real Ray, real engines, real queue.

Checks, for each schedule: every released dataset index is trained once or is somewhere in
the queue (pending, partial, leased, ready, batched) or dropped with a reason; per-token
alignment of what was generated (equal lengths, and the rollout log-probs recomputed under
each token's own weight version); the reward rises; and a ``kill -9`` of the whole demo
resumes with nothing lost and nothing trained twice.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from demo.run import CHECKPOINT, DemoConfig, run_demo
from producers.engines.tiny_model import load_weights, recompute_logprobs
from strawq.feeder import read_cursor_state
from strawq.groups import GroupData
from strawq.names import dataset_task_id
from strawq.queue import RunQueue
from strawq.storage import PosixStorage
from strawq.testing.audit import audit_run

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.ray]


def check_invariants(run_dir: str, trained: list[int]) -> None:
    dupes = [i for i, n in collections.Counter(trained).items() if n > 1]
    assert dupes == [], f"dataset indices trained twice: {dupes}"
    storage = PosixStorage(run_dir, writer_id="test")
    cursor = read_cursor_state(storage)
    assert cursor is not None
    released = [dataset_task_id(i) for i in range(cursor["next_index"])]
    audit = audit_run(storage)
    problems = audit.check(released, trained=[dataset_task_id(i) for i in trained])
    assert problems == []
    in_queue = audit.ids("pending", "partial", "leased", "ready", "batched", "dropped")
    assert not in_queue & {dataset_task_id(i) for i in trained if
                           audit.state_of(dataset_task_id(i)) not in (None, "batched")}


def check_alignment(run_dir: str, weights_dir: str) -> int:
    """Every ready/partial group: equal columns; log-probs match under each token's weights."""
    q = RunQueue.open(PosixStorage(run_dir, writer_id="test"))
    storage = q.storage
    models: dict[int, object] = {}
    checked = 0
    for name in storage.list("data"):
        if not name.endswith((".group", ".partial")):
            continue
        rec_group = GroupData.from_record(__import__("strawq.records", fromlist=["decode"])
                                          .decode(storage.read(f"data/{name}")))
        rec_group.validate()
        for i in range(rec_group.num_samples):
            s = rec_group.sample(i)
            if not s["tokens"].size:
                continue
            for v in np.unique(s["versions"]):
                path = os.path.join(weights_dir, f"v{int(v):06d}")
                if not os.path.isdir(path):
                    continue  # older weights were pruned (the trainer keeps the last few)
                model = models.setdefault(int(v), load_weights(path))
                with torch.no_grad():
                    lp = recompute_logprobs(model, rec_group.prompt_ids.tolist(),
                                            s["tokens"].tolist())
                sel = s["versions"] == v
                np.testing.assert_allclose(lp[sel], s["logprobs"][sel], atol=2e-4)
                checked += int(sel.sum())
    return checked


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "partial", "async"])
def test_demo_modes_end_to_end(mode: str, tmp_path: Path) -> None:
    cfg = DemoConfig(workdir=str(tmp_path / "w"), mode=mode, steps=6, prompts=400,
                     progress=False)
    result = run_demo(cfg)
    assert len(result.schedule.records) == 6
    assert os.path.getsize(result.files["timeline"]) > 10_000
    assert all(np.isfinite(r.metrics["loss"]) for r in result.schedule.records)
    if mode == "async":
        assert max(result.staleness) <= cfg.max_staleness
    if mode == "sync":
        assert max(result.staleness) == 0  # nothing generated across a weight update
    run_dir = os.path.join(cfg.workdir, "run")
    check_invariants(run_dir, result.trained_indices)
    tokens = check_alignment(run_dir, os.path.join(cfg.workdir, "weights"))
    assert tokens > 0, "no generated token could be checked against its weights"


@pytest.mark.timeout(300)
def test_demo_reward_rises(tmp_path: Path) -> None:
    cfg = DemoConfig(workdir=str(tmp_path / "w"), steps=30, prompts=1000, progress=False)
    result = run_demo(cfg)
    first, last = np.mean(result.rewards[:5]), np.mean(result.rewards[-5:])
    assert last > first + 0.1, f"reward did not rise: first 5 steps {first:.3f}, last {last:.3f}"
    check_invariants(os.path.join(cfg.workdir, "run"), result.trained_indices)


@pytest.mark.timeout(420)
def test_demo_resumes_after_kill_9(tmp_path: Path) -> None:
    work = tmp_path / "w"
    cmd = [sys.executable, "-m", "strawq.cli", "demo", "--workdir", str(work), "--steps", "14",
           "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = work / CHECKPOINT
    deadline = time.monotonic() + 240
    try:
        while True:
            assert proc.poll() is None, "the demo ended before it could be killed"
            if ckpt.exists():
                step = torch.load(ckpt, weights_only=True)["step"]
                if step >= 4:
                    break
            assert time.monotonic() < deadline, "no checkpoint at step 4 in time"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the demo, its engines, its Ray processes
        proc.wait(30)
    killed_at = torch.load(ckpt, weights_only=True)["step"]
    out = subprocess.run(cmd + ["--resume"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    state = torch.load(ckpt, weights_only=True)
    assert state["step"] == 14 and killed_at < 14
    summary = json.loads((work / "summary.json").read_text())
    assert summary["steps"][0]["step"] == killed_at  # continued, not restarted
    check_invariants(str(work / "run"), list(state["trained"]))
