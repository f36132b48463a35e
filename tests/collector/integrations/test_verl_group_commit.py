"""The verl queue's puts share their directory fsync (group commit,
``strawq.collector.integrations.verl.group_sync``), and a put is still durable when it
returns: checked on the commit's own order of events, and with a real process killed with
SIGKILL while many puts run at once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from strawq.collector.integrations.verl.group_sync import DirSync
from strawq.collector.integrations.verl.queue import (WRITERS, DurableSampleQueue,
                                                      StrawqMessageQueue)
from strawq.ondisk import records

REPO = str(Path(__file__).resolve().parents[3])


def test_a_put_returns_only_after_a_fsync_begun_after_its_rename() -> None:
    """A writer arriving while a fsync runs is not covered by it: it waits for the next one,
    which covers every writer that arrived meanwhile (one fsync for all of them)."""
    started: list[threading.Event] = []
    release: list[threading.Event] = []

    def sync() -> None:
        i = len(started)
        started.append(threading.Event())
        release.append(threading.Event())
        started[i].set()
        assert release[i].wait(30)

    ds = DirSync(sync)
    done = {k: threading.Event() for k in "abcd"}

    def writer(k: str) -> threading.Thread:
        def run() -> None:
            ds.wait()
            done[k].set()
        t = threading.Thread(target=run)
        t.start()
        return t

    threads = [writer("a")]
    while not started:  # a leads the first fsync
        threading.Event().wait(0.005)
    assert started[0].wait(30)
    threads += [writer("b"), writer("c"), writer("d")]  # renamed after it began
    while ds._written < 4:  # every writer has announced its rename
        threading.Event().wait(0.005)
    assert not any(e.is_set() for e in done.values())
    release[0].set()
    assert done["a"].wait(30)
    while len(started) < 2:  # one of b, c, d leads the second fsync
        threading.Event().wait(0.005)
    assert not any(done[k].is_set() for k in "bcd"), "covered by a fsync that began before"
    release[1].set()
    for t in threads:
        t.join(30)
    assert all(e.is_set() for e in done.values())
    assert ds.syncs == 2 and ds.covered == 4 and len(started) == 2


def test_a_failed_fsync_raises_and_the_writers_it_would_cover_make_their_own() -> None:
    calls = [0]

    def sync() -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise OSError(5, "EIO")

    ds = DirSync(sync)
    with pytest.raises(OSError):
        ds.wait()
    ds.wait()  # not covered by the failed one: makes its own
    assert calls[0] == 2 and ds.syncs == 1


def test_concurrent_puts_share_directory_fsyncs_and_keep_put_order(tmp_path: Path) -> None:
    q = DurableSampleQueue(str(tmp_path / "q"))
    barrier = threading.Barrier(8)

    def put(i: int) -> None:
        barrier.wait()
        for j in range(4):
            q.put(f"{i}-{j}".encode(), sample_id=f"s{i}_{j}")

    threads = [threading.Thread(target=put, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    syncs = q.stats()["dir_syncs"]
    assert syncs < 32, "every put made its own directory fsync"
    again = DurableSampleQueue(str(tmp_path / "q"))
    held = [got[0] for got in iter(again.get, None)]
    assert sorted(h.sample_id for h in held) == sorted(f"s{i}_{j}" for i in range(8)
                                                       for j in range(4))
    assert [h.seq for h in held] == sorted(h.seq for h in held)  # hand-outs in put order
    for i in range(8):  # one writer's puts keep its order
        mine = [h.sample_id for h in held if h.sample_id.startswith(f"s{i}_")]
        assert mine == [f"s{i}_{j}" for j in range(4)]


PUTTERS = """
import asyncio, sys
from strawq.collector.integrations.verl.queue import StrawqMessageQueue

async def main():
    mq = StrawqMessageQueue(None, 100000, path=sys.argv[1])
    async def put(w):
        for i in range(100000):
            await mq.put_sample(b"x" * 4096 + f"{w}/{i}".encode(), sample_id=f"w{w}_{i}")
            print(f"w{w}_{i}", flush=True)
    await asyncio.gather(*(put(w) for w in range(16)))

asyncio.run(main())
"""


@pytest.mark.process
@pytest.mark.slow
def test_killed_while_sixteen_puts_run_it_loses_no_returned_put_and_duplicates_none(
        tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", PUTTERS, str(tmp_path / "q")],
                            stdout=subprocess.PIPE, text=True, env={**os.environ,
                                                                     "PYTHONPATH": REPO})
    assert proc.stdout is not None
    returned = [proc.stdout.readline().strip() for _ in range(200)]
    os.kill(proc.pid, signal.SIGKILL)
    rest = proc.stdout.read().split()
    proc.wait()
    q = DurableSampleQueue(str(tmp_path / "q"))
    held = [got[0] for got in iter(q.get, None)]
    ids = [h.sample_id for h in held]
    assert set(returned + rest) <= set(ids)  # every put that returned survived
    assert len(ids) == len(set(ids))  # none twice
    assert [h.seq for h in held] == sorted(h.seq for h in held)
    for w in range(16):  # each writer's puts in its order, no gap before its last held
        mine = [int(s.split("_")[1]) for s in ids if s.startswith(f"w{w}_")]
        assert mine == list(range(len(mine)))


def _ids_in(data: Any) -> list[str]:
    """The sample ids a published record or batch file holds (from its first record)."""
    head = bytes(data[0]) if isinstance(data, (list, tuple)) else bytes(data)
    _, meta, _ = records.decode_meta_only(head)
    return list(meta["ids"]) if meta.get("verl") == "batch" else [meta["sample_id"]]


def _publishes(q: DurableSampleQueue, fail: str | None = None) -> list[tuple[str, list[str]]]:
    """Record (thread name, sample ids) of each publish of ``q``'s storage; a file holding
    sample ``fail`` raises OSError instead."""
    seen: list[tuple[str, list[str]]] = []
    publish = q.storage.publish

    def spy(key: str, data: Any, **kw: Any) -> None:
        ids = _ids_in(data)
        seen.append((threading.current_thread().name, ids))
        if fail is not None and fail in ids:
            raise OSError(28, "No space left on device")
        publish(key, data, **kw)

    q.storage.publish = spy  # type: ignore[method-assign]
    return seen


def test_concurrent_put_samples_reach_storage_in_batches_from_few_threads(
        tmp_path: Path) -> None:
    mq = StrawqMessageQueue(None, 1000, path=str(tmp_path / "q"))
    seen = _publishes(mq.q)

    async def main() -> list[bool]:
        return await asyncio.gather(*(mq.put_sample(f"s{i}".encode(), sample_id=f"s{i}")
                                      for i in range(32)))

    assert asyncio.run(main()) == [True] * 32
    stats = mq.q.stats()
    # one thread hop, one file and one trip to storage per batch of waiting puts
    assert stats["write_batches"] < 32
    assert stats["files_written"] == len(seen) == stats["write_batches"]
    assert len(os.listdir(tmp_path / "q" / "samples")) == len(seen) < 32
    assert sorted(i for _, ids in seen for i in ids) == sorted(f"s{i}" for i in range(32))
    assert len({thread for thread, _ in seen}) <= WRITERS
    assert stats["dir_syncs"] <= stats["write_batches"]
    again = DurableSampleQueue(str(tmp_path / "q"))
    assert [got[0].sample_id for got in iter(again.get, None)] == [f"s{i}" for i in range(32)]


def test_a_put_whose_write_fails_fails_with_its_file_alone_and_hand_outs_go_on(
        tmp_path: Path) -> None:
    mq = StrawqMessageQueue(None, 1000, path=str(tmp_path / "q"))
    seen = _publishes(mq.q, fail="s3")

    async def main() -> list[Any]:
        got = await asyncio.gather(*(mq.put_sample(f"s{i}".encode(), sample_id=f"s{i}")
                                     for i in range(8)), return_exceptions=True)
        out = []
        while mq.q.size():
            out.append((await mq.get_sample())[0])
        return [got, out]

    got, handed = asyncio.run(main())
    failed = next(ids for _, ids in seen if "s3" in ids)  # the puts of the file holding s3
    assert all(isinstance(got[i], OSError) for i in range(8) if f"s{i}" in failed)
    assert [g for i, g in enumerate(got) if f"s{i}" not in failed] == [True] * (8 - len(failed))
    assert handed == [f"s{i}".encode() for i in range(8) if f"s{i}" not in failed]
    for i in failed:  # their ids are free again: verl may put them again
        assert not mq.q.is_held(i)


def test_a_cancelled_put_whose_record_was_written_joins_the_queue(tmp_path: Path) -> None:
    mq = StrawqMessageQueue(None, 1000, path=str(tmp_path / "q"))
    gate = threading.Event()
    publish = mq.q.storage.publish

    def slow(key: str, data: Any, **kw: Any) -> None:
        gate.wait(30)
        publish(key, data, **kw)

    mq.q.storage.publish = slow  # type: ignore[method-assign]

    async def main() -> list[Any]:
        put = asyncio.ensure_future(mq.put_sample(b"a", sample_id="a"))
        await asyncio.sleep(0)  # the put has begun: its write waits at the gate
        put.cancel()
        gate.set()
        later = await mq.put_sample(b"b", sample_id="b")
        return [later, (await mq.get_sample())[0], (await mq.get_sample())[0]]

    assert asyncio.run(main()) == [True, b"a", b"b"]  # not stuck behind a put that ended
