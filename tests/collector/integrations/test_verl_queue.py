"""The durable verl queue without Ray: ``DurableSampleQueue``, ``StrawqMessageQueue``'s verl
contract, and verl's partial rollout on strawq (``docs/verl.md``).

Crashes are real: a process holding the queue, or one resuming a partial rollout through
verl's own ``FullyAsyncLLMServerClient`` loop, is killed with SIGKILL. The Ray tests (the
queue as verl's actor, rollout worker and trainer killed) are ``test_verl_queue_ray.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from strawq.collector.integrations.verl.partial import PartialStore, Prefix, prompt_key
from strawq.collector.integrations.verl.queue import (DurableSampleQueue, StrawqMessageQueue,
                                                      queue_dir, sample_identity,
                                                      strawq_settings)
from strawq.collector.integrations.verl.samples import batch_name
from strawq.errors import ConfigError
from strawq.ondisk import records
from strawq.ondisk.records import Kind
from strawq.storage import PosixStorage
from strawq.testing.faults import CrashPoint, FaultyStorage

REPO = str(Path(__file__).resolve().parents[3])


def until(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.02)


def config(tmp: Path, **training: Any) -> dict[str, Any]:
    return {"trainer": {"default_local_dir": str(tmp / "ckpt"), "resume_mode": "auto"},
            "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 2}},
            "async_training": {"require_batches": 1, "trigger_parameter_sync_step": 2,
                               **training}}


def drain(q: DurableSampleQueue) -> list[str]:
    out = []
    while (got := q.get()) is not None:
        out.append(got[1].decode())
    return out


# -- the durable FIFO ------------------------------------------------------------------------
def test_uncommitted_gets_are_handed_out_again_in_order(tmp_path: Path) -> None:
    q = DurableSampleQueue(str(tmp_path))
    for i in range(10):
        assert q.put(f"s{i}".encode(), sample_id=f"s{i}")
    assert [q.get()[1] for _ in range(6)] == [f"s{i}".encode() for i in range(6)]  # type: ignore[index]
    assert q.commit(4) == 4
    again = DurableSampleQueue(str(tmp_path))  # the queue's process started again
    assert (again.consumed, again.size()) == (4, 6)
    assert drain(again) == [f"s{i}" for i in range(4, 10)]


def test_a_stray_file_in_commits_neither_hides_nor_deletes_the_newest_commit(
        tmp_path: Path) -> None:
    """``commits/`` holds numbered names only: a file someone left there (a note, a copy)
    is ignored on restart, never taken for the newest commit or counted for pruning, so
    the real newest commit is neither skipped nor deleted (its samples would be handed out
    and trained again)."""
    q = DurableSampleQueue(str(tmp_path), keep_commits=1)
    for i in range(4):
        q.put(f"s{i}".encode(), sample_id=f"s{i}")
    assert [q.get()[1] for _ in range(2)] == [b"s0", b"s1"]  # type: ignore[index]
    assert q.commit(2) == 2
    (tmp_path / "commits" / "notes.txt").write_text("a stray file")
    (tmp_path / "samples" / "README").write_text("a stray file")
    again = DurableSampleQueue(str(tmp_path), keep_commits=1)
    assert (again.consumed, again.size()) == (2, 2)
    assert sorted(p.name for p in (tmp_path / "commits").iterdir()) == [
        f"{2:012d}", "notes.txt"]
    assert again.commit(3) == 1  # the next commit prunes the old one, not the stray file
    assert sorted(p.name for p in (tmp_path / "commits").iterdir()) == [
        f"{3:012d}", "notes.txt"]
    assert drain(again) == ["s3"]


def test_a_commit_from_an_earlier_life_covers_the_oldest_samples(tmp_path: Path) -> None:
    """The queue died after handing out 6 and before it saw the checkpoint of 4: the commit
    it reads after the restart covers the 4 oldest samples still on disk."""
    q = DurableSampleQueue(str(tmp_path))
    for i in range(8):
        q.put(f"s{i}".encode(), sample_id=f"s{i}")
    for _ in range(6):
        q.get()
    again = DurableSampleQueue(str(tmp_path))
    assert again.commit(4) == 4
    assert drain(again) == ["s4", "s5", "s6", "s7"]


def test_duplicate_ids_are_kept_once_even_after_their_commit(tmp_path: Path) -> None:
    q = DurableSampleQueue(str(tmp_path))
    q.put(b"a", sample_id="sample_0_1")
    assert q.put(b"a again", sample_id="sample_0_1") and q.duplicates == 1
    q.get()
    q.commit(1)
    again = DurableSampleQueue(str(tmp_path))
    assert again.put(b"a re-put", sample_id="sample_0_1") and again.size() == 0
    assert again.is_held("sample_0_1") and not again.is_held("sample_0_2")


def test_a_full_queue_drops_its_oldest_with_a_reason(tmp_path: Path) -> None:
    """verl's own overflow rule (put returns False, the oldest goes), recorded on disk."""
    q = DurableSampleQueue(str(tmp_path), max_size=2)
    assert q.put(b"0", sample_id="s0") and q.put(b"1", sample_id="s1")
    assert not q.put(b"2", sample_id="s2")
    assert os.listdir(tmp_path / "drops") == ["000000000000~s0~queue_full"]
    assert drain(DurableSampleQueue(str(tmp_path), max_size=2)) == ["1", "2"]


def test_a_torn_or_corrupt_sample_is_dropped_not_handed_out(tmp_path: Path) -> None:
    q = DurableSampleQueue(str(tmp_path))
    q.put(b"good", sample_id="s0")
    q.put(b"bad", sample_id="s1")
    with open(tmp_path / "samples" / "000000000001~s1", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"X")
    assert drain(DurableSampleQueue(str(tmp_path))) == ["good"]
    assert os.listdir(tmp_path / "drops") == ["000000000001~s1~corrupt"]


def test_bad_input_says_what_was_expected(tmp_path: Path) -> None:
    q = DurableSampleQueue(str(tmp_path))
    with pytest.raises(TypeError, match="RolloutSample"):
        q.put("not bytes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="strawq_queue_dir"):
        queue_dir({"trainer": {}})


PUTTER = """
import sys
from strawq.collector.integrations.verl.queue import DurableSampleQueue
q = DurableSampleQueue(sys.argv[1])
for i in range(100000):
    q.put(b"x" * 4096 + str(i).encode(), sample_id=f"sample_0_{i}")
    print(f"sample_0_{i}", flush=True)
"""


@pytest.mark.process
def test_the_process_holding_the_queue_killed_mid_put_loses_no_returned_put(
        tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", PUTTER, str(tmp_path / "q")],
                            stdout=subprocess.PIPE, text=True, env={**os.environ,
                                                                     "PYTHONPATH": REPO})
    assert proc.stdout is not None
    returned = [proc.stdout.readline().strip() for _ in range(40)]
    os.kill(proc.pid, signal.SIGKILL)
    rest = proc.stdout.read().split()
    proc.wait()
    q = DurableSampleQueue(str(tmp_path / "q"))
    held = [got[0].sample_id for got in iter(q.get, None)]
    assert set(returned + rest) <= set(held)
    assert held == [f"sample_0_{i}" for i in range(len(held))]  # in order, no gap, no tear


# -- verl's MessageQueue contract ------------------------------------------------------------
def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_verls_checkpoint_tracker_commits_what_it_covers(tmp_path: Path) -> None:
    """The tracker moves between two of verl's steps: the gets handed out when the queue
    sees it are the checkpoint's (here version 1 after two steps of 2 gets)."""
    cfg = config(tmp_path)

    async def go() -> None:
        mq = StrawqMessageQueue(cfg, 100)
        for i in range(10):
            assert await mq.put_sample(f"s{i}".encode(), sample_id=f"s{i}")
        got = [(await mq.get_sample())[0] for _ in range(4)]
        (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("1")
        got += [(await mq.get_sample())[0] for _ in range(2)]  # the next step's gets
        assert got == [f"s{i}".encode() for i in range(6)]
        s = await mq.get_statistics()
        assert (s["committed"], s["leased"], s["queue_size"]) == (4, 2, 4)

    os.makedirs(tmp_path / "ckpt")
    _run(go())

    async def restart() -> list[bytes]:
        mq = StrawqMessageQueue(cfg, 100)
        await mq.put_sample(None)  # verl's end of stream: in memory, after what is queued
        out = []
        while (got := await mq.get_sample())[0] is not None:
            out.append(got[0])
        return out

    assert _run(restart()) == [f"s{i}".encode() for i in range(4, 10)]


def test_a_checkpoint_verl_forces_mid_version_commits_every_get_it_holds(
        tmp_path: Path) -> None:
    """verl's own checkpoint cadence (``_fit_update_local_step``, ``_fit_save_checkpoint``,
    ``_save_checkpoint``): trigger 2, save_freq 2, three steps of 2 gets, then ``fit``'s
    forced save lands inside version 2 (it is checkpoint 1 holding 6 gets) and verl's task
    runner calls ``clear_queue``. The queue commits the 6, not 1 version × 4: after a
    restart the third step's samples are not handed out (and trained) again."""
    pytest.importorskip("verl")
    from omegaconf import OmegaConf
    from unittest import mock
    from verl.experimental.fully_async_policy import fully_async_trainer as fat

    from strawq.testing.verl_loop import ActorGroup, Rollouter, _ray_get

    cfg = config(tmp_path)
    ckpt = tmp_path / "ckpt"
    t = object.__new__(fat.FullyAsyncTrainer.__ray_actor_class__)
    t.__dict__.update(
        config=OmegaConf.create({"trainer": {
            "default_local_dir": str(ckpt), "default_hdfs_dir": None, "save_freq": 2,
            "esi_redundant_time": 0}}),
        current_param_version=0, local_trigger_step=1, trigger_parameter_sync_step=2,
        last_ckpt_version=0, max_steps_duration=0, timing_raw={}, global_steps=1,
        use_critic=False, rollouter=Rollouter(),
        actor_rollout_wg=ActorGroup(torch_module(), None, 0.0, lambda: None))

    async def go() -> list[bytes]:
        mq = StrawqMessageQueue(cfg, 100)
        for i in range(10):
            await mq.put_sample(f"s{i}".encode(), sample_id=f"s{i}")
        got = []
        with mock.patch.object(fat, "ray", mock.Mock(get=_ray_get)):
            for _step in range(3):  # verl's fit_step, as far as the queue and saves go
                got += [(await mq.get_sample())[0] for _ in range(2)]
                t._fit_update_local_step()
                t._fit_save_checkpoint()
            t._fit_save_checkpoint(force=True)  # the end of verl's fit
        await mq.clear_queue()  # verl's task runner, in its finally
        return got

    assert _run(go()) == [f"s{i}".encode() for i in range(6)]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1"

    async def restart() -> list[bytes]:
        mq = StrawqMessageQueue(cfg, 100)
        return [(await mq.get_sample())[0] for _ in range(4)]

    assert _run(restart()) == [f"s{i}".encode() for i in range(6, 10)]


def torch_module() -> Any:
    import torch

    return torch.nn.Linear(1, 1)


def test_rewind_hands_leases_out_again_and_ends_stale_waiters(tmp_path: Path) -> None:
    async def go() -> None:
        mq = StrawqMessageQueue(config(tmp_path), 100)
        await mq.put_sample(b"a", sample_id="a")
        assert (await mq.get_sample())[0] == b"a"
        waiter = asyncio.create_task(mq.get_sample())  # the dead trainer's pending get
        await asyncio.sleep(0)
        assert await mq.rewind() == 1
        assert await waiter is None
        assert (await mq.get_sample())[0] == b"a"

    _run(go())


def test_clear_queue_keeps_the_durable_samples(tmp_path: Path) -> None:
    """verl's task runner calls clear_queue in a ``finally`` after any failure."""
    cfg = config(tmp_path)

    async def go() -> int:
        mq = StrawqMessageQueue(cfg, 100)
        await mq.put_sample(b"a", sample_id="a")
        await mq.clear_queue()
        return int(await StrawqMessageQueue(cfg, 100).get_queue_size())

    assert _run(go()) == 1


def test_resume_disabled_refuses_an_earlier_runs_queue(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    _run(StrawqMessageQueue(cfg, 10).put_sample(b"a", sample_id="a"))
    cfg["trainer"]["resume_mode"] = "disable"
    with pytest.raises(ConfigError, match="resume_mode=disable"):
        StrawqMessageQueue(cfg, 10)


@pytest.mark.slow  # imports verl
def test_sample_identity_reads_a_real_rollout_sample_without_unpickling() -> None:
    pytest.importorskip("verl")
    from tests.collector.integrations.verl_helpers import blob

    assert sample_identity(blob(7, epoch=2)) == ("sample_2_7", 2)
    assert sample_identity(b"not a pickle") == (None, None)


@pytest.mark.slow  # imports verl
def test_sample_identity_reads_only_the_pickles_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    """A put's identity costs the actor a dozen opcodes, not the whole pickle (issue 40)."""
    pytest.importorskip("verl")
    import pickle
    import pickletools

    from strawq.collector.integrations.verl import samples as samples_mod
    from tests.collector.integrations.verl_helpers import blob

    real = pickletools.genops
    seen: list[int] = []

    def counting(data: Any) -> Any:
        for item in real(data):
            seen.append(1)
            yield item

    monkeypatch.setattr(samples_mod.pickletools, "genops", counting)
    sample = blob(7, epoch=2)
    assert sample_identity(sample) == ("sample_2_7", 2)
    assert 0 < len(seen) < 30, len(seen)
    # a key's bytes inside a payload after the real key: read from the start, as before
    tricky = pickle.dumps({"sample_id": "a", "epoch": 1, "z": b"\x8c\x09sample_id\x8c\x01b"},
                          protocol=5)
    assert sample_identity(tricky) == ("a", 1)


def test_verls_staleness_settings_are_strawqs_admission_window(tmp_path: Path) -> None:
    """verl's own bound (the Rollouter's max_required_samples, read from its source formula)
    equals strawq's window (η + 1)·u·B, fractional thresholds included."""
    cfg = config(tmp_path, staleness_threshold=0.5, partial_rollout=True)
    cfg["actor_rollout_ref"]["rollout"] = {"n": 8}
    s = strawq_settings(cfg)
    required, trig = 2, 2
    assert s["max_queue_size"] == int(required * (0.5 + 1) * trig) == 6
    assert (s["batch_groups"], s["batches_per_version"], s["admission_batches"]) == (2, 2, 3.0)
    assert (s["max_staleness"], s["group_size"], s["partial_rollout"]) == (1, 8, True)
    cfg["async_training"]["staleness_threshold"] = -1
    with pytest.raises(ConfigError, match="staleness_threshold"):
        strawq_settings(cfg)


# -- verl's partial rollout ------------------------------------------------------------------
def test_a_saved_prefix_is_claimed_once_and_returned_by_recovery(tmp_path: Path) -> None:
    store = PartialStore(PosixStorage(str(tmp_path)))
    key = prompt_key([1, 2, 3])
    p = Prefix(prompt_ids=[1, 2, 3])
    p.extend([7, 8], [-0.1, -0.2], 4)
    p.extend([9], [-0.3], 5)
    held = store.save(key, p)
    assert store.claim(key) is None  # held by its live request
    assert store.recover() == 1  # the job started again: nobody holds it
    got = store.claim(key)
    assert got is not None and store.claim(key) is None
    assert (got[1].tokens, got[1].versions) == ([7, 8, 9], [4, 4, 5])
    assert got[1].logprobs == pytest.approx([-0.1, -0.2, -0.3])
    store.finish(got[0])
    assert store.count() == {"partials": 0, "held": 0} and held


@pytest.mark.slow  # two processes import verl
def test_verls_resume_loop_continues_a_prefix_a_killed_process_saved(tmp_path: Path) -> None:
    """verl's FullyAsyncLLMServerClient loop aborts at a parameter sync (the pause file),
    saves the prefix through strawq, and is killed while it waits to resume; the next
    process's request for the same prompt continues that prefix: the same tokens as an
    uninterrupted run, each with the version it was sampled under."""
    pytest.importorskip("verl")
    qdir, sdir = tmp_path / "q", tmp_path / "engine"
    sdir.mkdir()
    (sdir / "version").write_text("3")
    (sdir / "pause").write_text("")
    script = str(Path(__file__).with_name("verl_engine.py"))
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen([sys.executable, script, str(qdir), str(sdir), "8"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    until(lambda: (qdir / "held").is_dir() and bool(os.listdir(qdir / "held")),
          "the first abort's prefix", timeout=120)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    store = PartialStore(PosixStorage(str(qdir)))
    assert store.recover() == 1
    (sdir / "pause").unlink()
    (sdir / "version").write_text("4")
    r = subprocess.run([sys.executable, script, str(qdir), str(sdir), "8"], env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    from tests.collector.integrations.verl_engine import token

    assert out["tokens"] == [token([5, 6, 7], i) for i in range(8)]
    assert out["log_probs"] == pytest.approx([-i / 1000 for i in range(8)])
    assert out["extra"] == {"min_global_steps": 3, "max_global_steps": 4,
                            "token_versions": [3, 3, 3, 4, 4, 4, 4, 4]}
    assert store.count() == {"partials": 0, "held": 0}


# -- batch files: the puts of one write in one file (issue 40) --------------------------------
def _write(q: DurableSampleQueue, ids: list[str]) -> list[bool]:
    """``ids`` put as one batch (``begin`` each, one ``write``, ``finish`` each)."""
    pending = [q.begin(i.encode(), sample_id=i) for i in ids]
    assert all(p is not None for p in pending)
    assert q.write([p for p in pending if p is not None]) == [None] * len(ids)
    return [q.finish(p) for p in pending if p is not None]


def _samples(path: Path) -> list[str]:
    return sorted(p.name for p in (path / "samples").iterdir())


def test_a_batch_of_puts_is_one_file_and_durable_when_write_returns(tmp_path: Path) -> None:
    q = DurableSampleQueue(str(tmp_path))
    pending = [q.begin(f"s{i}".encode(), sample_id=f"s{i}") for i in range(5)]
    assert q.write([p for p in pending if p is not None]) == [None] * 5
    assert _samples(tmp_path) == [batch_name(0, 4)]  # one create, fsync, rename for all
    assert q.stats()["files_written"] == 1
    # durable before finish: a queue started on the directory now holds all five
    again = DurableSampleQueue(str(tmp_path))
    assert drain(again) == [f"s{i}" for i in range(5)]
    assert again.put(b"again", sample_id="s3") and again.duplicates == 1  # ids in the file
    assert again.put(b"new", sample_id="s5") and again.size() == 1
    assert drain(again) == ["new"] and not again.is_held("s6")


def test_hand_outs_follow_put_order_across_batches_singles_and_restarts(tmp_path: Path) -> None:
    q = DurableSampleQueue(str(tmp_path))
    assert q.put(b"s0", sample_id="s0")  # a put alone: its own file, the old layout
    _write(q, ["s1", "s2", "s3"])
    assert q.put(b"s4", sample_id="s4")
    _write(q, ["s5", "s6"])
    assert _samples(tmp_path) == ["000000000000~s0", batch_name(1, 3), "000000000004~s4",
                                  batch_name(5, 6)]
    assert [q.get()[1] for _ in range(3)] == [b"s0", b"s1", b"s2"]  # type: ignore[index]
    assert q.commit(2) == 2
    again = DurableSampleQueue(str(tmp_path))
    assert again.size() == 5
    assert [again.get()[1] for _ in range(2)] == [b"s2", b"s3"]  # type: ignore[index]
    _write(again, ["s7", "s8"])  # numbered after everything on disk
    assert _samples(tmp_path)[-1] == batch_name(7, 8)
    third = DurableSampleQueue(str(tmp_path))
    assert drain(third) == [f"s{i}" for i in range(2, 9)]


def test_a_batch_file_is_read_once_after_a_restart(tmp_path: Path) -> None:
    q = DurableSampleQueue(str(tmp_path))
    _write(q, [f"s{i}" for i in range(6)])
    again = DurableSampleQueue(str(tmp_path))
    reads: list[str] = []
    read = again.storage.read

    def counting(key: str) -> bytes:
        reads.append(key)
        return read(key)

    again.storage.read = counting  # type: ignore[method-assign]
    assert drain(again) == [f"s{i}" for i in range(6)]
    assert reads == [f"samples/{batch_name(0, 5)}"]


def test_a_partly_committed_batch_stays_until_its_last_sample_is_trained(
        tmp_path: Path) -> None:
    q = DurableSampleQueue(str(tmp_path))
    _write(q, ["s0", "s1", "s2", "s3"])
    assert q.put(b"s4", sample_id="s4")
    assert [q.get()[1] for _ in range(3)] == [b"s0", b"s1", b"s2"]  # type: ignore[index]
    assert q.commit(2) == 2
    assert _samples(tmp_path) == [batch_name(0, 3), "000000000004~s4"]
    again = DurableSampleQueue(str(tmp_path))  # its covered samples are not handed out
    assert (again.consumed, again.size()) == (2, 3)
    assert [again.get()[1] for _ in range(2)] == [b"s2", b"s3"]  # type: ignore[index]
    assert again.commit(3) == 1
    assert _samples(tmp_path) == [batch_name(0, 3), "000000000004~s4"]
    assert again.commit(4) == 1  # its last sample: the file goes
    assert _samples(tmp_path) == ["000000000004~s4"]
    assert drain(DurableSampleQueue(str(tmp_path))) == ["s4"]


def test_a_commit_whose_deletion_a_crash_interrupted_is_finished_by_recovery(
        tmp_path: Path) -> None:
    q = DurableSampleQueue(str(tmp_path))
    _write(q, ["s0", "s1"])
    _write(q, ["s2", "s3"])
    q.put(b"s4", sample_id="s4")
    for _ in range(3):
        q.get()
    q.storage.delete = lambda key, **kw: None  # type: ignore[method-assign]
    assert q.commit(3) == 3  # commits/3 published, then the deletions "crash"
    assert _samples(tmp_path) == [batch_name(0, 1), batch_name(2, 3), "000000000004~s4"]
    again = DurableSampleQueue(str(tmp_path))
    assert _samples(tmp_path) == [batch_name(2, 3), "000000000004~s4"]
    assert drain(again) == ["s3", "s4"]


def test_a_sample_dropped_out_of_a_batch_stays_dropped_after_a_restart(tmp_path: Path) -> None:
    q = DurableSampleQueue(str(tmp_path), max_size=3)
    _write(q, ["s0", "s1", "s2"])
    assert not q.put(b"s3", sample_id="s3")  # full: the oldest, inside the batch, goes
    assert os.listdir(tmp_path / "drops") == ["000000000000~s0~queue_full"]
    kept = (tmp_path / "drops" / "000000000000~s0~queue_full").read_bytes()
    rec = records.decode(kept, expect=Kind.STATE)
    assert rec.tables()["s"].column("b").to_numpy().tobytes() == b"s0"  # its bytes are kept
    assert rec.meta["sample_id"] == "s0"
    assert batch_name(0, 2) in _samples(tmp_path)  # the batch file holds s1 and s2 still
    again = DurableSampleQueue(str(tmp_path), max_size=3)
    assert not again.is_held("s0")
    assert drain(again) == ["s1", "s2", "s3"]
    again.commit(3)
    assert _samples(tmp_path) == []


def test_a_batch_whose_samples_all_dropped_is_deleted_and_its_numbers_not_reused(
        tmp_path: Path) -> None:
    q = DurableSampleQueue(str(tmp_path))
    _write(q, ["s0", "s1"])
    assert q.clear() == 2
    assert _samples(tmp_path) == []
    assert sorted(os.listdir(tmp_path / "drops")) == ["000000000000~s0~cleared",
                                                      "000000000001~s1~cleared"]
    again = DurableSampleQueue(str(tmp_path))
    _write(again, ["s0", "s1"])  # put again: new numbers, not hidden by the old drops
    assert _samples(tmp_path) == [batch_name(2, 3)]
    assert drain(DurableSampleQueue(str(tmp_path))) == ["s0", "s1"]


def _damage(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at, os.SEEK_SET if at >= 0 else os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("where", ["a sample", "the index"])
def test_a_corrupt_batch_file_drops_every_sample_in_it(tmp_path: Path, where: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    q = DurableSampleQueue(str(tmp_path))
    q.put(b"first", sample_id="s0")
    _write(q, ["s1", "s2", "s3"])
    q.put(b"last", sample_id="s4")
    _damage(tmp_path / "samples" / batch_name(1, 3), -1 if where == "a sample" else 40)
    again = DurableSampleQueue(str(tmp_path))
    assert drain(again) == ["first", "last"]
    assert os.listdir(tmp_path / "drops") == [f"{batch_name(1, 3)}~corrupt"]
    assert "unreadable" in caplog.text
    assert not again.is_held("s2")
    assert drain(DurableSampleQueue(str(tmp_path))) == ["first", "last"]


def test_a_crash_at_any_storage_step_of_batched_puts_loses_no_returned_put(
        tmp_path: Path) -> None:
    """Batches, a drop out of a batch, commits and restarts, crashed before each mutating
    storage operation in turn: a queue started again holds every put that returned and no
    commit covers or drop took, in put order, once."""
    n = 1
    while True:
        root = tmp_path / f"c{n}"
        q = DurableSampleQueue(FaultyStorage(PosixStorage(str(root), writer_id="verlq"),
                                             crash_after=n), max_size=2)
        returned: list[str] = []
        handed: list[str] = []
        commits = [0]  # the commits made, the last one perhaps cut short by the crash
        try:
            for b in range(4):
                ids = [f"b{b}_{i}" for i in range(3)]
                _write(q, ids)
                returned += ids
                handed += [q.get()[0].sample_id for _ in range(2)]  # type: ignore[index]
                commits.append(len(handed) - 1)
                q.commit(commits[-1])
        except CrashPoint:
            pass
        else:
            break
        again = DurableSampleQueue(str(root), max_size=2)
        assert again.consumed in commits[-2:], (n, again.consumed, commits)
        committed = handed[:again.consumed]
        held = [got[0].sample_id for got in iter(again.get, None)]
        drops = {name.split("~")[1] for name in os.listdir(root / "drops")} \
            if (root / "drops").exists() else set()
        assert len(held) == len(set(held)), (n, held)
        assert not set(held) & set(committed), (n, held)
        assert not set(held) & drops, (n, held)
        assert set(returned) - set(committed) - drops <= set(held), (n, held)
        assert held == sorted(held, key=lambda s: (int(s[1]), int(s.split("_")[1])))
        n += 1
    assert n > 12  # every step of the sequence was a crash point once
