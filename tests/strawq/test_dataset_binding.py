"""A dataset mistake is refused before it binds the run: a dataset without rows (an empty
file, blank lines, a Parquet file of 0 rows, a shard set of such files, a mixture source
that is one) and a grown dataset without the operator's ``--dataset-grew``, each with one
message, exit 1 and nothing written."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from strawq.app.cli import main as cli_main
from strawq.config import QueueConfig
from strawq.data.binding import DatasetMismatch, check_binding, growth_problem
from strawq.data.cursor import read_cursor_state
from strawq.data.dataset import Dataset, EmptyDataset
from strawq.data.feeder import Feeder
from strawq.data.mixture import open_dataset
from strawq.errors import DatasetError
from strawq.storage import PosixStorage
from strawq.tasks.queue import RunQueue
from strawq.testing import write_jsonl
from strawq.testing.audit import audit_run


def tid(i: int) -> str:
    return f"i{i:012d}"


def rows(name: str, n: int, start: int = 0) -> list[dict[str, Any]]:
    return [{"prompt": f"{name}{i}"} for i in range(start, start + n)]


def make_run(tmp_path: Path, **kw: Any) -> str:
    run = str(tmp_path / "run")
    RunQueue.create(PosixStorage(run), QueueConfig(fsync=False, **kw))
    return run


def written(run: str) -> dict[str, list[str]]:
    """What a release writes: the cursor, staging, pending and dropped directories."""
    return {d: sorted(os.listdir(os.path.join(run, d)))
            for d in ("cursor", "staging", "pending", "dropped")}


def append(path: str, more: list[dict[str, Any]]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in more)


def write_parquet(path: Path, data: list[dict[str, Any]]) -> str:
    table = (pa.Table.from_pylist(data) if data
             else pa.table({"prompt": pa.array([], pa.string())}))
    pq.write_table(table, path)
    return str(path)


def write_gz(path: Path, lines: list[Any]) -> str:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for r in lines:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


# -- empty datasets ------------------------------------------------------------------------------
def _empty_file(tmp: Path) -> tuple[str, str]:
    (tmp / "data.jsonl").write_text("")
    return str(tmp / "data.jsonl"), "data.jsonl is empty (0 bytes)"


def _blank_lines(tmp: Path) -> tuple[str, str]:
    (tmp / "data.jsonl").write_text("\n  \n\n")
    return str(tmp / "data.jsonl"), "data.jsonl holds only blank lines"


def _parquet_of_0_rows(tmp: Path) -> tuple[str, str]:
    return write_parquet(tmp / "data.parquet", []), "data.parquet is a Parquet file of 0 rows"


def _shard_set_all_empty(tmp: Path) -> tuple[str, str]:
    d = tmp / "data"
    d.mkdir()
    (d / "part-0.jsonl").write_text("")
    (d / "part-1.jsonl").write_text("\n")
    write_gz(d / "part-2.jsonl.gz", [])
    return str(d), ("all its 3 files are empty: part-0.jsonl is empty (0 bytes); part-1.jsonl "
                    "holds only blank lines; part-2.jsonl.gz is empty once decompressed")


def _mixture_source_empty(tmp: Path) -> tuple[str, str]:
    write_jsonl(tmp / "math.jsonl", rows("m", 6))
    (tmp / "code.jsonl").write_text("")
    spec = tmp / "m.mixture.json"
    spec.write_text(json.dumps({"sources": [
        {"name": "math", "path": "math.jsonl"}, {"name": "code", "path": "code.jsonl"}]}))
    return str(spec), "its source 'code' (" + str(tmp / "code.jsonl") + ") has no rows: " \
        "code.jsonl is empty (0 bytes)"


EMPTY: dict[str, Callable[[Path], tuple[str, str]]] = {
    "empty file": _empty_file, "blank lines": _blank_lines,
    "parquet of 0 rows": _parquet_of_0_rows, "shard set all empty": _shard_set_all_empty,
    "mixture source empty": _mixture_source_empty}


@pytest.mark.parametrize("kind", list(EMPTY))
def test_an_empty_dataset_is_refused_by_release_with_nothing_written(
        kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(tmp_path)
    data, what = EMPTY[kind](tmp_path)
    before = written(run)
    assert cli_main(["release", run, data]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"strawq release: error: refusing dataset {data!r}: {what}. ")
    assert "Nothing was written to the run" in err and "Traceback" not in err
    assert err.count("\n") == 1  # one paragraph
    assert written(run) == before == {"cursor": [], "staging": [], "pending": [],
                                      "dropped": []}
    assert cli_main(["release", run, data, "--dry-run"]) == 1
    assert f"refusing dataset {data!r}" in capsys.readouterr().err
    assert written(run) == before


def test_the_export_that_lands_after_an_empty_one_is_released(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(tmp_path)
    data, _ = _empty_file(tmp_path)
    assert cli_main(["release", run, data]) == 1
    write_jsonl(data, rows("p", 3))  # the export finishes: the same path, now with rows
    assert cli_main(["release", run, data, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["released"], out["next_index"], out["exhausted"]) == (3, 3, True)


def test_a_feeder_refuses_an_empty_dataset_before_it_writes(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    q = RunQueue.open(PosixStorage(run))
    data, what = _blank_lines(tmp_path)
    with pytest.raises(EmptyDataset, match=f"refusing dataset .*: {what}"):
        Feeder(q, Dataset(data))
    with pytest.raises(EmptyDataset):
        Feeder(q, Dataset(data), check_dataset=False)  # nor can a run be switched to one
    assert written(run)["cursor"] == []


def test_emptiness_reads_up_to_the_first_row(tmp_path: Path) -> None:
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.jsonl").write_text("")
    write_parquet(d / "b.parquet", [])
    write_gz(d / "c.jsonl.gz", ["", *rows("c", 1)])
    # a row, then a line no reader could take: emptiness stops at the row
    (d / "d.jsonl").write_bytes(b'{"prompt": "d"}\n\xff\xfe{not json\n')
    assert not Dataset(str(d / "c.jsonl.gz")).is_empty()
    assert not Dataset(str(d / "d.jsonl")).is_empty()
    assert Dataset(str(d / "a.jsonl")).is_empty() and Dataset(str(d / "b.parquet")).is_empty()
    assert Dataset(str(d / "*.jsonl.gz")).emptiness() is None
    (d / "e.parquet").write_bytes(b"")  # a Parquet export that never wrote its footer
    assert Dataset(str(d / "e.parquet")).emptiness() == "e.parquet is empty (0 bytes)"
    (d / "f.parquet").write_bytes(b"garbage, not parquet")
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        Dataset(str(d / "f.parquet")).is_empty()
    many = tmp_path / "many"
    many.mkdir()
    for i in range(7):
        (many / f"p{i}.jsonl").write_text("")
    assert Dataset(str(many)).emptiness() == (
        "all its 7 files are empty: " + "; ".join(f"p{i}.jsonl is empty (0 bytes)"
                                                  for i in range(5)) + "; and 2 more")


# -- a dataset that grew -------------------------------------------------------------------------
def test_a_grown_file_is_refused_naming_the_flag_and_continued_with_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(tmp_path)
    data = write_jsonl(tmp_path / "d.jsonl", rows("p", 3))
    assert cli_main(["release", run, data, "--count", "2"]) == 0
    append(data, rows("p", 3, start=3))
    before = written(run)
    assert cli_main(["release", run, data]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"strawq release: error: refusing to release from {data!r}: it is "
                          "not the run's dataset")
    assert "with rows appended" in err and "--dataset-grew" in err
    assert "continuing from index 2" in err and err.count("\n") == 1
    assert written(run) == before  # refused: no cursor, no staging, no task
    assert cli_main(["release", run, data, "--dataset-grew", "--count", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["released"], out["next_index"]) == (3, 5)
    state = read_cursor_state(PosixStorage(run))
    assert state is not None and state["fingerprint"] == Dataset(data).fingerprint
    # the cursor records the grown file: later releases take it with no flag
    assert cli_main(["release", run, data, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["released"] == 1
    q = RunQueue.open(PosixStorage(run))
    got = {lease.task_id: lease.task["row"]["prompt"] for lease in q.claim("p", 10)}
    assert got == {tid(i): f"p{i}" for i in range(6)}  # task ids continue, none reused
    assert audit_run(q.storage).check([tid(i) for i in range(6)]) == []


def test_an_exhausted_cursor_continues_over_the_rows_appended(tmp_path: Path) -> None:
    run = make_run(tmp_path, num_epochs=2)
    data = write_jsonl(tmp_path / "d.jsonl", rows("p", 2))
    q = RunQueue.open(PosixStorage(run))
    f = Feeder(q, Dataset(data))
    assert f.release(3) == 2 and f.cursor.exhausted  # the first pass ended at index 2
    append(data, rows("p", 2, start=2))
    with pytest.raises(DatasetMismatch, match="--dataset-grew"):
        Feeder(q, Dataset(data))
    g = Feeder(q, Dataset(data), check_dataset=False)
    cur = g.continue_grown()
    assert (cur.next_index, cur.exhausted, g.base) == (2, False, 0)
    assert g.release(10) == 2 and g.cursor.exhausted  # the rest of the first pass: 2, 3
    assert g.release(10) == 4 and g.cursor.epoch_bases == (0, 4)  # the second: 4..7
    got = {lease.task_id: lease.task["row"]["prompt"] for lease in q.claim("p", 10)}
    assert got == {tid(i): f"p{i % 4}" for i in range(8)}


def test_grew_is_refused_for_a_dataset_that_did_not_only_grow(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(tmp_path)
    data = write_jsonl(tmp_path / "d.jsonl", rows("p", 4))
    assert cli_main(["release", run, data, "--count", "2"]) == 0
    other = write_jsonl(tmp_path / "other.jsonl", rows("o", 9))
    before = written(run)
    assert cli_main(["release", run, other, "--dataset-grew"]) == 1
    err = capsys.readouterr().err
    assert "refusing to continue" in err and "as the run's dataset grown (--dataset-grew)" in err
    assert "are not its first 1" in err and "switch_dataset" in err
    write_jsonl(data, rows("p", 3))  # the run's file, shrunk
    assert cli_main(["release", run, data, "--dataset-grew"]) == 1
    assert "refusing to continue" in capsys.readouterr().err
    assert written(run) == before
    assert cli_main(["release", run, data, "--dataset-grew", "--dry-run"]) == 2


def test_growth_is_new_shards_after_the_runs_or_rows_on_its_last_one(tmp_path: Path) -> None:
    d = tmp_path / "data"
    d.mkdir()
    write_jsonl(d / "b-0.jsonl", rows("a", 2))
    write_jsonl(d / "b-1.jsonl", rows("b", 2))
    old = Dataset(str(d)).fingerprint
    assert growth_problem(old, Dataset(str(d))) is None  # no change is no growth problem
    append(str(d / "b-1.jsonl"), rows("b", 1, start=2))
    assert growth_problem(old, Dataset(str(d))) is None  # the last shard grew
    write_jsonl(d / "b-2.jsonl", rows("c", 2))
    assert growth_problem(old, Dataset(str(d))) is None  # and a shard after it is new
    write_jsonl(d / "a-0.jsonl", rows("z", 1))  # sorts first: every index would move
    assert "are not its first 2" in str(growth_problem(old, Dataset(str(d))))
    os.unlink(d / "a-0.jsonl")
    append(str(d / "b-0.jsonl"), rows("a", 1, start=2))  # a row on an earlier shard
    assert "are not its first 2" in str(growth_problem(old, Dataset(str(d))))
    one = Dataset(str(d / "b-0.jsonl")).fingerprint
    assert "the run's dataset had 3" in str(growth_problem(
        {**old, "shards": 3}, Dataset(str(d / "b-0.jsonl"))))
    pq_ds = Dataset(write_parquet(tmp_path / "p.parquet", rows("p", 2)))
    assert "its format is parquet" in str(growth_problem(one, pq_ds))
    assert "predates shard digests" in str(growth_problem(
        {"url": "x", "size": 1, "format": "jsonl"}, Dataset(str(d / "b-0.jsonl"))))
    mix = tmp_path / "m.mixture.json"
    mix.write_text(json.dumps({"sources": [{"name": "b", "path": str(d / "b-0.jsonl")}]}))
    assert "mixture" in str(growth_problem(one, open_dataset(str(mix))))


def test_check_binding_takes_the_runs_own_dataset_and_a_fresh_run(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", rows("p", 2))
    ds = Dataset(data)
    assert check_binding(ds, None) is False
    assert check_binding(ds, {"next_index": 1, "fingerprint": ds.fingerprint},
                         grew=True) is False  # the run's dataset: nothing to continue
    append(data, rows("p", 1, start=2))
    grown = Dataset(data)
    assert check_binding(grown, {"next_index": 1, "fingerprint": ds.fingerprint},
                         grew=True) is True
    with pytest.raises(DatasetMismatch, match="--dataset-grew"):
        check_binding(grown, {"next_index": 1, "fingerprint": ds.fingerprint})
