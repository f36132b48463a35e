"""``StrawqMessageQueueClient``: verl's ``MessageQueueClient``, whose puts write the samples
where they are made (``docs/verl.md``).

verl's Rollouter puts every finished sample (a pickle of ~140 KB) through a Ray call to the
queue actor; with strawq's queue the actor then writes it to disk. This client writes the
records itself, in the Rollouter's process, into the queue directory's ``incoming/``: the
puts waiting go into ONE batch file (``samples.IncomingWriter.write_batch``: one create,
write, fsync and rename for them all, durable before the queue hears of them), and the puts
that arrive while a file is written wait for the next (group commit). The queue is sent
only the file's name and its samples' ids (``StrawqMessageQueue.put_written_batches``: one
rename there; the files written while a call is out go in one call). The samples' bytes
cross no Ray call, and the queue actor does one rename a file.

Every sample is written so by default, on a local disk and on a shared mount (JuiceFS)
alike (docs/benchmarks.md, "verl queue", has the figures): ``write_from_bytes`` sends smaller
samples as verl's client sends them, and ``on_shared_mounts=False`` sends every put so where
the queue directory is not on a local filesystem (``writes_here``). Where the queue actor
cannot see the written file (a local directory, the actor on another node),
``put_written_batches`` answers None for it: this client deletes it and puts through the
actor from then on, as verl's client does.
``install()`` (``strawq.collector.integrations.verl.queue``) makes verl's fully-async entry
point build this client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from verl.experimental.fully_async_policy.message_queue import MessageQueueClient

from strawq.collector.integrations.verl.samples import IncomingWriter, WrittenBatch
from strawq.doctor.mounts import LOCAL_TYPES, find_mount
from strawq.errors import StrawqError
from strawq.storage import PosixStorage

log = logging.getLogger(__name__)

__all__ = ["StrawqMessageQueueClient"]

#: the thread writing this client's batch files: one, so that the puts that arrive while it
#: writes a file (its fsync) wait and go into its next file together (group commit)
WRITERS = 1
#: the most bytes of samples one batch file holds (a larger put alone is a file alone)
FILE_BYTES = 64 << 20
#: a put's answer: what ``put_sample`` returns, None when the queue cannot see the file
_Answer = asyncio.Future[bool | None]
#: the smallest sample written here (0: every sample). A batch file of many puts costs the
#: putter less than a Ray call of each sample costs verl's queue, from 9 KiB samples up, on
#: a local disk and on JuiceFS (docs/benchmarks.md, "verl queue")
WRITE_FROM_BYTES = 0
#: filesystems that are local (the queue directory on a local disk: doctor's local types,
#: and a container's overlay): with ``on_shared_mounts=False`` puts are written here only
#: on these, and go through the actor on a shared mount (JuiceFS, NFS)
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
                 on_shared_mounts: bool = True) -> None:
        super().__init__(queue_actor)
        self.write_from_bytes = int(write_from_bytes)
        #: write puts here on a shared mount too (False: only where ``writes_here``)
        self.on_shared_mounts = bool(on_shared_mounts)
        #: the writer into the queue's directory; None until the first put asks the queue
        #: where it is, False once the queue could not see a file written here
        self._writer: IncomingWriter | bool | None = None
        self._pool: ThreadPoolExecutor | None = None
        #: puts written here and named by the queue, puts sent through the actor
        self.written = 0
        self.sent = 0
        #: batch files written here, and ``put_written_batches`` calls made (each names the
        #: files written while the last was out)
        self.files = 0
        self.naming_calls = 0
        #: puts waiting for the writer, and whether it is at work
        self._waiting: list[tuple[Any, str | None, dict[str, Any], _Answer]] = []
        self._writing = False
        #: batch files written, waiting for the queue to name them, and whether a call is out
        self._naming: list[tuple[WrittenBatch, list[_Answer]]] = []
        self._sending = False
        self._tasks: set[asyncio.Task[None]] = set()
        #: puts begun and not returned yet (verl's end of stream waits for them)
        self._outstanding: set[asyncio.Future[None]] = set()

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

    def _start(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write_files(self, writer: IncomingWriter) -> None:
        """The writer: the puts waiting go into one batch file (``write_batch``: one file,
        fsync and rename for them all), while the puts that arrive meanwhile wait for the
        next (group commit); each file goes to the queue to be named (``_send_names``)
        while the next is written."""
        loop = asyncio.get_running_loop()
        try:
            while self._waiting:
                batch, self._waiting = _take(self._waiting)
                answers = [done for *_, done in batch]
                puts = [(sample, sid, meta) for sample, sid, meta, _ in batch]
                try:
                    assert self._pool is not None
                    written, failed = await loop.run_in_executor(
                        self._pool, writer.write_batch, puts)
                except BaseException as exc:  # every put of the file fails with it
                    _fail(answers, exc if isinstance(exc, Exception) else None)
                    if not isinstance(exc, Exception):
                        raise
                    continue
                for i, error in failed.items():  # a put its record could not be made of
                    _fail([answers[i]], error)
                if written is None:
                    continue
                answers = [done for i, done in enumerate(answers) if i not in failed]
                self.files += 1
                self._naming.append((written, answers))
                if not self._sending:
                    self._sending = True
                    self._start(self._send_names(writer))
        finally:
            self._writing = False
            left, self._waiting = self._waiting, []
            _fail([done for *_, done in left], None)  # cancelled: no file will hold them

    async def _send_names(self, writer: IncomingWriter) -> None:
        """Have the queue name the batch files written: those written while a call is out
        go in the next call together (``put_written_batches``: one Ray call for them all)."""
        try:
            while self._naming:
                files, self._naming = self._naming, []
                self.naming_calls += 1
                try:
                    got = await self._call("put_written_batches",
                                           [(w.name, list(w.parts), w.size) for w, _ in files])
                    if len(got) != len(files):
                        raise RuntimeError(f"verl queue: {len(got)} answers to "
                                           f"{len(files)} batch files")
                    for (written, answers), each in zip(files, got, strict=True):
                        self._answer(writer, written, answers, each)
                except BaseException as exc:  # every put of the call not answered fails
                    for _, answers in files:
                        _fail(answers, exc if isinstance(exc, Exception) else None)
                    if not isinstance(exc, Exception):
                        raise
        finally:
            self._sending = False
            left, self._naming = self._naming, []
            for _, answers in left:  # this sender was cancelled: no call will name them
                _fail(answers, None)

    def _answer(self, writer: IncomingWriter, written: WrittenBatch, answers: list[_Answer],
                each: Any) -> None:
        """Hand the queue's answer for one batch file to its puts: one per place (a put's
        ``{"error": ...}`` fails it), None (the queue cannot see the file: it is deleted, and
        its puts send their bytes), or ``{"error": ...}`` (the file's puts fail with it)."""
        if each is None:
            try:
                writer.discard(written.name)
            except Exception as exc:  # noqa: BLE001 (a file left is adopted by no queue here)
                log.warning("verl queue: could not delete %s (%s)", written.name, exc)
            _settle(answers, [None] * len(answers))
        elif isinstance(each, dict):
            _fail(answers, StrawqError(f"verl queue: the queue could not store batch file "
                                       f"{written.name}: {each.get('error')}"))
        elif isinstance(each, list) and len(each) == len(answers):
            for done, one in zip(answers, each, strict=True):
                if isinstance(one, dict):  # this put's own error
                    _fail([done], StrawqError(f"verl queue: the queue could not store a put "
                                              f"of {written.name}: {one.get('error')}"))
                else:
                    _settle([done], [bool(one)])
        else:
            raise RuntimeError(f"verl queue: {each!r} is no answer for a batch file of "
                               f"{len(answers)} puts")

    async def connect(self) -> bool:
        """Ask the queue where it lives (the first put does otherwise). True when puts will
        be written here (until the queue finds it cannot see them)."""
        return await self._writer_here() is not None

    async def _writer_here(self) -> IncomingWriter | None:
        if self._writer is None:
            where = await self._call("where")
            if self._writer is None and not (self.on_shared_mounts
                                             or writes_here(str(where["path"]))):
                log.info("verl queue: %s is on a shared mount and on_shared_mounts=False: "
                         "puts go through the actor", where["path"])
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
        oldest sample not handed out. verl's end of stream (``None``) is sent once every put
        this client began before it has returned, so it follows them as it would had they
        gone through the actor (a written put waits for its file and its name)."""
        if sample is None:
            if self._outstanding:
                await asyncio.wait(set(self._outstanding))
            return bool(await self._call("put_sample", None, **meta))
        mark: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._outstanding.add(mark)
        try:
            return await self._put(sample, meta)
        finally:
            mark.set_result(None)
            self._outstanding.discard(mark)

    async def _put(self, sample: Any, meta: dict[str, Any]) -> bool:
        # anything but bytes goes through the actor, which refuses it for this put alone
        small = (not isinstance(sample, (bytes, bytearray, memoryview))
                 or memoryview(sample).nbytes < self.write_from_bytes)
        writer = None if small else await self._writer_here()
        if writer is None or self._pool is None:
            self.sent += 1
            return bool(await self._call("put_sample", sample, **meta))
        sample_id = meta.pop("sample_id", None)
        done: _Answer = asyncio.get_running_loop().create_future()
        self._waiting.append((sample, sample_id, meta, done))
        if not self._writing:
            self._writing = True
            self._start(self._write_files(writer))
        ok = await done
        if ok is None:  # the queue's process cannot see this directory: send the bytes
            if self._writer is not False:
                log.warning("verl queue: the queue actor cannot see %s as this process does "
                            "(not a shared directory): puts go through the actor",
                            writer.storage.describe())
            self._writer = False
            self.sent += 1
            return bool(await self._call("put_sample", sample, sample_id=sample_id, **meta))
        self.written += 1
        return bool(ok)


def _take(waiting: list[tuple[Any, str | None, dict[str, Any], _Answer]]
          ) -> tuple[list[tuple[Any, str | None, dict[str, Any], _Answer]],
                     list[tuple[Any, str | None, dict[str, Any], _Answer]]]:
    """The puts of the next batch file (at most ``FILE_BYTES`` of samples, at least one), and
    those left waiting."""
    size = 0
    for i, (sample, *_rest) in enumerate(waiting):
        size += memoryview(sample).nbytes
        if i and size > FILE_BYTES:
            return waiting[:i], waiting[i:]
    return waiting, []


def _settle(answers: list[_Answer], results: list[bool | None]) -> None:
    """Answer the puts not answered yet."""
    for done, result in zip(answers, results, strict=True):
        if not done.done():
            done.set_result(result)


def _fail(answers: list[_Answer], exc: Exception | None) -> None:
    """Fail the puts not answered yet with ``exc`` (None: cancel them)."""
    for done in answers:
        if done.done():
            continue
        if exc is None:
            done.cancel()
        else:
            done.set_exception(exc)
