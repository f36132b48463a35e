"""``strawq demo``: a real RL loop on a laptop, every part for real.

A local Ray cluster with two nodes, a run directory (local disk, or a JuiceFS mount), two
tiny engines (real torch models behind SGLang's HTTP protocol), one producer actor per
node, the collector (grantor + feeder) in a thread, and a GRPO trainer that consumes
batches through the reader API and pushes new weights through the weight-update bracket
after every step, with their fingerprint: every engine is attested before producers resume
(the summary's ``attest/checks`` and ``attest/failures``).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import shutil
import signal
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from strawq.collector.core import Collector
from strawq.collector.trainer.reader import BatchReader
from strawq.config import Config, QueueConfig, merge
from strawq.data.dataset import Dataset
from strawq.demo import plots, task, tools_task
from strawq.demo.assembly import BracketOptions, RunAssembly
from strawq.demo.hops import HopSamples, HopTracer, IdleGaps, idle_gaps
from strawq.demo.schedule import (
    ScheduleConfig,
    ScheduleResult,
    StepRecord,
    collector_config,
    run_schedule,
)
from strawq.demo.trainer import GRPOTrainer
from strawq.errors import StrawqError
from strawq.producers.engines.tiny_model import init_model, load_weights, save_weights
from strawq.storage import PosixStorage
from strawq.storage.watch import IN_CREATE, IN_MOVED_TO, DirWatch
from strawq.tasks.queue import RunQueue
from strawq.weights.control import Control

log = logging.getLogger(__name__)

CHECKPOINT = "trainer.ckpt"
#: a stretch longer than this with the trainer waiting and every engine idle is dead time
IDLE_GAP_S = 0.1


@dataclass(frozen=True, kw_only=True)
class DemoConfig(Config):
    #: where everything goes: run/ (the queue), weights/, plots, metrics, summary
    workdir: str = "runs/demo"
    #: put the queue's run directory under this mount instead (e.g. a JuiceFS mount)
    run_root: str | None = None
    mode: str = "async"
    #: ``count`` (write exactly k tokens) or ``tools`` (arithmetic through a calculator
    #: tool: multi-turn trajectories, ``strawq.demo.tools_task``)
    task: str = "count"
    steps: int = 60
    batch_groups: int = 8
    group_size: int = 8
    max_staleness: int = 1
    oversample: float = 1.5
    engines: int = 2
    nodes: int = 2
    #: concurrent requests per engine (C); K = floor(C*E/G) group slots
    concurrency: int = 64
    prompts: int = 4000
    lr: float = 1e-3
    seed: int = 0
    resume: bool = False
    #: discard a previous run in ``workdir`` and start over
    fresh: bool = False
    lease_timeout_s: float = 20.0
    progress: bool = True
    #: where the GRPO trainer's model trains (``cpu`` or ``cuda``; the engines stay on CPU)
    trainer_device: str = "cpu"


@dataclass
class DemoResult:
    config: DemoConfig
    schedule: ScheduleResult
    rewards: list[float]
    staleness: list[int]
    trained_indices: list[int]
    files: dict[str, str] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    hops: HopSamples | None = None
    gaps: IdleGaps | None = None


class Sampler(threading.Thread):
    """Polls engine loads every ``period_s`` for the timeline and the idle-gap check
    (busy = requests running or waiting). One kept-alive connection per engine: at 50 Hz a
    new connection per poll would cost more than the engines' own work."""

    def __init__(self, urls: list[str], period_s: float = 0.02) -> None:
        super().__init__(daemon=True, name="strawq-demo-sampler")
        self.urls, self.period = urls, period_s
        self.samples = plots.Samples()
        self.stop_event = threading.Event()

    def run(self) -> None:
        conns: dict[int, http.client.HTTPConnection] = {}
        while not self.stop_event.wait(self.period):
            for i, url in enumerate(self.urls):
                now = time.monotonic()
                try:
                    if i not in conns:
                        u = urllib.parse.urlsplit(url)
                        conns[i] = http.client.HTTPConnection(u.hostname or "127.0.0.1",
                                                              u.port, timeout=2)
                    conns[i].request("GET", "/v1/loads?include=core")
                    loads = json.loads(conns[i].getresponse().read())["loads"]
                    running = sum(int(x.get("num_running_reqs", 0))
                                  + int(x.get("num_waiting_reqs", 0)) for x in loads)
                    cap = sum(int(x.get("max_running_requests", 1) or 1) for x in loads)
                    self.samples.add(f"engine {i}", now, min(1.0, running / max(cap, 1)))
                except (OSError, http.client.HTTPException, ValueError, KeyError):
                    conns.pop(i, None)
                    self.samples.add(f"engine {i}", now, 0.0)
        for c in conns.values():
            c.close()


def run_demo(cfg: DemoConfig) -> DemoResult:
    """Run the whole loop; Ctrl-C stops cleanly (run again with resume=True to continue)."""
    from strawq.producers.placement import (
        PlacementConfig,
        ProducerPlacement,
        start_local_cluster,
        wait_for_nodes,
    )
    from strawq.producers.producer_config import ProducerConfig

    torch.set_num_threads(1)
    work = os.path.abspath(cfg.workdir)
    os.makedirs(work, exist_ok=True)
    run_dir = os.path.join(os.path.abspath(cfg.run_root) if cfg.run_root else work, "run")
    weights = os.path.join(work, "weights")
    ckpt_path = os.path.join(work, CHECKPOINT)
    dataset_path = os.path.join(work, "prompts.jsonl")
    if cfg.fresh and not cfg.resume:
        shutil.rmtree(run_dir, ignore_errors=True)  # only what a demo writes
        shutil.rmtree(weights, ignore_errors=True)
        for name in (CHECKPOINT, "metrics.jsonl", "summary.json"):
            if os.path.exists(os.path.join(work, name)):
                os.remove(os.path.join(work, name))
    fresh = not (cfg.resume and os.path.exists(os.path.join(run_dir, "run.meta")))
    if fresh and os.path.exists(os.path.join(run_dir, "run.meta")):
        raise StrawqError(f"{run_dir} already holds a run: pass --resume to continue it, "
                          "--fresh to discard it and start over, or another --workdir")
    if not os.path.exists(dataset_path):
        (tools_task if cfg.task == "tools" else task).write_dataset(
            dataset_path, cfg.prompts, seed=cfg.seed)
    sched = ScheduleConfig(mode=cfg.mode, batch_groups=cfg.batch_groups, steps=cfg.steps,
                           max_staleness=cfg.max_staleness, oversample=cfg.oversample,
                           slots=cfg.concurrency * cfg.engines // cfg.group_size)
    qcfg = QueueConfig(group_size=cfg.group_size, lease_timeout_s=cfg.lease_timeout_s,
                       heartbeat_interval_s=cfg.lease_timeout_s / 5, release_batch=32)
    run = RunAssembly(run_dir)
    queue = run.create(PosixStorage(run_dir, writer_id="demo"), qcfg, meta={"demo": asdict(cfg)})

    # weights: fresh model, or the checkpoint's
    start_step = start_version = 0
    model = init_model(task.tiny_config(cfg.seed))
    ckpt: dict[str, Any] | None = None
    if not fresh and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, weights_only=True)
        start_step, start_version = int(ckpt["step"]), int(ckpt["version"])
        model = load_weights(ckpt["weights_dir"]) if os.path.isdir(ckpt["weights_dir"]) \
            else model
    # A bracket left open by a killed trainer: restarting is a weight update to that
    # version with the checkpoint's weights (versions only go forward; names never reused).
    control = Control(queue.storage).state()
    reopen = control.pause_version if control.paused else None
    start_version = max(start_version, reopen or 0, queue.current_version())
    initial = os.path.join(weights, f"v{start_version:06d}")
    if not os.path.isdir(initial):
        save_weights(model, initial)

    stop = threading.Event()
    old_handler = signal.getsignal(signal.SIGINT)

    def on_sigint(signum: int, frame: Any) -> None:
        log.warning("interrupted: finishing the current step, then stopping cleanly "
                    "(run again with --resume to continue)")
        stop.set()

    signal.signal(signal.SIGINT, on_sigint)
    try:
        urls = run.start_engines("tiny", cfg.engines, model_path=initial,
                                 max_running_requests=cfg.concurrency,
                                 weight_version=str(start_version))
        tracer = HopTracer(queue)
        tracer.start()
        run.add("hop tracer", lambda: tracer.stop() if tracer.is_alive() else None)
        # The collector and the bracket wake on the files they wait for (inotify: every
        # process of the demo is on this host) instead of sleeping a poll interval.
        col_watch = _watch(queue, ("ready", "acked", "dropped", "versions", "pending"))
        ctl_watch = _watch(queue, ("control",))
        run.add("collector watch", col_watch.close)
        run.add("control watch", ctl_watch.close)
        # GC at every pass: admission counts acked groups as untrained until GC removes
        # them, so a GC every gc_interval_s (1 s) held each release back by up to that long.
        collector = Collector.open(run_dir, Dataset(dataset_path),
                                   collector_config(sched, gc_interval_s=0.0),
                                   queue_config=qcfg, owner="demo-collector",
                                   sleep=_waiter(col_watch))
        run.start_collector(collector, stop_event=stop)
        cluster = start_local_cluster(cfg.nodes)
        run.add("ray cluster", cluster.shutdown)
        wait_for_nodes(cfg.nodes)
        task_keys: dict[str, Any] = tools_task.PRODUCER if cfg.task == "tools" else {
            "plugins": {"reward": "strawq.producers.rewards.count_task"},
            "sampling": {"max_new_tokens": task.MAX_NEW_TOKENS}}
        pcfg = ProducerConfig.from_dict(merge(
            {"run_dir": run_dir, "engine": {"workers": tuple(urls)},
             "sampling": {"temperature": 1.0, "seed": cfg.seed}}, task_keys))
        placement = ProducerPlacement(pcfg, PlacementConfig(
            run_id="demo", concurrency=cfg.concurrency, engines=cfg.engines),
            group_size=cfg.group_size)
        run.add("producers", placement.stop)
        placement.reconcile()
        trainer = GRPOTrainer(model, weights, urls, lr=cfg.lr, device=cfg.trainer_device)
        reader = run.open_reader(BracketOptions(lease_timeout_s=cfg.lease_timeout_s,
                                                poll_interval_s=0.02,
                                                sleep=_waiter(ctl_watch),
                                                repair=trainer.repair_engines,
                                                engine_urls=tuple(urls)),
                                 metrics_jsonl=os.path.join(work, "metrics.jsonl"))
        bracket = reader.bracket
        _trace_returns(reader, tracer)
        if reopen is not None and bracket.is_open:
            log.warning("closing the weight-update bracket a previous run left open "
                        "(version %d)", reopen)
            bracket.end_weight_update(start_version)
        if ckpt is not None:
            trainer.load_state_dict(ckpt["trainer"])
            reader.load_state_dict(json.loads(ckpt["reader"]))
        sampler = Sampler(urls)
        run.add("sampler", sampler.stop_event.set)
        sampler.start()
        bar = _progress(cfg, start_step)
        records: list[StepRecord] = []
        trained: list[int] = list(ckpt["trained"]) if ckpt is not None else []

        spans: list[tuple[float, float]] = []  # tool calls of trained groups (wall clock)

        def checkpoint(rec: StepRecord, batch: Any) -> None:
            trained.extend(rec.indices)
            for s in getattr(batch, "summaries", None) or []:
                spans.extend(tools_task.tool_spans(s.get("meta") or {}))
            state = reader.state_dict(consumed=batch)
            torch.save({"step": rec.step + 1, "version": rec.version,
                        "weights_dir": os.path.join(weights, f"v{rec.version:06d}"),
                        "trainer": trainer.state_dict(), "trained": list(trained),
                        "reader": json.dumps(state)},
                       ckpt_path + ".tmp")
            with open(ckpt_path + ".tmp", "rb+") as f:
                os.fsync(f.fileno())
            os.replace(ckpt_path + ".tmp", ckpt_path)
            # The checkpoint is durable: its batch may be collected once acked. Without the
            # commit GC waited for the next step's state_dict, admission counted the acked
            # batch as untrained for a whole step, and η = 1 ran like η = 0 (trainer wait
            # ratio 0.70, staleness ~0).
            reader.commit(state)

        def on_step(rec: StepRecord) -> None:
            records.append(rec)
            if bar is not None:
                d = collector.depths()
                bar.set_postfix_str(
                    f"reward {rec.metrics.get('reward/mean', 0):.2f} len "
                    f"{rec.metrics.get('response_len/mean', 0):.0f} stale "
                    f"{rec.metrics.get('staleness/mean', 0):.2f} wait {rec.wait_s:.1f}s "
                    f"q[p{d.pending}+{d.partial} l{d.leased} r{d.ready}]", refresh=False)
                bar.update(1)

        res = run_schedule(sched, reader, bracket, trainer, start_version=start_version,
                           start_step=start_step, on_step=on_step, checkpoint=checkpoint,
                           should_stop=stop.is_set)
        if bar is not None:
            bar.close()
        stats = placement.stats()
        hops = tracer.stop()
        for p in stats.values():
            tracer.add_producer_hops(p.get("hops") or {})
        sampler.stop_event.set()
        sampler.join(2)
        result = DemoResult(cfg, res, [r.metrics.get("reward/mean", 0.0) for r in records],
                            [s for r in records for s in r.staleness],
                            list(trained))
        result.summary = _summary(cfg, res, stats, collector)
        # attestation: each update's engines checked against the pushed weights' fingerprint
        attested = bracket.attestation_metrics()
        result.summary["attest/checks"] = int(attested["attest/checks_total"])
        result.summary["attest/failures"] = int(attested["attest/failures_total"])
        result.summary["attest/unreachable"] = int(attested["attest/unreachable_total"])
        waits = [(iv.start, iv.end) for iv in res.intervals if iv.what == "wait"]
        result.hops = hops
        result.gaps = idle_gaps(waits, sampler.samples.series, threshold_s=IDLE_GAP_S)
        result.summary["hops"] = hops.summary()
        result.summary["idle_gaps"] = result.gaps.to_dict(IDLE_GAP_S)
        if reader.metrics is not None:  # the histograms in the run's metrics too
            reader.metrics.emit({f"hop/{h}/{k}": v for h, st in result.summary["hops"].items()
                                 for k, v in st.items()})
            reader.metrics.emit(attested)
        if spans:  # a timeline row: tool calls in flight (of trained groups)
            sampler.samples.series["tools"] = tools_task.tool_series(
                spans, time.time() - time.monotonic(), scale=cfg.group_size * cfg.batch_groups)
            result.summary["tool_calls_trained"] = len(spans)
            result.summary["tool_seconds_trained"] = round(sum(e - s for s, e in spans), 3)
        result.files = _write_outputs(work, cfg, result, sampler.samples, stats)
        return result
    finally:
        stop.set()
        signal.signal(signal.SIGINT, old_handler)
        run.close()  # the last started first: a resumed run takes the fences at once


def _watch(queue: RunQueue, dirs: tuple[str, ...]) -> DirWatch:
    return DirWatch(queue.storage, dirs, mask=IN_CREATE | IN_MOVED_TO)


def _waiter(watch: DirWatch) -> Callable[[float], None]:
    """A ``sleep`` that returns as soon as the watched directories gain an entry."""
    def wait(seconds: float) -> None:
        watch.wait(seconds)
    return wait


def _trace_returns(reader: BatchReader, tracer: HopTracer) -> None:
    """Tell the tracer when ``next_batch`` returns each batch (batch → trainer hop)."""
    inner = reader.next_batch

    def next_batch(timeout: float = 600.0) -> Any:
        batch = inner(timeout)
        tracer.returned(batch.seq)
        return batch

    reader.next_batch = next_batch  # type: ignore[method-assign]


def _progress(cfg: DemoConfig, start: int) -> Any:
    if not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.steps, initial=start, desc=f"strawq demo [{cfg.mode}]", unit="step",
                dynamic_ncols=True)


def _summary(cfg: DemoConfig, res: ScheduleResult, stats: dict[str, Any],
             collector: Collector) -> dict[str, Any]:
    recs = res.records
    rewards = [r.metrics.get("reward/mean", 0.0) for r in recs]
    k = max(1, len(rewards) // 5)
    tokens = sum(p.get("tokens_generated", 0) for p in stats.values())
    return {
        "mode": cfg.mode, "steps": len(recs), "wall_s": round(res.wall_s, 1),
        "reward/first": round(sum(rewards[:k]) / k, 3) if rewards else None,
        "reward/last": round(sum(rewards[-k:]) / k, 3) if rewards else None,
        "trainer/wait_ratio": round(res.trainer_wait_ratio(), 3),
        "staleness/mean": round(sum(r.metrics.get("staleness/mean", 0) for r in recs)
                                / max(len(recs), 1), 3),
        "staleness/max": max((r.metrics.get("staleness/max", 0) for r in recs), default=0),
        "staleness/multi_version_frac": round(
            sum(r.metrics.get("staleness/multi_version_frac", 0) for r in recs)
            / max(len(recs), 1), 3),
        "groups/s": round(sum(len(r.indices) for r in recs) / max(res.wall_s, 1e-9), 2),
        "tokens_generated": tokens,
        "dropped": collector.dropped_by_reason(),
        "producer_slot_utilisation": {p.get("producer_id", n): round(p.get(
            "slot_utilisation", 0.0), 3) for n, p in stats.items()},
    }


def _write_outputs(work: str, cfg: DemoConfig, result: DemoResult, samples: plots.Samples,
                   stats: dict[str, Any]) -> dict[str, str]:
    files = {
        "timeline": plots.timeline(os.path.join(work, "timeline.png"), result.schedule,
                                   samples, title=f"strawq demo ({cfg.mode}): who is busy",
                                   marks=result.hops.marks if result.hops else None,
                                   gaps=result.gaps.gaps if result.gaps else None),
        "reward": plots.reward_curve(os.path.join(work, "reward.png"),
                                     {cfg.mode: result.rewards},
                                     title="reward per training step"),
        "staleness": plots.staleness_hist(os.path.join(work, "staleness.png"),
                                          {cfg.mode: result.staleness},
                                          title="staleness of trained samples"),
    }
    summary_path = os.path.join(work, "summary.json")
    with open(summary_path, "w", encoding="utf-8") as f:
        json.dump({"summary": result.summary, "config": asdict(cfg),
                   "steps": [asdict(r) for r in result.schedule.records]}, f, indent=2,
                  default=str)
    files["summary"] = summary_path
    if result.hops is not None:  # the raw events behind the hop table and the timeline
        hops_path = os.path.join(work, "hops.json")
        t0 = result.schedule.started
        with open(hops_path, "w", encoding="utf-8") as f:
            json.dump({"t0": t0, "hops_s": result.hops.hops,
                       "marks_s": {k: [round(t - t0, 4) for t in v]
                                   for k, v in result.hops.marks.items()},
                       "idle_gaps_s": [(round(a - t0, 4), round(b - t0, 4))
                                       for a, b in (result.gaps.gaps if result.gaps else [])],
                       "trainer_s": [(iv.what, round(iv.start - t0, 4), round(iv.end - t0, 4))
                                     for iv in result.schedule.intervals],
                       "engines_s": {k: [(round(t - t0, 4), b) for t, b in v]
                                     for k, v in samples.series.items()}},
                      f)
        files["hops"] = hops_path
    return files


def format_summary(result: DemoResult) -> str:
    rows = [(k, v) for k, v in result.summary.items() if k != "hops"]
    width = max(len(k) for k, _ in rows)
    lines = ["", f"{'metric':<{width}}  value", f"{'-' * width}  -----"]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    hops = result.summary.get("hops") or {}
    if hops:
        w = max(len(h) for h in hops)
        lines += ["", f"{'hop':<{w}}  count   p50 ms   p90 ms   p99 ms   max ms"]
        for h, st in hops.items():
            if st.get("count"):
                lines.append(f"{h:<{w}}  {st['count']:>5}  {st['p50_ms']:>7}  {st['p90_ms']:>7}"
                             f"  {st['p99_ms']:>7}  {st['max_ms']:>7}")
            else:
                lines.append(f"{h:<{w}}      0")
    lines += ["", "files:"] + [f"  {k:<10} {v}" for k, v in result.files.items()]
    return "\n".join(lines)
