"""Datasets: shards (directory, glob, fsspec URL), chat rows, fingerprints, the dry run, and
the refusals that keep a cursor from being exhausted or skipped by mistake."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from strawq.config import QueueConfig
from strawq.data.binding import DatasetMismatch
from strawq.data.dataset import BadRow, Dataset, prompt_kind
from strawq.data.feeder import Feeder, preview_release
from strawq.errors import DatasetError
from strawq.storage import PosixStorage
from strawq.tasks.queue import RunQueue
from strawq.testing.audit import audit_run

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


def tid(i: int) -> str:
    return f"i{i:012d}"


def write_jsonl(path: Path, rows: list[Any]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_shards(d: Path, n_shards: int, per: int, *, row_group: int = 3) -> list[dict[str, Any]]:
    d.mkdir(parents=True, exist_ok=True)
    rows = []
    for s in range(n_shards):
        part = [{"prompt": CHAT + [{"role": "user", "content": f"q{s}-{j}"}],
                 "label": f"{s}-{j}"} for j in range(per)]
        pq.write_table(pa.Table.from_pylist(part), d / f"train-{s:05d}-of-{n_shards:05d}.parquet",
                       row_group_size=row_group)
        rows += part
    return rows


def make_queue(tmp_path: Path, **kw: Any) -> RunQueue:
    kw.setdefault("fsync", False)
    return RunQueue.create(PosixStorage(str(tmp_path / "run")), QueueConfig(**kw))


def good_rows(ds: Dataset, start: int = 0, count: int = 10_000) -> list[dict[str, Any]]:
    return [r for _, r in ds.read(start, count) if not isinstance(r, BadRow)]


def test_prompt_kinds() -> None:
    assert prompt_kind("hi") == "text" and prompt_kind([1, 2]) == "ids"
    assert prompt_kind(CHAT) == "chat"
    assert prompt_kind([{"role": "user", "content": [{"type": "text", "text": "x"}]}]) == "chat"
    for bad in ("", [], [1, -1], [True], [{"content": "no role"}], [{"role": "u", "content": 3}],
                [1, {"role": "user", "content": "x"}], None, 5):
        assert prompt_kind(bad) is None, bad


def test_directory_of_parquet_shards_reads_in_order(tmp_path: Path) -> None:
    rows = write_shards(tmp_path / "data", 4, 5)
    (tmp_path / "data" / "_SUCCESS").write_text("")
    (tmp_path / "data" / ".hidden.parquet").write_text("not parquet")
    (tmp_path / "data" / "README.md").write_text("ignored: not a dataset extension")
    ds = Dataset(str(tmp_path / "data"))
    assert ds.fmt == "parquet" and len(ds.shards) == 4 and len(ds) == 20
    assert good_rows(ds) == rows
    assert good_rows(ds, 7, 6) == rows[7:13]          # across a shard boundary
    assert [i for i, _ in ds.read(18, 10)] == [18, 19]
    glob = Dataset(str(tmp_path / "data" / "train-*.parquet"))
    assert good_rows(glob) == rows and glob.fingerprint["digest"] == ds.fingerprint["digest"]


def test_fsspec_url_of_jsonl_shards_and_stable_fingerprint(tmp_path: Path) -> None:
    fs = fsspec.filesystem("memory")
    for s in range(3):
        with fs.open(f"/ds/part-{s}.jsonl", "w") as f:
            f.write("".join(json.dumps({"prompt": f"p{s}.{j}"}) + "\n" for j in range(4)))
    ds = Dataset("memory://ds")
    assert ds.fmt == "jsonl" and len(ds) == 12
    assert [r["prompt"] for r in good_rows(ds)] == [f"p{s}.{j}" for s in range(3) for j in range(4)]
    # the same files under another root have the same fingerprint; other bytes do not
    fs.copy("/ds", "/mirror", recursive=True)
    assert Dataset("memory://mirror").fingerprint["digest"] == ds.fingerprint["digest"]
    with fs.open("/ds/part-2.jsonl", "a") as f:
        f.write(json.dumps({"prompt": "more"}) + "\n")
    assert Dataset("memory://ds").fingerprint["digest"] != ds.fingerprint["digest"]


def test_formats_that_cannot_be_read_are_refused(tmp_path: Path) -> None:
    (tmp_path / "d.csv").write_text("prompt\nhello\n")
    with pytest.raises(DatasetError, match="CSV is not supported"):
        Dataset(str(tmp_path / "d.csv"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no JSONL or Parquet"):
        Dataset(str(tmp_path / "empty"))
    mixed = tmp_path / "mixed"
    write_shards(mixed, 1, 2)
    write_jsonl(mixed / "b.jsonl", [{"prompt": "x"}])
    with pytest.raises(DatasetError, match="mixes formats"):
        Dataset(str(mixed))
    txt = write_jsonl(tmp_path / "rows.txt", [{"prompt": "x"}])
    assert Dataset(txt, fmt="jsonl").fmt == "jsonl"


def test_chat_rows_are_released_and_bad_chat_rows_dropped(tmp_path: Path) -> None:
    rows = [{"prompt": CHAT}, {"prompt": [{"role": "user"}]}, {"prompt": "text"},
            {"prompt": [{"content": "no role"}]}, {"prompt": [7, 8]}]
    q = make_queue(tmp_path)
    f = Feeder(q, Dataset(write_jsonl(tmp_path / "d.jsonl", rows)))
    assert f.release(10) == 5
    audit = audit_run(q.storage)
    assert audit.check([tid(i) for i in range(5)]) == []
    assert audit.ids("dropped") == {tid(3)}  # a message without content is valid (tool calls)
    leased = {lease.task_id: lease.task["row"] for lease in q.claim("p", 10)}
    assert leased[tid(0)] == {"prompt": CHAT}


def test_dry_run_reports_without_moving_the_cursor(tmp_path: Path) -> None:
    rows = [{"prompt": "a"}, {"prompt": ""}, {"prompt": CHAT}, {"prompt": [1]}, {"nope": 1}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    q = make_queue(tmp_path)
    before = sorted(q.storage.list("cursor"))
    p = preview_release(q, Dataset(data), 4)
    assert (p.start, p.end, p.good, p.exhausted, p.refused) == (0, 4, 3, False, None)
    assert [b.index for b in p.bad] == [1] and p.kinds == {"text": 1, "chat": 1, "ids": 1}
    assert "would release 3 rows and drop 1 bad rows" in p.describe()
    assert sorted(q.storage.list("cursor")) == before and not q.list_pending()
    f = Feeder(q, Dataset(data))
    assert f.release(2) == 2
    p = preview_release(q, Dataset(data), 10)
    assert (p.start, p.end, p.good, len(p.bad), p.exhausted) == (2, 5, 2, 1, True)
    assert f.cursor.next_index == 2


def test_the_wrong_file_is_refused_and_cannot_exhaust_the_cursor(tmp_path: Path) -> None:
    right = write_jsonl(tmp_path / "right.jsonl", [{"prompt": f"p{i}"} for i in range(20)])
    wrong = write_jsonl(tmp_path / "wrong.jsonl", [{"prompt": f"w{i}"} for i in range(5)])
    q = make_queue(tmp_path)
    assert Feeder(q, Dataset(right)).release(10) == 10
    with pytest.raises(DatasetMismatch, match="not the run's dataset.*switch_dataset"):
        Feeder(q, Dataset(wrong))
    p = preview_release(q, Dataset(wrong), 5)
    assert p.refused is not None and "not the run's dataset" in p.refused
    f = Feeder(q, Dataset(right))  # the run's dataset still releases where it stopped
    assert f.release(10) == 10 and f.cursor.next_index == 20 and not f.exhausted
    # the end of the right dataset exhausts the cursor, as it should
    assert f.release(1) == 0 and f.exhausted
    assert audit_run(q.storage).check([tid(i) for i in range(20)]) == []


def test_switching_datasets_on_purpose_continues_the_index_space(tmp_path: Path) -> None:
    first = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}"} for i in range(3)])
    second = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}"} for i in range(6)])
    q = make_queue(tmp_path)
    f = Feeder(q, Dataset(first))
    assert f.release(5) == 3 and f.exhausted
    g = Feeder(q, Dataset(second), check_dataset=False)
    cur = g.switch_dataset(start_row=2)
    assert cur.next_index == 3 and not cur.exhausted and cur.fingerprint["base"] == 1
    assert g.release(10) == 4 and g.exhausted
    with pytest.raises(DatasetMismatch):
        Feeder(q, Dataset(first))
    rows = {lease.task_id: lease.task["row"]["prompt"] for lease in q.claim("p", 20)}
    assert rows == {tid(0): "a0", tid(1): "a1", tid(2): "a2", tid(3): "b2", tid(4): "b3",
                    tid(5): "b4", tid(6): "b5"}
    h = Feeder(q, Dataset(second))  # the switched-to dataset is now the run's
    assert h.cursor.next_index == 7 and h.release(1) == 0


def test_the_runs_prompt_key_wins(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"question": "x", "prompt": "y"}])
    q = make_queue(tmp_path, prompt_key="question")
    with pytest.raises(DatasetMismatch, match="the run's key wins"):
        Feeder(q, Dataset(data))
    with pytest.raises(DatasetMismatch, match="prompt_key"):
        preview_release(q, Dataset(data))
    assert Feeder(q, Dataset(data, prompt_key="question")).release(1) == 1


@pytest.mark.process
def test_release_dry_run_cli(tmp_path: Path) -> None:
    run = tmp_path / "run"
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": 3}, {"prompt": CHAT}])
    cli = [sys.executable, "-m", "strawq"]
    subprocess.run(cli + ["init", str(run)], check=True, capture_output=True)
    out = subprocess.run(cli + ["release", str(run), data, "--dry-run", "--json"],
                         check=True, capture_output=True, text=True).stdout
    rep = json.loads(out)
    assert (rep["would_release"], rep["would_drop"], rep["would_move_to"]) == (2, 1, 3)
    assert rep["bad_rows"][0]["index"] == 1
    status = subprocess.run(cli + ["release", str(run), data, "--count", "1"], check=True,
                            capture_output=True, text=True).stdout
    assert "cursor at index 1" in status
    other = write_jsonl(tmp_path / "o.jsonl", [{"prompt": "zzz"}])
    r = subprocess.run(cli + ["release", str(run), other, "--dry-run"], capture_output=True,
                       text=True)
    assert r.returncode == 1 and "not the run's dataset" in r.stdout
    r = subprocess.run(cli + ["release", str(run), other], capture_output=True, text=True)
    assert r.returncode != 0 and "not the run's dataset" in r.stderr


def test_a_checkpointed_cursor_restores_on_the_same_dataset_only(tmp_path: Path) -> None:
    first = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}"} for i in range(2)])
    second = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}"} for i in range(5)])
    q = make_queue(tmp_path)
    Feeder(q, Dataset(first)).release(2)
    f = Feeder(q, Dataset(second), check_dataset=False)
    f.switch_dataset(start_row=1)
    assert f.release(1) == 1
    state = f.state_dict()
    assert state["next_index"] == 3 and state["fingerprint"]["base"] == 1
    fresh = RunQueue.create(PosixStorage(str(tmp_path / "run2")), QueueConfig(fsync=False))
    with pytest.raises(DatasetMismatch):
        Feeder(fresh, Dataset(first)).load_state_dict(state)
    g = Feeder(fresh, Dataset(second))
    g.load_state_dict(state)
    assert g.release(10) == 3
    rows = {lease.task_id: lease.task["row"]["prompt"] for lease in fresh.claim("p", 10)}
    assert rows == {tid(3): "b2", tid(4): "b3", tid(5): "b4"}


def test_collector_cli_takes_the_runs_prompt_key(tmp_path: Path) -> None:
    import argparse

    from strawq.collector.cli import _prompt_key
    from strawq.config import from_dict
    from strawq.errors import ConfigError

    make_queue(tmp_path, prompt_key="question")
    path = str(tmp_path / "run")

    def key(cfg: dict[str, Any] | None) -> str:
        qc_path = None
        if cfg is not None:
            qc_path = str(tmp_path / "qc.json")
            Path(qc_path).write_text(json.dumps(cfg))
        qc = None if cfg is None else from_dict(QueueConfig, cfg)
        return _prompt_key(argparse.Namespace(path=path, queue_config=qc_path), qc)

    assert key(None) == "question"
    assert key({"group_size": 4}) == "question"  # a queue config without prompt_key
    assert key({"prompt_key": "question"}) == "question"
    with pytest.raises(ConfigError, match="the run's key wins"):
        key({"prompt_key": "prompt"})
    path = str(tmp_path / "new-run")
    assert key({"prompt_key": "q2"}) == "q2" and key(None) == "prompt"
