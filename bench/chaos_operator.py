"""The chaos benchmark's operator workload (``chaos.py --workload operator``): an operator's
commands on a live run while the nemesis strikes.

A module of ``chaos.py`` (not a benchmark of its own). The run is the default workload's
with ``max_attempts=1``, so that leases the faults cut short (a producer killed or stopped
past the lease timeout) spend a task's attempts and drops happen (``lease_expired.max_attempts``
and the like). The trainer (``chaos.py --role operator-trainer``) is the default one plus a
weight update after every step (``reader.bracket.weight_update(push)``: the producers pause,
both sim engines load the new version, the producers resume on it), and after a restore
``bracket.restore(push, state)``; so the weight version advances and brackets are open a
good part of the time. Engines restart on the newest version the trainer pushed (as in the
slime workload, ``chaos_slime.engine_argv``).

The operator, every 0.7 s (its command is a victim of the nemesis like any process):
``strawq release``, ``strawq status --json``, ``strawq gc``, ``strawq bracket status``, and
``strawq requeue RUN --reason R --json`` for a reason found in ``dropped/`` (or one that
has none: a refusal; while ``dropped/`` holds drops the operator requeues them first, before
a ``gc`` folds them into the drop audit, where they cannot be requeued). And when the
nemesis kills the trainer, before its restart: ``strawq
bracket status``, then ``strawq bracket finish`` (or, one time in four, ``strawq bracket
abort``) — the settle of a bracket whose trainer died — and the engines are probed right
after: every engine that answers must hold the run's announced version (then the weights an
engine loads when it restarts are that version's again, as an operator who undid an update
puts the old weights back).

Each command's exit status and output is recorded. A command is **failed** when its output
holds a Python traceback, when it exits other than 0, 1 or 2 without having been killed by
the nemesis, when it exits 1 or 2 without a message, or when it took a wrong decision (a
``bracket finish`` or ``abort`` after which an engine holds another version than the one
announced). A refusal with a clear message is fine. The total-queue check is the default
one: a requeued row is a fresh generation of the same task, so it counts once when it is
trained once and twice (``duplicated``) when it is trained twice; a requeued row trained by
nobody and not dropped again is ``lost``. Before the trainer is told the run is done, a
requeue that landed after the collector had drained gets a collector again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaos_fleet import write_atomic, write_json_atomic
from chaos_slime import engine_argv, push_weights
from chaos_versions import trained_samples

PY = sys.executable
CHAOS = str(Path(__file__).with_name("chaos.py"))
ROOT = Path(__file__).resolve().parents[1]


# -- the trainer role ------------------------------------------------------------------------

def operator_trainer(run: str, ckpt: str, events: str, interval: int, step_s: float,
                     done: str, engines: list[str], latest: str) -> int:
    """chaos.py's trainer (train, ack, state_dict, save, commit every ``interval`` steps)
    with a weight update pushed to ``engines`` after every step."""

    from strawq.collector.errors import BatchTimeout, RunFinished
    from strawq.collector.trainer.reader import BatchReader

    def log(**ev: Any) -> None:
        with open(events, "a", encoding="utf-8") as f:
            f.write(json.dumps({"t": time.time(), **ev}) + "\n")

    def push(version: int) -> None:
        push_weights(engines, version, latest)

    reader = BatchReader.open(run)
    model: list[dict[str, Any]] = []
    steps = 0
    if os.path.exists(ckpt):
        with open(ckpt, encoding="utf-8") as f:
            saved = json.load(f)
        model, steps = saved["model"], saved["steps"]
        reader.load_state_dict(saved["strawq"])
        rep = reader.bracket.restore(push, saved["strawq"], timeout=120)
        log(event="update", version=rep.version, continued=rep.continued, restore=True)
    log(event="start", steps=steps)

    def checkpoint() -> None:
        state = reader.state_dict()
        write_json_atomic(ckpt, {"model": model, "steps": steps, "strawq": state})
        reader.commit(state)
        log(event="ckpt", steps=steps, seq=state["batch_seq"])

    while True:
        try:
            batch = reader.next_batch(timeout=0.5)
        except (BatchTimeout, RunFinished) as exc:
            # the run has finished (every batch acked): the collector waits for the last
            # commit before it exits, so commit it now rather than at `done`
            if isinstance(exc, RunFinished) or os.path.exists(done):
                checkpoint()
                return 0
            continue
        groups = [{"id": g.id, "gen": g.gen, "tokens": int(sum(s["sample_lens"])),
                   # the tokens, for the "invented" check
                   "samples": trained_samples(reader.queue.read_group(g.id, g.gen))}
                  for g, s in zip(batch.groups, batch.summaries, strict=True)]
        time.sleep(step_s)  # the optimizer step
        model.append({"seq": batch.seq, "groups": groups})
        steps += 1
        log(event="batch", seq=batch.seq, step=steps, ids=[g["id"] for g in groups])
        reader.ack(batch)
        rep = reader.bracket.weight_update(push, timeout=120)
        log(event="update", version=rep.version, continued=rep.continued)
        if steps % interval == 0:
            checkpoint()


# -- the operator ----------------------------------------------------------------------------

@dataclass
class Command:
    n: int
    what: str
    argv: list[str]
    log: str
    p: subprocess.Popen[bytes] | None = None
    rc: int | None = None
    output: str = ""
    #: a wrong decision seen right after it (bracket finish/abort), else ""
    wrong: str = ""
    #: task ids a requeue put back (its --json report)
    requeued: tuple[str, ...] = ()

    def collect(self) -> None:
        if self.p is not None and self.rc is None:
            self.rc = self.p.wait()
        with open(self.log, encoding="utf-8", errors="replace") as f:
            self.output = f.read()
        if self.what == "requeue" and self.rc == 0:
            try:
                self.requeued = tuple(json.loads(self.output).get("task_ids", []))
            except ValueError:
                pass

    @property
    def failure(self) -> str:
        if "Traceback (most recent call last)" in self.output:
            return "traceback"
        if self.wrong:
            return f"wrong decision: {self.wrong}"
        if self.rc is None or self.rc in (0, -signal.SIGKILL):
            return ""
        if self.rc in (1, 2):
            return "" if self.output.strip() else f"exit {self.rc} without a message"
        return f"exit {self.rc}"


def _strawq(*args: str) -> list[str]:
    return [PY, "-m", "strawq", *args]


def setup(ch: Any) -> None:
    """The run's trainer pushes weights after every step; engines restart on the newest."""
    latest = str(ch.work / "weights-latest")
    engines = [f"http://127.0.0.1:{port}" for port in ch.engine_ports]
    for i in range(2):
        proc = ch.procs[f"engine{i}"]
        proc.argv = engine_argv(proc.argv, latest)
    ch.procs["trainer"].argv = [
        PY, CHAOS, "--role", "operator-trainer", "--run", ch.path(1), "--ckpt", ch.ckpt,
        "--events", ch.events, "--interval", str(ch.interval), "--step-s", str(ch.step_s),
        "--done", ch.done, "--latest", latest, "--engines", ",".join(engines)]
    ch.op_commands = []
    ch.op_dir = ch.work / "operator"
    ch.op_dir.mkdir()
    ch.engine_urls = engines
    ch.latest = latest
    ch.on_kill = on_kill


def _command(ch: Any, what: str, argv: list[str]) -> Command:
    n = len(ch.op_commands)
    cmd = Command(n, what, argv, str(ch.op_dir / f"{n:04d}-{what}.log"))
    ch.op_commands.append(cmd)
    return cmd


def _reasons(ch: Any) -> list[str]:
    """The drop reasons in ``dropped/`` now (the operator reads them off the run)."""
    from strawq.storage import open_storage
    from strawq.tasks.states import TaskState, names_in
    storage = open_storage(ch.run_a, writer_id="chaos-operator")
    return sorted({n.producer or "" for n in names_in(storage, TaskState.DROPPED)} - {""})


def tick(ch: Any) -> None:
    """One operator command, run as the ``operator`` process (a nemesis victim)."""
    op = ch.procs["operator"]
    if op.p is not None and ch.op_commands and ch.op_commands[-1].p is op.p:
        ch.op_commands[-1].collect()
    rng = ch.operator_rng
    if not getattr(ch, "op_cycle", None):  # every command once a round, in a random order
        ch.op_cycle = list(range(6))
        rng.shuffle(ch.op_cycle)
    reasons = _reasons(ch)
    i = 5 if reasons else ch.op_cycle.pop()  # drops are requeued before a gc folds them
    path = ch.path(i)
    if i == 0:
        what, argv = "release", _strawq("release", path, ch.dataset, "--count", "4", "-q")
    elif i == 1:
        what, argv = "status", _strawq("status", path, "--json", "-q")
    elif i == 2:
        what, argv = "gc", _strawq("gc", path, "-q")
    elif i == 3:
        what, argv = "bracket-status", _strawq("bracket", "status", path)
    else:
        reasons = reasons or ["lease_expired.max_attempts"]
        what, argv = "requeue", _strawq("requeue", path, "--reason", rng.choice(reasons),
                                        "--json", "-q")
    cmd = _command(ch, what, argv)
    op.argv, op.log = argv, cmd.log
    op.start()
    cmd.p = op.p


def _run(ch: Any, what: str, argv: list[str]) -> Command:
    """A command the operator runs and waits for (not a victim)."""
    cmd = _command(ch, what, argv)
    with open(cmd.log, "ab") as out:
        cmd.p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            cmd.p.wait(60)
        except subprocess.TimeoutExpired:
            cmd.p.kill()
    cmd.collect()
    return cmd


def _engine_versions(urls: list[str]) -> dict[str, str]:
    found = {}
    for url in urls:
        try:
            with urllib.request.urlopen(f"{url}/model_info", timeout=2) as r:
                found[url] = str(json.load(r)["weight_version"])
        except (OSError, ValueError, KeyError):
            continue  # down or restarting: it starts on the newest pushed version
    return found


def on_kill(ch: Any, victim: str) -> None:
    """The trainer was killed (maybe inside its bracket): settle the bracket by hand."""
    if victim != "trainer":
        return
    from strawq.storage import open_storage
    from strawq.tasks.queue import RunQueue

    path = ch.path(ch.operator_rng.randrange(2))
    _run(ch, "bracket-status", _strawq("bracket", "status", path, "--json"))
    abort = ch.operator_rng.random() < 0.25
    what = "bracket-abort" if abort else "bracket-finish"
    cmd = _run(ch, what, _strawq("bracket", "abort" if abort else "finish", path, "--json"))
    if cmd.rc == 0:
        queue = RunQueue.open(open_storage(ch.run_a, writer_id="chaos-operator"))
        version = str(queue.current_version())
        # the weights an engine loads when it starts are the announced version's again (an
        # undo or an abort leaves the bracket's on disk: the operator puts the old ones back)
        write_atomic(ch.latest, version)
        held = _engine_versions(ch.engine_urls)
        wrong = {u: v for u, v in held.items() if v != version}
        if wrong:
            cmd.wrong = f"announced version {version}, engines hold {wrong}"


def before_done(ch: Any, deadline_s: float = 120.0) -> None:
    """The operator's last command is done; tasks it requeued after the collector drained
    get a collector again (as an operator would start one)."""
    from strawq.storage import open_storage
    from strawq.tasks.states import TaskState, names_in

    op = ch.procs["operator"]
    if op.stopped:
        op.signal(signal.SIGCONT)
        op.stopped = False
    if op.p is not None:
        op.p.wait()
    storage = open_storage(ch.run_a, writer_id="chaos-operator")
    end = time.time() + deadline_s
    while any(names_in(storage, s) for s in (TaskState.PENDING, TaskState.LEASED,
                                             TaskState.READY)):
        col = ch.procs["collector"]
        if not col.alive():
            ch.procs["collector"] = ch._collector(col.restarts + 1)
            ch.procs["collector"].restarts = col.restarts + 1
            ch.procs["collector"].start()
            ch.late_collectors = getattr(ch, "late_collectors", 0) + 1
        if time.time() > end:
            break
        time.sleep(0.2)
    col = ch.procs["collector"]
    if col.p is not None:
        try:
            col.p.wait(max(end - time.time(), 1))
        except subprocess.TimeoutExpired:
            pass


def operator_report(ch: Any, res: dict[str, Any]) -> None:
    """Per command kind: runs, exit statuses, failures; requeued rows and how they ended."""
    from collections import Counter, defaultdict

    for cmd in ch.op_commands:
        if cmd.rc is None or not cmd.output:
            cmd.collect()
    kinds: dict[str, Counter[str]] = defaultdict(Counter)
    failures = []
    for cmd in ch.op_commands:
        rc = "killed" if cmd.rc == -signal.SIGKILL else str(cmd.rc)
        kinds[cmd.what][rc] += 1
        if cmd.failure:
            failures.append(cmd)
    print("operator commands (exit status: count):")
    for what in sorted(kinds):
        print(f"  {what:<15} {sum(kinds[what].values()):>4}  "
              + ", ".join(f"{k}: {v}" for k, v in sorted(kinds[what].items())))
    trained = Counter(g["id"] for g in res["lineage"])
    requeued = {t for cmd in ch.op_commands for t in cmd.requeued}
    once = sum(1 for t in requeued if trained[t] == 1)
    dropped = sum(1 for t in requeued if trained[t] == 0 and t in set(res["dropped"]))
    print(f"operator: {len(requeued)} rows requeued: {once} trained once, {dropped} dropped "
          f"again, {sum(1 for t in requeued if trained[t] > 1)} trained twice; "
          f"{getattr(ch, 'late_collectors', 0)} collectors started for requeues after the "
          "drain")
    for cmd in failures[:10]:
        tail = cmd.output.strip().splitlines()[-3:]
        print(f"operator command FAILED ({cmd.failure}): {' '.join(cmd.argv[2:])} -> "
              f"exit {cmd.rc}: {' | '.join(tail)}")
    res["operator_failures"] = [c.n for c in failures]
    print(f"operator: {len(ch.op_commands)} commands, {len(failures)} failed")


__all__ = ["before_done", "on_kill", "operator_report", "operator_trainer", "setup", "tick"]
