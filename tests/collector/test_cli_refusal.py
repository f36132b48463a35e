"""``strawq collector`` stops with exit 1, before dropping anything, when its releases would
drop the dataset's rows as bad (a run whose prompt_key the rows do not have); it refuses a
dataset without rows, or one that grew without ``--dataset-grew``, before it writes
anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from strawq.app.cli import main as cli_main
from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.data.binding import DatasetMismatch
from strawq.data.cursor import read_cursor_state
from strawq.data.dataset import Dataset, EmptyDataset
from strawq.storage import PosixStorage
from strawq.tasks.queue import RunQueue
from strawq.testing import write_jsonl
from strawq.testing.audit import audit_run
from tests.collector.helpers import make_run

FAST = ["--no-fsync", "--set", "batch_groups=2", "--set", "poll_interval_s=0.01",
        "--set", "gc_interval_s=0.05", "--set", "max_running=8", "--set", "max_ready=8"]


def test_a_collector_whose_rows_lack_the_prompt_key_exits_1_with_nothing_dropped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    make_run(str(run))
    data = write_jsonl(tmp_path / "d.jsonl", [{"question": f"q{i}", "answer": i}
                                              for i in range(24)])
    assert cli_main(["collector", str(run), data, *FAST, "--max-passes", "20", "--json"]) == 1
    captured = capsys.readouterr()
    assert "strawq collector: error: refusing to release task indices 0.." in captured.err
    assert "missing 'prompt'" in captured.err and "['answer', 'question']" in captured.err
    assert "Traceback" not in captured.err
    assert not list((run / "dropped").iterdir()) and not list((run / "cursor").iterdir())
    assert not list((run / "pending").iterdir())
    # the cursor never moved: fixed, the same run releases from index 0
    fixed = write_jsonl(tmp_path / "ok.jsonl", [{"prompt": [1, 2, 3], "i": i}
                                                 for i in range(4)])
    assert cli_main(["release", str(run), fixed, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["released"] == 4


def _tree(path: Path) -> list[str]:
    """Every file and directory under ``path``: what a refused start must leave as it was."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_a_collector_refuses_an_empty_dataset_before_it_creates_the_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    empty = tmp_path / "d.jsonl"
    empty.write_text("\n\n")
    assert cli_main(["collector", str(run), str(empty), *FAST, "--max-passes", "2",
                     "--create"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"strawq collector: error: refusing dataset {str(empty)!r}: d.jsonl "
                          "holds only blank lines. ")
    assert "Nothing was written to the run" in err and "Traceback" not in err
    assert not run.exists()  # no run created
    with pytest.raises(EmptyDataset, match="holds only blank lines"):
        Collector.open(str(run), Dataset(str(empty)), CollectorConfig(), fsync=False)
    assert not run.exists()
    # an existing run: no epoch taken, no cursor, nothing else
    make_run(str(run))
    before = _tree(run)
    write_jsonl(tmp_path / "math.jsonl", [{"prompt": [1, 2]}] * 4)
    (tmp_path / "code.jsonl").write_text("")
    mix = tmp_path / "m.mixture.json"
    mix.write_text(json.dumps({"sources": [{"name": "math", "path": "math.jsonl"},
                                           {"name": "code", "path": "code.jsonl"}]}))
    assert cli_main(["collector", str(run), str(mix), *FAST, "--max-passes", "2"]) == 1
    assert "its source 'code'" in capsys.readouterr().err
    assert _tree(run) == before


def test_a_collector_continues_a_grown_dataset_only_with_the_flag(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    make_run(str(run))
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": [1, 2, i]} for i in range(3)])
    assert cli_main(["release", str(run), data, "--count", "2"]) == 0
    with open(data, "a", encoding="utf-8") as f:
        f.writelines(json.dumps({"prompt": [1, 2, i]}) + "\n" for i in range(3, 6))
    before = _tree(run)
    capsys.readouterr()
    assert cli_main(["collector", str(run), data, *FAST, "--max-passes", "2"]) == 1
    err = capsys.readouterr().err
    assert "strawq collector: error: refusing to release from" in err
    assert "--dataset-grew" in err and "Traceback" not in err
    assert _tree(run) == before  # no epoch taken, nothing released
    with pytest.raises(DatasetMismatch, match="--dataset-grew"):
        Collector.open(str(run), Dataset(data), CollectorConfig(), fsync=False)
    assert _tree(run) == before
    assert cli_main(["collector", str(run), data, *FAST, "--max-passes", "2",
                     "--dataset-grew"]) == 0
    state = read_cursor_state(PosixStorage(str(run)))
    assert state is not None and state["fingerprint"] == Dataset(data).fingerprint
    nxt = state["next_index"]
    assert nxt > 2  # the collector released past the old end, task ids continuing
    q = RunQueue.open(PosixStorage(str(run)))
    got = {lease.task_id: lease.task["row"]["prompt"] for lease in q.claim("p", 10)}
    assert got == {f"i{i:012d}": [1, 2, i] for i in range(nxt)}
    assert audit_run(q.storage).check([f"i{i:012d}" for i in range(nxt)]) == []


def test_a_path_that_holds_no_run_is_refused_with_nothing_created(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A typo'd run path (or an empty directory) is not turned into a new run with the
    default queue config: exit 1, nothing created, the message names 'strawq init'."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": [1, 2, 3]} for _ in range(4)])
    typo = tmp_path / "runs" / "r1-typo"
    empty = tmp_path / "empty"
    empty.mkdir()
    for path in (typo, empty):
        assert cli_main(["collector", str(path), data, *FAST, "--max-passes", "2"]) == 1
        err = capsys.readouterr().err
        assert "holds no strawq run" in err and "strawq init" in err and "--create" in err
        assert "Traceback" not in err
    assert not typo.exists() and not (tmp_path / "runs").exists()
    assert list(empty.iterdir()) == []


def test_create_makes_the_run_where_none_is(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": [1, 2, 3]} for _ in range(4)])
    qc = tmp_path / "queue.json"
    qc.write_text(json.dumps({"group_size": 2}))
    run = tmp_path / "new"
    assert cli_main(["collector", str(run), data, *FAST, "--max-passes", "2", "--create",
                     "--queue-config", str(qc)]) == 0
    assert RunQueue.open(PosixStorage(str(run))).config.group_size == 2
