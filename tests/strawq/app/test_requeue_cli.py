"""``strawq requeue RUN --reason R``: dropped tasks back into the queue from the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from strawq.app.cli import main as cli_main
from strawq.storage import PosixStorage
from strawq.tasks.queue import RunQueue
from strawq.tasks.states import TaskState, names_in
from tests.strawq.queue_helpers import make_feeder, make_queue, tid


def _run(tmp_path: Path) -> str:
    """A run with i0..i2 dropped as bad_task and i3 as zero_variance."""
    path = str(tmp_path / "run")
    q = make_queue(PosixStorage(path, fsync=False))
    make_feeder(q, tmp_path, 4).release(4)
    for lease in q.claim("p", 4):
        if lease.task_id == tid(3):
            q.drop(lease, "zero_variance", "filter")
        else:
            q.fail(lease, "bad_task", "no tokenizer", retryable=False)
    return path


def _reasons(path: str) -> list[str | None]:
    return sorted(n.producer for n in names_in(PosixStorage(path), TaskState.DROPPED))


def test_requeue_dry_run_then_requeue_with_json_and_quiet(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    assert cli_main(["requeue", run, "--reason", "bad_task", "--dry-run"]) == 0
    assert "would requeue 3 tasks dropped with reason bad_task" in capsys.readouterr().out
    assert _reasons(run) == ["bad_task"] * 3 + ["zero_variance"]
    assert cli_main(["requeue", run, "--reason", "bad_task", "--json", "--limit", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requeued"] == 1 and out["task_ids"] == [tid(0)] and not out["dry_run"]
    assert cli_main(["-q", "requeue", run, "--reason", "bad_task"]) == 0
    assert capsys.readouterr().out == ""
    assert _reasons(run) == ["zero_variance"]
    pending = {lease.task_id for lease in RunQueue.open(PosixStorage(run)).claim("p2", 4)}
    assert pending == {tid(0), tid(1), tid(2)}


def test_requeue_of_an_absent_or_unrunnable_reason_exits_1(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    assert cli_main(["requeue", run, "--reason", "typo"]) == 1
    err = capsys.readouterr().err
    assert "no dropped task" in err and "bad_task=3, zero_variance=1" in err
    assert cli_main(["requeue", run, "--reason", "bad_row"]) == 1
    assert "cannot be requeued" in capsys.readouterr().err
    assert cli_main(["requeue", run, "--reason", "../x"]) == 1
    assert "Traceback" not in capsys.readouterr().err
    assert cli_main(["requeue", str(tmp_path / "nope"), "--reason", "bad_task"]) == 1
    with pytest.raises(SystemExit) as exc:
        cli_main(["requeue", run])  # --reason is required: a usage error
    assert exc.value.code == 2
    assert _reasons(run) == ["bad_task"] * 3 + ["zero_variance"]
