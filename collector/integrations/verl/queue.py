"""verl's fully-async ``MessageQueue``, durable: ``StrawqMessageQueue`` (``docs/verl.md``).

verl's fully-async policy puts every finished ``RolloutSample`` (pickled by the Rollouter with
``ray.cloudpickle``) into a ``MessageQueue`` Ray actor and the Trainer takes them one by one;
the actor's deque dies with it. ``StrawqMessageQueue`` has the same methods and the same
constructor ``(config, max_queue_size)``, and keeps the samples in a strawq storage directory:

* a put is durable when it returns (``samples/<seq>~<sample id>``, or with the other puts
  of its batch in ``samples/<first seq>~<last seq>~batch``);
* a get hands the oldest sample out under a lease (held by the queue, in hand-out order);
* a sample counts as consumed only when a checkpoint of the trainer covers it:
  ``commit(consumed)`` (or, for verl's own trainer, the queue reading verl's checkpoint
  tracker, ``latest_checkpointed_iteration.txt``: the checkpoint holds the gets handed out
  when the queue first sees the tracker move, verl making none between its save and its
  next step; at least v · ppo_mini_batch_size · require_batches ·
  trigger_parameter_sync_step at version v) publishes
  ``commits/<consumed>`` and deletes the samples it covers. A queue that starts again
  hands every sample not covered out again, oldest first; ``rewind()`` does the same for a
  trainer restarted beside a queue that lived on.

The durable FIFO is ``DurableSampleQueue`` (``strawq.collector.integrations.verl.samples``),
the prefixes of aborted requests ``PartialStore`` (``...verl.partial``); the directories and
moves of both are declared in the core's table (``strawq.tasks.states.VERL_SAMPLES``,
``VERL_PREFIXES``). This module is verl's side: its settings, its ``MessageQueue`` methods,
its checkpoint tracker.

verl's queue is a Ray actor by verl's design: ``actor_class()`` wraps this class with
``ray.remote`` (the one place this module needs Ray, imported there), and ``install()`` puts
it where verl's ``fully_async_main`` looks for ``MessageQueue`` (run in every Ray worker by
``ray_kwargs.ray_init.runtime_env.worker_process_setup_hook``: the one-line switch).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from strawq.collector.integrations.verl.config import _cfg, queue_dir
from strawq.collector.integrations.verl.samples import (QUEUE_FULL, SAMPLES, DurableSampleQueue,
                                                        Held, Pending, sample_identity)
from strawq.errors import ConfigError, NotFound
from strawq.storage import PosixStorage

log = logging.getLogger(__name__)

__all__ = ["QUEUE_FULL", "DurableSampleQueue", "Held", "StrawqMessageQueue", "TRACKER",
           "actor_class", "install", "queue_dir", "sample_identity", "samples_per_version",
           "strawq_settings"]

#: threads writing puts: each takes every put waiting, writes them as one batch file (file,
#: fsync, rename) and fsyncs the directory once for them. One: while it writes, the puts that
#: arrive wait and go into its next file together (group commit; a slower fsync makes larger
#: batches), and a put costs the actor least (docs/benchmarks.md, "verl queue")
WRITERS = 1
#: verl's checkpoint tracker, written by the trainer after every checkpoint it saves
TRACKER = "latest_checkpointed_iteration.txt"


def samples_per_version(config: Any) -> int | None:
    """Gets one verl weight version takes: the trainer's ``required_samples`` (ppo mini-batch
    size × ``require_batches``) × ``trigger_parameter_sync_step``; None if the config lacks one."""
    mini = _cfg(config, "actor_rollout_ref.actor.ppo_mini_batch_size")
    req = _cfg(config, "async_training.require_batches", 1)
    trig = _cfg(config, "async_training.trigger_parameter_sync_step")
    if mini is None or trig is None:
        return None
    return int(mini) * int(req) * int(trig)


def strawq_settings(config: Any) -> dict[str, Any]:
    """verl's fully-async staleness settings as strawq's collector settings (docs/verl.md).

    A verl ``RolloutSample`` (one prompt, ``rollout.n`` responses) is one strawq group; the
    trainer's step (``required_samples`` of them) one batch; ``trigger_parameter_sync_step``
    steps one weight version. verl's Rollouter stops generating at ``max_required_samples =
    required_samples · (staleness_threshold + 1) · trigger_parameter_sync_step`` samples in
    flight or queued: strawq's admission window ``(η + 1) · u · B`` (docs/design.md,
    "Admission"), with ``admission_batches`` carrying a fractional threshold exactly.
    """
    mini = _cfg(config, "actor_rollout_ref.actor.ppo_mini_batch_size")
    trig = _cfg(config, "async_training.trigger_parameter_sync_step")
    if mini is None or trig is None:
        raise ConfigError("strawq_settings: expected actor_rollout_ref.actor.ppo_mini_batch_size "
                          "and async_training.trigger_parameter_sync_step in the verl config")
    required = int(mini) * int(_cfg(config, "async_training.require_batches", 1))
    threshold = float(_cfg(config, "async_training.staleness_threshold", 1))
    if threshold < 0:
        raise ConfigError(f"staleness_threshold must be >= 0, found {threshold}")
    window = (threshold + 1) * int(trig)
    return {"batch_groups": required, "batches_per_version": int(trig),
            "admission_batches": window, "max_staleness": math.ceil(threshold),
            "eta_mode": "train", "group_size": int(_cfg(config, "actor_rollout_ref.rollout.n",
                                                          1)),
            "partial_rollout": bool(_cfg(config, "async_training.partial_rollout", True)),
            "max_queue_size": int(required * window)}


class StrawqMessageQueue:
    """verl's ``MessageQueue`` contract over a ``DurableSampleQueue`` (same constructor, same
    async methods; ``actor_class()`` makes it the Ray actor verl expects).

    Beyond verl's methods: ``commit(consumed)``, ``commit_version(v)``, ``rewind()``,
    ``put_partial``/``get_partial``/``finish_partial`` (``strawq.collector.integrations.
    verl.partial``). ``clear_queue`` (verl's task runner calls it in a ``finally`` after any
    failure) keeps the durable samples: clearing them would lose exactly what this queue
    exists to keep; ``drop_all()`` is the durable clear.
    """

    #: writer threads (``WRITERS``; a subclass may set its own)
    writers = WRITERS

    def __init__(self, config: Any = None, max_queue_size: int | None = 1000, *,
                 path: str | None = None, fsync: bool = True) -> None:
        if max_queue_size is None:
            raise ValueError(f"max_queue_size cannot be None, got: {max_queue_size}")
        self.config = config
        self.path = path or queue_dir(config)
        self._tracker_dir = _cfg(config, "trainer.default_local_dir")
        self._per_version = samples_per_version(config)
        fresh = not os.path.isdir(os.path.join(self.path, SAMPLES))
        resume_mode = str(_cfg(config, "trainer.resume_mode", "auto"))
        self.fsync = fsync
        self.storage = PosixStorage(self.path, writer_id="verlq", fsync=fsync)
        self.q = DurableSampleQueue(self.storage, max_size=int(max_queue_size))
        if resume_mode == "disable" and not fresh and (self.q.size() or self.q.consumed):
            raise ConfigError(
                f"StrawqMessageQueue: trainer.resume_mode=disable starts training from scratch, "
                f"but the queue at {self.path} holds {self.q.size()} samples and "
                f"{self.q.consumed} committed hand-outs of an earlier run; remove that "
                "directory, name a new one (+async_training.strawq_queue_dir=...), or resume "
                "(trainer.resume_mode=auto)")
        self._tracker_seen: tuple[float, int] | None = None
        self._val: deque[Any] = deque()
        self._sentinels: deque[int] = deque()  # hand-out positions of verl's end-of-stream None
        self.running = True
        #: bumped by ``rewind``: gets still waiting from before it return None
        self._generation = 0
        self._cond: asyncio.Condition | None = None
        self._partials: Any = None
        #: puts begun and waiting for a writer thread, and the writer threads at work
        self._batch: list[tuple[Pending, asyncio.Future[bool]]] = []
        self._batch_lock = threading.Lock()
        self._writing = 0
        self._writers = ThreadPoolExecutor(self.writers, thread_name_prefix="verlq-write")
        self._notifiers: set[asyncio.Task[None]] = set()
        self._watch_checkpoint(live=False)
        from strawq.collector.integrations.verl.partial import PartialStore

        self._partials = PartialStore(self.storage)
        self._partials.recover()
        log.info("StrawqMessageQueue at %s: %d samples to hand out, %d committed", self.path,
                 self.q.size(), self.q.consumed)

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    def _watch_checkpoint(self, *, live: bool = True) -> None:
        """Commit what verl's newest checkpoint covers (its tracker file, read when it moved).

        verl's trainer makes no get between its save and the tracker write, nor between the
        tracker write and its next step's first get: the gets handed out when the queue
        first sees the tracker move (at a get, a statistics call, ``rewind``, ``clear_queue``
        or ``shutdown``) are exactly the gets the checkpoint holds, mid-version included
        (verl's forced save at the end of ``fit``, an expiry save). A queue that starts
        after the tracker moved unseen (the job died between the tracker write and the
        queue's next call) commits the version's count, a lower bound: nothing is lost, the
        gets of a partial version in that checkpoint are handed out again."""
        if not self._tracker_dir or not self._per_version:
            return
        path = os.path.join(str(self._tracker_dir), TRACKER)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return
        seen = (st.st_mtime, st.st_size)
        if seen == self._tracker_seen:
            return
        try:
            with open(path, encoding="utf-8") as f:
                version = int(f.read().strip())
        except (OSError, ValueError):
            return  # being written; read again at the next call
        self._tracker_seen = seen
        if self.q.version is not None and version <= self.q.version:
            return  # this checkpoint is committed already
        floor = version * self._per_version
        self.q.commit(max(floor, self.q.handed) if live else floor, version=version)

    # -- verl's MessageQueue methods ---------------------------------------------------------
    async def put_sample(self, sample: Any, **meta: Any) -> bool:
        cond = self._condition()
        if sample is None:  # verl's end-of-stream signal: in memory only
            async with cond:
                self._sentinels.append(self.q.handed + self.q.size() + self.q.in_flight())
                cond.notify_all()
            return True
        # The record is encoded here, in the loop (no I/O); a writer thread takes every put
        # waiting, writes them as one batch file and fsyncs the directory once for them (group
        # commit, shared with the other writers): a thread hop, a file and its fsync per
        # batch, not per put, and at most ``writers`` file fsyncs at once. A put returns
        # when its batch is durable.
        pending = self.q.begin(sample, sample_id=meta.pop("sample_id", None), meta=meta)
        if pending is None:
            return True  # a duplicate: stored already
        return await self._submit(pending)

    async def put_written(self, name: str, sample_id: str, size: int) -> bool | None:
        """A put whose putter wrote the record itself, durable in ``incoming/<name>``
        (``StrawqMessageQueueClient``, ``samples.IncomingWriter``): a writer thread renames
        it into ``samples/`` with the other puts waiting. Returns what ``put_sample`` returns,
        or None when this process cannot see the putter's file (another node's directory at
        the same path): the putter then sends the sample's bytes (``put_sample``)."""
        return (await self.put_written_many([(name, sample_id, size)]))[0]

    async def put_written_many(self, puts: list[tuple[str, str, int]]) -> list[bool | None]:
        """``put_written`` of each ``(name, sample_id, size)``, in that order: one call for the
        puts a client wrote while its last call was out. A put's error other than not seeing
        its file raises (the puts after it in the list are still made: their files are in
        ``incoming/`` and their results lost with the call; a re-put is a duplicate)."""
        waits = []
        for name, sample_id, size in puts:
            pending = self.q.begin_written(name, sample_id=sample_id, size=size)
            waits.append(None if pending is None else self._submit(pending))
        answers: list[bool | None] = []
        error: BaseException | None = None
        for wait in waits:
            if wait is None:
                answers.append(True)  # a duplicate: its copy deleted
                continue
            try:
                answers.append(await wait)
            except NotFound:
                answers.append(None)
            except Exception as exc:  # noqa: BLE001 (raised once every put is settled)
                error = error or exc
                answers.append(None)
        if error is not None:
            raise error
        return answers

    async def put_written_batches(self, batches: list[tuple[str, list[str], int]]
                                  ) -> list[list[bool | dict[str, str]] | dict[str, str] | None]:
        """Puts their putter wrote as batch files (``StrawqMessageQueueClient``,
        ``samples.IncomingWriter.write_batch``): each ``(name, sample id parts, size)``, durable
        in ``incoming/<name>``; a writer thread renames each into ``samples/`` with the other
        puts waiting. Returns, per file: for each of its places what ``put_sample`` returns
        (a duplicate: True, stored already), or ``{"error": "<type>: <message>"}`` for a
        put stored whose joining the queue failed (a drop it made); None when this process
        cannot see the file (the putter then sends the samples' bytes); or
        ``{"error": ...}`` for the file when it could not be stored (its puts fail; the other
        files of the call are answered as usual; a file that failed whole has an error at
        every place)."""
        plans: list[tuple[int, list[Pending], list[asyncio.Future[bool]]] | BaseException] = []
        for name, parts, size in batches:
            try:
                live = self.q.begin_written_batch(name, parts, size)
                plans.append((len(parts), live, self._submit_many(live)))
            except Exception as exc:  # noqa: BLE001 (that file's answer)
                plans.append(exc)
        answers: list[list[bool | dict[str, str]] | dict[str, str] | None] = []
        for plan in plans:
            if isinstance(plan, BaseException):
                answers.append(_error(plan))
                continue
            count, live, waits = plan
            each: list[bool | dict[str, str]] = [True] * count  # no put: a duplicate
            answer: list[bool | dict[str, str]] | dict[str, str] | None = each
            for pending, wait in zip(live, waits, strict=True):
                place = pending.seq - (pending.batch.first if pending.batch else pending.seq)
                try:
                    each[place] = bool(await wait)
                except NotFound:  # the file unseen here: every put of it fails so
                    answer = None
                except Exception as exc:  # noqa: BLE001 (that put's answer)
                    each[place] = _error(exc)
            answers.append(answer)
        return answers

    def _submit(self, pending: Pending) -> asyncio.Future[bool]:
        """Hand a begun put to the writer threads (in their batch on return): the future is
        True/False once it is durable and in the queue (``DurableSampleQueue.finish``), its
        error otherwise."""
        return self._submit_many([pending])[0]

    def _submit_many(self, pending: list[Pending]) -> list[asyncio.Future[bool]]:
        """``_submit`` of puts that go to one writer together (a putter's batch file: its
        puts are named by one rename)."""
        loop = asyncio.get_running_loop()
        dones: list[asyncio.Future[bool]] = [loop.create_future() for _ in pending]
        if not pending:
            return dones
        with self._batch_lock:
            self._batch += zip(pending, dones, strict=True)
            start = self._writing < self.writers
            self._writing += start
        if start:
            try:
                loop.run_in_executor(self._writers, self._write_batches, loop)
            except BaseException as exc:  # no writer could start: every put waiting fails
                with self._batch_lock:
                    batch, self._batch = self._batch, []
                    self._writing -= 1
                self._settle(batch, [exc] * len(batch))
                raise
        return dones

    def _write_batches(self, loop: asyncio.AbstractEventLoop) -> None:
        """A writer thread: write the puts waiting, hand them back to the loop, again until
        none waits."""
        while True:
            with self._batch_lock:
                batch, self._batch = self._batch, []
                if not batch:
                    self._writing -= 1
                    return
            try:
                errors = self.q.write([p for p, _ in batch])
            except BaseException as exc:  # noqa: BLE001 (every put of the batch fails with it)
                errors = [exc] * len(batch)
            try:
                loop.call_soon_threadsafe(self._settle, batch, errors)
            except RuntimeError:  # the loop is closed: no caller is left to answer
                with self._batch_lock:
                    self._writing -= 1
                return

    def _settle(self, batch: list[tuple[Pending, asyncio.Future[bool]]],
                errors: list[BaseException | None]) -> None:
        """In the loop: the batch's durable puts join the queue (even one whose caller was
        cancelled: its record is on disk), the others give their reservation back; then the
        waiting gets are woken."""
        for (pending, done), error in zip(batch, errors, strict=True):
            if error is None:
                try:
                    ok = self.q.finish(pending)
                except Exception as exc:  # noqa: BLE001 (a drop it made failed: its put says so)
                    if not done.done():
                        done.set_exception(exc)
                    continue
                if not done.done():
                    done.set_result(ok)
            else:
                self.q.abort(pending)
                if not done.done():
                    done.set_exception(error)
        task = asyncio.get_running_loop().create_task(self._notify())
        self._notifiers.add(task)
        task.add_done_callback(self._notifiers.discard)

    async def _notify(self) -> None:
        cond = self._condition()
        async with cond:
            cond.notify_all()

    async def get_sample(self) -> Any | None:
        cond = self._condition()
        async with cond:
            self._watch_checkpoint()
            generation = self._generation
            while True:
                if generation != self._generation:
                    return None  # a get of the trainer ``rewind`` replaced: its caller is gone
                if self._sentinels and self._sentinels[0] <= self.q.handed:
                    self._sentinels.popleft()
                    return None, self.q.size()
                got = self.q.get() if self.q.size() else None
                if got is not None:
                    return got[1], self.q.size()
                if not self.running:
                    return None
                await cond.wait()

    async def get_queue_size(self) -> int:
        return self.q.size()

    async def pid(self) -> int:
        """The queue's process id (what a crash test kills)."""
        return os.getpid()

    async def get_statistics(self) -> dict[str, Any]:
        self._watch_checkpoint()
        return {**self.q.stats(), "pid": os.getpid(), **self._partials.count()}

    async def clear_queue(self) -> None:
        self._watch_checkpoint()  # verl's task runner calls it after fit's forced save
        log.info("clear_queue: the %d samples not handed out stay durable in %s (drop_all() "
                 "deletes them)", self.q.size(), self.path)

    async def drop_all(self) -> int:
        return self.q.clear()

    async def shutdown(self) -> None:
        self._watch_checkpoint()
        cond = self._condition()
        async with cond:
            self.running = False
            cond.notify_all()

    async def get_memory_usage(self) -> dict[str, Any]:
        return {"queue_samples": self.q.size(), "estimated_memory_bytes": 0,
                "estimated_memory_mb": 0.0}

    async def put_validate(self, data: Any) -> None:
        self._val.append(data)

    async def get_validate(self) -> Any | None:
        return self._val.popleft() if self._val else None

    # -- strawq's additions ----------------------------------------------------------------
    async def commit(self, consumed: int) -> int:
        """A durable trainer checkpoint covers the first ``consumed`` gets of the run."""
        return self.q.commit(int(consumed))

    async def commit_version(self, version: int) -> int:
        """verl's trainer saved the checkpoint of weight version ``version``."""
        if not self._per_version:
            raise ConfigError("commit_version needs actor_rollout_ref.actor.ppo_mini_batch_size "
                              "and async_training.trigger_parameter_sync_step in the config; "
                              "call commit(consumed) with the number of gets instead")
        return self.q.commit(int(version) * self._per_version)

    async def rewind(self) -> int:
        """A trainer restored from its newest checkpoint: commit what that checkpoint covers,
        then hand every other lease out again, oldest first."""
        cond = self._condition()
        async with cond:
            self._watch_checkpoint()
            self._generation += 1
            cond.notify_all()
            return self.q.rewind()

    async def where(self) -> dict[str, Any]:
        """The queue's directory and whether it fsyncs: where ``StrawqMessageQueueClient``
        writes its puts."""
        return {"path": os.path.abspath(self.path), "fsync": self.fsync}

    async def is_held(self, sample_id: str) -> bool:
        return self.q.is_held(sample_id)

    async def put_partial(self, key: str, prefix: Any) -> str:
        return str(self._partials.put(key, prefix))

    async def get_partial(self, key: str) -> Any | None:
        return self._partials.claim(key)

    async def finish_partial(self, handle: str) -> None:
        self._partials.finish(handle)


def _error(exc: BaseException) -> dict[str, str]:
    """A batch file's answer when it could not be stored (``put_written_batches``)."""
    return {"error": f"{type(exc).__name__}: {exc}"}


def actor_class(**options: Any) -> Any:
    """``StrawqMessageQueue`` as a Ray actor class, with verl's options (``num_cpus=2``,
    ``max_concurrency=20``) unless ``options`` says otherwise."""
    import ray  # verl's queue is a Ray actor: the one import of Ray here

    opts = {"num_cpus": 2, "max_concurrency": 20, **options}
    return ray.remote(**opts)(StrawqMessageQueue)


def install() -> None:
    """Make verl's fully-async entry point create ``StrawqMessageQueue``, its client
    ``StrawqMessageQueueClient`` (puts written by the Rollouter: ``queue_client``) and the
    durable partial-rollout client. Run in every Ray worker by
    ``+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=strawq.collector.integrations.verl.queue.install``,
    or call it before ``fully_async_main.main()`` in a driver that runs the task runner."""
    from verl.experimental.fully_async_policy import fully_async_main, message_queue

    from strawq.collector.integrations.verl.queue_client import StrawqMessageQueueClient

    actor = actor_class()
    for module in (message_queue, fully_async_main):
        setattr(module, "MessageQueue", actor)  # noqa: B010 (mypy: a class name)
        setattr(module, "MessageQueueClient", StrawqMessageQueueClient)  # noqa: B010
    try:
        from strawq.collector.integrations.verl.client import install_partial_client
    except ImportError:  # pragma: no cover - verl without its rollout client
        return
    install_partial_client()
