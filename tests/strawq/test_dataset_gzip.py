"""gzip'd JSONL (``.jsonl.gz``, ``.json.gz``, ``.ndjson.gz``) read by its extension: its
length, its rows from any index, a bad row's line, a directory mixing plain and gzip'd
shards, a damaged file, and a release through the command line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from strawq.app.cli import main as cli_main
from strawq.config import QueueConfig
from strawq.data.cursor import list_cursors
from strawq.data.dataset import BadRow, Dataset
from strawq.errors import DatasetError
from strawq.ondisk import records
from strawq.storage import PosixStorage
from strawq.tasks.queue import RunQueue
from strawq.testing import write_jsonl


def rows(name: str, n: int, start: int = 0) -> list[dict[str, Any]]:
    return [{"prompt": f"{name}{i}"} for i in range(start, start + n)]


def write_gz(path: Path, lines: list[Any]) -> str:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for r in lines:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


@pytest.mark.parametrize("ext", [".jsonl.gz", ".json.gz", ".ndjson.gz", ".JSONL.GZ"])
def test_gzipped_jsonl_is_read_by_its_extension(tmp_path: Path, ext: str) -> None:
    path = write_gz(tmp_path / f"d{ext}", [*rows("p", 2), "", "{broken", *rows("p", 1, 2)])
    ds = Dataset(path)
    assert ds.fmt == "jsonl" and ds.fingerprint["format"] == "jsonl"
    assert ds.shards[0].compression == "gzip" and len(ds) == 4
    got = ds.read(0, 10)
    assert [r["prompt"] for _, r in got if not isinstance(r, BadRow)] == ["p0", "p1", "p2"]
    (_, bad), = [(i, r) for i, r in got if isinstance(r, BadRow)]
    assert (bad.index, bad.line, bad.shard) == (2, 4, path)  # the blank line 3 is counted
    assert bad.message.startswith(f"{path} line 4: invalid JSON")
    assert [i for i, _ in ds.read(3, 5)] == [3]  # reading from a row inside the file


def test_a_directory_mixing_jsonl_and_gzipped_jsonl(tmp_path: Path) -> None:
    d = tmp_path / "data"
    d.mkdir()
    write_jsonl(d / "part-0.jsonl", rows("a", 2))
    write_gz(d / "part-1.jsonl.gz", rows("b", 3))
    write_jsonl(d / "part-2.ndjson", rows("c", 1))
    (d / "notes.txt.gz").write_bytes(gzip.compress(b"not a dataset"))
    ds = Dataset(str(d))
    assert [(s.rel, s.compression) for s in ds.shards] == [
        ("part-0.jsonl", None), ("part-1.jsonl.gz", "gzip"), ("part-2.ndjson", None)]
    assert len(ds) == 6
    assert [r["prompt"] for _, r in ds.read(1, 10) if not isinstance(r, BadRow)] == [
        "a1", "b0", "b1", "b2", "c0"]
    (d / "part-3.jsonl.gz").write_bytes(gzip.compress(b'{"prompt": "d0"}\n')[:-12])
    with pytest.raises(DatasetError, match="part-3.jsonl.gz: not a readable gzip file"):
        Dataset(str(d)).read(6, 1)


def test_release_of_a_gzipped_file_drops_its_bad_row_by_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = str(tmp_path / "run")
    RunQueue.create(PosixStorage(run), QueueConfig(fsync=False))
    data = write_gz(tmp_path / "d.jsonl.gz", [*rows("p", 3), "", "{broken"])
    assert cli_main(["release", run, data, "--max-bad-row-share", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["released"], out["dropped_bad_rows"], out["next_index"]) == (3, 1, 4)
    storage = PosixStorage(run)
    (name,) = storage.list("dropped")
    rec = records.decode(storage.read(f"dropped/{name}"))
    assert rec.meta["summary"]["line"] == 5 and "d.jsonl.gz line 5" in rec.meta["message"]
    assert len(list_cursors(storage)) == 1
