"""``strawq cluster up RUN.json``: a whole run on this machine from one run config, no Ray.

It starts, from the sections of one ``RunConfig`` file (``deploy/examples/quickstart.json``
works as shipped):

* the run (``strawq init`` with the ``queue`` section, at ``producer.run_dir``);
* ``placement.engines`` local engines (``strawq engine serve``, the ``sim`` timing model by
  default), each with ``--max-running-requests placement.concurrency``, and a router on the
  port of ``producer.engine.router_url`` that lists them (the trainer pushes weights there);
* ``--producers W`` producer processes (``strawq producer``), W = 1 by default, sharing the
  engines: K = floor(C*E/G) group slots split by ``divmod(K, W)``, printed at start;
* the collector (``strawq collector``) on ``--dataset`` (default: a generated dataset of the
  count task, the one the sim engine and ``strawq.producers.rewards.count_task`` score).

The run folder and the producers' slots come from the one run assembly
(``strawq.demo.assembly``: ``create_run``, ``producer_plan``), as for ``strawq demo`` and
``strawq lab``; here each part is a ``strawq`` command of its own, with its log.

It refuses, before it starts or writes anything (no engine, router or producer started, no
log touched), a run that a live collector holds (another ``cluster up`` on it, say): a
collector epoch that did not close and whose process is not known gone.

Each ``cluster up`` on a workdir is one *incarnation* (numbered in ``WORKDIR/logs/incarnation``).
Each process appends to ``WORKDIR/logs/<name>.log`` after a header line naming the
incarnation, so a crashed incarnation's log is kept above the restart's; producer ids carry
the incarnation (``p-local-<i>-<n>``), never reusing a previous incarnation's id. The
sections it was given are written to ``WORKDIR/<section>.json`` (the producer section
without ``budget.slots`` unless the run config sets it: a ``strawq producer --config`` run
by hand then derives or asks for its slots instead of taking one).

It then waits: SIGINT/SIGTERM (or ``--max-seconds``) stops the producers first (they hand
back their groups), then the collector, the router and the engines. A process that exits on
its own stops the rest; the exit status says whether everything stopped cleanly (0) or one
of them failed (1, naming it and its log).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any
from urllib.parse import urlsplit

from strawq.argtypes import UsageError, positive_float, positive_int
from strawq.errors import ConfigError, StrawqError, os_error_text

#: Default sim engine flags: a fast, short-response timing model for one machine.
SIM_ARGS = "--time-scale 0.05 --len-median 40 --len-cap 200"
#: Seconds an engine or router gets to print its ready line.
READY_TIMEOUT_S = 120.0
#: Seconds a process gets to stop after SIGTERM before it is killed.
STOP_TIMEOUT_S = 60.0


@dataclass
class Child:
    """One started process, its log and (for a server) its URL."""

    name: str
    proc: subprocess.Popen[bytes]
    log: str
    url: str | None = None
    #: where this incarnation's output starts in ``log`` (earlier incarnations' above it)
    offset: int = 0

    def tail(self, lines: int = 5) -> str:
        try:
            with open(self.log, encoding="utf-8", errors="replace") as f:
                f.seek(self.offset)
                return " | ".join(line.strip() for line in f.readlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Cluster:
    """The processes of one local run, in start order (stopped in reverse)."""

    workdir: str
    children: list[Child] = field(default_factory=list)
    #: this ``cluster up``'s number on the workdir (``next_incarnation``)
    incarnation: int = 1

    def spawn(self, name: str, argv: Sequence[str]) -> Child:
        logs = os.path.join(self.workdir, "logs")
        os.makedirs(logs, exist_ok=True)
        path = os.path.join(logs, f"{name}.log")
        out: IO[bytes] = open(path, "ab")  # noqa: SIM115 - the child holds it
        try:
            out.write(f"==== strawq cluster up: incarnation {self.incarnation}, {name} started "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')} ====\n".encode())
            out.flush()
            offset = out.tell()
            proc = subprocess.Popen([sys.executable, "-m", "strawq", *argv], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        finally:
            out.close()
        child = Child(name, proc, path, offset=offset)
        self.children.append(child)
        return child

    def wait_ready(self, child: Child, timeout_s: float = READY_TIMEOUT_S) -> str:
        """The URL on a server's ready line (``STRAWQ_ENGINE_READY <url>``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with open(child.log, encoding="utf-8", errors="replace") as f:
                    f.seek(child.offset)  # this incarnation's lines only
                    for line in f:
                        if line.startswith("STRAWQ_ENGINE_READY "):
                            child.url = line.split()[1]
                            return child.url
            except OSError:
                pass
            if child.proc.poll() is not None:
                raise StrawqError(f"{child.name} exited with status {child.proc.returncode} "
                                  f"before it was ready: {child.tail()} (log: {child.log})")
            if time.monotonic() > deadline:
                raise StrawqError(f"{child.name} printed no ready line within {timeout_s:.0f} "
                                  f"s (log: {child.log}); the machine may be overloaded")
            time.sleep(0.05)

    def exited(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def stop(self) -> list[Child]:
        """SIGTERM each process in reverse start order (waiting for each to stop, killing it
        after ``STOP_TIMEOUT_S``); the ones that failed (killed, or a non-zero status)."""
        failed: list[Child] = []
        for child in reversed(self.children):
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
                try:
                    child.proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()
                    failed.append(child)
                    continue
            if child.proc.returncode not in (0, -signal.SIGTERM):
                failed.append(child)
        return failed


def count_dataset(path: str, rows: int, *, seed: int = 0, eos: int = 2) -> str:
    """A JSONL dataset of the count task (write exactly ``count`` tokens, then stop): token id
    prompts, the one task the sim engine's ids and ``count_task`` score meaningfully."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(rows):
            prompt = [rng.randrange(3, 250) for _ in range(rng.randrange(3, 9))]
            f.write(json.dumps({"prompt": prompt, "count": rng.randrange(4, 60),
                                "eos": eos}) + "\n")
    return path


def _local_port(url: str) -> int:
    parts = urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost") or parts.port is None:
        raise UsageError(f"producer.engine.router_url is {url!r}: cluster up starts the router "
                         "on this machine, so it must be http://127.0.0.1:PORT")
    return parts.port


def _write(path: str, section: Any, *, drop: Sequence[tuple[str, str]] = ()) -> str:
    # owner-only: a section may hold an engine API key (docs/security.md)
    data = section.to_dict()
    for part, key in drop:
        if isinstance(data.get(part), dict):
            data[part].pop(key, None)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w",
              encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    return path


def producer_id(index: int, incarnation: int) -> str:
    """The id of producer ``index`` of ``cluster up`` incarnation ``incarnation``: never one
    an earlier incarnation used (its heartbeat and leases may still be on the run)."""
    return f"p-local-{index}-{incarnation}"


def next_incarnation(workdir: str) -> int:
    """Count this ``cluster up`` on ``workdir``: 1 for the first, then 2, ... (the number is
    kept in ``WORKDIR/logs/incarnation``)."""
    logs = os.path.join(workdir, "logs")
    os.makedirs(logs, exist_ok=True)
    path = os.path.join(logs, "incarnation")
    try:
        with open(path, encoding="utf-8") as f:
            n = int(f.read().strip() or 0) + 1
    except (OSError, ValueError):
        n = 1
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{n}\n")
    return n


def refuse_live_run(run_dir: str) -> None:
    """``StrawqError`` if a live collector may hold the run at ``run_dir`` (reads only)."""
    from strawq.collector.fencing import live_holder
    from strawq.storage import PosixStorage

    if not os.path.exists(os.path.join(run_dir, "run.meta")):
        return
    holder = live_holder(PosixStorage(run_dir))
    if holder is not None:
        raise StrawqError(
            f"the run at {run_dir} is live: {holder}. Nothing was started and no log was "
            "touched. Stop the cluster that runs it first (Ctrl-C in its 'strawq cluster up', "
            "or SIGTERM to its collector), or give this one another producer.run_dir")


def cmd_cluster_up(args: argparse.Namespace) -> int:
    from strawq.app.run_config import RunConfig, slots_explicit
    from strawq.config import load_config
    from strawq.demo.assembly import create_run, producer_plan
    from strawq.storage import open_storage

    cfg = load_config(RunConfig, args.config, args.set, where="run config")
    if cfg.producer is None or cfg.placement is None:
        raise ConfigError(f"{args.config} needs a producer and a placement section (the "
                          "engines are placement.engines of placement.concurrency "
                          "requests); deploy/examples/quickstart.json has both")
    if cfg.producer.engine.router_url is None:
        raise ConfigError(f"{args.config}: producer.engine.router_url is not set; cluster up "
                          "starts a router there (e.g. http://127.0.0.1:32000)")
    router_port = _local_port(cfg.producer.engine.router_url)
    run_dir = os.path.abspath(cfg.producer.run_dir)
    workdir = os.path.abspath(args.workdir or os.path.dirname(run_dir))
    c, e, g = cfg.placement.concurrency, cfg.placement.engines, cfg.group_size
    plan = producer_plan(c, e, g, args.producers)  # ConfigError with the numbers
    refuse_live_run(run_dir)  # before anything is started or written
    drop = () if slots_explicit(args.config, args.set) else (("budget", "slots"),)
    try:
        os.makedirs(workdir, exist_ok=True)
        incarnation = next_incarnation(workdir)
        create_run(open_storage(run_dir, writer_id="cli"), cfg.queue)
        files = {s: _write(os.path.join(workdir, f"{s}.json"), getattr(cfg, s),
                           drop=drop if s == "producer" else ())
                 for s in ("queue", "collector", "producer")}
        dataset = args.dataset or count_dataset(os.path.join(workdir, "data.jsonl"),
                                                args.prompts)
    except OSError as exc:
        raise StrawqError(os_error_text(exc, "write")) from exc
    cluster = Cluster(workdir, incarnation=incarnation)
    quiet = args.quiet

    def say(text: str) -> None:
        if not quiet:
            print(text, flush=True)

    stop = threading.Event()
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    failed: list[Child] = []
    try:
        engine_args = ["--max-running-requests", str(c), *args.engine_args.split()]
        engines = [cluster.spawn(f"engine-{i}", ["engine", "serve", "--kind", args.engine_kind,
                                                  "--port", "0", *engine_args])
                   for i in range(e)]
        urls = [cluster.wait_ready(x) for x in engines]
        router = cluster.spawn("router", ["engine", "serve", "--kind", "router", "--port",
                                          str(router_port), "--worker-urls", ",".join(urls)])
        cluster.wait_ready(router)
        say(f"run {run_dir}: {e} {args.engine_kind} engines of C = {c} ({', '.join(urls)}), "
            f"router {cfg.producer.engine.router_url}")
        for i, (pid, slots) in enumerate(plan.producers(lambda i: producer_id(i, incarnation))):
            cluster.spawn(f"producer-{i}", ["producer", run_dir, "--config", files["producer"],
                                            "--slots", str(slots), "--producer-id", pid])
        say(f"{args.producers} producer(s): K = floor(C*E/G) = floor({c}*{e}/{g}) = "
            f"{plan.budget.total} group slots, split {list(plan.budget.slots)}")
        cluster.spawn("collector", ["collector", run_dir, dataset, "--config",
                                    files["collector"], "--queue-config", files["queue"]])
        say(f"collector on {dataset}; logs in {os.path.join(workdir, 'logs')}\n"
            f"train:  python deploy/examples/trainer_loop.py {run_dir} --router-url "
            f"{cfg.producer.engine.router_url} --weights-dir {os.path.join(workdir, 'weights')}"
            f" --steps 5\nstatus: strawq status {run_dir}\nstop:   Ctrl-C (or SIGTERM)")
        deadline = None if args.max_seconds is None else time.monotonic() + args.max_seconds
        gone: Child | None = None
        while not stop.wait(0.2):
            gone = cluster.exited()
            if gone is not None or (deadline is not None and time.monotonic() > deadline):
                break
        if gone is not None and gone.proc.returncode != 0:
            failed.append(gone)
        elif gone is not None:
            say(f"{gone.name} finished; stopping the others")
    finally:
        say("stopping: producers (they hand back their groups), collector, router, engines")
        failed += [f for f in cluster.stop() if f not in failed]
        for s, h in old.items():
            signal.signal(s, h)
    if failed:
        names = "; ".join(f"{f.name} (status {f.proc.returncode}, log {f.log}: {f.tail(2)})"
                          for f in failed)
        raise StrawqError(f"not every process stopped cleanly: {names}")
    say("stopped")
    return 0


def add_parsers(subparsers: Any) -> None:
    """``strawq cluster up``."""
    up = subparsers.add_parser(
        "up", help="start a run, its engines, producers and collector on this machine",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    up.add_argument("config", help="run config JSON (deploy/examples/quickstart.json works "
                    "as shipped)")
    up.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one run config value (repeatable)")
    up.add_argument("--workdir", help="logs, section files and the generated dataset "
                    "(default: the directory above producer.run_dir)")
    up.add_argument("--dataset", help="prompt dataset (default: a generated count-task "
                    "dataset, WORKDIR/data.jsonl)")
    up.add_argument("--prompts", type=positive_int, default=2000,
                    help="rows of the generated dataset (default 2000)")
    up.add_argument("--producers", type=positive_int, default=1, metavar="W",
                    help="producer processes sharing the engines (default 1)")
    up.add_argument("--engine-kind", choices=("sim", "tiny"), default="sim",
                    help="sim: the timing model (default); tiny: a small torch model")
    up.add_argument("--engine-args", default=SIM_ARGS,
                    help=f"more flags of strawq engine serve (default: {SIM_ARGS!r})")
    up.add_argument("--max-seconds", type=positive_float, default=None,
                    help="stop everything after this long")
    up.set_defaults(func=cmd_cluster_up)
