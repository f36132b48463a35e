"""verl queue benchmark: strawq's durable ``StrawqMessageQueue`` against verl's own in-memory
``MessageQueue``, both as Ray actors, on the same sample stream.

1. Builds S verl ``RolloutSample`` objects (one prompt, n responses of L tokens: prompt,
   response, input ids, attention mask and rollout log-probs as verl's Rollouter fills them)
   and pickles them as the Rollouter does (``ray.cloudpickle.dumps``).
2. For each queue, through verl's own ``MessageQueueClient``: S puts (``--concurrency`` in
   flight, as the Rollouter's sample tasks put), then S gets one at a time (as the Trainer
   takes them): puts per second, gets per second, the p99 latency of a get, and bytes per
   sample (the pickle; for strawq the record it writes, framing and checksum included).
   Throughput is S / (put time + get time). Also the actor process's CPU per put (user and
   system, all its threads, read with ``getrusage`` in the actor before and after the puts):
   less moved by the machine's load than a rate, it says what a put costs the actor; and,
   for strawq, the mean puts per file written (its writers, and the putter's, put each
   batch of waiting puts in one file).
3. Crash: K samples put into each queue, its actor's process killed with SIGKILL, a new actor
   made the way verl's task runner makes it (same config): the samples it still has.
   verl's queue comes back empty; strawq's hands all K out again.

    python bench/verl_queue.py [--quick] [--samples S] [--n N] [--tokens L] [--crash K]
                               [--no-fsync] [--writers W]

``--no-fsync``: strawq's queue made with ``fsync=False`` (its records survive the actor's
death, not the machine's): the most any batching of fsyncs could gain, which tells whether a
put's cost is its fsync or the actor's CPU.

``--quick`` (the CI size): 60 samples, 20 in the crash; it checks the path, its ratio is
noise. The machine this runs on may be shared: the figures move with its load.

The last line: ``verl: strawq queue / verl MessageQueue throughput = X, samples lost per queue
crash = 0 vs N``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

with warnings.catch_warnings():  # verl's imports warn about missing GPU extras
    warnings.simplefilter("ignore")
    import ray
    from omegaconf import OmegaConf

    from strawq.collector.integrations.verl.queue import StrawqMessageQueue
    from tests.collector.integrations.verl_helpers import rollout_sample


async def _cpu(self: Any) -> tuple[float, float]:
    """The actor process's CPU seconds so far, user and system (all its threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def verl_actor() -> Any:
    """verl's own ``MessageQueue`` as a Ray actor, plus a ``pid`` method to kill it by and a
    ``cpu`` method to read its CPU by."""
    from verl.experimental.fully_async_policy.message_queue import MessageQueue

    cls = MessageQueue.__ray_metadata__.modified_class

    async def pid(self: Any) -> int:
        return os.getpid()

    return ray.remote(num_cpus=0, max_concurrency=20)(
        type("VerlMessageQueue", (cls,), {"pid": pid, "cpu": _cpu}))


def strawq_actor(writers: int | None = None) -> Any:
    """``actor_class`` (verl's options, no CPU reserved) with the same ``cpu`` method (and
    ``writers`` writer threads, when given)."""
    extra = {} if writers is None else {"writers": writers}
    return ray.remote(num_cpus=0, max_concurrency=20)(
        type("StrawqMessageQueue", (StrawqMessageQueue,), {"cpu": _cpu, **extra}))


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


def client_of(actor: Any, strawq: bool, write_from: int | None = None,
              shared: bool = True) -> Any:
    """The client verl's entry point makes for the queue: verl's ``MessageQueueClient``, or,
    after ``install()``, ``StrawqMessageQueueClient`` (its puts of ``write_from`` bytes or
    more written by the putter, default its own ``WRITE_FROM_BYTES``; on a shared mount
    only with ``shared``)."""
    from verl.experimental.fully_async_policy.message_queue import MessageQueueClient

    from strawq.collector.integrations.verl.queue_client import (WRITE_FROM_BYTES,
                                                                 StrawqMessageQueueClient)

    if not strawq:
        return MessageQueueClient(actor)
    return StrawqMessageQueueClient(
        actor, write_from_bytes=WRITE_FROM_BYTES if write_from is None else write_from,
        on_shared_mounts=shared)


def run_stream(actor: Any, blobs: list[bytes], concurrency: int,
               strawq: bool, write_from: int | None = None,
               shared: bool = True) -> dict[str, float]:
    client = client_of(actor, strawq, write_from, shared)
    ray.get(actor.get_queue_size.remote())  # the actor is up: its start is not timed

    async def go() -> dict[str, float]:
        sem = asyncio.Semaphore(concurrency)

        async def put(b: bytes) -> None:
            async with sem:
                await client.put_sample(sample=b)

        if strawq:  # the client asks the queue where it lives once: not timed
            await client.connect()
        c0 = await asyncio.wrap_future(actor.cpu.remote().future())
        p0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        await asyncio.gather(*(put(b) for b in blobs))
        t_put = time.perf_counter() - t0
        p1 = resource.getrusage(resource.RUSAGE_SELF)
        c1 = await asyncio.wrap_future(actor.cpu.remote().future())
        lat: list[float] = []
        t0 = time.perf_counter()
        for _ in blobs:
            t = time.perf_counter()
            got, _left = await client.get_sample()
            lat.append(time.perf_counter() - t)
            assert got is not None
        t_get = time.perf_counter() - t0
        stats = await client.get_statistics()
        return {"put_s": t_put, "get_s": t_get, "p99_ms": 1000 * p99(lat),
                "put_usr_ms": 1000 * (c1[0] - c0[0]) / len(blobs),
                "put_sys_ms": 1000 * (c1[1] - c0[1]) / len(blobs),
                "client_usr_ms": 1000 * (p1.ru_utime - p0.ru_utime) / len(blobs),
                "client_sys_ms": 1000 * (p1.ru_stime - p0.ru_stime) / len(blobs),
                "bytes_put": float(stats.get("bytes_put", 0)),
                "files": float(stats.get("files_written", 0)
                               + stats.get("files_written_by_putter", 0)),
                "written": float(stats.get("puts_written_by_putter", 0))}

    return asyncio.run(go())


def crash(make: Any, blobs: list[bytes], strawq: bool) -> int:
    """Samples lost when the actor holding ``blobs``, put through its client, is killed with
    SIGKILL."""
    a = make()
    client = client_of(a, strawq)

    async def put_all() -> None:
        for b in blobs:
            await client.put_sample(sample=b)

    asyncio.run(put_all())
    assert ray.get(a.get_queue_size.remote()) == len(blobs)
    os.kill(ray.get(a.pid.remote()), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(a.pid.remote(), timeout=2)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            break
        time.sleep(0.05)
    again = make()
    return len(blobs) - int(ray.get(again.get_queue_size.remote()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--n", type=int, default=4, help="responses per prompt")
    ap.add_argument("--tokens", type=int, default=1024, help="response tokens")
    ap.add_argument("--crash", type=int, default=200, help="samples held at the crash")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--no-fsync", action="store_true",
                    help="strawq's queue without fsync (an upper bound for fsync batching)")
    ap.add_argument("--writers", type=int, default=None,
                    help="strawq's writer threads (default: the queue's WRITERS)")
    ap.add_argument("--dir", default=None, help="where the strawq queues live (a temp dir)")
    ap.add_argument("--write-from", type=int, default=None, metavar="BYTES",
                    help="strawq's client writes samples of this size or more itself, "
                         "smaller ones go through the actor (default: its WRITE_FROM_BYTES, "
                         "0: every sample written)")
    ap.add_argument("--actor-on-shared-mounts", action="store_true",
                    help="strawq's client puts through the actor where --dir is on a shared "
                         "mount (JuiceFS, NFS: on_shared_mounts=False)")
    a = ap.parse_args()
    if a.quick:
        a.samples, a.crash, a.tokens = 60, 20, 256
    root = a.dir or tempfile.mkdtemp(prefix="verlq-bench-")
    # Ray's sockets live under its temp dir, and a socket path has at most 107 bytes: a long
    # TMPDIR (a test's) gets Ray's own default, /tmp/ray, instead
    short = {} if len(tempfile.gettempdir()) < 40 else {"_temp_dir": "/tmp/ray"}
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="error",
             log_to_driver=False, **short,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                 [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                  os.environ.get("PYTHONPATH", "")])}})
    try:
        blobs = [bytes(ray.cloudpickle.dumps(rollout_sample(i, n=a.n, prompt_len=256,
                                                            resp_len=a.tokens)))
                 for i in range(a.samples)]
        size = sum(len(b) for b in blobs) / len(blobs)
        print(f"{a.samples} samples: 1 prompt × {a.n} responses × {a.tokens} tokens, "
              f"{size / 1024:.1f} KiB pickled; {a.concurrency} puts in flight")
        verl_cls = verl_actor()
        cfg = OmegaConf.create({"trainer": {"default_local_dir": os.path.join(root, "ckpt"),
                                            "resume_mode": "auto"}})
        strawq_cls = strawq_actor(a.writers)
        sync = {"fsync": False} if a.no_fsync else {}
        if a.no_fsync:
            print("strawq queue without fsync: durable against its actor's death only")
        results = {}
        for name, make in (("verl MessageQueue", lambda: verl_cls.remote(cfg, 100000)),
                           ("strawq queue", lambda: strawq_cls.remote(cfg, 100000, **sync))):
            results[name] = r = run_stream(make(), blobs, a.concurrency,
                                           strawq=name.startswith("strawq"),
                                           write_from=a.write_from,
                                           shared=not a.actor_on_shared_mounts)
            per = r["bytes_put"] / a.samples if r["bytes_put"] else size
            print(f"{name:18s} puts/s {a.samples / r['put_s']:8.0f}   gets/s "
                  f"{a.samples / r['get_s']:8.0f}   p99 get {r['p99_ms']:6.2f} ms   "
                  f"bytes/sample {per:9.0f}" + ("" if r["bytes_put"] else " (in memory)"))
            print(f"{'':18s} CPU per put: the actor's user {r['put_usr_ms']:.2f} ms, system "
                  f"{r['put_sys_ms']:.2f} ms; the putter's user {r['client_usr_ms']:.2f} ms, "
                  f"system {r['client_sys_ms']:.2f} ms"
                  + (f"; puts per file {a.samples / r['files']:.2f}" if r["files"] else "")
                  + (f"; written by the putter {r['written'] / a.samples:.2f}"
                     if name.startswith("strawq") else ""))
            shutil.rmtree(os.path.join(root, "ckpt"), ignore_errors=True)
        through = {k: a.samples / (r["put_s"] + r["get_s"]) for k, r in results.items()}
        lost_verl = crash(lambda: verl_cls.remote(cfg, 100000), blobs[:a.crash], False)
        lost_strawq = crash(lambda: strawq_cls.remote(cfg, 100000, **sync), blobs[:a.crash],
                            True)
        print(f"crash with {a.crash} samples queued: verl's queue lost {lost_verl}, "
              f"strawq's lost {lost_strawq}")
        ratio = through["strawq queue"] / through["verl MessageQueue"]
    finally:
        ray.shutdown()
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"verl: strawq queue / verl MessageQueue throughput = {ratio:.2f}, samples lost "
          f"per queue crash = {lost_strawq} vs {lost_verl}", flush=True)


if __name__ == "__main__":
    main()
