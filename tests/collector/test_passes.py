"""Several passes over the dataset through the collector (``queue.num_epochs``): every row
trained once per pass, the run ends after the last pass, and a cursor resume from a
checkpoint taken in a later pass keeps counting passes from where it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from strawq.collector.config import CollectorConfig
from strawq.collector.core import Collector
from strawq.collector.trainer.reader import BatchReader
from strawq.config import QueueConfig
from strawq.data.dataset import Dataset
from tests.collector.helpers import SimProducer, train_until_drained, write_dataset

N = 6
PASSES = 3
CFG = CollectorConfig(batch_groups=2, max_running=4, max_ready=4, max_prefetch_batches=2,
                      max_staleness=None, poll_interval_s=0, gc_interval_s=0,
                      takeover_timeout_s=0.05, metrics_interval_s=0.0)
QCFG = QueueConfig(fsync=False, lease_timeout_s=2.0, heartbeat_interval_s=0.2,  # type: ignore
                   release_batch=4, group_size=4, num_epochs=PASSES)


def _rows(batch) -> list[int]:  # type: ignore[no-untyped-def]
    # the task index runs on across passes; the dataset row is index mod N here (base 0)
    return [int(s["index"]) for s in batch.summaries]


def _run(col: Collector, reader: BatchReader, prod: SimProducer, trained: list[int],
         stop_after: int | None = None) -> bool:
    """Drive to the end (True) or until ``stop_after`` rows are trained (False)."""
    def on_batch(b: Any) -> bool:
        trained.extend(_rows(b))
        return stop_after is not None and len(trained) >= stop_after
    return train_until_drained(col, prod, reader, on_batch)


@pytest.mark.timeout(120)
def test_every_row_is_trained_once_per_pass_and_the_run_ends_after_the_last(
        tmp_path: Path) -> None:
    ds = Dataset(write_dataset(str(tmp_path / "ds.jsonl"), N))
    metrics = tmp_path / "m.jsonl"
    col = Collector.open(str(tmp_path / "run"), ds,
                         CollectorConfig(**{**CFG.to_dict(), "metrics_jsonl": str(metrics)}),
                         queue_config=QCFG, fsync=False)
    trained: list[int] = []
    assert _run(col, BatchReader(col.queue), SimProducer(col.queue, "p0", seed=1), trained)
    col.close()
    assert sorted(trained) == list(range(PASSES * N))
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert sorted({v["dataset/pass"] for v in lines}) == list(range(PASSES))


@pytest.mark.timeout(120)
def test_a_cursor_resume_in_a_later_pass_keeps_its_pass_count(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    ds = Dataset(write_dataset(str(tmp_path / "ds.jsonl"), N))
    col = Collector.open(run, ds, CFG, queue_config=QCFG, fsync=False)
    reader = BatchReader(col.queue)
    trained: list[int] = []
    assert not _run(col, reader, SimProducer(col.queue, "p0", seed=1), trained,
                    stop_after=N + 2)
    ckpt = json.loads(json.dumps(reader.state_dict()))
    assert ckpt["feeder"]["epoch_bases"] == [0, N], ckpt["feeder"]
    col.close()
    shutil.rmtree(run)  # the queue state is lost: resume from the checkpoint's cursor
    col2 = Collector.open(run, ds, CFG, queue_config=QCFG, checkpoint=ckpt, fsync=False)
    assert col2.resume_info is not None and col2.resume_info.path == "cursor"
    reader2 = BatchReader(col2.queue)
    reader2.load_state_dict(ckpt)
    assert _run(col2, reader2, SimProducer(col2.queue, "p1", seed=5), trained)
    # three passes in all, not three more after the resume
    assert sorted(trained) == list(range(PASSES * N))
