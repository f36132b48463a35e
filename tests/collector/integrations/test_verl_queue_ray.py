"""Crash tests of the durable verl queue with verl's real classes on a real Ray cluster.

The queue is ``StrawqMessageQueue`` as a Ray actor (``actor_class``), reached through verl's
own ``MessageQueueClient``; samples are verl ``RolloutSample`` objects pickled as verl's
Rollouter pickles them; the trainer side is verl's own ``FullyAsyncTrainer.
_get_samples_from_queue``, with checkpoints written as verl writes them (``global_step_<v>/``,
then ``latest_checkpointed_iteration.txt``). Each test kills one process with SIGKILL — the
queue actor, a rollout worker, the trainer reader — and counts the trained samples by id.
"""

from __future__ import annotations

import collections
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl")
ray = pytest.importorskip("ray")

from strawq.collector.integrations.verl.queue import actor_class  # noqa: E402
from tests.collector.integrations import verl_helpers as vh  # noqa: E402

# every Ray worker here imports verl (tens of seconds on a small machine): ray and slow
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]
REPO = str(Path(__file__).resolve().parents[3])


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    # "local": a fresh instance, whatever Ray cluster another process left on this host
    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="warning",
             namespace="strawq-verl-test",
             runtime_env={"env_vars": {"PYTHONPATH": REPO}})
    try:
        yield
    finally:
        ray.shutdown()


def until(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


def config(tmp: Path, required: int, trigger: int) -> dict[str, Any]:
    return {"trainer": {"default_local_dir": str(tmp / "ckpt"), "resume_mode": "auto"},
            "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": required}},
            "async_training": {"require_batches": 1, "trigger_parameter_sync_step": trigger}}


def queue(cfg: dict[str, Any], size: int = 1000) -> Any:
    from omegaconf import OmegaConf

    return actor_class(num_cpus=0).remote(OmegaConf.create(cfg), size)


def trainer(q: Any, cfg: dict[str, Any], required: int, trigger: int) -> Any:
    return ray.remote(num_cpus=0)(vh.TrainerReader).remote(
        q, cfg["trainer"]["default_local_dir"], required, trigger)


def stats(q: Any) -> dict[str, Any]:
    return dict(ray.get(q.get_statistics.remote()))


def once_each(ids: list[str], n: int) -> None:
    counts = collections.Counter(ids)
    twice = sorted(k for k, c in counts.items() if c > 1)
    assert not twice, f"trained twice: {twice}"
    assert sorted(counts) == sorted(f"sample_0_{i}" for i in range(n)), \
        f"missing: {sorted(set(f'sample_0_{i}' for i in range(n)) - set(counts))}"


SWITCH = """
import sys
import ray
from omegaconf import OmegaConf
from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

line = sys.argv[1]  # the one config entry, as a user passes it to verl on the command line
key, _, value = line.lstrip("+").partition("=")
user = OmegaConf.from_dotlist([f"{key}={value}"])
runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(None), user.ray_kwargs.ray_init.runtime_env)
ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="error",
         runtime_env=OmegaConf.to_container(runtime_env))

@ray.remote(num_cpus=0)
def which():
    from verl.experimental.fully_async_policy import fully_async_main, fully_async_rollouter
    cls = fully_async_main.MessageQueue.__ray_metadata__.modified_class
    return (cls.__mro__[1].__name__, fully_async_main.MessageQueueClient.__name__,
            fully_async_rollouter.FullyAsyncLLMServerClient.__name__)

print("SWITCHED", *ray.get(which.remote()))
"""


def test_the_one_config_line_switches_verls_entry_point(tmp_path: Path) -> None:
    """verl's own ``ray.init`` path (its runtime env merged with ``ray_kwargs.ray_init``) with
    the one line of docs/verl.md: every Ray worker's ``fully_async_main.MessageQueue`` is the
    durable queue, its ``MessageQueueClient`` the client whose puts the Rollouter writes, and
    the Rollouter's rollout client the durable partial-rollout client."""
    import subprocess
    import sys

    line = ("+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook="
            "strawq.collector.integrations.verl.queue.install")
    script = tmp_path / "switch.py"
    script.write_text(SWITCH)
    r = subprocess.run([sys.executable, str(script), line], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": REPO}, timeout=200, check=False)
    out = [ln for ln in r.stdout.splitlines() if ln.startswith("SWITCHED")]
    assert out == ["SWITCHED StrawqMessageQueue StrawqMessageQueueClient "
                   "StrawqFullyAsyncLLMServerClient"], r.stderr[-3000:]


def test_queue_actor_killed_holding_samples_loses_none(cluster: None, tmp_path: Path) -> None:
    cfg = config(tmp_path, required=4, trigger=2)
    q = queue(cfg)
    w = ray.remote(num_cpus=0)(vh.RolloutWorker).remote()
    ray.get(w.run.remote(q, 0, 40, str(tmp_path / "put.log")))
    t = trainer(q, cfg, 4, 2)
    assert ray.get(t.run.remote(2)) == 2  # 16 trained and checkpointed
    ray.get(t.run.remote(3))  # ... 8 more handed out and checkpointed as version 3
    before = stats(q)
    assert before["queue_size"] == 16, before
    os.kill(before["pid"], signal.SIGKILL)
    until(lambda: _dead(q), "the queue actor to die")
    q2 = queue(cfg)
    after = stats(q2)
    assert after["queue_size"] == 16 and after["committed"] == 24, after
    t2 = trainer(q2, cfg, 4, 2)
    assert ray.get(t2.run.remote(5)) == 5
    once_each(vh.trained_ids(tmp_path / "ckpt"), 40)


def _dead(actor: Any) -> bool:
    try:
        ray.get(actor.pid.remote(), timeout=2)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return True
    return False


def test_rollout_worker_killed_mid_stream(cluster: None, tmp_path: Path) -> None:
    """The worker dies (SIGKILL) between puts; its replacement puts the whole range again:
    every put that returned is kept, every re-put is a duplicate, nothing is trained twice."""
    cfg = config(tmp_path, required=5, trigger=2)
    q = queue(cfg)
    log = tmp_path / "put.log"
    w = ray.remote(num_cpus=0)(vh.RolloutWorker).remote()
    pid = ray.get(w.pid.remote())
    w.run.remote(q, 0, 30, str(log))
    until(lambda: log.exists() and len(log.read_text().split()) >= 8, "8 puts")
    os.kill(pid, signal.SIGKILL)
    returned = set(log.read_text().split())
    assert stats(q)["total_produced"] >= len(returned)
    w2 = ray.remote(num_cpus=0)(vh.RolloutWorker).remote()
    ray.get(w2.run.remote(q, 0, 30, str(log)))
    s = stats(q)
    assert s["total_produced"] == 30 and s["duplicates"] >= len(returned), s
    t = trainer(q, cfg, 5, 2)
    assert ray.get(t.run.remote(3)) == 3
    once_each(vh.trained_ids(tmp_path / "ckpt"), 30)


def test_trainer_reader_killed_mid_step(cluster: None, tmp_path: Path) -> None:
    """The trainer dies (SIGKILL) with samples handed out after its last checkpoint; the one
    restored from that checkpoint gets them again (``rewind``), and no sample is trained twice."""
    cfg = config(tmp_path, required=4, trigger=1)
    q = queue(cfg)
    worker = ray.remote(num_cpus=0)(vh.RolloutWorker)
    ray.get(worker.remote().run.remote(q, 0, 14, str(tmp_path / "p.log")))
    ckpt = cfg["trainer"]["default_local_dir"]
    t = ray.remote(num_cpus=0)(vh.TrainerReader).remote(q, ckpt, 4, 1)
    pid = ray.get(t.pid.remote())
    t.run.remote(6)  # checkpoints versions 1-3 (12 samples), then waits inside version 4
    until(lambda: stats(q)["total_consumed"] == 14, "two gets past the third checkpoint")
    os.kill(pid, signal.SIGKILL)
    until(lambda: _dead(t), "the trainer to die")
    s = stats(q)
    assert (s["committed"], s["leased"]) == (12, 2), s
    assert ray.get(q.rewind.remote()) == 2
    ray.get(worker.remote().run.remote(q, 14, 26, str(tmp_path / "p.log")))
    ray.get(q.put_sample.remote(None))  # the Rollouter's end of stream
    t2 = ray.remote(num_cpus=0)(vh.TrainerReader).remote(q, ckpt, 4, 1)
    assert ray.get(t2.run.remote(100)) == 6
    # 26 = 6 versions of 4, and 2 the end of stream left short of a step
    once_each(vh.trained_ids(tmp_path / "ckpt") + ["sample_0_24", "sample_0_25"], 26)


def test_puts_written_by_the_rollout_worker_survive_the_queue_actor(cluster: None,
                                                                     tmp_path: Path) -> None:
    """``StrawqMessageQueueClient``, made in the driver as verl's entry point makes its
    client and handed to the worker by Ray: every put is written by the worker and only
    named by the queue; the queue actor killed, the next one has them all, each trained
    once."""
    from strawq.collector.integrations.verl.queue_client import StrawqMessageQueueClient

    cfg = config(tmp_path, required=4, trigger=2)
    q = queue(cfg)
    w = ray.remote(num_cpus=0)(vh.RolloutWorker).remote()
    client = StrawqMessageQueueClient(q, write_from_bytes=0)  # the test's samples are small
    ray.get(w.run.remote(q, 0, 24, str(tmp_path / "put.log"), client))
    before = stats(q)
    assert (before["total_produced"], before["puts_written_by_putter"]) == (24, 24), before
    assert before["files_written"] == 0, before  # the actor wrote no sample file itself
    t = trainer(q, cfg, 4, 2)
    assert ray.get(t.run.remote(2)) == 2  # 16 trained and checkpointed
    os.kill(before["pid"], signal.SIGKILL)
    until(lambda: _dead(q), "the queue actor to die")
    q2 = queue(cfg)
    assert stats(q2)["queue_size"] == 8
    assert ray.get(trainer(q2, cfg, 4, 2).run.remote(3)) == 3
    once_each(vh.trained_ids(tmp_path / "ckpt"), 24)


def test_the_client_writes_every_sample_unless_told_a_size(cluster: None,
                                                          tmp_path: Path) -> None:
    """By default every sample, small or large, is written by the putter; with
    ``write_from_bytes`` a smaller one is sent to the actor as verl's client sends it."""
    import asyncio

    from strawq.collector.integrations.verl.queue_client import StrawqMessageQueueClient

    q = queue(config(tmp_path, required=4, trigger=2))
    small, large = vh.blob(0), vh.blob(1, resp_len=4096, prompt_len=1024)
    default = StrawqMessageQueueClient(q)
    sized = StrawqMessageQueueClient(q, write_from_bytes=len(small) + 1)

    async def go() -> None:
        assert await default.put_sample(small)
        assert await sized.put_sample(vh.blob(2)) and await sized.put_sample(large)

    asyncio.run(go())
    s = stats(q)
    assert (s["total_produced"], s["puts_written_by_putter"]) == (3, 2), s
    assert (default.sent, default.written) == (0, 1)
    assert (sized.sent, sized.written) == (1, 1)


def test_puts_made_at_once_share_batch_files(cluster: None, tmp_path: Path) -> None:
    """32 puts in flight, as the Rollouter's sample tasks put: every one written by the
    putter and stored once, in fewer batch files than puts, named in at most as many calls
    as files."""
    import asyncio

    from strawq.collector.integrations.verl.queue_client import StrawqMessageQueueClient

    q = queue(config(tmp_path, required=4, trigger=2))
    client = StrawqMessageQueueClient(q, write_from_bytes=0)

    async def go() -> list[Any]:
        oks = await asyncio.gather(*(client.put_sample(vh.blob(i)) for i in range(32)))
        assert all(oks)
        return [await client.get_sample() for _ in range(32)]

    got = asyncio.run(go())
    s = stats(q)
    assert (s["total_produced"], s["puts_written_by_putter"]) == (32, 32), s
    assert client.written == 32 and client.files < 32, client.files
    assert client.naming_calls <= client.files == s["files_written_by_putter"], s
    assert sorted(bytes(g[0]) for g in got) == sorted(vh.blob(i) for i in range(32))


def test_a_failed_naming_call_fails_its_puts_only_and_loses_none(cluster: None,
                                                                  tmp_path: Path) -> None:
    """The queue's first ``put_written_batches`` raises: that put raises in the putter, the
    client's next put is named as usual (its sender is not stuck), and the queue started
    again holds both samples: the failed put's record was durable in ``incoming/``."""
    import asyncio

    from omegaconf import OmegaConf

    from strawq.collector.integrations.verl.queue import StrawqMessageQueue
    from strawq.collector.integrations.verl.queue_client import StrawqMessageQueueClient

    async def put_written_batches(self: Any, files: Any) -> Any:
        if not getattr(self, "failed_once", False):
            self.failed_once = True
            raise RuntimeError("injected: the queue failed this call")
        return await StrawqMessageQueue.put_written_batches(self, files)

    cls = ray.remote(num_cpus=0)(type("FailsOnce", (StrawqMessageQueue,),
                                      {"put_written_batches": put_written_batches}))
    cfg = config(tmp_path, required=4, trigger=2)
    q = cls.remote(OmegaConf.create(cfg), 100)
    client = StrawqMessageQueueClient(q, write_from_bytes=0)

    async def go() -> None:
        with pytest.raises(Exception, match="injected"):
            await client.put_sample(vh.blob(0))
        assert await client.put_sample(vh.blob(1))

    asyncio.run(go())
    s = stats(q)
    assert (s["total_produced"], s["puts_written_by_putter"]) == (1, 1), s
    os.kill(s["pid"], signal.SIGKILL)
    until(lambda: _dead(q), "the queue actor to die")
    again = stats(queue(cfg))
    assert (again["queue_size"], again["recovered"]) == (2, 2), again


def test_a_client_whose_directory_the_queue_cannot_see_puts_through_the_actor(
        cluster: None, tmp_path: Path) -> None:
    """The queue tells the client a directory that is not its own (as another node's local
    directory at the same path would be): the first put's file is refused and deleted, and
    every put goes through the actor, none lost."""
    from omegaconf import OmegaConf

    from strawq.collector.integrations.verl.queue import StrawqMessageQueue
    from strawq.collector.integrations.verl.queue_client import StrawqMessageQueueClient

    elsewhere = tmp_path / "another-node"

    async def where(self: Any) -> dict[str, Any]:
        return {"path": str(elsewhere), "fsync": True}

    cls = ray.remote(num_cpus=0)(type("Elsewhere", (StrawqMessageQueue,), {"where": where}))
    cfg = config(tmp_path, required=4, trigger=2)
    q = cls.remote(OmegaConf.create(cfg), 100)
    w = ray.remote(num_cpus=0)(vh.RolloutWorker).remote()
    client = StrawqMessageQueueClient(q, write_from_bytes=0)
    ray.get(w.run.remote(q, 0, 6, str(tmp_path / "put.log"), client))
    s = stats(q)
    assert (s["total_produced"], s["puts_written_by_putter"]) == (6, 0), s
    assert os.listdir(elsewhere / "incoming") == []
    assert sorted((tmp_path / "put.log").read_text().split()) == \
        sorted(f"sample_0_{i}" for i in range(6))


def test_verls_own_queue_loses_what_it_held(cluster: None) -> None:
    """The baseline the benchmark reports: verl's own MessageQueue, its process killed with
    samples in it, comes back empty."""
    from verl.experimental.fully_async_policy.message_queue import MessageQueue

    cls = MessageQueue.__ray_metadata__.modified_class
    assert cls.__name__ == "MessageQueue" and cls.__module__.startswith("verl.")

    async def pid(self: Any) -> int:
        return os.getpid()

    verls = ray.remote(num_cpus=0)(type("VerlMessageQueue", (cls,), {"pid": pid}))
    mq = verls.remote({}, 100)
    for i in range(10):
        ray.get(mq.put_sample.remote(vh.blob(i)))
    assert ray.get(mq.get_queue_size.remote()) == 10
    os.kill(ray.get(mq.pid.remote()), signal.SIGKILL)
    until(lambda: _dead(mq), "verl's queue actor to die")
    assert ray.get(verls.remote({}, 100).get_queue_size.remote()) == 0
