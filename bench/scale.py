"""Scale: what idle producers cost the metadata service, and claim latency as they multiply.

Needs the two-client JuiceFS test volume (``deploy/juicefs/testvol.sh up DIR``; the
exports ``STRAWQ_JUICEFS_A`` / ``STRAWQ_JUICEFS_B``); ``--meta redis`` takes
``STRAWQ_JUICEFS_REDIS_A`` / ``_B`` instead (``META=redis deploy/juicefs/testvol.sh up
DIR``: Redis metadata, the engine production uses). The engine is printed as the client
names it. Metadata operations are counted from
each client's own counters (``<mount>/.stats``, ``juicefs_meta_ops_total_<op>``).

1. **Idle producer** — one real ``Producer`` (default ``ProducerConfig`` and
   ``QueueConfig``) with free slots and nothing to claim, gone idle (its heartbeat marked
   idle, ``pending/`` statted every ``timing.idle_probe_s``), on client B while the run
   lives on client A, for ``--idle-s`` seconds: its metadata operations per second, net
   of what client B sends with nothing running (counted first, over the same window), as
   shipped (list on change) and with a listing at every look instead; and a
   trainer rank waiting in ``BatchReader.next_batch`` on that run (it stats ``batches/``
   at each 20 ms poll and lists on change or once a second; and listing every poll).
2. **Claim latency vs producers** — one producer process claims tasks one by one on client
   A (p50 / p99) while N simulated idle producers load the same volume through client B
   at an idle producer's pace (their real operations: a look at ``pending/`` once per
   ``timing.idle_probe_s``, an idle heartbeat once per lease timeout), N in ``--counts``. The
   achieved background rate is counted, not assumed: where the volume cannot carry N
   producers' load, the row says so.
3. **Extrapolation** to a 1,000-GPU and a 10,000-GPU job (one producer per 8-GPU node:
   125 and 1,250 producers), from the measured rates.

``--control-plane`` instead counts a whole run's control plane at its metadata server
(``bench/control_plane.py`` has the counts and rates assumed per client kind, and why Redis
commands per logical operation is what is measured): it brings up its own Redis-backed
volume (``META=redis deploy/juicefs/testvol.sh``, a private ``redis-server`` on a unix
socket, no attribute or entry cache unless ``--meta-cache default``), has producers,
collector and trainer ranks make their real operations, counts each operation's Redis
commands (``INFO commandstats``), multiplies by each operation's rate at ``--gpus``,
measures the server's capacity with ``redis-benchmark`` on the run's steady command mix, and
ends on ``scale: 10k-GPU control plane = A ops/s steady, B ops per update burst; metadata
server capacity = C ops/s; share = A/C (burst B/D/C over D s)``, saying how many volumes a
run must be sharded across to stay under 20 % of each. ``--quick``: 80 GPUs' clients, every
one counted (under a minute). The defaults are a run's: rank 0 watches, the in-flight
journal every 4 s, the bracket held. ``--trainer-watch`` names how ranks wait: ``rank0``
(the default: ``BatchReader(process_group=...)``, one rank watches, the others hear over
the process group and load only their shard; the per-rank figures from the same counts are
printed beside it; slime's and verl's adapters read with one process) or ``per-rank``
(every rank watches ``batches/``: a reader without its process group).

    python bench/scale.py --control-plane [--quick] [--gpus 10000] [--ranks N]
                           [--slots 24] [--batch-groups 2048] [--step-s 60]
                           [--meta-cache zero|default] [--sample 100]
                           [--journal-every-s 4] [--journal-format segments|records]
                           [--journal-tok-s 30] [--release-chunk K]
                           [--update bracket|rolling] [--engines-per-node 8] [--wave 0.25]
                           [--load-s 30] [--park]

With the journal on (``--journal-every-s``, 4 s by default, a producer's default; 0: off)
the bracket's producers hold their groups through the pause, as a producer does by default
(``timing.hold_through_pause``): the burst is one window record per producer; ``--park``
counts the park instead (both are printed).

A rolling weight update (``bench/control_plane_rolling.py``: nothing parked, engines load in
waves) is counted beside the bracket's burst in every run: a line ``rolling: E engines, wave
W, T s = N ops a rolling update (B with a full step at every poll); share S over the update
(S0 before)``; ``--update rolling`` makes it the last line's burst (over the update's T s).

``--release-chunk K``: the collector releases in chunks of K (``queue.release_chunk``);
producers claim as many tasks as they have free slots, which free one at a time as groups
finish, so the model's steady claims want 1 task (taken out of a chunk). Refills are one
claim of a producer's whole slot budget: its start's fill (whole chunks where K > 1) and
its refill after each update (the parked tasks, single files; the burst counts these
claims); a line ``refill: release_chunk = K, start fill = F Redis commands a task, update
refill = R a task (claims of one: S); update burst B ops (claims of one: B1)`` says what
they cost.

``--live SECONDS`` drives the run instead of multiplying (``bench/control_plane_live.py``):
after the counted pass (the model's prediction for the same run), every client makes its
real operations concurrently at its real schedule for SECONDS of wall time (every
producer's heartbeat, the groups' completions and claims, the collector's releases and
steps, the rank 0 reader's real ``next_batch`` or every rank's look, every producer's
park and refill at each update), run by ``--live-workers`` threads from a heap of due
times. It prints, per operation kind, the count wanted by the schedule and achieved (lag
p50 / p99), Redis's commands a second between updates and per update, and ends on
``scale live: N GPUs, M clients, achieved A of wanted W ops/s (share x); Redis X
commands/s steady (p50), Y per update over D s; model (cost x rate) predicts P commands/s
steady, Q per update``. ``--gpus`` takes a list there (``1000,2500,10000``): sizes run
smallest first until one is not kept up with (under 95 % achieved), and a last line names
the largest kept up with. A step that does not fit SECONDS / 2 is scaled down to it (the
groups' rate kept: said in the output). ``--quick``: 80 GPUs.

``--dilate F`` (with ``--live``) drives the run at 1/F of its rates where this machine
cannot keep up with them: every period (the step, the heartbeat, the journal's window, a
rank's listing, the readers' own clocks, and with ``--meta-cache default`` the volume's
cache TTLs) times F, every count kept (producers, ranks, leases in flight, groups per step,
the pending depth, a window's tokens). What each operation sends the server is unchanged;
a line after each size's live line gives the run at its real rates, the clients' commands
a second times F, against the server's capacity for the run's command mix (as the counted
mode measures it): ``scale live at real rates: N GPUs driven at 1/F of their rates: Redis X
commands/s steady, Y per update over D s; model P commands/s steady; metadata server
capacity = C ops/s; share = X/C steady (model P/C), update U``. What a dilated run cannot
show: contention that only the real rates make (claims racing for the same names, a step's
shard loads against the steady schedule) is F times rarer.

    python bench/scale.py --control-plane --live SECONDS [--gpus 1000,2500,10000]
                           [--live-workers 16] [--dilate F] [--quick] [the flags above]

    python bench/scale.py [--quick] [--meta sqlite|redis] [--idle-s 20] [--counts 1,10,100]
                           [--claims 200]

``--quick`` (the CI size): 2 s idle windows, N in 1,10, 20 claims each; it checks the
path, its figures are noise.

The last line: ``scale: idle producer = X meta ops/s, claim p99 at N=<max> / N=1 = Y``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strawq.config import QueueConfig  # noqa: E402
from strawq.data.dataset import Dataset  # noqa: E402
from strawq.data.feeder import Feeder  # noqa: E402
from strawq.storage import PosixStorage  # noqa: E402
from strawq.tasks.queue import RunQueue  # noqa: E402

#: JuiceFS's default attribute-cache TTL (the test volume's): a stat is served from the
#: kernel within it, so a polling client costs at most one getattr per directory per TTL
ATTR_TTL_S = 1.0


def meta_ops_by_kind(mount: str) -> dict[str, float]:
    out: dict[str, float] = {}
    with open(os.path.join(mount, ".stats"), encoding="utf-8") as f:
        for line in f:
            if line.startswith("juicefs_meta_ops_total_"):
                name, value = line.split()[:2]
                out[name[len("juicefs_meta_ops_total_"):]] = float(value)
    return out


def meta_ops(mount: str) -> float:
    return sum(meta_ops_by_kind(mount).values())


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1)))] if s else float("nan")


def new_run(root: str, tasks: int) -> str:
    os.makedirs(root)
    ds = os.path.join(root, "ds.jsonl")
    with open(ds, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"prompt": [1, 2, 3]}) + "\n" for _ in range(tasks))
    run = os.path.join(root, "run")
    q = RunQueue.create(PosixStorage(run, writer_id="c"), QueueConfig(release_batch=256))
    if tasks:
        feeder = Feeder(q, Dataset(ds))
        while feeder.release():
            pass
    return run


def engine_of(mount: str) -> str:
    """The metadata engine of the JuiceFS client behind ``mount`` (``unknown`` if unseen)."""
    from strawq.doctor import find_mount, juicefs_settings

    try:
        settings, _argv = juicefs_settings(find_mount(mount).mount_point)
    except OSError:
        return "unknown"
    return settings.meta_engine or "unknown"


def client_rate(mount: str, seconds: float) -> tuple[float, dict[str, float]]:
    """Metadata ops/s the client sends over ``seconds`` with nothing of this bench running."""
    before, t0 = meta_ops_by_kind(mount), time.perf_counter()
    time.sleep(seconds)
    after, dt = meta_ops_by_kind(mount), time.perf_counter() - t0
    kinds = {k: round((v - before.get(k, 0.0)) / dt, 2) for k, v in after.items()
             if v - before.get(k, 0.0) > 0}
    return sum(kinds.values()), kinds


# -- 1. an idle producer -------------------------------------------------------------------
class IdleClient:
    """An engine client that is never asked to generate (the producer has no work)."""

    worker_urls: list[str] = []

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def generate(self, input_ids: Any, sampling_params: Any, **kw: Any) -> Any:
        raise RuntimeError("an idle producer generated")

    async def abort(self, rid: str | None = None, *, url: str | None = None) -> None:
        pass


def idle_rate(run_b: str, mount_b: str, seconds: float, probe: bool
              ) -> tuple[float, dict[str, float]]:
    """Metadata ops/s of one idle producer on client B (``probe=False``: list every poll)."""
    from strawq.producers.producer import Producer
    from strawq.producers.producer_config import (
        BudgetConfig,
        EngineConfig,
        PluginsConfig,
        ProducerConfig,
    )
    from strawq.producers.sample import SamplerParams
    from strawq.storage.watch import DirProbe

    real = DirProbe.changed
    if not probe:
        DirProbe.changed = lambda self: True  # type: ignore[method-assign]
    try:
        p = Producer(ProducerConfig(
            run_dir=run_b,
            engine=EngineConfig(workers=("http://127.0.0.1:9",)),
            plugins=PluginsConfig(reward="strawq.producers.rewards.count_task"),
            budget=BudgetConfig(slots=4),
            sampling=SamplerParams(ignore_eos=True)),  # no engine to read EOS ids from
                     client=IdleClient())  # type: ignore[arg-type]

        async def main() -> tuple[float, dict[str, float]]:
            task = asyncio.create_task(p.run())
            # started, first claim done, first heartbeat written; and gone idle (its
            # heartbeat marked idle, timing.idle_after_s after the claim found nothing)
            await asyncio.sleep(2.0 + p.config.timing.idle_after_s + 1.0)
            before, t0 = meta_ops_by_kind(mount_b), time.perf_counter()
            await asyncio.sleep(seconds)
            after, dt = meta_ops_by_kind(mount_b), time.perf_counter() - t0
            kinds = {k: round((v - before.get(k, 0.0)) / dt, 2) for k, v in after.items()
                     if v - before.get(k, 0.0) > 0}
            p.request_stop()
            await asyncio.wait_for(task, 30)
            return sum(kinds.values()), kinds

        return asyncio.run(main())
    finally:
        DirProbe.changed = real  # type: ignore[method-assign]


def waiting_rank_rate(run_b: str, mount_b: str, seconds: float, probe: bool) -> float:
    """Metadata ops/s of a trainer rank on client B waiting in ``next_batch`` on a run
    that publishes nothing (``probe=False``: it lists ``batches/`` at every poll)."""
    from strawq.collector.errors import BatchTimeout
    from strawq.collector.trainer.reader import BatchReader
    from strawq.storage.watch import DirProbe

    real = DirProbe.changed
    if not probe:
        DirProbe.changed = lambda self: True  # type: ignore[method-assign]
    try:
        reader = BatchReader.open(run_b)
        try:
            try:
                reader.next_batch(timeout=0.5)  # opened, replay position read
            except BatchTimeout:
                pass
            before, t0 = meta_ops(mount_b), time.perf_counter()
            try:
                reader.next_batch(timeout=seconds)
            except BatchTimeout:
                pass
            return (meta_ops(mount_b) - before) / (time.perf_counter() - t0)
        finally:
            reader.close()
    finally:
        DirProbe.changed = real  # type: ignore[method-assign]


# -- 2. claim latency under N simulated idle producers -----------------------------------------
def background(run_b: str, n: int, stop: threading.Event, threads: int = 4) -> None:
    """N idle producers' operations on client B, as an idle producer makes them: each
    looks at pending/ once per ``timing.idle_probe_s`` and beats (idle-marked) once per
    lease timeout (a look is a listing here: each real producer is its own client, so its
    looks are not served from this client's shared attribute cache)."""
    from strawq.producers.producer_config import TimingConfig

    beat_s, look_s = QueueConfig().lease_timeout_s, TimingConfig().idle_probe_s
    q = RunQueue.open(PosixStorage(run_b, writer_id="sim", fsync=False))
    st = q.storage
    per_thread = [list(range(i, n, threads)) for i in range(threads)]
    looks_per_beat = max(1, round(beat_s / look_s))

    def loop(ids: list[int]) -> None:
        if not ids:
            return
        # events per second for this thread's producers: beats and looks, spread evenly
        rate = len(ids) * (1 / beat_s + 1 / look_s)
        gap = 1.0 / rate
        k = 0
        nxt = time.perf_counter()
        while not stop.is_set():
            pid = ids[k % len(ids)]
            try:
                if k % (looks_per_beat + 1) == 0:
                    q.heartbeat(f"sim{pid}", idle=True)
                else:
                    st.list("pending")
            except Exception:  # noqa: BLE001 - overloaded volume: keep loading it
                pass
            k += 1
            nxt += gap
            delay = nxt - time.perf_counter()
            if delay > 0:
                stop.wait(delay)
            elif delay < -1.0:
                nxt = time.perf_counter()  # cannot keep up: do not build a backlog

    ts = [threading.Thread(target=loop, args=(ids,), daemon=True) for ids in per_thread]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def claimer(run_a: str, claims: int, out: Any) -> None:
    q = RunQueue.open(PosixStorage(run_a, writer_id="claimer"))
    lat = []
    for _ in range(claims):
        t0 = time.perf_counter()
        got = q.claim("claimer", 1)
        lat.append(time.perf_counter() - t0)
        if not got:
            break
        time.sleep(0.01)  # a producer claims when a slot frees, not in a tight loop
    out.put(lat)


def claim_latency(run_a: str, run_b: str, mount_b: str, n: int, claims: int
                  ) -> dict[str, float]:
    stop = threading.Event()
    bg = threading.Thread(target=background, args=(run_b, n, stop), daemon=True) if n else None
    if bg is not None:
        bg.start()
        time.sleep(1.0)
    before, t0 = meta_ops(mount_b), time.perf_counter()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    proc = ctx.Process(target=claimer, args=(run_a, claims, out))
    proc.start()
    lat = out.get(timeout=600)
    proc.join(30)
    achieved = (meta_ops(mount_b) - before) / (time.perf_counter() - t0)
    stop.set()
    if bg is not None:
        bg.join(10)
    return {"n": n, "p50_ms": pct(lat, 0.5) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3,
            "claims": len(lat), "background_ops_s": achieved}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--meta", choices=("sqlite", "redis"), default="sqlite",
                    help="which test volume's exports to default to: STRAWQ_JUICEFS_A/B "
                         "(sqlite) or STRAWQ_JUICEFS_REDIS_A/B (redis)")
    ap.add_argument("--mount-a", default=None)
    ap.add_argument("--mount-b", default=None)
    ap.add_argument("--quick", action="store_true",
                    help="CI size: 2 s idle windows, N in 1,10, 20 claims")
    ap.add_argument("--idle-s", type=float, default=None, help="default 20")
    ap.add_argument("--counts", default=None, help="default 1,10,100,1000")
    ap.add_argument("--claims", type=int, default=None, help="default 200")
    ap.add_argument("--json", help="write results here")
    cp = ap.add_argument_group(
        "control plane (--control-plane): every client of a large run, counted at a "
        "Redis metadata server this bench starts")
    cp.add_argument("--control-plane", action="store_true",
                    help="count the control plane of a --gpus run instead (brings its own "
                         "Redis-backed volume up: needs juicefs, /dev/fuse, redis-server)")
    cp.add_argument("--gpus", default=None,
                    help="default 10000 (--quick: 80); with --live a comma list of sizes, "
                         "run smallest first until one cannot be kept up with")
    cp.add_argument("--gpus-per-node", type=int, default=8, help="one producer per node")
    cp.add_argument("--ranks", type=int, default=None,
                    help="trainer ranks waiting for batches (default: one per GPU)")
    cp.add_argument("--slots", type=int, default=24, help="groups in flight per producer")
    cp.add_argument("--batch-groups", type=int, default=None,
                    help="groups per step (default 2048 at 10,000 GPUs, in proportion to "
                         "--gpus otherwise)")
    cp.add_argument("--step-s", type=float, default=60.0,
                    help="seconds per training step; a weight update after each")
    cp.add_argument("--handback-share", type=float, default=0.25,
                    help="share of the groups in flight handed back at an update (the rest "
                         "are saved as partials and resumed)")
    cp.add_argument("--burst-window-s", type=float, default=10.0,
                    help="seconds an update's saves and resumes spread over")
    cp.add_argument("--pending-depth", type=int, default=None,
                    help="tasks waiting in pending/ as producers claim (default 1024, "
                         "--quick: 64)")
    cp.add_argument("--sample", type=int, default=None,
                    help="identities of each kind whose operations are counted, spread over "
                         "all of them (default 100; --quick: every one; 0: every one)")
    cp.add_argument("--meta-cache", choices=("zero", "default"), default="zero",
                    help="the volume's kernel caches: zero (every call reaches the server, "
                         "as on a node whose cache has expired: the upper bound) or default "
                         "(1 s TTLs, shared by every simulated client: the lower bound)")
    cp.add_argument("--trainer-watch", choices=("per-rank", "rank0"), default="rank0",
                    help="how trainer ranks wait for batches: rank0 (the default: the group's "
                         "rank 0 watches, the others hear over the group: "
                         "BatchReader(process_group=...); per-rank's figures printed beside "
                         "its own, from the same counts) or per-rank (each rank polls "
                         "batches/: a reader without its process group)")
    cp.add_argument("--journal-every-s", type=float, default=4.0,
                    help="the in-flight journal's window in seconds (default 4, a producer's "
                         "timing.journal_every_s; 0: no journal): each producer's window "
                         "record and superseded delete as a steady term, and the bracket held "
                         "(or, with --park, parked into the journal) at the update; the "
                         "figures without it are printed beside")
    cp.add_argument("--journal-format", choices=("segments", "records"), default="segments",
                    help="segments: each window appended to the writer's open segment (what a "
                         "store that can append gets); records: a file published per window "
                         "and deleted once superseded")
    cp.add_argument("--journal-tok-s", type=float, default=30.0,
                    help="tokens a second each held sequence receives (a window's delta)")
    cp.add_argument("--release-chunk", type=int, default=1, metavar="K",
                    help="the collector releases in chunks of K tasks (queue.release_chunk); "
                         "the model's producers claim as many tasks as they have free slots, "
                         "which free one at a time as groups finish: steady claims want 1 "
                         "task, taken out of a chunk (default 1: one task per file)")
    cp.add_argument("--update", choices=("bracket", "rolling"), default="bracket",
                    help="the weight update the last line's burst is of: bracket (every "
                         "producer pauses: with the journal on it holds its groups, the "
                         "producer's default, else parks them) or rolling (engines load in "
                         "waves; bench/control_plane_rolling.py); both are counted and printed")
    cp.add_argument("--park", action="store_true",
                    help="with the journal on, the bracket's producers park their groups "
                         "(timing.hold_through_pause=false) instead of holding them (the "
                         "default); both bursts are printed either way")
    cp.add_argument("--engines-per-node", type=int, default=8,
                    help="engines per producer, for the rolling update (default 8)")
    cp.add_argument("--wave", type=float, default=0.25,
                    help="the rolling wave: engines loading at once, a count, or a share of "
                         "the engines below 1 (default 0.25, the trainer's)")
    cp.add_argument("--load-s", type=float, default=30.0,
                    help="seconds one engine's load takes, for the rolling update (default 30)")
    live = ap.add_argument_group(
        "live control plane (--control-plane --live SECONDS): every client at its real "
        "schedule, concurrently, counted at the Redis server per second and per update")
    live.add_argument("--live", type=float, default=None, metavar="SECONDS",
                      help="drive the run's clients at their real rates for SECONDS of wall "
                           "time (bench/control_plane_live.py) after a counted pass for the "
                           "model's prediction; --step-s is scaled down to SECONDS / 2 where "
                           "a step would not fit")
    live.add_argument("--live-workers", type=int, default=16,
                      help="worker threads that run the schedule (not a thread per client)")
    live.add_argument("--dilate", type=float, default=1.0, metavar="F",
                      help="drive the run at 1/F of its rates (every period and the readers' "
                           "clocks times F, with --meta-cache default the cache TTLs too; "
                           "every count kept), and print its commands a second at the real "
                           "rates (times F) against the server's capacity (default 1)")
    args = ap.parse_args()
    try:
        sizes = [int(x) for x in args.gpus.split(",")] if args.gpus else []
    except ValueError:
        ap.error(f"--gpus takes a number or, with --live, a comma list of numbers: {args.gpus!r}")
    if len(sizes) > 1 and args.live is None:
        ap.error("--gpus takes one number without --live")
    args.gpus_list = sorted(sizes)
    args.gpus = max(sizes) if sizes else None
    if args.live is not None and (not args.control_plane or args.live <= 0
                                  or args.live_workers < 1):
        ap.error("--live SECONDS needs --control-plane, SECONDS > 0 and --live-workers >= 1")
    if args.dilate != 1.0 and (args.live is None or not args.dilate > 1.0):
        ap.error(f"--dilate F needs --live and F > 1, got {args.dilate:g}")
    if args.release_chunk < 1:
        ap.error(f"--release-chunk must be >= 1, got {args.release_chunk}")
    if args.control_plane:
        bad = [f"--{k.replace('_', '-')} {v}" for k, v, ok in (
            ("gpus", args.gpus, all(n >= args.gpus_per_node for n in args.gpus_list)),
            ("gpus_per_node", args.gpus_per_node, args.gpus_per_node >= 1),
            ("ranks", args.ranks, args.ranks is None or args.ranks >= 1),
            ("slots", args.slots, args.slots >= 1),
            ("engines_per_node", args.engines_per_node, args.engines_per_node >= 1),
            ("wave", args.wave, args.wave > 0),
            ("load_s", args.load_s, args.load_s > 0),
            ("batch_groups", args.batch_groups, args.batch_groups is None
             or args.batch_groups >= 1),
            ("step_s", args.step_s, args.step_s > 0),
            ("handback_share", args.handback_share, 0 <= args.handback_share <= 1),
            ("burst_window_s", args.burst_window_s, args.burst_window_s > 0),
            ("pending_depth", args.pending_depth, args.pending_depth is None
             or args.pending_depth >= 0),
            ("sample", args.sample, args.sample is None or args.sample >= 0),
            ("journal_every_s", args.journal_every_s, args.journal_every_s >= 0),
            ("journal_tok_s", args.journal_tok_s, args.journal_tok_s > 0)) if not ok]
        if bad:
            ap.error(f"out of range: {', '.join(bad)} (GPUs at least one node's, counts and "
                     "seconds positive, --handback-share within 0..1)")
        return control_plane(args)
    infix = "_REDIS" if args.meta == "redis" else ""
    args.mount_a = args.mount_a or os.environ.get(f"STRAWQ_JUICEFS{infix}_A")
    args.mount_b = args.mount_b or os.environ.get(f"STRAWQ_JUICEFS{infix}_B")
    args.idle_s = args.idle_s or (2.0 if args.quick else 20.0)
    args.counts = args.counts or ("1,10" if args.quick else "1,10,100,1000")
    args.claims = args.claims or (20 if args.quick else 200)
    if not (args.mount_a and args.mount_b and os.path.exists(os.path.join(args.mount_a,
                                                                          ".stats"))):
        print(f"scale: needs two JuiceFS clients of one volume (STRAWQ_JUICEFS{infix}_A/B "
              f"from {'META=redis ' if infix else ''}deploy/juicefs/testvol.sh up DIR)")
        return 2
    name = f"scale-{secrets.token_hex(3)}"
    root_a = os.path.join(args.mount_a, name)
    counts = [int(x) for x in args.counts.split(",")]
    try:
        run_a = new_run(root_a, args.claims * (len(counts) + 1))
        run_b = os.path.join(args.mount_b, name, "run")
        for _ in range(100):  # client B sees A's new directory (entry cache)
            if os.path.exists(os.path.join(run_b, "run.meta")):
                break
            time.sleep(0.1)
        idle_root = os.path.join(args.mount_a, name + "-idle")
        new_run(idle_root, 0)
        idle_b = os.path.join(args.mount_b, name + "-idle", "run")
        for _ in range(100):
            if os.path.exists(os.path.join(idle_b, "run.meta")):
                break
            time.sleep(0.1)
        from strawq.producers.producer_config import TimingConfig
        engine = engine_of(args.mount_b)
        print(f"volume: JuiceFS on {engine} metadata (client B as the metadata engine "
              "names it: strawq doctor's reading)")
        # what client B sends with nothing of ours running (other processes of the host,
        # the client's own background work): subtracted from the idle producer's rate
        quiet, quiet_kinds = client_rate(args.mount_b, args.idle_s)
        raw, kinds = idle_rate(idle_b, args.mount_b, args.idle_s, probe=True)
        shipped = max(raw - quiet, 0.0)
        before, kinds_before = idle_rate(idle_b, args.mount_b, args.idle_s, probe=False)
        t = TimingConfig()
        print(f"idle producer (default config: gone idle {t.idle_after_s:g} s after an empty "
              f"claim, stats pending/ every {t.idle_probe_s:g} s, beats once per lease "
              f"timeout, {QueueConfig().lease_timeout_s:.0f} s), client B, "
              f"{args.idle_s:.0f} s: {shipped:.2f} meta ops/s ({raw:.2f} counted, less the "
              f"client's {quiet:.2f} with nothing running; listing at every look: "
              f"{max(before - quiet, 0.0):.2f})")
        print(f"  by kind, ops/s: {kinds}; nothing running: {quiet_kinds}; listing at every "
              f"look: {kinds_before}")
        waiting = waiting_rank_rate(idle_b, args.mount_b, args.idle_s, probe=True)
        waiting_before = waiting_rank_rate(idle_b, args.mount_b, args.idle_s, probe=False)
        print(f"a waiting trainer rank (next_batch, polls 0.02 s), client B, "
              f"{args.idle_s:.0f} s: {waiting:.1f} meta ops/s (stat probes; listing every "
              f"poll: {waiting_before:.1f})")
        rows = []
        print(f"{'N':>6} {'background ops/s':>17} {'(wanted)':>9} {'claim p50 ms':>13} "
              f"{'p99 ms':>8}")
        for n in counts:
            r = claim_latency(run_a, run_b, args.mount_b, n, args.claims)
            r["wanted_ops_s"] = n * (1 / QueueConfig().lease_timeout_s
                                     + 1 / TimingConfig().idle_probe_s)
            rows.append(r)
            print(f"{n:>6} {r['background_ops_s']:>17.0f} {r['wanted_ops_s']:>9.0f} "
                  f"{r['p50_ms']:>13.2f} {r['p99_ms']:>8.2f}", flush=True)
        for gpus in (1000, 10000):
            prods = gpus // 8
            print(f"{gpus:>6} GPUs = {prods} producers: idle load {prods * shipped:.0f} meta "
                  f"ops/s (listing every poll: {prods * before:.0f})")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"engine": engine, "idle_ops_s": shipped, "idle_ops_s_counted": raw,
                       "client_quiet_ops_s": quiet, "idle_ops_s_listing": before,
                           "waiting_rank_ops_s": waiting,
                           "waiting_rank_ops_s_listing": waiting_before,
                           "claims": rows}, f, indent=2)
        base = rows[0]["p99_ms"] if rows else float("nan")
        top = rows[-1] if rows else {"n": 0, "p99_ms": float("nan")}
        print(f"scale: idle producer = {shipped:.2f} meta ops/s, claim p99 at N={top['n']} / "
              f"N={rows[0]['n'] if rows else 0} = {top['p99_ms'] / base:.2f}")
    finally:
        shutil.rmtree(root_a, ignore_errors=True)
        shutil.rmtree(os.path.join(args.mount_a, name + "-idle"), ignore_errors=True)
    return 0


def make_run(args: argparse.Namespace, gpus: int) -> Any:
    from control_plane import Run

    return Run(gpus=gpus, gpus_per_node=args.gpus_per_node, ranks=args.ranks or gpus,
              slots=args.slots, step_s=args.step_s,
              batch_groups=args.batch_groups or max(1, round(2048 * gpus / 10_000)),
              handback_share=args.handback_share, burst_window_s=args.burst_window_s,
              pending_depth=(64 if args.quick else 1024) if args.pending_depth is None
              else args.pending_depth,
              sample=(0 if args.quick else 100) if args.sample is None else args.sample,
              trainer_watch=args.trainer_watch, journal_every_s=args.journal_every_s,
              journal_tok_s=args.journal_tok_s, journal_format=args.journal_format,
              release_chunk=args.release_chunk, update=args.update,
              hold=bool(args.journal_every_s) and not args.park,
              engines_per_node=args.engines_per_node, wave=args.wave, load_s=args.load_s)


def volume_caption(vol: Any, args: argparse.Namespace) -> str:
    """The control-plane runs' first line: the private Redis-backed volume and its caches."""
    caches = ("no attribute or entry cache" if args.meta_cache == "zero" else
              "1 s attribute and entry caches")
    return f"volume: JuiceFS on a private redis-server ({vol.sock}), two clients, {caches}"


def control_plane(args: argparse.Namespace) -> int:
    from control_plane import report
    from redis_meta import Unavailable, test_volume

    if args.live is not None:
        return control_plane_live(args)
    run = make_run(args, args.gpus or (80 if args.quick else 10_000))
    try:
        with test_volume("redis", meta_cache=args.meta_cache) as vol:
            print(volume_caption(vol, args), flush=True)
            out = report(vol, run, quiet_s=2.0 if args.quick else 10.0,
                         capacity_requests=5_000 if args.quick else 100_000)
    except Unavailable as e:
        print(f"scale: the control-plane run needs a Redis-backed JuiceFS volume: {e}")
        return 2
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        print(f"scale: the control-plane run failed: {type(e).__name__}: {e}")
        return 1
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2, default=str)
    return 0


def control_plane_live(args: argparse.Namespace) -> int:
    """``--control-plane --live SECONDS``: the counted pass for the model's prediction,
    then each ``--gpus`` size driven live (smallest first, until one is not kept up with:
    under 95 % of the wanted operations achieved)."""
    from control_plane_live import KEPT_UP, SetupTooSlow, dilated, drive, live_run, model
    from redis_meta import Unavailable, test_volume

    sizes = args.gpus_list or [80 if args.quick else 10_000]
    # an update's parks take at most this many workers: the rest keep the steady schedule
    burst_workers = max(1, args.live_workers - max(2, args.live_workers // 4))
    results = []
    f = args.dilate
    # a dilated run's caches keep their TTLs in proportion to its periods
    ttl = f"{f:g}s"
    extra = (f"--attr-cache {ttl} --entry-cache {ttl} --dir-entry-cache {ttl}"
             if f != 1.0 and args.meta_cache == "default" else "")
    try:
        with test_volume("redis", meta_cache=args.meta_cache, extra_opts=extra) as vol:
            print(f"{volume_caption(vol, args)}; load average {os.getloadavg()[0]:.1f}",
                  flush=True)
            if f != 1.0:
                print(f"dilated: every period times {f:g}, every rate divided by it, every "
                      f"count kept" + (f"; cache TTLs {ttl}" if extra else ""), flush=True)
            for gpus in sizes:
                run = dilated(make_run(args, gpus), f)
                lrun = live_run(run, args.live)
                if lrun.step_s != run.step_s:
                    print(f"live: a {run.step_s:g} s step and its update do not fit "
                          f"{args.live:g} s: step scaled to {lrun.step_s:g} s and "
                          f"{lrun.batch_groups} groups ({lrun.groups_per_s:.2f} groups/s, "
                          f"{run.groups_per_s:.2f} at the real step)", flush=True)
                predicted = model(vol, lrun, quiet_s=2.0 if args.quick else 5.0,
                                  capacity_requests=(5_000 if args.quick else 100_000)
                                  if f != 1.0 else 0)
                print(f"live: {gpus} GPUs: {lrun.producers} producers ({lrun.slots} slots, "
                      f"{lrun.in_flight} groups in flight), {lrun.ranks} ranks "
                      f"({lrun.trainer_watch}), {lrun.groups_per_s:.2f} groups/s, a step "
                      f"every {lrun.step_s:g} s, heartbeat every {lrun.heartbeat_s:g} s; "
                      f"{args.live:g} s live, {args.live_workers} workers ({burst_workers} at most "
                      f"on an update's parks); load average "
                      f"{os.getloadavg()[0]:.1f}", flush=True)
                try:
                    r = drive(vol, lrun, args.live, args.live_workers, burst_workers,
                              predicted, dilate=f)
                except SetupTooSlow as e:
                    print(f"  this machine did not keep up with {gpus} GPUs: {e}", flush=True)
                    break
                results.append(r)
                print(r.line(), flush=True)
                if f != 1.0:
                    print(r.real_line(), flush=True)
                if not r.kept_up:
                    why = (f"achieved {r.share:.1%} of the wanted operations, under "
                           f"{KEPT_UP:.0%}" if r.share < KEPT_UP else
                           "its update did not finish before the run was cut off: the window "
                           "and as long again after it, 30 s at least")
                    print(f"  this machine did not keep up with {gpus} GPUs ({why})",
                          flush=True)
                    break
    except Unavailable as e:
        print(f"scale: the control-plane run needs a Redis-backed JuiceFS volume: {e}")
        return 2
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        print(f"scale: the live control-plane run failed: {type(e).__name__}: {e}")
        return 1
    if len(sizes) > 1:
        kept = [r.gpus for r in results if r.kept_up]
        print("scale live: the largest size kept up with: "
              + (f"{max(kept)} GPUs" if kept else "none") + f" (of {','.join(map(str, sizes))}"
              + (f"; reached {results[-1].gpus} GPUs at share {results[-1].share:.3f})"
                 if results else ")"))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([{k: v for k, v in r.__dict__.items() if k != "tally"}
                       | {"ops": {k: {"wanted": t.wanted, "done": t.done, "failed": t.failed}
                                  for k, t in r.tally.items()}} for r in results], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
