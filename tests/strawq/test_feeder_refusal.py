"""A release that would drop too many bad rows is refused before anything is written, and a
bad row names its place in its file (docs/design.md, invariant 12)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from strawq.app.cli import main as cli_main
from strawq.config import QueueConfig
from strawq.data.dataset import BadRow, Dataset
from strawq.data.feeder import Feeder, preview_release
from strawq.data.release_check import BadRowsRefused
from strawq.errors import ConfigError
from strawq.storage import PosixStorage, Storage
from strawq.tasks.queue import RunQueue
from strawq.testing import audit_run, write_jsonl
from tests.strawq.queue_helpers import tid


def _queue(tmp_path: Path, **kw: Any) -> RunQueue:
    kw.setdefault("fsync", False)
    return RunQueue.create(PosixStorage(str(tmp_path / "run")), QueueConfig(**kw))


def _written(storage: Storage) -> dict[str, list[str]]:
    """What a release leaves: cursor records, staging, pending and dropped entries."""
    return {d: sorted(storage.list(d)) for d in ("cursor", "staging", "pending", "dropped")}


def test_the_wrong_prompt_key_is_refused_with_nothing_released(tmp_path: Path) -> None:
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(24)]
    q = _queue(tmp_path)
    f = Feeder(q, Dataset(write_jsonl(tmp_path / "d.jsonl", rows)))
    before = _written(q.storage)
    with pytest.raises(BadRowsRefused) as exc:
        f.release(64)
    msg = str(exc.value)
    assert "24 of its 24 rows are bad" in msg and "missing 'prompt'" in msg
    assert "['answer', 'question']" in msg and "d.jsonl line 1:" in msg
    assert "the cursor stays at index 0" in msg and "--max-bad-row-share 1" in msg
    assert _written(q.storage) == before  # no cursor, no drop, no half release
    assert Feeder(q, f.dataset).cursor.next_index == 0 and not f.exhausted
    # released knowingly: every row dropped with its reason, the cursor at the end
    g = Feeder(q, f.dataset, max_bad_row_share=1.0)
    assert g.release(64) == 24 and g.exhausted
    assert audit_run(q.storage).ids("dropped") == {tid(i) for i in range(24)}


def test_the_share_is_judged_against_a_whole_batch_and_carried_by_the_cursor(
        tmp_path: Path) -> None:
    bad_at = {5, 20, 40, 70, 71, 72, 73}
    rows: list[Any] = ["{broken" if i in bad_at else {"prompt": f"p{i}"} for i in range(100)]
    q = _queue(tmp_path, release_batch=64)
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    f = Feeder(q, Dataset(data))
    assert f.release(64) == 64  # 3 bad of 64: within 5 %
    assert f.release(2) == 2  # 64..65: a new window
    # a second writer (an operator's release) sees the window on the cursor: rows 66..73
    # hold 4 bad rows, 4 of the window's 10 rows but judged against a whole batch of 64
    g = Feeder(RunQueue.open(q.storage), Dataset(data))
    assert g.release(4) == 4  # 66..69: no bad row
    with pytest.raises(BadRowsRefused, match=r"4 of its 4 rows are bad \(4 of the last 10"):
        g.release(4)  # 70..73 all bad: 4 > 0.05 * 64
    assert f.refresh().next_index == 70
    assert Feeder(q, Dataset(data), max_bad_row_share=0.1).release(4) == 4  # 4 <= 6.4


def test_a_small_release_with_one_bad_row_goes_ahead_but_a_first_all_bad_one_does_not(
        tmp_path: Path) -> None:
    q = _queue(tmp_path)
    data = write_jsonl(tmp_path / "d.jsonl", ["{broken", {"prompt": "a"}, "{broken"])
    with pytest.raises(BadRowsRefused, match="first release of a dataset"):
        Feeder(q, Dataset(data)).release(1)
    f = Feeder(q, Dataset(data))
    assert f.release(2) == 2  # one bad of two, judged against release_batch=64
    assert f.release(5) == 1 and f.exhausted  # a later all-bad release of one row: allowed


def test_the_share_must_be_a_share(tmp_path: Path) -> None:
    q = _queue(tmp_path)
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}])
    with pytest.raises(ConfigError, match="from 0 to 1"):
        Feeder(q, Dataset(data), max_bad_row_share=1.5)


def test_bad_rows_name_their_jsonl_line_and_parquet_row(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n   \n{"nope": 1}\n{broken\n')
    rows = Dataset(str(path)).read(0, 10)
    bad = [r for _, r in rows if isinstance(r, BadRow)]
    assert [(b.index, b.line) for b in bad] == [(2, 5), (3, 6)]
    assert bad[0].message.startswith(f"{path} line 5: missing 'prompt'")
    assert bad[1].message.startswith(f"{path} line 6: invalid JSON")
    assert bad[0].keys == ("nope",) and bad[0].shard == str(path)

    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(pa.table({"prompt": [f"a{i}" for i in range(5)]}),
                   shards / "part-0.parquet", row_group_size=2)
    pq.write_table(pa.table({"prompt": ["b0", "b1", "b2", "", "b4"]}),
                   shards / "part-1.parquet", row_group_size=2)
    (got,) = [r for _, r in Dataset(str(shards)).read(0, 10) if isinstance(r, BadRow)]
    assert (got.index, got.row, got.line) == (8, 3, None)
    assert got.shard.endswith("part-1.parquet")
    assert got.message.startswith(f"{got.shard} row 3 (0-based): 'prompt' is an empty string")


def test_the_cli_release_that_would_drop_8_of_12_rows_exits_1(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = str(tmp_path / "run")
    rows: list[Any] = [{"prompt": [1, 2]} if i % 3 == 0 else {"question": "x"} for i in range(12)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    assert cli_main(["init", run, "-q"]) == 0
    capsys.readouterr()
    storage = PosixStorage(run)
    before = _written(storage)
    assert cli_main(["release", run, data, "--json"]) == 1
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["released"] == 0 and out["next_index"] == 0 and len(out["bad_rows"]) == 8
    assert out["bad_rows"][0]["line"] == 2 and "missing 'prompt'" in out["refused"]
    assert "error: refusing to release" in captured.err and "Traceback" not in captured.err
    assert _written(storage) == before
    assert cli_main(["release", run, data, "--dry-run"]) == 1
    assert "would release nothing: refusing" in capsys.readouterr().out
    assert preview_release(RunQueue.open(storage), Dataset(data)).refused is not None
    assert cli_main(["release", run, data, "--max-bad-row-share", "1"]) == 0
    assert "released 4 of 12 rows (8 bad dropped" in capsys.readouterr().out


@pytest.mark.parametrize("first", [3, 4])
def test_a_dry_run_at_the_end_of_a_pass_previews_the_next_pass(tmp_path: Path,
                                                               first: int) -> None:
    """With passes left (``queue.num_epochs``), the end of a pass is not the end of the
    run: a dry run there shows the next pass's rows at the indexes a release would give
    them, as that release then does. ``first`` 3: the pass's rows were all taken, its end
    not yet seen; 4: the release that took them found the end (the cursor says
    exhausted)."""
    q = _queue(tmp_path, num_epochs=2, release_batch=4)
    ds = Dataset(write_jsonl(tmp_path / "d.jsonl", [{"prompt": [i + 1]} for i in range(3)]))
    f = Feeder(q, ds)
    assert f.release(first) == 3
    assert f.cursor.exhausted == (first == 4)
    got = preview_release(q, ds, 2)
    assert got.refused is None and (got.start, got.end, got.good) == (3, 5, 2), got
    assert not got.exhausted
    assert f.release(2) == 2 and f.cursor.next_index == 5
