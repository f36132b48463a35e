"""``strawq collector`` stops with exit 1, before dropping anything, when its releases would
drop the dataset's rows as bad (a run whose prompt_key the rows do not have)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from strawq.app.cli import main as cli_main
from strawq.testing import write_jsonl
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
