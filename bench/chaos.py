"""Chaos benchmark: every part a real process, a nemesis of kill -9 and SIGSTOP, then a
total-queue check and a storage check.

    python bench/chaos.py [--quick] [--faults F] [--prompts N] [--workdir DIR]
                          [--juicefs DIR]          # the run on a two-client JuiceFS volume
                          [--disk-full]            # a tmpfs (--juicefs: a quota) the nemesis fills
                          [--fault-kinds K,...]    # of kill9,sigstop,jfs-client,partition,skew
    python bench/chaos.py --workload agentic [--quick] [--turns T] [--tool-min S]
                          [--tool-max S]           # trajectories with tools (chaos_agentic.py)
    python bench/chaos.py --workload slime [--quick]     # slime's rollout loop (chaos_slime.py)
    python bench/chaos.py --workload operator [--quick]  # operator commands (chaos_operator.py)
    python bench/chaos.py --workload stream|flow|regenerate|old-weights [--quick]
                                                   # the trainer advances the weights
                                                   # (chaos_versions.py)
    python bench/chaos.py --workload longgen [--quick]  # long generations: the token RPO
                          [--producer-set K=V] [--before D]  # of every fault (chaos_longgen.py)
    python bench/chaos.py --workload all [--quick] ...  # every workload, then the aggregate

Processes: two sim engines (``strawq engine serve --kind sim``, each behind a counting
proxy in this process that tallies the completion tokens of every ``/generate`` answer by
producer, task and lease generation), two producers (``strawq producer``), the collector
(``strawq collector``), a trainer (this file, ``--role trainer``: a ``BatchReader`` that
checkpoints every few steps in the documented order: train, ack, state_dict, save, commit)
and an operator issuing ``strawq release``, ``strawq status`` and ``strawq gc``. With
``--juicefs`` half of the processes open the run through mount A and half through mount B.

The nemesis picks a victim every ``--gap`` seconds: ``kill -9`` (then a restart after a
short pause; a collector restart takes over after ``takeover_timeout_s``) or ``SIGSTOP``
for up to 3 s (a collector stopped past the takeover timeout is replaced by a new one, and
the stopped one must find itself fenced when it wakes). A kill lands at a random instant,
so some land inside a write (the crash enumerations in ``tests/`` cover each write step).
With ``--disk-full`` (root: it mounts a tmpfs) the run lives on a size-limited tmpfs, and
before a quarter of its picks the nemesis fills the disk with a ballast file instead
(victim ``disk``, kind ``full``) and frees it again after up to ``--max-stop`` seconds.
With ``--disk-full --juicefs`` the full disk is the run's quota on the volume used up
(``chaos_cluster.VolumeQuota``): held from the quota's setting until every client
accepts creates again after it is lifted (clients load quotas at their heartbeat).

Cluster faults (``--fault-kinds``, default ``kill9,sigstop``; ``bench/chaos_cluster.py``
has the parts). Each enabled cluster kind is picked as often as the process faults
together (every kind once per round, in a random order); the victim is a producer, and
the nemesis waits for the fault to heal, as for a SIGSTOP:

* ``jfs-client`` (with ``--juicefs``; root): each producer's host opens the run through a
  JuiceFS client of its own, mounts ``C`` and ``D`` of the test volume beside ``A``
  (collector, operator) and ``B`` (trainer), so that a dead client takes one producer's
  host down and nothing else. The ``juicefs mount`` process under the victim is killed
  with SIGKILL (its supervisor too): the producer's storage calls fail, its heartbeats
  stop and its leases expire on the grantor's clock (lease timeout 2 s; the mount stays
  dead 2.5 s to 2.5 + ``--max-stop`` s); then the client is mounted again at the same
  path with the same options and the producer restarted on it (the host rejoins). The
  victim's leases at the kill and still held at the remount are counted.
* ``partition`` (root, iproute2): each producer runs in a network namespace of its own
  (``ip netns exec``), joined to this one by a veth pair; the engines' proxies listen on
  the host end's address too (and on loopback). The fault takes the host end of the
  victim's link down for 1 to 2 × ``--max-stop`` s: its packets vanish unanswered (no
  reset, no refusal), while the filesystem stays shared and it goes on heartbeating. The
  producers in namespaces run with the client timeouts of ``tests/producers/test_partition.py``
  (connect 0.5 s, control 1 s), so a cut of seconds ends their requests in flight. The
  leases it held at the cut, still held at the heal and claimed during the cut are counted.
* ``skew`` (libfaketime, ``apt-get install -y faketime``): the victim is stopped (SIGTERM:
  it hands back what it holds) and started again with libfaketime preloaded and its clocks
  60 to 600 s ahead or behind, runs so for 2 to 2 + 2 × ``--max-stop`` s, then is restarted
  on the true clock. Each skewed incarnation has its own producer id, so every rid shows it.

A kind this machine cannot run is refused with its reason in one line (exit 1).

Checks, after the nemesis stops and the run drains:
* total queue (Jepsen): every dataset row is trained exactly once in the final model's
  lineage (the trainer's last checkpoint) or dropped with a recorded reason: ``lost`` and
  ``duplicated`` must be 0;
* storage: after ``strawq gc`` only live records remain (no batch, ack, payload, lease,
  staging or task entry).
* invented (every workload): each trained sample's response tokens are a concatenation, in
  the order the engines returned them, of ``/generate`` answers the proxies saw for its
  task and sample (a partial resumed across updates is several answers), and carry the
  per-token weight versions those answers were stamped with (``versions wrong`` otherwise;
  the agentic workload checks the model's own tokens, its tool tokens are not the engines').

Figures (printed, and the last line exactly)::

    chaos: faults = F, lost = L, duplicated = D, invented = I, tokens lost per fault = T,
    recovery p50 = R s   (one line)

T = (completion tokens the engines returned − response tokens in the final model) / F.
Per victim: faults, recovery (restart or SIGCONT → the trainer's next new batch), the tokens
of tasks hit by that victim's faults that were generated and then thrown away, and for the
trainer the steps lost (trained since its last checkpoint). Tokens an engine generated for
an answer it never returned (it was killed) are invisible to the proxy: T is a lower bound.

``--workload agentic`` (``bench/chaos_agentic.py`` has the parts): the producers run the
stateful key-value agent, 10 turns deep (48 prompts, 36 faults by default), each turn
followed by a ``put`` executed by a tool server process (0.5–5 s a call); the victims are the
engines, the producers, the tool server, the collector and the trainer. The trainer records
every trained trajectory; after the total-queue check an oracle checks each against the tool
server's ledger and the store its calls describe. Last line::

    chaos agentic: faults = F, lost = L, duplicated = D, tool effects applied twice = A,
    persisted tool calls re-executed = P, environment mismatches = M, tokens lost per fault
    = T, recovery p50 = R s

(one line; T counts generated tokens only, appended tool tokens are not the engines').

``--workload slime`` (``bench/chaos_slime.py``): the trainer is slime's ``train.py`` loop in
strawq's mode 2 on slime's real objects (``call_rollout_fn(generate_rollout, ...)`` per
rollout, slime's own sample conversion, a model checkpoint every ``--interval`` rollouts and
then ``StrawqBatchSource.save``, ``update_weights`` through slime's post-write hook, ``load``
of the newest model checkpoint's rollout on restart); the model checkpoint carries the
lineage the total-queue check reads. ``--workload operator`` (``bench/chaos_operator.py``):
``max_attempts=1`` so that faults cause drops, a trainer that runs a weight-update bracket
after every step, and an operator running ``strawq requeue`` (the reasons in ``dropped/``),
``release``, ``status``, ``gc`` and ``bracket status`` beside the faults, and ``bracket
status`` then ``bracket finish`` (or ``abort``) each time the trainer is killed; each
command's exit status and output is recorded, and a traceback, an exit without a message or
a wrong decision fails the run. In both the engines restart on the newest pushed weight
version and the trainer is not picked while it starts. Last lines::

    chaos slime: faults = F, lost = L, duplicated = D, tokens lost per fault = T,
    recovery p50 = R s

(one line; ``chaos operator: ...`` the same, after a table of the operator's commands).

``--workload stream|flow|regenerate|old-weights`` (``bench/chaos_versions.py`` has the parts):
the trainer advances the weights. After each step it acks, runs a weight-update bracket
that pushes the new version to both engines (``/update_weights_from_disk`` through the
proxies), and every ``--interval`` steps saves and commits (the documented order); a
restarted trainer loads its checkpoint and calls ``bracket.restore`` (the engines may hold
weights trained after it); engines a push missed are noted and repaired by the bracket's
repair thread (``start_repairs``). ``stream`` and ``flow`` train a step as 2 micro-batches
(the collector runs ``schedule.collector_config`` of the mode; flow acks each micro-batch
as trained); ``regenerate`` runs ``eta_mode=regenerate`` with η = 1 and counts the
regenerations of the trained groups; in ``old-weights`` a killed engine restarts on
version 0 (in the others on the run's version), the producers' version guard keeps it out
of rotation and the repair pushes it the run's version, and the trainer steps every 1 s.
``--quick``: 48 prompts, 5 faults, faults from the first weight update on. Last line::

    chaos WORKLOAD: faults = F, lost = L, duplicated = D, invented = I, tokens lost per
    fault = T, recovery p50 = R s

(one line; the default workload's last line has ``invented = I`` after ``duplicated``).

Per producer kill (each producer incarnation runs with its own ``--producer-id``, so every
rid names it): the tokens it had in flight — generated for the leases it held and had not
persisted: the answers it had received, plus the tokens of its requests running on the
engines at the kill (read from the engines' ``/strawq/live_requests`` right after it) —
versus the tokens regenerated for the same tasks by their next lease (a killed producer
leaves no partial, so the redo starts each group from its prompt), and the tokens its
orphaned requests went on generating after it died. Printed per kill and in total.

Per fault kind: the faults and their recovery p50 (``faults by kind: ...``); the per-victim
table has a column per enabled cluster kind.

``--workload longgen`` (``bench/chaos_longgen.py`` has the parts and the definitions): responses
of thousands of tokens at a 30 ms/token pace run 10x faster; node ``i`` is producer ``i`` and
engine ``i`` (each producer generates on both engines); the nemesis lands kill -9 of each
engine, each producer, each node (its producer and engine together) and the collector, and a
SIGTERM to a producer, once per round each. Per fault the engines' live requests are read
just before the signal; the token RPO of each sequence is what it had generated then less
what the next request for its sample resumes with. ``--quick``: 16 prompts, 8 faults. It
prints the default workload's figures, a row per fault, and ends with::

    chaos: token RPO p50 = A, p99 = B tokens (C s); tokens regenerated per fault = D
    (before: E); drain kept = 100 %; extra meta ops per producer-second = F   (one line)

``--workload all`` runs every registered workload (``WORKLOADS``) one after another, each in
its own workdir (``WORKDIR/NAME/run``; its output in ``WORKDIR/NAME/stdout.txt``), with the
rest of the command line (``--quick`` shrinks each); each writes its figures to
``--summary`` (a workload that does not is read from its last line, its recovery p50
standing for each of its faults). It prints each workload's last line and finally::

    chaos: workloads = W, faults = F, lost = L, duplicated = D, tokens lost per fault = T,
    recovery p50 = R s

(one line): F, L and D summed, T the mean of the workloads' tokens lost per fault weighted
by their faults, R the median over every recovery of every workload. It exits 1 when a
workload failed or anything was lost or duplicated.
"""

from __future__ import annotations

import argparse
import atexit
import errno
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chaos_fleet import fleet_lost, fleet_trainer, write_json_atomic  # noqa: E402 (bench/)
from chaos_fleet import line as fleet_line  # noqa: E402
from chaos_proxy import Proxies, Tally, parse_rid  # noqa: E402
from chaos_versions import VERSIONED  # noqa: E402

#: ``--workload NAME``: the one list of workloads (default: the queue under process faults;
#: agentic: chaos_agentic.py; slime: chaos_slime.py; operator: chaos_operator.py, both with
#: the default workload's victims and their own trainer; stream, flow, regenerate,
#: old-weights: chaos_versions.py); ``--workload all`` runs each, one after another
WORKLOADS: tuple[str, ...] = ("default", "agentic", "slime", "operator", *VERSIONED,
                               "longgen")

PY = sys.executable
#: the fault kinds ``--fault-kinds`` chooses from (process faults, then cluster faults)
PROCESS_FAULTS = ("kill9", "sigstop")
CLUSTER_FAULTS = ("jfs-client", "partition", "skew")
FAULT_KINDS = (*PROCESS_FAULTS, *CLUSTER_FAULTS)
VICTIMS = ("engine0", "engine1", "producer0", "producer1", "collector", "trainer", "operator")
#: ``--workload agentic`` (bench/chaos_agentic.py): the tool server is a victim, the operator
#: is not (the dataset is small; its releases and gc stay in the default workload)
AGENTIC_VICTIMS = ("engine0", "engine1", "producer0", "producer1", "tool", "collector",
                   "trainer")


# -- the trainer role ------------------------------------------------------------------------

def trainer(run: str, ckpt: str, events: str, interval: int, step_s: float, done: str,
            agentic: bool = False) -> int:
    from strawq.collector.errors import BatchTimeout, RunFinished
    from strawq.collector.trainer.reader import BatchReader

    def log(**ev: Any) -> None:
        with open(events, "a", encoding="utf-8") as f:
            f.write(json.dumps({"t": time.time(), **ev}) + "\n")

    reader = BatchReader.open(run)
    model: list[dict[str, Any]] = []
    steps = 0
    if os.path.exists(ckpt):
        with open(ckpt, encoding="utf-8") as f:
            saved = json.load(f)
        model, steps = saved["model"], saved["steps"]
        reader.load_state_dict(saved["strawq"])
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
        groups: list[dict[str, Any]] = [{"id": g.id, "gen": g.gen,
                   "tokens": int(sum(s["sample_lens"]))}
                  for g, s in zip(batch.groups, batch.summaries, strict=True)]
        from chaos_versions import trained_samples  # the tokens, for the "invented" check
        for g, name in zip(groups, batch.groups, strict=True):
            g["samples"] = trained_samples(reader.queue.read_group(name.id, name.gen),
                                           masked=agentic)
        if agentic:  # the trained trajectories, for the oracle (gc removes the records)
            from chaos_agentic import trained_group
            for g, name in zip(groups, batch.groups, strict=True):
                g["agentic"] = trained_group(reader.queue.read_group(name.id, name.gen))
                g["tokens"] = sum(x["gen_tokens"] for x in g["agentic"]["samples"]
                                  if x["status"] != "failed")
        time.sleep(step_s)  # the optimizer step
        model.append({"seq": batch.seq, "groups": groups})
        steps += 1
        log(event="batch", seq=batch.seq, step=steps, ids=[g["id"] for g in groups])
        reader.ack(batch)
        if steps % interval == 0:
            checkpoint()


# -- the processes ---------------------------------------------------------------------------

@dataclass
class Proc:
    name: str
    argv: list[str]
    log: str
    p: subprocess.Popen[bytes] | None = None
    stopped: bool = False
    restarts: int = 0
    #: a producer: ``--producer-id NAME.rK`` per incarnation, so rids name the incarnation
    producer_id: bool = False
    #: run under this prefix (``ip netns exec NS``: a producer in its network namespace)
    wrap: list[str] = field(default_factory=list)
    #: extra environment (a skewed producer: libfaketime's ``LD_PRELOAD`` and ``FAKETIME``)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def incarnation(self) -> str:
        return f"{self.name}.r{self.restarts}"

    def start(self) -> None:
        argv = [*self.argv, "--producer-id", self.incarnation] if self.producer_id \
            else self.argv
        env = {**os.environ, **self.env} if self.env else None
        with open(self.log, "ab") as out:  # (``ip netns exec`` execs: the pid is the command)
            self.p = subprocess.Popen([*self.wrap, *argv], stdout=out, stderr=subprocess.STDOUT,
                                      cwd=ROOT, start_new_session=True, env=env)

    def alive(self) -> bool:
        return self.p is not None and self.p.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.p is not None
            os.kill(self.p.pid, sig)

    def stop(self, timeout: float = 10.0) -> None:
        if self.p is None:
            return
        if self.stopped:
            self.signal(signal.SIGCONT)
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.p.wait()


def strawq(*args: str) -> list[str]:
    return [PY, "-m", "strawq", *args]


@dataclass
class Fault:
    victim: str
    kind: str
    at: float
    end: float = 0.0
    #: a producer kill: the dead incarnation, when it died, and its requests then running
    #: on the engines (rid -> tokens generated so far; None: an engine did not answer)
    incarnation: str = ""
    dead_at: float = 0.0
    running: dict[str, int] | None = None
    #: a jfs-client or partition fault: the victim's leases at the fault and at its heal
    held_at: set[str] = field(default_factory=set)
    held_after: set[str] = field(default_factory=set)


@dataclass
class Chaos:
    work: Path
    run_a: str
    run_b: str
    prompts: int
    faults_target: int
    gap: float
    seed: int
    interval: int = 3
    step_s: float = 0.1
    restart_pause: float = 0.8
    max_stop: float = 3.0
    tally: Tally = field(default_factory=Tally)
    procs: dict[str, Proc] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    extra_collectors: list[Proc] = field(default_factory=list)
    _cycle: list[str] = field(default_factory=list)
    _families: list[str] = field(default_factory=list)
    #: "default" or "agentic" (turns deep, tool latency [min, max] s)
    workload: str = "default"
    turns: int = 10
    tool_s: tuple[float, float] = (0.5, 5.0)
    #: more ``strawq init --set`` settings (the operator workload's low max_attempts)
    init_set: tuple[str, ...] = ()
    #: called after a victim's kill -9, before its restart (the operator workload)
    on_kill: Any = None
    #: the collector's workload settings (chaos_versions.collector_sets)
    col_sets: list[str] = field(default_factory=list)
    #: ``--producer-set``: more ``--set KEY=VALUE`` for every producer (longgen)
    producer_sets: tuple[str, ...] = ()

    @property
    def victims(self) -> tuple[str, ...]:
        if self.workload == "longgen":
            from chaos_longgen import VICTIMS as LONGGEN_VICTIMS
            return LONGGEN_VICTIMS
        return AGENTIC_VICTIMS if self.workload == "agentic" else VICTIMS

    #: ``--disk-full``: the mount point of the tmpfs the run lives on
    disk: str | None = None
    #: ``--disk-full --juicefs``: the run's quota on the volume (chaos_cluster.VolumeQuota)
    quota: Any = None
    #: ``--fault-kinds``: the kinds the nemesis lands
    kinds: tuple[str, ...] = PROCESS_FAULTS
    #: jfs-client: the test volume's directory, and each producer's own mount and run path
    juicefs: str | None = None
    producer_mounts: dict[str, str] = field(default_factory=dict)
    producer_runs: dict[str, str] = field(default_factory=dict)
    #: partition: each producer's network namespace
    netns: dict[str, Any] = field(default_factory=dict)
    #: skew: the clock offset of each skew fault, s
    offsets: list[int] = field(default_factory=list)

    def path(self, i: int) -> str:
        return self.run_a if i % 2 == 0 else self.run_b

    def setup(self) -> None:
        rng = random.Random(self.seed)
        self.dataset = str(self.work / "prompts.jsonl")
        with open(self.dataset, "w", encoding="utf-8") as f:
            for i in range(self.prompts):
                f.write(json.dumps({"prompt": [rng.randrange(3, 200) for _ in range(6)],
                                    "count": rng.randrange(4, 40), "i": i}) + "\n")
        subprocess.run(strawq("init", self.run_a, "-q", "--set", "group_size=4",
                              "--set", "lease_timeout_s=2.0", "--set", "heartbeat_interval_s=0.2",
                              "--set", "release_batch=8", "--set", "max_attempts=50",
                              *[a for kv in self.init_set for a in ("--set", kv)]),
                       check=True, cwd=ROOT)
        self.engine_ports = [self._free_port() for _ in range(2)]
        if self.workload in VERSIONED:
            from chaos_versions import collector_sets
            self.col_sets = collector_sets(self.workload)
        lens = ("12", "30") if self.workload == "agentic" else ("24", "96")
        pace = ["--step-base-ms", "4", "--step-per-req-ms", "0.05", "--len-median", lens[0],
                "--len-cap", lens[1], "--cap-prob", "0.02"]
        if self.workload == "longgen":
            from chaos_longgen import ENGINE_ARGS
            pace = ENGINE_ARGS
        for i, port in enumerate(self.engine_ports):
            self.procs[f"engine{i}"] = Proc(f"engine{i}", strawq(
                "engine", "serve", "--kind", "sim", "--port", str(port), *pace, "-q"),
                str(self.work / f"engine{i}.log"))
            self.procs[f"engine{i}"].start()
        self._wait_engines()
        if "partition" in self.kinds:  # each producer in a network namespace of its own
            from chaos_cluster import Netns
            for i in range(2):
                ns = Netns.create(i)
                atexit.register(ns.delete)
                self.netns[f"producer{i}"] = ns
        self.proxies = Proxies(self.engine_ports, self.tally,
                               hosts=tuple(ns.host_ip for ns in self.netns.values()))
        extra = ["--slots", "4", "--set", "sampling.max_new_tokens=96"]
        if self.workload == "agentic":
            extra = self._agentic_setup()
        elif self.workload == "longgen":
            from chaos_longgen import PRODUCER_ARGS
            extra = [*PRODUCER_ARGS, *(a for kv in self.producer_sets for a in ("--set", kv))]
        for i in range(2):
            name = f"producer{i}"
            pns = self.netns.get(name)
            host = pns.host_ip if pns is not None else "127.0.0.1"
            urls = [a for port in self.proxies.ports for a in ("--engine",
                                                                f"http://{host}:{port}")]
            if pns is not None:  # a cut of seconds outlasts its client's timeouts, as in
                # tests/producers/test_partition.py: it hands its groups back and probes
                urls += ["--set", "engine.client.connect_timeout_s=0.5",
                         "--set", "engine.client.control_timeout_s=1.0"]
            self.procs[name] = Proc(name, strawq(
                "producer", self.producer_runs.get(name, self.path(i)), *urls, *extra,
                "--reward", "strawq.producers.rewards.count_task",
                "-q"), str(self.work / f"{name}.log"), producer_id=True,
                wrap=pns.wrap if pns is not None else [])
        self.procs["collector"] = self._collector(0)
        self.ckpt = str(self.work / "trainer.ckpt.json")
        self.events = str(self.work / "trainer.events.jsonl")
        self.done = str(self.work / "done")
        self.procs["trainer"] = Proc("trainer", [
            PY, str(Path(__file__).resolve()), "--role", "trainer", "--run", self.path(1),
            "--ckpt", self.ckpt, "--events", self.events, "--interval", str(self.interval),
            "--step-s", str(self.step_s), "--done", self.done,
            *(["--workload", self.workload] if self.workload != "default" else []),
            *(["--engine", ",".join(f"http://127.0.0.1:{p}" for p in self.proxies.ports)]
              if self.workload in VERSIONED else [])],
            str(self.work / "trainer.log"))
        if self.workload == "slime":
            from chaos_slime import setup as slime_setup
            slime_setup(self)
        elif self.workload == "operator":
            from chaos_operator import setup as operator_setup
            operator_setup(self)
        for name in ("producer0", "producer1", "collector", "trainer"):
            self.procs[name].start()
        self.operator_rng = random.Random(self.seed + 1)
        self.procs["operator"] = Proc("operator", [PY, "-c", "pass"],
                                      str(self.work / "operator.log"))

    def _agentic_setup(self) -> list[str]:
        """Start the tool server; the producers' arguments for the key-value agent."""
        from chaos_agentic import PersistWatch

        from strawq.storage import open_storage

        self.ledger = str(self.work / "ledger")
        port = self._free_port()
        self.procs["tool"] = Proc("tool", [
            PY, str(Path(__file__).resolve()), "--role", "tool-server", "--port", str(port),
            "--ledger", self.ledger, "--tool-min", str(self.tool_s[0]),
            "--tool-max", str(self.tool_s[1])], str(self.work / "tool.log"))
        self.procs["tool"].start()
        self._wait_engines([port])
        self.watch = PersistWatch(open_storage(self.run_a, writer_id="chaos-watch"),
                                  self.ledger)
        # a try outlasts the slowest call plus the longest stop; the agent gives up (the
        # sample fails with the reason recorded) only after many tries with the same key
        try_s = self.tool_s[1] + self.max_stop + 1.0
        deadline = max(20 * try_s, 60.0)
        args = {"ledger": self.ledger, "turns": self.turns, "tool_url":
                f"http://127.0.0.1:{port}", "tool_try_s": try_s, "tool_deadline_s": deadline}
        return ["--slots", "8", "--set", f"sampling.max_new_tokens={self.turns * 40}",
                "--set", "plugins.generate=strawq.demo.agentic_kv.kv_agent",
                "--set", f"plugins.generate_args={json.dumps(args)}",
                "--set", f"tools.timeout_s={deadline + 10}", "--set", "tools.retries=0"]

    def _collector(self, n: int) -> Proc:
        return Proc("collector", strawq(
            "collector", self.path(n), self.dataset, "--set", "batch_groups=4",
            "--set", "takeover_timeout_s=2.0", "--set", "poll_interval_s=0.05",
            "--set", "gc_interval_s=0.5", "--set", "max_prefetch_batches=2", *self.col_sets,
            "-q"), str(self.work / "collector.log"))

    @staticmethod
    def _free_port() -> int:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
            return port

    def _wait_engines(self, ports: list[int] | None = None) -> None:
        import urllib.request
        deadline = time.time() + 60
        for port in ports or self.engine_ports:
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                    break
                except OSError:
                    if time.time() > deadline:
                        raise RuntimeError(f"engine on port {port} did not start") from None
                    time.sleep(0.1)

    def engine_requests(self, prefix: str) -> dict[str, int] | None:
        """The requests whose rid starts with ``prefix`` running on the engines now, with
        the tokens each has generated (the local engines' ``/strawq/live_requests``)."""
        import urllib.error
        import urllib.request
        found: dict[str, int] = {}
        for port in self.engine_ports:
            url = f"http://127.0.0.1:{port}/strawq/live_requests"
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    body = json.load(r)
            except urllib.error.URLError as exc:
                if isinstance(exc.reason, ConnectionRefusedError):
                    continue  # dead or still starting: it runs nothing
                return None  # not answering: unknown
            except (OSError, ValueError):
                return None
            found.update({q["rid"]: int(q["output_tokens"]) for q in body["requests"]
                          if str(q["rid"]).startswith(prefix)})
        return found

    def trainer_up(self, proc: Proc) -> bool:
        """Whether this trainer process has loaded its checkpoint (its ``start`` event)."""
        pid = f'"pid": {proc.p.pid if proc.p else -1},'
        return os.path.exists(self.events) and any(
            pid in line for line in open(self.events, encoding="utf-8"))

    def engine_weights(self, proc: Proc) -> None:
        """A weight-version workload: a restarted engine comes up on the run's version, or
        on version 0 (old-weights)."""
        if self.workload in VERSIONED and proc.name.startswith("engine"):
            from chaos_versions import engine_version
            proc.argv = [*proc.argv[:proc.argv.index("-q")], "-q", "--weight-version",
                         str(engine_version(self.workload, self.run_a))]

    def operator_tick(self) -> None:
        op = self.procs["operator"]
        if op.alive() or op.stopped:
            return
        if self.workload == "operator":
            from chaos_operator import tick
            tick(self)
            return
        i = self.operator_rng.randrange(4)
        cmd = [strawq("release", self.path(i), self.dataset, "--count", "4", "-q"),
               strawq("status", self.path(i), "--json", "-q"),
               strawq("gc", self.path(i), "-q"),
               strawq("release", self.path(i), self.dataset, "--count", "3", "-q")][i]
        op.argv = cmd
        op.start()

    def fill_disk(self, rng: random.Random) -> None:
        """Fill the run's tmpfs with a ballast file (on JuiceFS: use up the run's quota),
        hold it full, then free it."""
        if self.quota is not None:
            fault = Fault("disk", "full", time.time())
            self.faults.append(fault)
            self.quota.fill()
            time.sleep(rng.uniform(0.3, self.max_stop))
            self.quota.free()
            fault.end = time.time()
            print(f"fault {len(self.faults)}: full volume quota ({fault.end - fault.at:.1f}s)",
                  file=sys.stderr, flush=True)
            return
        assert self.disk is not None
        fault = Fault("disk", "full", time.time())
        self.faults.append(fault)
        ballast = os.path.join(self.disk, "ballast")
        chunk = b"\0" * (1 << 16)
        with open(ballast, "ab", buffering=0) as f:
            try:
                while True:
                    f.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
        time.sleep(rng.uniform(0.3, self.max_stop))
        os.unlink(ballast)
        fault.end = time.time()
        print(f"fault {len(self.faults)}: full disk ({fault.end - fault.at:.1f}s)",
              file=sys.stderr, flush=True)

    def held_by(self, incarnation: str) -> set[str]:
        """The tasks ``leased/`` lists as held by this producer incarnation (read through
        the collector's client)."""
        try:
            names = os.listdir(os.path.join(self.run_a, "leased"))
        except OSError:
            return set()
        from strawq.ondisk.names import TaskName
        parsed = (TaskName.try_parse(n) for n in names)
        return {t.id for t in parsed if t is not None and t.producer == incarnation}

    def cluster_fault(self, kind: str, rng: random.Random) -> None:
        """A ``jfs-client``, ``partition`` or ``skew`` fault under a producer, landed and
        healed (the nemesis waits for it, as for a SIGSTOP)."""
        from chaos_cluster import kill_client, mount_client, mount_dead, skew_env
        victim = rng.choice([n for n in ("producer0", "producer1")
                             if self.procs[n].alive() and not self.procs[n].stopped] or [""])
        if not victim:
            return
        proc = self.procs[victim]
        fault = Fault(victim, kind, time.time())
        self.faults.append(fault)
        note = ""
        if kind == "jfs-client":
            # the client dies under the producer: its storage calls fail, it can neither
            # heartbeat nor write, and its leases expire on the grantor's clock (the
            # collector's, through another client) while the mount is down
            mnt = self.producer_mounts[victim]
            fault.held_at = self.held_by(proc.incarnation)
            kill_client(mnt)
            until = time.time() + 30
            while not mount_dead(mnt) and time.time() < until:
                time.sleep(0.02)
            time.sleep(rng.uniform(2.5, 2.5 + self.max_stop))  # lease_timeout_s = 2
            fault.held_after = self.held_by(proc.incarnation)
            note = f" {len(fault.held_at)} leases held, {len(fault.held_after)} at the remount"
            assert self.juicefs is not None
            mount_client(self.juicefs, os.path.basename(mnt))
            proc.signal(signal.SIGKILL)  # the host rejoins: its producer restarted
            assert proc.p is not None
            proc.p.wait()
            proc.restarts += 1
            proc.start()
        elif kind == "partition":
            ns = self.netns[victim]
            fault.held_at = self.held_by(proc.incarnation)
            ns.cut()
            try:
                time.sleep(rng.uniform(1.0, 2 * self.max_stop))
                fault.held_after = self.held_by(proc.incarnation)
            finally:
                ns.heal()
            note = (f" {len(fault.held_at)} leases held, {len(fault.held_after)} at the heal "
                    f"({len(fault.held_after - fault.held_at)} claimed while cut off)")
        else:  # skew: restarted with its clock minutes off, a while, then restarted right
            offset = rng.choice((-1, 1)) * rng.randrange(60, 601)
            self.offsets.append(offset)
            note = f" {offset:+d} s"
            for env in (skew_env(offset), {}):
                self._terminate(proc)
                proc.env = env
                proc.restarts += 1
                proc.start()
                if env:
                    time.sleep(rng.uniform(2.0, 2.0 + 2 * self.max_stop))
        fault.end = time.time()
        print(f"fault {len(self.faults)}: {kind} {victim}{note} ({fault.end - fault.at:.1f}s)",
              file=sys.stderr, flush=True)

    @staticmethod
    def _terminate(proc: Proc) -> None:
        """SIGTERM (a producer hands back what it holds), SIGKILL after 15 s."""
        proc.signal(signal.SIGTERM)
        assert proc.p is not None
        try:
            proc.p.wait(15)
        except subprocess.TimeoutExpired:
            proc.signal(signal.SIGKILL)
            proc.p.wait()

    def inject(self, rng: random.Random) -> None:
        if self.workload == "longgen":
            from chaos_longgen import inject
            inject(self, rng)
            return
        if (self.disk is not None or self.quota is not None) and rng.random() < 0.25:
            self.fill_disk(rng)
            return
        # each enabled cluster kind as often as the process faults together: every one once
        # per round, in a random order
        process = [k for k in PROCESS_FAULTS if k in self.kinds]
        if not self._families:
            self._families = [k for k in CLUSTER_FAULTS if k in self.kinds]
            self._families += ["process"] if process else []
            rng.shuffle(self._families)
        family = self._families.pop()
        if family != "process":
            self.cluster_fault(family, rng)
            return
        if not self._cycle:  # every victim once per round, in a random order
            self._cycle = list(self.victims)
            rng.shuffle(self._cycle)
        victim = self._cycle.pop()
        proc = self.procs[victim]
        if not proc.alive() or proc.stopped or self.starting(victim):
            return
        if self.workload in VERSIONED and victim == "trainer" and not self.trainer_up(proc):
            return  # a fault on a trainer still starting (imports) tests nothing new
        kind = ("kill9" if rng.random() < 0.7 else "sigstop") if len(process) == 2 \
            else process[0]
        fault = Fault(victim, kind, time.time())
        self.faults.append(fault)
        if kind == "kill9":
            proc.signal(signal.SIGKILL)
            assert proc.p is not None
            proc.p.wait()
            if self.on_kill is not None:
                self.on_kill(self, victim)
            if proc.producer_id:
                fault.incarnation, fault.dead_at = proc.incarnation, time.time()
                fault.running = self.engine_requests(f"{proc.incarnation}/")
            time.sleep(rng.uniform(0.05, self.restart_pause))
            if victim != "operator":
                self.engine_weights(proc)
                proc.restarts += 1
                if victim == "collector":
                    self.procs["collector"] = proc = self._collector(proc.restarts)
                    proc.restarts = self.procs["collector"].restarts
                proc.start()  # an engine comes up in the background: the proxy answers 502
        else:
            pause = rng.uniform(0.3, self.max_stop)
            proc.signal(signal.SIGSTOP)
            proc.stopped = True
            if victim == "collector" and pause > 2.2:
                # the takeover: a second collector while the first is frozen
                fresh = self._collector(len(self.extra_collectors) + 1)
                fresh.start()
                time.sleep(pause)
                proc.signal(signal.SIGCONT)  # it must find itself fenced and exit
                proc.stopped = False
                self.extra_collectors.append(proc)
                self.procs["collector"] = fresh
            else:
                time.sleep(pause)
                proc.signal(signal.SIGCONT)
                proc.stopped = False
        fault.end = time.time()
        if self.workload == "agentic":  # beside the ledger's times, for reading a failure
            with open(self.work / "faults.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps({"victim": victim, "kind": kind, "at": fault.at,
                                    "end": fault.end, "pid": proc.p.pid if proc.p else None})
                        + "\n")
        print(f"fault {len(self.faults)}: {kind} {victim} ({fault.end - fault.at:.1f}s)",
              file=sys.stderr, flush=True)

    def starting(self, victim: str) -> bool:
        """slime/operator: the trainer is not picked while it starts (slime's imports take
        10-20 s on a loaded machine: a kill every round would never let it train)."""
        if victim != "trainer" or self.workload not in ("slime", "operator"):
            return False
        if not os.path.exists(self.events):
            return True
        starts = Path(self.events).read_text().count('"event": "start"')
        return starts < self.procs["trainer"].restarts + 1

    def nemesis(self) -> None:
        rng = random.Random(self.seed + 2)
        if self.workload == "agentic":  # faults mid-trajectory, not while the fleet starts
            from strawq.demo.agentic_kv import counts
            until = time.time() + 120
            while sum(counts(self.ledger, "exec").values()) < 8 and time.time() < until:
                time.sleep(0.1)
        if self.workload in ("slime", "operator"):  # faults once it trains, not while it
            until = time.time() + 120               # imports and the fleet starts
            while not (os.path.exists(self.events) and "batch" in Path(self.events).read_text()
                       ) and time.time() < until:
                time.sleep(0.1)
        elif self.workload == "longgen":  # faults while long responses generate
            from chaos_longgen import wait_generating
            wait_generating(self)
        elif self.workload in VERSIONED:  # faults while the weights advance, not at start
            until = time.time() + 120
            while time.time() < until and not (os.path.exists(self.events) and any(
                    '"push"' in line for line in open(self.events, encoding="utf-8"))):
                time.sleep(0.1)
        next_op = time.time()
        while len(self.faults) < self.faults_target and self.collector_running():
            now = time.time()
            if now >= next_op:
                self.operator_tick()
                next_op = now + 0.7
            self.keep_alive()
            if self.workload == "agentic":
                self.watch.scan()
            self.inject(rng)
            time.sleep(rng.uniform(0.2, self.gap))

    def collector_running(self) -> bool:
        col = self.procs["collector"]
        if col.alive():
            return True
        assert col.p is not None
        return col.p.returncode != 0  # it exits 0 once drained

    def keep_alive(self) -> None:
        """A process that exited on its own (a fenced collector exits 1; a producer whose
        engines were all down may give up) is started again, except a drained collector."""
        for name in ("engine0", "engine1", "producer0", "producer1", "trainer", "tool"):
            if name not in self.procs:
                continue
            proc = self.procs[name]
            if not proc.alive() and not proc.stopped:
                self.engine_weights(proc)
                proc.restarts += 1
                proc.start()
        col = self.procs["collector"]
        if not col.alive() and col.p is not None and col.p.returncode != 0:
            self.procs["collector"] = self._collector(col.restarts + 1)
            self.procs["collector"].restarts = col.restarts + 1
            self.procs["collector"].start()

    def finish(self, deadline_s: float) -> bool:
        end = time.time() + deadline_s
        while time.time() < end:
            self.keep_alive()
            if self.workload == "agentic":
                self.watch.scan()
            col = self.procs["collector"]
            if not col.alive() and col.p is not None and col.p.returncode == 0:
                break
            time.sleep(0.2)
        else:
            return False
        if self.workload == "operator":
            from chaos_operator import before_done
            before_done(self)
        Path(self.done).touch()
        trainer_proc = self.procs["trainer"]
        assert trainer_proc.p is not None
        trainer_proc.p.wait(60)
        for proc in [*self.procs.values(), *self.extra_collectors]:
            proc.stop()
        self.proxies.close()
        return True

    # -- checks and figures -------------------------------------------------------------------
    def check(self) -> dict[str, Any]:
        from strawq.storage import open_storage
        from strawq.testing import audit_run

        if self.workload == "slime":
            from chaos_slime import final_model
            saved = final_model(self.ckpt)
        else:
            with open(self.ckpt, encoding="utf-8") as f:
                saved = json.load(f)
        lineage = [g for step in saved["model"] for g in step["groups"]]
        trained = [g["id"] for g in lineage]
        storage = open_storage(self.run_a, writer_id="chaos")
        audit = audit_run(storage)
        from strawq.delivery.retention import find_drop

        rows = {f"i{i:012d}" for i in range(self.prompts)}
        counts: dict[str, int] = defaultdict(int)
        for t in trained:
            counts[t] += 1
        duplicated = sorted(t for t, c in counts.items() if c > 1)
        # dropped with a recorded reason: in dropped/, quarantine, or folded into the audit
        dropped = {t for t in rows - set(trained)
                   if t in audit.ids("dropped", "quarantined") or find_drop(storage, t)}
        lost = sorted(rows - set(trained) - dropped)
        subprocess.run(strawq("gc", self.run_a, "-q"), cwd=ROOT, check=False)
        left = []
        for d in ("pending", "leased", "ready", "batched", "batches", "acked", "data",
                  "staging", "tmp"):
            for n in storage.list(d):
                key = f"{d}/{n}"
                left += [f"{key}/{m}" for m in storage.list(key)] if storage.is_dir(key) \
                    else [key]
        res = {"lineage": lineage, "lost": lost, "duplicated": duplicated, "left": left,
               "dropped": sorted(dropped), "steps": saved["steps"]}
        from chaos_versions import invented  # trained tokens no engine answered
        with self.tally.lock:
            outputs = list(self.tally.outputs)
        res["invented"], res["versions_wrong"], res["invented_checked"] = invented(lineage,
                                                                                  outputs)
        if self.workload == "agentic":
            from chaos_agentic import oracle
            res["agentic"] = oracle(lineage, self.ledger, self.watch.at_persist)
        return res

    def figures(self, res: dict[str, Any]) -> dict[str, Any]:
        events = [json.loads(line) for line in open(self.events, encoding="utf-8")]
        batch_times = sorted(e["t"] for e in events if e["event"] == "batch")
        seen: set[int] = set()
        new_batch_times = []
        for e in sorted((e for e in events if e["event"] == "batch"), key=lambda e: e["t"]):
            if e["seq"] not in seen:
                seen.add(e["seq"])
                new_batch_times.append(e["t"])
        useful = sum(g["tokens"] for g in res["lineage"])
        by_task_useful = {g["id"]: g["tokens"] for g in res["lineage"]}
        with self.tally.lock:
            answers = list(self.tally.answers)
        generated = sum(a[4] for a in answers)
        per_task: dict[str, list[tuple[float, str, int, int]]] = defaultdict(list)
        for t, producer, task, gen, n, _rid in answers:
            per_task[task].append((t, producer, gen, n))
        by_victim: dict[str, dict[str, Any]] = {
            v: {"faults": 0, "recovery": [], "tokens_lost": 0, "steps_lost": []}
            for v in self.victims}
        for f in self.faults:
            row = by_victim.setdefault(f.victim, {"faults": 0, "recovery": [],
                                                  "tokens_lost": 0, "steps_lost": []})
            row["faults"] += 1
            nxt = next((t for t in new_batch_times if t >= f.end), None)
            if nxt is not None:
                row["recovery"].append(nxt - f.end)
        # tokens thrown away per task, charged to the last fault before its final answer
        for task, items in per_task.items():
            waste = sum(n for *_x, n in items) - by_task_useful.get(task, 0)
            if waste <= 0:
                continue
            first, last = min(i[0] for i in items), max(i[0] for i in items)
            hit = [f for f in self.faults if first - 3.0 <= f.at <= last]
            victim = hit[-1].victim if hit else "none"
            by_victim.setdefault(victim, {"faults": 0, "recovery": [], "tokens_lost": 0,
                                          "steps_lost": []})["tokens_lost"] += waste
        # trainer: steps trained since its last checkpoint, lost at each kill
        starts = [e for e in events if e["event"] == "start"]
        for s in starts[1:]:
            before = [e for e in events if e["event"] == "batch" and e["t"] < s["t"]]
            if before:
                by_victim["trainer"]["steps_lost"].append(max(before[-1]["step"] - s["steps"],
                                                              0))
        recov = [r for v in by_victim.values() for r in v["recovery"]]
        nf = max(len(self.faults), 1)
        by_kind: dict[str, dict[str, Any]] = {}
        for f in self.faults:
            k = by_kind.setdefault(f.kind, {"faults": 0, "recovery": []})
            k["faults"] += 1
            nxt = next((t for t in new_batch_times if t >= f.end), None)
            if nxt is not None:
                k["recovery"].append(nxt - f.end)
        return {"generated": generated, "useful": useful, "by_kind": by_kind,
                "recoveries": recov,
                "tokens_lost_per_fault": (generated - useful) / nf,
                "recovery_p50": statistics.median(recov) if recov else float("nan"),
                "by_victim": by_victim, "batches": len(batch_times),
                "producer_kills": self.producer_kills(res, answers)}

    def producer_kills(self, res: dict[str, Any],
                       answers: list[tuple[float, str, str, int, int, str]]
                       ) -> list[dict[str, Any]]:
        """Per producer kill: the tokens it had in flight (generated for the leases it held
        and had not persisted: answers it had received, plus the tokens of its requests then
        running on the engines), the tokens generated for the same tasks by their next lease
        (the redo), and the tokens its orphaned requests went on generating after it died."""
        trained_gen = {g["id"]: g["gen"] for g in res["lineage"]}
        by_task: dict[str, list[tuple[float, int, int]]] = defaultdict(list)
        for t, _producer, task, gen, n, _rid in answers:
            by_task[task].append((t, gen, n))
        rows = []
        for number, f in enumerate(self.faults, 1):
            if not f.incarnation:
                continue
            mine = [a for a in answers if a[1] == f.incarnation]
            running = f.running or {}
            leases = {(a[2], a[3]) for a in mine if a[0] <= f.dead_at}
            for rid in running:
                who = parse_rid(rid)
                if who is not None:
                    leases.add((who[1], who[2]))
            held = {(task, gen) for task, gen in leases
                    if trained_gen.get(task) != gen  # not persisted before the kill
                    and not any(g > gen and t <= f.dead_at for t, g, _n in by_task[task])}
            received = sum(a[4] for a in mine if a[0] <= f.dead_at and (a[2], a[3]) in held)
            partial = 0
            for rid, k in running.items():
                who = parse_rid(rid)
                if who is not None and (who[1], who[2]) in held:
                    partial += k
            after = {a[5]: a[4] for a in mine if a[0] > f.dead_at}
            orphaned = sum(max(n - running.get(rid, 0), 0) for rid, n in after.items())
            redo = 0
            for task, gen in held:
                later = [g for _t, g, _n in by_task[task] if g > gen]
                if later:
                    redo += sum(n for _t, g, n in by_task[task] if g == min(later))
            rows.append({"fault": number, "victim": f.victim, "incarnation": f.incarnation,
                         "tasks": len(held), "received": received, "running": partial,
                         "in_flight": received + partial, "regenerated": redo,
                         "orphaned": orphaned, "engines_known": f.running is not None})
        return rows


def report(ch: Chaos, res: dict[str, Any], fig: dict[str, Any], fs: str,
           fleet: dict[str, Any] | None = None) -> None:
    print(f"\nchaos run on {fs}: {ch.prompts} prompts, {len(ch.faults)} faults, "
          f"{res['steps']} trainer steps in the final model, {fig['batches']} batch deliveries")
    print(f"tokens: {fig['generated']} returned by engines, {fig['useful']} in the final model")
    cluster = [k for k in CLUSTER_FAULTS if k in ch.kinds]
    heads = "".join(f" {k:>{len(k)}}" for k in cluster)
    print(f"{'victim':<10} {'faults':>6} {'kill9':>6} {'stop':>5}{heads} {'recovery p50 s':>15} "
          f"{'tokens lost':>12} {'lost/fault':>10} {'steps lost':>11}")
    for v, row in fig["by_victim"].items():
        kinds = [f.kind for f in ch.faults if f.victim == v]
        rec = f"{statistics.median(row['recovery']):.2f}" if row["recovery"] else "-"
        per = f"{row['tokens_lost'] / row['faults']:.0f}" if row["faults"] else "-"
        steps = (f"{statistics.mean(row['steps_lost']):.1f}" if row["steps_lost"] else "-")
        cols = "".join(f" {kinds.count(k):>{len(k)}}" for k in cluster)
        print(f"{v:<10} {row['faults']:>6} {kinds.count('kill9'):>6} "
              f"{kinds.count('sigstop'):>5}{cols} {rec:>15} {row['tokens_lost']:>12} "
              f"{per:>10} {steps:>11}")
    by_kind = fig["by_kind"]
    print("faults by kind: " + ", ".join(
        f"{k} = {by_kind[k]['faults']} (recovery p50 "
        + (f"{statistics.median(by_kind[k]['recovery']):.2f} s)" if by_kind[k]["recovery"]
           else "-)") for k in by_kind))
    for k, at in (("jfs-client", "remount"), ("partition", "heal")):
        fs_ = [f for f in ch.faults if f.kind == k]
        if fs_:
            print(f"{k}: {len(fs_)} faults, the victim's leases: "
                  f"{sum(len(f.held_at) for f in fs_)} held at the fault, "
                  f"{sum(len(f.held_after) for f in fs_)} still held at the {at}, "
                  f"{sum(len(f.held_after - f.held_at) for f in fs_)} claimed during it")
    if ch.offsets:
        print(f"skew: {len(ch.offsets)} producer runs with the clock off by "
              f"{min(ch.offsets):+d} to {max(ch.offsets):+d} s "
              f"({sum(1 for o in ch.offsets if o > 0)} ahead, "
              f"{sum(1 for o in ch.offsets if o < 0)} behind)")
    # (agentic: a killed producer's next lease resumes from its turn checkpoint, not from
    # the prompt, so what it generates is not a redo; agentic_report gives the redo)
    kills = fig["producer_kills"] if ch.workload == "default" else []
    if kills:
        print("producer kills: tokens in flight at the kill (answers received + requests "
              "running) vs tokens regenerated by the same tasks' next lease")
        print(f"{'fault':>5} {'producer':<13} {'tasks':>5} {'in flight':>9} {'received':>8} "
              f"{'running':>7} {'regenerated':>11} {'orphaned':>8}")
        for k in kills:
            mark = "" if k["engines_known"] else "  (engines did not answer: running unknown)"
            print(f"{k['fault']:>5} {k['incarnation']:<13} {k['tasks']:>5} {k['in_flight']:>9} "
                  f"{k['received']:>8} {k['running']:>7} {k['regenerated']:>11} "
                  f"{k['orphaned']:>8}{mark}")
        flight = sum(k["in_flight"] for k in kills)
        redo = sum(k["regenerated"] for k in kills)
        ratio = f"{redo / flight:.2f}" if flight else "-"
        print(f"producer kills: {len(kills)}, tokens in flight = {flight} "
              f"({sum(k['received'] for k in kills)} received + "
              f"{sum(k['running'] for k in kills)} running), regenerated = {redo} "
              f"(x{ratio}), orphaned after the kill = {sum(k['orphaned'] for k in kills)}, "
              f"tasks = {sum(k['tasks'] for k in kills)}")
    if res["left"]:
        print(f"storage check FAILED: {len(res['left'])} records left after gc, e.g. "
              f"{res['left'][:5]}")
    else:
        print("storage check: only live records after gc")
    if res["lost"] or res["duplicated"]:
        print(f"total-queue check FAILED: lost {res['lost'][:10]}, "
              f"duplicated {res['duplicated'][:10]}")
    else:
        print(f"total-queue check: every row trained once or dropped with a reason "
              f"({len(res['dropped'])} dropped)")
    if res["invented"] or res["versions_wrong"]:
        print(f"invented check FAILED: {len(res['invented'])} trained samples no engine "
              f"answered, e.g. {res['invented'][:5]}; {len(res['versions_wrong'])} with "
              f"versions the engines did not stamp, e.g. {res['versions_wrong'][:5]}")
    else:
        print(f"invented check: every trained response token of {res['invented_checked']} "
              f"samples came from an engine's answer")
    if fleet is not None:
        print(f"fleet time: the restarted trainer's first bracket waited "
              f"{fleet['trainer_bracket']:.1f}s of its {fleet['trainer']:.1f}s")
        print(fleet_line(fleet))
    if ch.workload == "agentic":
        agentic_report(ch, res, fig)
        return
    if ch.workload == "operator":
        from chaos_operator import operator_report
        operator_report(ch, res)
    name = "chaos" if ch.workload == "default" else f"chaos {ch.workload}"
    if ch.workload in VERSIONED:
        from chaos_versions import report_lines
        print("\n".join(report_lines(ch.workload, ch, res)))
    print(f"{name}: faults = {len(ch.faults)}, lost = {len(res['lost'])}, "
          f"duplicated = {len(res['duplicated'])}, invented = {len(res['invented'])}, "
          f"tokens lost per fault = {fig['tokens_lost_per_fault']:.0f}, "
          f"recovery p50 = {fig['recovery_p50']:.2f} s")


def agentic_report(ch: Chaos, res: dict[str, Any], fig: dict[str, Any]) -> None:
    a = res["agentic"]
    print(f"agentic: {a['trajectories']} trajectories trained ({ch.turns} turns, tools "
          f"{ch.tool_s[0]:g}-{ch.tool_s[1]:g} s), {a['tool_calls_trained']} tool calls "
          f"trained, {a['executions']} executions, {a['persisted']} calls persisted, "
          f"{a['rerun_in_flight']} in flight at a fault ran again (same key), "
          f"{a['fenced']} calls of taken-over leases refused by the tool server, "
          f"{a['restores']} environments restored, {a['effects_untrained']} effects of "
          f"calls in no trained trajectory (work discarded at a fault), "
          f"{a['failed_samples']} samples failed "
          f"{a['failure_reasons'] or ''}".rstrip())
    kills = sum(1 for f in ch.faults if f.incarnation)
    redo = a["model_tokens_live"] - a["model_tokens_trained"]
    print(f"agentic: model tokens generated live {a['model_tokens_live']}, in trained "
          f"trajectories {a['model_tokens_trained']}: regenerated {redo} over {kills} producer "
          f"kills ({redo / kills if kills else 0:.1f} a kill; turns cut by a fault are in "
          "neither)")
    for what in ("effects_twice", "persisted_reexecuted", "world_mismatches"):
        if a[what]:
            print(f"agentic check FAILED: {what}: {a[what][:5]}")
    if a["agent_mismatches"]:
        print(f"agentic check FAILED: {a['agent_mismatches']} samples found their store "
              f"wrong (ledger/mismatch)")
    print(f"chaos agentic: faults = {len(ch.faults)}, lost = {len(res['lost'])}, "
          f"duplicated = {len(res['duplicated'])}, "
          f"tool effects applied twice = {len(a['effects_twice'])}, "
          f"persisted tool calls re-executed = {len(a['persisted_reexecuted'])}, "
          f"environment mismatches = {a['env_mismatches']}, "
          f"tokens lost per fault = {fig['tokens_lost_per_fault']:.0f}, "
          f"recovery p50 = {fig['recovery_p50']:.2f} s")


# -- the aggregate: ``--workload all`` -------------------------------------------------------

#: the last line of any workload: ``chaos[ NAME]: faults = F, lost = L, duplicated = D, ...,
#: tokens lost per fault = T, recovery p50 = R s``
LAST_LINE = re.compile(r"^chaos(?: [\w-]+)?: faults = (\d+), lost = (\d+), duplicated = (\d+), "
                       r".*tokens lost per fault = (-?\d+), recovery p50 = ([\d.]+|nan) s$")


def write_summary(path: str, workload: str, faults: int, lost: int, duplicated: int,
                  tokens_lost_per_fault: float, recoveries: list[float]) -> None:
    """A workload's figures for ``--workload all`` (``--summary PATH``)."""
    write_json_atomic(path, {"workload": workload, "faults": faults, "lost": lost,
                              "duplicated": duplicated,
                              "tokens_lost_per_fault": tokens_lost_per_fault,
                              "recoveries": recoveries})


def summary_from_line(workload: str, line: str) -> dict[str, Any] | None:
    """A workload that wrote no summary: its figures from its last line (its recovery p50
    then stands for each of its faults' recoveries)."""
    m = LAST_LINE.match(line.strip())
    if m is None:
        return None
    f, lost, dup, t, r = m.groups()
    return {"workload": workload, "faults": int(f), "lost": int(lost),
            "duplicated": int(dup), "tokens_lost_per_fault": float(t),
            "recoveries": [] if r == "nan" else [float(r)] * int(f)}


def aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """W workloads, F faults summed, L and D summed, T the fault-weighted mean of the
    workloads' tokens lost per fault, R the median over every recovery of every workload."""
    faults = sum(int(r["faults"]) for r in rows)
    recov = [float(x) for r in rows for x in r["recoveries"]]
    return {"workloads": len(rows), "faults": faults,
            "lost": sum(int(r["lost"]) for r in rows),
            "duplicated": sum(int(r["duplicated"]) for r in rows),
            "tokens_lost_per_fault": (sum(float(r["tokens_lost_per_fault"]) * int(r["faults"])
                                          for r in rows) / faults) if faults else 0.0,
            "recovery_p50": statistics.median(recov) if recov else float("nan")}


def aggregate_line(agg: dict[str, Any]) -> str:
    return (f"chaos: workloads = {agg['workloads']}, faults = {agg['faults']}, "
            f"lost = {agg['lost']}, duplicated = {agg['duplicated']}, "
            f"tokens lost per fault = {agg['tokens_lost_per_fault']:.0f}, "
            f"recovery p50 = {agg['recovery_p50']:.2f} s")


def _passthrough(argv: list[str]) -> list[str]:
    """The command line less ``--workload``, ``--workdir`` and ``--summary`` (each child
    gets its own)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--workload", "--workdir", "--summary"):
            skip = True
            continue
        if a.split("=", 1)[0] in ("--workload", "--workdir", "--summary"):
            continue
        out.append(a)
    return out


def run_all(argv: list[str], work: Path) -> int:
    """Each registered workload in a workdir of its own, one after another, then the
    aggregate line."""
    rows, failed = [], []
    for w in WORKLOADS:
        wd = work / w
        wd.mkdir(parents=True, exist_ok=True)
        summary = wd / "summary.json"
        cmd = [PY, str(Path(__file__).resolve()), *_passthrough(argv), "--workload", w,
               "--workdir", str(wd / "run"), "--summary", str(summary)]
        print(f"workload {w}: {' '.join(cmd[1:])}", flush=True)
        with open(wd / "stdout.txt", "w", encoding="utf-8") as out, \
                open(wd / "stderr.txt", "w", encoding="utf-8") as err:
            rc = subprocess.run(cmd, stdout=out, stderr=err, cwd=ROOT, check=False).returncode
        lines = (wd / "stdout.txt").read_text(encoding="utf-8").strip().splitlines()
        last = lines[-1] if lines else ""
        errs = (wd / "stderr.txt").read_text(encoding="utf-8").strip().splitlines()
        print(f"workload {w}: {last or (errs[-1] if errs else '(no output)')}"
              + (f"  (exit {rc}; logs in {wd})" if rc else ""), flush=True)
        row = (json.loads(summary.read_text(encoding="utf-8")) if summary.exists()
               else summary_from_line(w, last))
        if rc or row is None:
            failed.append(w)
        if row is not None:
            rows.append(row)
    if failed:
        print(f"chaos: workloads failed: {', '.join(failed)}", flush=True)
    print(aggregate_line(aggregate(rows)))
    agg = aggregate(rows)
    return 1 if failed or agg["lost"] or agg["duplicated"] else 0


def agentic_bad(res: dict[str, Any]) -> bool:
    a = res.get("agentic")
    return bool(res.get("invented") or res.get("versions_wrong")) or (
        a is not None and bool(a["effects_twice"] or a["persisted_reexecuted"]
                               or a["env_mismatches"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["bench", "trainer", "fleet-trainer", "tool-server",
                                       "slime-trainer", "operator-trainer"], default="bench")
    ap.add_argument("--workload", choices=[*WORKLOADS, "all"], default="default",
                    help="agentic: the key-value agent with a tool server (chaos_agentic.py); "
                    "slime: slime's rollout loop as the trainer (chaos_slime.py); operator: "
                    "requeue/release/gc/bracket commands under faults (chaos_operator.py); "
                    "stream, flow, regenerate, old-weights: the trainer advances the weights "
                    "(chaos_versions.py); longgen: responses of thousands of tokens, the "
                    "token RPO of every fault (chaos_longgen.py); all: every workload in turn, "
                    "each in its own "
                    "workdir, then the aggregate")
    ap.add_argument("--producer-set", action="append", metavar="KEY=VALUE",
                    help="longgen: one more producer config key for every producer (e.g. the "
                    "in-flight journal's keys, to measure it against --before)")
    ap.add_argument("--before", type=float, default=None, metavar="D",
                    help="longgen: the tokens regenerated per fault of the same workload "
                    "without the journal, printed as 'before' (default: this run's own)")
    ap.add_argument("--fault-kinds", default=",".join(PROCESS_FAULTS),
                    help="comma-separated, of " + ", ".join(FAULT_KINDS) + " (default "
                    "kill9,sigstop): jfs-client needs --juicefs, partition and jfs-client root")
    ap.add_argument("--summary", default=None,
                    help="write the run's figures to this JSON file (for --workload all)")
    ap.add_argument("--turns", type=int, default=None,
                    help="agentic: turns per trajectory (default 10; --quick 5)")
    ap.add_argument("--tool-min", type=float, default=None,
                    help="agentic: shortest tool call, s (default 0.5; --quick 0.05)")
    ap.add_argument("--tool-max", type=float, default=None,
                    help="agentic: longest tool call, s (default 5; --quick 0.5)")
    ap.add_argument("--port", type=int, help="tool-server: its port")
    ap.add_argument("--ledger", help="tool-server: its ledger directory")
    ap.add_argument("--engine", help="fleet-trainer: the engine it pushes weights to; "
                    "trainer: the engines, comma-separated")
    ap.add_argument("--engines", help="slime-/operator-trainer: the engines it pushes "
                    "weights to, comma-separated")
    ap.add_argument("--latest", help="slime-/operator-trainer: the file naming the newest "
                    "pushed weight version")
    ap.add_argument("--fleet-only", action="store_true",
                    help="only the fleet-time phase (seconds lost per failure kind)")
    ap.add_argument("--no-fleet", action="store_true",
                    help="skip the fleet-time phase after the nemesis run")
    ap.add_argument("--run")
    ap.add_argument("--ckpt")
    ap.add_argument("--events")
    ap.add_argument("--done")
    ap.add_argument("--interval", type=int, default=3)
    ap.add_argument("--step-s", type=float, default=0.1, help="the trainer's step time")
    ap.add_argument("--quick", action="store_true", help="CI size: 160 prompts, 16 faults "
                    "(agentic: 40 prompts, 7 faults, 5 turns, tools 0.05-0.5 s; slime, "
                    "operator: 32 prompts, 5 faults)")
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--faults", type=int, default=300)
    ap.add_argument("--gap", type=float, default=1.0, help="max seconds between faults")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--juicefs", default=None,
                    help="DIR for a two-client JuiceFS test volume (deploy/juicefs/testvol.sh)")
    ap.add_argument("--disk-full", action="store_true",
                    help="the run on a 64 MiB tmpfs that the nemesis fills and frees (root)")
    ap.add_argument("--deadline", type=float, default=600.0)
    ap.add_argument("--max-stop", type=float, default=3.0, help="longest SIGSTOP, seconds")
    ap.add_argument("--restart-pause", type=float, default=0.8,
                    help="longest pause between a kill -9 and the restart, seconds")
    raw = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    if args.role == "trainer" and args.workload in VERSIONED:
        from chaos_versions import trainer as versions_trainer
        return versions_trainer(args.run, args.ckpt, args.events, args.interval, args.step_s,
                                args.done, args.engine.split(","), args.workload)
    kinds = tuple(k for k in args.fault_kinds.split(",") if k)
    bad = [k for k in kinds if k not in FAULT_KINDS]
    if bad or not kinds:
        ap.error(f"--fault-kinds: expected a comma-separated list of {', '.join(FAULT_KINDS)}, "
                 f"got {args.fault_kinds!r}")
    if args.role == "bench" and args.workload == "all":
        work = Path(args.workdir or f"{tempfile.gettempdir()}/strawq-chaos-all-{os.getpid()}")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        return run_all(raw, work)
    if args.role == "bench" and not args.fleet_only:
        from chaos_cluster import jfs_client_unavailable, netns_unavailable, skew_unavailable
        why = {"jfs-client": lambda: jfs_client_unavailable(args.juicefs),
               "partition": netns_unavailable, "skew": skew_unavailable}
        for k in CLUSTER_FAULTS:
            reason = why[k]() if k in kinds else None
            if reason is not None:
                print(f"chaos: --fault-kinds {k}: {reason}", file=sys.stderr)
                return 1
        if args.workload != "longgen" and (args.producer_set or args.before is not None):
            ap.error("--producer-set and --before go with --workload longgen")
        if args.workload == "longgen" and (set(kinds) & set(CLUSTER_FAULTS) or args.disk_full):
            ap.error("--workload longgen lands its own faults (kill -9 of producers, engines, "
                     "nodes and the collector, and a SIGTERM drain): drop --fault-kinds and "
                     "--disk-full")
        if "partition" in kinds and args.workload == "agentic":
            ap.error("--fault-kinds partition runs with --workload default (the agentic "
                     "tool server listens on loopback only)")
        if args.disk_full and set(kinds) & set(CLUSTER_FAULTS):
            ap.error("--disk-full runs with the process fault kinds only (kill9,sigstop)")
    if args.role == "trainer":
        return trainer(args.run, args.ckpt, args.events, args.interval, args.step_s, args.done,
                       agentic=args.workload == "agentic")
    if args.role == "slime-trainer":
        from chaos_slime import slime_trainer
        return slime_trainer(args.run, args.ckpt, args.events, args.interval, args.step_s,
                             args.done, args.engines.split(","), args.latest)
    if args.role == "operator-trainer":
        from chaos_operator import operator_trainer
        return operator_trainer(args.run, args.ckpt, args.events, args.interval, args.step_s,
                                args.done, args.engines.split(","), args.latest)
    if args.role == "tool-server":
        from chaos_agentic import serve
        return serve(args.port, args.ledger, args.tool_min, args.tool_max)
    agentic = args.workload == "agentic"
    if agentic and not args.fleet_only:
        quick = args.quick
        args.turns = args.turns or (5 if quick else 10)
        args.tool_min = args.tool_min if args.tool_min is not None else (0.05 if quick else 0.5)
        args.tool_max = args.tool_max if args.tool_max is not None else (0.5 if quick else 5.0)
        if not (args.turns >= 2 and 0 < args.tool_min <= args.tool_max):
            ap.error(f"--workload agentic needs --turns >= 2 and 0 < --tool-min <= "
                     f"--tool-max, got {args.turns}, {args.tool_min}, {args.tool_max}")
        if args.quick:
            args.quick = False
            args.prompts, args.faults, args.gap = 40, 7, 0.4
        elif args.prompts == ap.get_default("prompts") and args.faults == ap.get_default(
                "faults"):
            args.prompts, args.faults, args.gap = 48, 36, 2.0
    elif agentic:
        ap.error("--workload agentic has no fleet phase: drop --fleet-only")
    if args.role == "fleet-trainer":
        return fleet_trainer(args.run, args.events, args.engine)
    if args.workload in VERSIONED and args.step_s == ap.get_default("step_s"):
        from chaos_versions import SPECS
        args.step_s = SPECS[args.workload].step_s
    if args.quick and args.workload in ("slime", "operator"):
        args.quick = False
        args.prompts, args.faults, args.gap = 32, 5, 0.4
    if args.quick and args.workload in VERSIONED:
        args.quick = False
        args.prompts, args.faults, args.gap = 48, 5, 0.5
        args.step_s = max(args.step_s, 0.25)  # the faults land while it trains
    if args.workload == "longgen":  # long responses: fewer prompts, a round of each fault
        if args.quick:
            args.prompts, args.faults, args.gap = 16, 8, 2.5
        elif args.prompts == ap.get_default("prompts") and args.faults == ap.get_default(
                "faults"):
            args.prompts, args.faults, args.gap = 64, 24, 3.0
        args.quick = False
    if args.quick:
        args.prompts, args.faults, args.gap = 160, 16, 0.6
    work = Path(args.workdir or f"{tempfile.gettempdir()}/strawq-chaos-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    fs = "local disk"
    disk: str | None = None
    jfs_dir: str | None = None
    producer_mounts: dict[str, str] = {}
    producer_runs: dict[str, str] = {}
    quota = None
    if args.disk_full and not args.juicefs:
        disk = str(work / "disk")
        os.mkdir(disk)
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", disk],
                                 capture_output=True, text=True, check=False)
        if mounted.returncode != 0:
            print(f"chaos: --disk-full needs to mount a tmpfs (root or CAP_SYS_ADMIN): "
                  f"{mounted.stderr.strip() or 'mount failed'}", file=sys.stderr)
            return 1
        atexit.register(subprocess.run, ["umount", "-l", disk], capture_output=True,
                        check=False)
        run_a = run_b = f"{disk}/run"
        fs = "a 64 MiB tmpfs, filled and freed by the nemesis"
    elif args.juicefs:
        a, b = f"{args.juicefs}/A", f"{args.juicefs}/B"
        if not (os.path.ismount(a) and os.path.ismount(b)):  # mount it (else: reuse)
            vol = ["bash", str(ROOT / "deploy/juicefs/testvol.sh")]
            out = subprocess.run([*vol, "up", args.juicefs], capture_output=True, text=True,
                                 check=False)
            if out.returncode != 0:
                print(f"chaos: could not mount the JuiceFS test volume at {args.juicefs} "
                      f"(deploy/juicefs/testvol.sh up): {out.stderr.strip() or out.stdout.strip()}"
                      "\n(the juicefs binary: put it on PATH or set JUICEFS=/path/to/juicefs)",
                      file=sys.stderr)
                return 1
            # this run mounted it, so this run unmounts it (a volume found mounted is left up)
            atexit.register(subprocess.run, [*vol, "down", args.juicefs], capture_output=True,
                            check=False)
            env = dict(word.split("=", 1) for line in out.stdout.splitlines()
                       for word in line.removeprefix("export ").split() if "=" in word)
            a = env["STRAWQ_JUICEFS_A"].strip("'\"")
            b = env["STRAWQ_JUICEFS_B"].strip("'\"")
        sub = f"chaos-{os.getpid()}"
        run_a, run_b = f"{a}/{sub}", f"{b}/{sub}"
        fs = "JuiceFS (two clients)"
        if args.disk_full:  # the run one level down: its quota's directory holds the probes
            from chaos_cluster import VolumeQuota, juicefs_binary
            if juicefs_binary() is None:
                ap.error("--disk-full --juicefs needs the juicefs binary on PATH")
            quota = VolumeQuota(os.path.dirname(os.path.realpath(a)), f"/{sub}",
                                [f"{a}/{sub}/probe-A", f"{b}/{sub}/probe-B"])
            run_a, run_b = f"{a}/{sub}/run", f"{b}/{sub}/run"
            fs = "JuiceFS (two clients), the run's inode quota used up and freed by the nemesis"
        if "jfs-client" in kinds:  # each producer's host: a client of its own (C, D)
            from chaos_cluster import mount_client, umount
            jfs_dir = os.path.dirname(os.path.realpath(a))
            for i, name in enumerate(("C", "D")):
                mnt = mount_client(jfs_dir, name)
                atexit.register(umount, mnt)
                producer_mounts[f"producer{i}"] = mnt
                producer_runs[f"producer{i}"] = f"{mnt}/{sub}"
            fs = "JuiceFS (four clients: collector A, trainer B, producers C and D)"
    else:
        run_a = run_b = str(work / "run")
    if args.fleet_only:
        fleet = fleet_lost(work / "fleet")
        print(f"fleet time: the restarted trainer's first bracket waited "
              f"{fleet['trainer_bracket']:.1f}s of its {fleet['trainer']:.1f}s")
        print(fleet_line(fleet))
        return 0
    ch = Chaos(work, run_a, run_b, args.prompts, args.faults, args.gap, args.seed,
               interval=args.interval, step_s=args.step_s, restart_pause=args.restart_pause,
               max_stop=args.max_stop, workload=args.workload,
               init_set=("max_attempts=1",) if args.workload == "operator" else (),
               turns=args.turns or 10, tool_s=(args.tool_min or 0.5, args.tool_max or 5.0),
               disk=disk, quota=quota, kinds=kinds, juicefs=jfs_dir,
               producer_mounts=producer_mounts,
               producer_runs=producer_runs, producer_sets=tuple(args.producer_set or ()))

    def _term(_sig: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    ch.setup()
    try:
        ch.nemesis()
        ok = ch.finish(args.deadline)
    except BaseException:
        for proc in [*ch.procs.values(), *ch.extra_collectors]:
            proc.stop(2)
        raise
    if not ok:
        for proc in [*ch.procs.values(), *ch.extra_collectors]:
            proc.stop(2)
        print(f"chaos: the run did not drain within {args.deadline:.0f}s (logs in {work})")
        return 1
    res = ch.check()
    fig = ch.figures(res)
    report(ch, res, fig, fs, fleet_lost(work / "fleet")
           if args.workload == "default" and not args.no_fleet else None)
    longgen_bad: list[str] = []
    if args.workload == "longgen":
        import chaos_longgen
        lg = chaos_longgen.figures(ch)
        chaos_longgen.report(lg)
        longgen_bad = chaos_longgen.bad(lg)
        for reason in longgen_bad:
            print(f"chaos longgen: {reason}")
        print(chaos_longgen.line(lg, before=args.before))
    if args.summary:
        write_summary(args.summary, args.workload, len(ch.faults), len(res["lost"]),
                      len(res["duplicated"]), fig["tokens_lost_per_fault"], fig["recoveries"])
    return 0 if not (res["lost"] or res["duplicated"] or res["left"] or agentic_bad(res)
                     or res.get("operator_failures") or longgen_bad) else 1


if __name__ == "__main__":
    sys.exit(main())
