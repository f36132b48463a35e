"""``strawq collector`` as an operator meets it: refusals, hints, and a clean finish."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from strawq.app.cli import main as cli_main
from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.trainer.reader import BatchReader
from strawq.data.dataset import Dataset
from tests.collector.helpers import SimProducer, make_run, write_dataset

FAST = ["--no-fsync", "--set", "batch_groups=2", "--set", "poll_interval_s=0.01",
        "--set", "gc_interval_s=0.05", "--set", "max_running=8", "--set", "max_ready=8"]


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_a_foreign_directory_is_refused_untouched(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("mine")
    ds = write_dataset(str(tmp_path / "ds.jsonl"), 2)
    before = _tree(home)
    assert cli_main(["collector", str(home), ds, *FAST]) == 1
    assert "no strawq run" in capsys.readouterr().err
    assert _tree(home) == before


def test_a_corrupt_run_meta_asks_for_the_queue_config(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    run = tmp_path / "run"
    make_run(str(run))
    ds = write_dataset(str(tmp_path / "ds.jsonl"), 2)
    with open(run / "run.meta", "r+b") as f:
        f.seek(40)
        f.write(b"\xff\xff\xff\xff")
    ckpt = tmp_path / "ckpt.json"
    ckpt.write_text(json.dumps({"format": 1, "batch_seq": 0, "version": 0,
                                "feeder": {"next_index": 1, "seq": 1, "fingerprint": None}}))
    assert cli_main(["collector", str(run), ds, "--checkpoint", str(ckpt), *FAST]) == 1
    err = capsys.readouterr().err
    assert "--queue-config" in err and "Traceback" not in err
    assert (run / "run.meta").exists()  # nothing was moved aside without the config


def test_a_refused_collector_writes_nothing_and_names_real_flags(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    q = make_run(str(run))
    ds = write_dataset(str(tmp_path / "ds.jsonl"), 2)
    holder = Collector(q, Dataset(ds), CollectorConfig())
    holder.start(wait=False)
    for leftover in (run / "tmp",):
        for f in leftover.iterdir():
            f.unlink()
        leftover.rmdir()
    before = _tree(run)
    assert cli_main(["collector", str(run), ds, "--no-wait", *FAST]) == 1
    err = capsys.readouterr().err
    assert "did not close" in err and "without --no-wait" in err
    assert _tree(run) == before


def test_a_reader_opens_a_run_without_writing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    make_run(str(run))
    if (run / "tmp").exists():
        (run / "tmp").rmdir()
    before = _tree(run)
    BatchReader.open(str(run)).close()
    assert _tree(run) == before


def _produce_and_train(q, stop: threading.Event, acks: bool = True) -> threading.Thread:
    def loop() -> None:
        p = SimProducer(q, "p", seed=3)
        reader = BatchReader(q, checkpointed=False)  # never restores: an ack is trained
        while not stop.is_set():
            p.step()
            if acks:
                try:
                    b = reader.next_batch(timeout=0.01)
                except Exception:  # noqa: BLE001 - BatchTimeout: nothing yet
                    continue
                reader.ack(b)
            stop.wait(0.002)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


@pytest.mark.timeout(120)
def test_max_steps_counts_published_batches(tmp_path: Path) -> None:
    run = tmp_path / "run"
    q = make_run(str(run))
    ds = write_dataset(str(tmp_path / "ds.jsonl"), 16)
    stop = threading.Event()
    t = _produce_and_train(q, stop, acks=False)
    try:
        assert cli_main(["collector", str(run), ds, "--max-steps", "1",
                         "--set", "max_prefetch_batches=4", *FAST]) == 0
    finally:
        stop.set()
        t.join(5)
    assert len(os.listdir(run / "batches")) == 1


@pytest.mark.timeout(120)
def test_a_finished_collector_leaves_no_batched_work_and_ignores_stray_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    q = make_run(str(run))
    (run / "pending" / "junk.txt").write_text("not a task")
    (run / "leased" / "junk.txt").write_text("not a task")
    ds = write_dataset(str(tmp_path / "ds.jsonl"), 6)
    stop = threading.Event()
    t = _produce_and_train(q, stop)
    try:
        assert cli_main(["collector", str(run), ds, "--max-passes", "20000", "--json",
                         *FAST]) == 0
    finally:
        stop.set()
        t.join(5)
    out = json.loads(capsys.readouterr().out)
    assert out["drained"], out
    assert cli_main(["status", str(run), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["counts"]["batched"] == 0 and st["batches_unacked"] == 0
    assert st["stray_files"] == ["pending/junk.txt", "leased/junk.txt"]
    assert os.listdir(run / "batches") == [] and os.listdir(run / "data") == []


def test_the_collector_collects_dead_writers_temporary_files(tmp_path: Path) -> None:
    import time

    run = tmp_path / "run"
    q = make_run(str(run))
    (run / "tmp").mkdir(exist_ok=True)
    old = run / "tmp" / "p-gone.otherhost-7.0123abcd"
    fresh = run / "tmp" / "p-live.otherhost-8.4567abcd"
    for f in (old, fresh):
        f.write_bytes(b"half a record")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    col = Collector(q, Dataset(write_dataset(str(tmp_path / "ds.jsonl"), 2)),
                    CollectorConfig(gc_interval_s=0.0))
    col.start(wait=False)
    try:
        rep = col.step()
    finally:
        col.close()
    assert rep.gc is not None and rep.gc.tmp == 1
    assert sorted(os.listdir(run / "tmp")) == [fresh.name]
