"""A dataset mistake is refused before it binds the run: a dataset without rows (an empty
file, blank lines, a Parquet file of 0 rows, a shard set of such files, a mixture source
that is one), with one message, exit 1 and nothing written."""

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
from strawq.dataset import Dataset, EmptyDataset
from strawq.errors import DatasetError
from strawq.feeder import Feeder
from strawq.queue import RunQueue
from strawq.storage import PosixStorage
from strawq.testing import write_jsonl


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
