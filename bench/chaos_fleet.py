"""The chaos benchmark's fleet-time phase: seconds the live fleet loses per failure.

A module of ``chaos.py`` (not a benchmark of its own). One run at the queue's default lease
timeout (60 s) and the collector's default takeover timeout (30 s), heartbeats every 0.5 s;
a sim engine, two producers, a collector and a trainer (``chaos.py --role fleet-trainer``)
that runs a weight-update bracket after every batch, pushing to the engine. Then one failure
of each kind, each ``kill -9`` followed by an immediate restart (as a supervisor would):

* **producer**: the seconds the next bracket kept the live producers paused (its wait);
* **collector**: the seconds from the kill until the restarted collector holds the run
  (no new batch meanwhile);
* **trainer**, killed while its bracket holds the producers paused: the seconds from the
  kill until the restarted trainer resumed them (its process start included; the part its
  first bracket waited is printed beside it).

Two faults of operators, beside them:

* **two trainers**: a second trainer process started on the run while the first lives (a
  preempted job requeued while the old one still runs). It must be refused (the trainer
  fence) having trained nothing; the seconds to its refusal, the batches it trained
  (duplicated) and the batches the first one trained but could not ack meanwhile (lost).
* **same producer id**: a producer killed and restarted under the id it had. The seconds
  until none of the killed process's leases is still held (the new incarnation hands them
  back), the tasks it held that are in no state (lost), and tasks in two states or two
  batches (duplicated).
* **rolling upgrade**: parts restarted one by one onto a release that writes a newer group
  format, ``strawq upgrade`` refused while an old part lives
  (``strawq.testing.upgrade.rolling_upgrade``, 24 tasks): tasks lost and duplicated.

Printed as ``chaos: fleet seconds lost per failure = X (producer Y, collector Z, trainer W);
two trainers: refused in R s, lost = 0, duplicated = 0; same producer id: leases back in S s,
lost = 0, duplicated = 0; rolling upgrade: lost = 0, duplicated = 0`` with X the mean of the
first three.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
CHAOS = str(Path(__file__).with_name("chaos.py"))


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` durably: a temporary file, fsync, rename, fsync of the
    directory (a kill at any instant leaves the old file or the new one)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str, obj: Any) -> None:
    write_atomic(path, json.dumps(obj))


def _strawq(*args: str) -> list[str]:
    return [PY, "-m", "strawq", *args]


# -- the trainer role ------------------------------------------------------------------------

def fleet_trainer(run: str, events: str, engine: str) -> int:  # noqa: C901
    """Train (sleep), ack, then a weight update pushed to ``engine``; log each update."""
    from strawq.collector.errors import BatchTimeout
    from strawq.collector.trainer.fence import TrainerBusy
    from strawq.collector.trainer.reader import BatchReader
    from strawq.errors import StrawqError

    def log(**ev: Any) -> None:
        with open(events, "a", encoding="utf-8") as f:
            f.write(json.dumps({"t": time.time(), "pid": os.getpid(), **ev}) + "\n")

    def push(version: int) -> None:
        body = json.dumps({"model_path": "fleet", "weight_version": str(version),
                           "abort_all_requests": False, "flush_cache": True}).encode()
        req = urllib.request.Request(f"{engine}/update_weights_from_disk", data=body,
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=30).read()
        time.sleep(0.3)  # a push takes a while: the producers stay paused meanwhile

    reader = BatchReader.open(run)
    log(event="start")
    first = True
    try:
        while True:
            began = time.time()
            rep = reader.bracket.weight_update(push, timeout=600)
            log(event="update", began=began, waited=rep.waited_s, dead=sorted(rep.dead),
                continued=rep.continued, first=first, version=rep.version)
            first = False
            try:
                batch = reader.next_batch(timeout=0.5)
            except BatchTimeout:
                continue
            time.sleep(0.05)  # the optimizer step
            log(event="train", seq=batch.seq)
            try:
                reader.ack(batch)
            except StrawqError as exc:
                log(event="ack_refused", seq=batch.seq, error=str(exc))
                raise
    except TrainerBusy as exc:  # another trainer holds the run: this one trains nothing
        log(event="refused", error=str(exc))
        print(f"fleet trainer refused: {exc}", file=sys.stderr)
        return 3


# -- the phase -------------------------------------------------------------------------------

class _Proc:
    def __init__(self, argv: list[str], log: str) -> None:
        self.argv, self.log = argv, log
        self.p: subprocess.Popen[bytes] | None = None

    def start(self, extra: list[str] | None = None) -> None:
        with open(self.log, "ab") as out:
            self.p = subprocess.Popen([*self.argv, *(extra or [])], stdout=out,
                                      stderr=subprocess.STDOUT, cwd=ROOT,
                                      start_new_session=True)

    def kill9(self) -> None:
        assert self.p is not None
        self.p.send_signal(signal.SIGKILL)
        self.p.wait()

    def stop(self) -> None:
        if self.p is not None and self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
            self.p.wait()


def _wait(cond: Any, what: str, deadline_s: float = 300.0) -> float:
    end = time.time() + deadline_s
    while time.time() < end:
        if cond():
            return time.time()
        time.sleep(0.02)
    raise RuntimeError(f"fleet phase: {what} did not happen within {deadline_s:.0f}s")


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def fleet_lost(work: Path) -> dict[str, Any]:
    """Run the phase in ``work``; returns the seconds lost per failure kind."""
    from strawq.storage import open_storage
    from strawq.tasks.epochs import epochs, list_names
    from strawq.tasks.queue import RunQueue
    from strawq.tasks.states import TaskState, names_in
    from strawq.weights.control import read_state

    work.mkdir(parents=True, exist_ok=True)
    run = str(work / "run")
    dataset = str(work / "prompts.jsonl")
    with open(dataset, "w", encoding="utf-8") as f:
        for i in range(20000):
            f.write(json.dumps({"prompt": [3 + i % 97, 5, 7], "count": 4, "i": i}) + "\n")
    subprocess.run(_strawq("init", run, "-q", "--set", "group_size=4",
                           "--set", "heartbeat_interval_s=0.5", "--set", "release_batch=8",
                           "--set", "max_attempts=50"), check=True, cwd=ROOT)
    port = _free_port()
    engine = f"http://127.0.0.1:{port}"
    procs: list[_Proc] = []

    def proc(argv: list[str], name: str) -> _Proc:
        procs.append(_Proc(argv, str(work / f"{name}.log")))
        return procs[-1]

    eng = proc(_strawq("engine", "serve", "--kind", "sim", "--port", str(port),
                       "--step-base-ms", "4", "--len-median", "8", "--len-cap", "24", "-q"),
               "engine")
    producers = [proc(_strawq("producer", run, "--engine", engine, "--slots", "2",
                              "--set", "sampling.max_new_tokens=24",
                              "--reward", "strawq.producers.rewards.count_task", "-q"),
                      f"producer{i}") for i in range(2)]
    collector = proc(_strawq("collector", run, dataset, "--set", "batch_groups=2",
                             "--set", "poll_interval_s=0.05",
                             "--set", "max_prefetch_batches=1", "-q"), "collector")
    events = str(work / "fleet.events.jsonl")
    trainer = proc([PY, CHAOS, "--role", "fleet-trainer", "--run", run, "--events", events,
                    "--engine", engine], "trainer")
    storage = open_storage(run, writer_id="fleet-bench")

    def logged(kind: str) -> list[dict[str, Any]]:
        if not os.path.exists(events):
            return []
        with open(events, encoding="utf-8") as f:
            return [e for e in map(json.loads, f) if e["event"] == kind]

    def updates() -> list[dict[str, Any]]:
        return logged("update")

    out: dict[str, Any] = {}
    try:
        eng.start()
        _wait(lambda: _health(engine), "the engine to start")
        for i, p in enumerate(producers):
            p.start(["--producer-id", f"fleet-p{i}.r0"])
        collector.start()
        trainer.start()
        _wait(lambda: len(updates()) >= 4, "four weight updates")
        # -- producer: the next bracket's wait for the dead one
        producers[0].kill9()
        killed = time.time()
        producers[0].start(["--producer-id", "fleet-p0.r1"])
        _wait(lambda: any(u["began"] >= killed for u in updates()),
              "a weight update after the producer kill")
        after = next(u for u in updates() if u["began"] >= killed)
        out["producer"] = after["waited"]
        # -- collector: the kill to the restarted collector holding the run
        epoch = max(epochs(list_names(storage)))
        collector.kill9()
        killed = time.time()
        collector.start()
        held = _wait(lambda: max(epochs(list_names(storage))) > epoch,
                     "the restarted collector to take over")
        out["collector"] = held - killed
        n = len(updates())
        _wait(lambda: len(updates()) > n + 1, "weight updates after the takeover")
        # -- trainer: killed while its bracket holds the producers paused
        for _try in range(20):
            _wait(lambda: read_state(storage).paused, "a bracket to open", 120)
            trainer.kill9()
            killed = time.time()
            st = read_state(storage)
            trainer.start()
            if st.paused:
                break
            # the bracket closed before the kill landed: let it run, try again
            seen = len(updates())
            _wait(lambda seen=seen: len(updates()) > seen + 1,
                  "weight updates after the restart")
        else:
            raise RuntimeError("fleet phase: no trainer kill landed inside a bracket")
        version = st.pause_version
        resumed = _wait(lambda: read_state(storage).resume_version >= version,
                        "the restarted trainer to resume the producers")
        out["trainer"] = resumed - killed
        _wait(lambda: any(u["first"] and u["t"] >= killed for u in updates()),
              "the restarted trainer's first update to be logged")
        first = next(u for u in updates() if u["first"] and u["t"] >= killed)
        out["trainer_bracket"] = first["waited"]
        # -- two trainers: a second one started while the first lives is refused
        second = proc([PY, CHAOS, "--role", "fleet-trainer", "--run", run, "--events", events,
                       "--engine", engine], "trainer2")
        started = time.time()
        second.start()
        assert second.p is not None
        _wait(lambda: second.p is not None and second.p.poll() is not None,
              "the second trainer to be refused", 180)
        refused = [e for e in logged("refused") if e["pid"] == second.p.pid]
        if not refused:
            raise RuntimeError(f"fleet phase: the second trainer was not refused (exit "
                               f"{second.p.returncode}; see {second.log})")
        out["two_trainers"] = refused[0]["t"] - started
        out["two_trainers_duplicated"] = sum(e["pid"] == second.p.pid
                                             for e in logged("train"))
        out["two_trainers_lost"] = len(logged("ack_refused"))
        n = len(updates())
        _wait(lambda: len(updates()) > n + 1, "the first trainer to go on")
        # -- same producer id: killed, restarted under the id it had
        queue = RunQueue.open(storage)
        pid_ = "fleet-p1.r0"
        _wait(lambda: any(t.producer == pid_ for t in names_in(storage, TaskState.LEASED)),
              "the producer to hold a lease", 120)
        producers[1].kill9()
        killed = time.time()
        held = {t.id for t in names_in(storage, TaskState.LEASED) if t.producer == pid_}
        producers[1].start(["--producer-id", pid_])

        def stale() -> set[str]:
            return {t.id for t in names_in(storage, TaskState.LEASED)
                    if t.producer == pid_ and t.id in held and t.gen <= gens[t.id]}

        gens = {t.id: t.gen for t in names_in(storage, TaskState.LEASED) if t.id in held}
        back = _wait(lambda: not stale(), "the killed producer's leases to go back", 120)
        out["same_id"] = back - killed
        out["same_id_lost"], out["same_id_duplicated"] = _oracle(queue, held)
    finally:
        for p in procs:
            p.stop()
    out["mean"] = (out["producer"] + out["collector"] + out["trainer"]) / 3
    # -- a rolling upgrade across an on-disk format change (strawq.testing.upgrade: parts
    # restarted one by one onto a release that writes a newer group format, `strawq
    # upgrade` refused while an old part lives)
    from strawq.testing.upgrade import rolling_upgrade

    up = rolling_upgrade(str(work / "upgrade"), n=24)
    out["upgrade_lost"], out["upgrade_duplicated"] = up.lost, up.duplicated + len(up.problems)
    return out


def _oracle(queue: Any, watched: set[str]) -> tuple[int, int]:
    """(lost, duplicated): tasks of ``watched`` in no state; tasks in two states at once or
    named by two batches."""
    from collections import Counter

    from strawq.delivery.batches import BatchStore
    from strawq.errors import StrawqError
    from strawq.tasks.states import TaskState, names_in

    where: Counter[str] = Counter()
    for state in TaskState:
        try:
            where.update(t.id for t in names_in(queue.storage, state))
        except (StrawqError, ValueError, KeyError):
            continue  # a state without a directory of names (retired)
    batches = BatchStore(queue)
    named: Counter[str] = Counter()
    for seq in batches.batch_seqs()[0]:
        try:
            named.update(str(n.id) for n in batches.read_manifest(seq).groups)
        except StrawqError:
            continue
    lost = sum(1 for t in watched if where[t] == 0)
    duplicated = sum(1 for n in where.values() if n > 1) + sum(1 for n in named.values() if n > 1)
    return lost, duplicated


def _health(url: str) -> bool:
    try:
        urllib.request.urlopen(f"{url}/health", timeout=1)
    except OSError:
        return False
    return True


def line(fl: dict[str, Any]) -> str:
    return (f"chaos: fleet seconds lost per failure = {fl['mean']:.1f} (producer "
            f"{fl['producer']:.1f}, collector {fl['collector']:.1f}, trainer "
            f"{fl['trainer']:.1f}); two trainers: refused in {fl['two_trainers']:.1f} s, "
            f"lost = {fl['two_trainers_lost']}, duplicated = {fl['two_trainers_duplicated']}; "
            f"same producer id: leases back in {fl['same_id']:.1f} s, lost = "
            f"{fl['same_id_lost']}, duplicated = {fl['same_id_duplicated']}; rolling "
            f"upgrade: lost = {fl['upgrade_lost']}, duplicated = {fl['upgrade_duplicated']}")
