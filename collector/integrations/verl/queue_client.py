"""``StrawqMessageQueueClient``: verl's ``MessageQueueClient``, whose puts write the sample
where it is made (``docs/verl.md``).

verl's Rollouter puts every finished sample (a pickle of ~140 KB) through a Ray call to the
queue actor; with strawq's queue the actor then writes it to disk. This client writes the
record itself, in the Rollouter's process, into the queue directory's ``incoming/``
(``samples.IncomingWriter``: durable before the queue hears of it), and sends the queue only
its name (``StrawqMessageQueue.put_written_many``: one rename there; the names of the
puts written while a call is out go in one call). The sample's bytes cross no
Ray call and the queue actor does no storage work per put beyond that rename. A sample small
enough for Ray to pass inside the call (under 100 KiB) is sent as verl's client sends it:
there the call is cheaper than a file.

Only where the queue directory is on a local filesystem (``writes_here``): on a shared mount
(JuiceFS, NFS) a file a put costs more metadata operations than the queue's batch files of
many puts, and puts go through the actor (``on_shared_mounts=True`` writes there too). Where
the queue actor cannot see the written file (a local directory, the actor on another node),
``put_written`` returns None: this client deletes it and puts through the actor from then on,
as verl's client does.
``install()`` (``strawq.collector.integrations.verl.queue``) makes verl's fully-async entry
point build this client.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from verl.experimental.fully_async_policy.message_queue import MessageQueueClient

from strawq.collector.integrations.verl.samples import IncomingWriter, Written
from strawq.doctor.mounts import LOCAL_TYPES, find_mount
from strawq.errors import StrawqError
from strawq.storage import PosixStorage

log = logging.getLogger(__name__)

__all__ = ["StrawqMessageQueueClient"]

#: threads writing this client's puts (each: record, file fsync, rename; the directory
#: fsync shared by those written at once)
WRITERS = 8
#: the smallest sample written here: Ray passes a smaller argument inside the call itself
#: (its ``max_direct_call_object_size``, 100 KiB by default), which costs less than a file
#: here; a larger one goes through Ray's object store, which costs more (docs/benchmarks.md,
#: "verl queue")
WRITE_FROM_BYTES = 100 * 1024
#: filesystems a putter writes its puts on (the queue directory on a local disk: doctor's
#: local types, and a container's overlay): on a shared mount (JuiceFS, NFS: every file a
#: round trip of metadata operations, and its fsync an upload) a file a put costs more than
#: the queue's own batch files of many puts, so puts go through the actor there
#: (docs/benchmarks.md, "verl queue")
LOCAL_FILESYSTEMS = LOCAL_TYPES | {"overlay"}


def writes_here(path: str, *, mountinfo: str = "/proc/self/mountinfo") -> bool:
    """Whether a putter writes its puts into the queue directory ``path`` itself: where that
    directory is on a local filesystem (``LOCAL_FILESYSTEMS``, read from the mount table)."""
    return find_mount(path, mountinfo).fs_type in LOCAL_FILESYSTEMS


class StrawqMessageQueueClient(MessageQueueClient):
    """verl's ``MessageQueueClient`` over ``StrawqMessageQueue``: puts written here, every
    other call verl's own. Picklable as verl's is (Ray hands it to the Rollouter and the
    Trainer): only the actor handle travels; the writer is made where it is used. A sample
    smaller than ``write_from_bytes`` goes through the actor, as verl's client sends it."""

    def __init__(self, queue_actor: Any, *, write_from_bytes: int = WRITE_FROM_BYTES,
                 on_shared_mounts: bool = False) -> None:
        super().__init__(queue_actor)
        self.write_from_bytes = int(write_from_bytes)
        #: write puts here on a shared mount too (``writes_here``: not by default)
        self.on_shared_mounts = bool(on_shared_mounts)
        #: the writer into the queue's directory; None until the first put asks the queue
        #: where it is, False once the queue could not see a file written here
        self._writer: IncomingWriter | bool | None = None
        self._pool: ThreadPoolExecutor | None = None
        #: puts written here and named by the queue, puts sent through the actor
        self.written = 0
        self.sent = 0
        #: ``put_written_many`` calls made (each names the puts written while the last was out)
        self.naming_calls = 0
        #: written puts waiting for the queue to name them, and whether a call is out
        self._naming: list[tuple[Written, asyncio.Future[bool | None]]] = []
        self._sending = False
        self._senders: set[asyncio.Task[None]] = set()

    def __getstate__(self) -> dict[str, Any]:
        return {"queue_actor": self.queue_actor, "write_from_bytes": self.write_from_bytes,
                "on_shared_mounts": self.on_shared_mounts}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["queue_actor"],  # type: ignore[misc]
                      write_from_bytes=state["write_from_bytes"],
                      on_shared_mounts=state["on_shared_mounts"])

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        ref = getattr(self.queue_actor, method).remote(*args, **kwargs)
        return await asyncio.wrap_future(ref.future())

    async def _name(self, written: Written) -> bool | None:
        """Have the queue name a written put: the puts written while a call is out go in the
        next call together (``put_written_many``: one Ray call for them all)."""
        done: asyncio.Future[bool | None] = asyncio.get_running_loop().create_future()
        self._naming.append((written, done))
        if not self._sending:
            self._sending = True
            task = asyncio.get_running_loop().create_task(self._send_names())
            self._senders.add(task)
            task.add_done_callback(self._senders.discard)
        return await done

    async def _send_names(self) -> None:
        try:
            while self._naming:
                batch, self._naming = self._naming, []
                self.naming_calls += 1
                try:
                    answers = await self._call(
                        "put_written_many", [(w.name, w.sample_id, w.size) for w, _ in batch])
                    if len(answers) != len(batch):
                        raise RuntimeError(f"verl queue: {len(answers)} answers to "
                                           f"{len(batch)} written puts")
                except BaseException as exc:  # every put of the call fails with it
                    for _, done in batch:
                        if done.done():
                            continue
                        if isinstance(exc, Exception):
                            done.set_exception(exc)
                        else:  # this sender was cancelled
                            done.cancel()
                    if not isinstance(exc, Exception):
                        raise
                    continue
                for (_, done), answer in zip(batch, answers, strict=True):
                    if not done.done():
                        done.set_result(answer)
        finally:
            self._sending = False
            left, self._naming = self._naming, []
            for _, done in left:  # this sender was cancelled: no call will name them
                done.cancel()

    async def connect(self) -> bool:
        """Ask the queue where it lives (the first put does otherwise). True when puts will
        be written here (until the queue finds it cannot see them)."""
        return await self._writer_here() is not None

    async def _writer_here(self) -> IncomingWriter | None:
        if self._writer is None:
            where = await self._call("where")
            if self._writer is None and not (self.on_shared_mounts
                                             or writes_here(str(where["path"]))):
                log.info("verl queue: %s is on a shared mount: puts go through the actor "
                         "(its batch files cost fewer metadata operations there)",
                         where["path"])
                self._writer = False
            if self._writer is None:  # not made by a put that asked at the same time
                try:
                    self._writer = IncomingWriter(PosixStorage(
                        str(where["path"]), writer_id="verlc", fsync=bool(where["fsync"])))
                except (OSError, StrawqError) as exc:
                    log.warning("verl queue: cannot write into %s here (%s): puts go through "
                                "the actor", where["path"], exc)
                    self._writer = False
                else:
                    self._pool = ThreadPoolExecutor(WRITERS, thread_name_prefix="verlq-client")
        return self._writer if isinstance(self._writer, IncomingWriter) else None

    async def put_sample(self, sample: Any, **meta: Any) -> bool:
        """verl's put: durable when it returns; False when the queue was full and dropped its
        oldest sample not handed out."""
        small = sample is None or (isinstance(sample, (bytes, bytearray, memoryview))
                                   and memoryview(sample).nbytes < self.write_from_bytes)
        writer = None if small else await self._writer_here()
        if writer is None or self._pool is None:
            self.sent += 1
            return bool(await self._call("put_sample", sample, **meta))
        loop = asyncio.get_running_loop()
        sample_id = meta.pop("sample_id", None)
        written = await loop.run_in_executor(
            self._pool, lambda: writer.write(sample, sample_id=sample_id, meta=meta))
        ok = await self._name(written)
        if ok is None:  # the queue's process cannot see this directory: send the bytes
            writer.discard(written.name)
            if self._writer is not False:
                log.warning("verl queue: the queue actor cannot see %s as this process does "
                            "(not a shared directory): puts go through the actor",
                            writer.storage.describe())
            self._writer = False
            self.sent += 1
            return bool(await self._call("put_sample", sample, sample_id=sample_id, **meta))
        self.written += 1
        return bool(ok)
