"""The documented trainer loop's restore path (deploy/examples/trainer_loop.py): after a
checkpoint restore the restored weights reach the engines, under a new version, before
training resumes."""

from __future__ import annotations

import json

from strawq.storage import open_storage
from strawq.tasks.queue import RunQueue
from strawq.testing.reference import make_reference_run
from tests.collector.helpers import load_example


def test_restore_pushes_the_restored_weights_before_training(tmp_path, monkeypatch):
    run_dir, _ = make_reference_run(str(tmp_path / "r"), groups=2, group_size=2)
    loop = load_example("trainer_loop")
    events: list[tuple[str, int]] = []
    monkeypatch.setattr(loop, "push_weights",
                        lambda _router, _dir, v, urls=None: events.append(("push", v)))
    monkeypatch.setattr(loop, "restore_model", lambda _ckpt: events.append(("restore", -1)))
    real_step = loop.train_step
    monkeypatch.setattr(loop, "train_step",
                        lambda b: (events.append(("train", b.seq)), real_step(b))[1])
    ckpt = tmp_path / "state.json"
    args = [run_dir, "--router-url", "http://router", "--weights-dir", str(tmp_path / "w"),
            "--checkpoint", str(ckpt)]
    assert loop.main([*args, "--steps", "1"]) == 0
    assert events == [("train", 1), ("push", 1)]  # a fresh start: no restore, no push first
    assert json.loads(ckpt.read_text())["batch_seq"] == 1
    # the trainer restarts from its checkpoint: the restored weights go out first
    events.clear()
    assert loop.main([*args, "--steps", "0"]) == 0
    assert events == [("restore", -1), ("push", 2)]
    q = RunQueue.open(open_storage(run_dir, writer_id="t"))
    assert q.current_version() == 2
