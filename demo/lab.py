"""``strawq lab``: the three rollout schedules compared at the scale of a 64-GPU job.

What runs, per mode, for real: the queue on disk, the collector (grantor + feeder +
admission + staleness-first batches) in a thread, producers (``strawq.producers.producer.Producer``,
one process per emulated node, each on its own event loop), the weight-update bracket, the
reader API and a trainer that sleeps for its step time (``strawq.demo.trainer.SleepTrainer``).
What is simulated: the engines (``sim`` timing model) and the training step.

**Engine emulation.** The job has ``engines`` (E) rollout engines of ``concurrency`` (C)
slots each, but a 2-core box cannot run E engine processes. ``sim_processes`` (P)
processes each serve the slots of k = E/P engines: ``max_running_requests = k·C``. A sim
process pays ``step_base_ms + step_per_req_ms·batch`` per decode step for its whole batch,
whereas k real engines each pay the base for their own batch, in parallel. So the process
gets ``step_per_req_ms / k`` and ``prefill_ms_per_token / k``: with its batch spread evenly
over the k emulated engines (requests go round-robin, so they are in expectation), one
decode step then costs exactly what one of those engines' steps costs, and each emulated
engine keeps its own decode rate. (An uneven spread, e.g. a tail of 3 requests that would
sit on one engine, costs base + 3·per_req/k instead of base + 3·per_req: a slight
under-estimate when per_req·C is small against the base, as it is here.)

**Time.** Every engine time is multiplied by ``time_scale`` and so is the trainer's step;
all reported times are *model* seconds (wall ÷ time_scale). Queue, producer and HTTP
overheads are real wall time, so in model time they look ``1/time_scale`` times larger:
the lab is pessimistic about them.

**CPU.** Every simulated token costs real CPU (the engine's decode loop, JSON, the
producer's bookkeeping), and on a small box that cost stretches the simulated decode step.
The lab measures it: ``decode_stretch`` = measured wall seconds per generated token of a
busy slot ÷ the modelled step (≈ 1 when the box keeps up). Sizes are chosen so that it
stays near 1; the report prints it, and the CPU seconds each part used.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from strawq.config import merge
from strawq.demo.lab_config import HISTORY_CASE, MIXTURE_CASE, MODES, REWARDS, LabConfig
from strawq.demo.lab_report import (
    format_table,
    generated_lengths,
    history_figures,
    history_gain,
    length_bias,
    length_buckets,
    plot_bias,
    row_of,
)

__all__ = ["HISTORY_CASE", "HISTORY_RULES", "MIXTURE_CASE", "MODES", "REWARDS", "LabConfig",
           "LabResult", "ModeResult", "format_table", "generated_lengths", "history_figures",
           "history_gain", "length_bias", "length_buckets", "mixture_figures", "p_solve_of",
           "plot_bias", "row_of", "run_history_case", "run_lab", "run_mode"]

log = logging.getLogger(__name__)

@dataclass
class ModeResult:
    mode: str
    #: every figure of the row (model seconds unless named *_wall_s)
    row: dict[str, Any]
    #: the full configuration that produced the row (LabConfig + schedule + collector)
    config: dict[str, Any]
    #: per-sample staleness of every trained sample
    staleness: list[int] = field(default_factory=list)
    #: dataset indices trained, per step
    trained: list[list[int]] = field(default_factory=list)
    #: problems found by the end-of-run queue audit (empty when consistent)
    problems: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)


@dataclass
class LabResult:
    config: LabConfig
    modes: dict[str, ModeResult] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)

    def ratios(self) -> dict[str, dict[str, float]]:
        """Per mode: throughput and rollout-to-train-end against ``sync``."""
        base = self.modes.get("sync")
        out: dict[str, dict[str, float]] = {}
        for m, r in self.modes.items():
            if base is None:
                continue
            out[m] = {
                "throughput_x": _ratio(r.row["trained_tokens_per_s"],
                                       base.row["trained_tokens_per_s"]),
                "rollout_to_train_end_x": _ratio(r.row["rollout_to_train_end_s"],
                                                 base.row["rollout_to_train_end_s"]),
                "wait_ratio_cut": 1.0 - _ratio(r.row["trainer_wait_ratio"],
                                               base.row["trainer_wait_ratio"]),
                "throughput_steady_x": _ratio(r.row["trained_tokens_per_s_steady"],
                                              base.row["trained_tokens_per_s_steady"]),
            }
        return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def _agent_keys(cfg: LabConfig) -> dict[str, Any]:
    """Producer config keys of the multi-turn case (none for the single-turn one)."""
    if cfg.agent_turns_p <= 0:
        return {}
    return {"plugins": {"generate": "strawq.demo.agentic_sim.sim_agent",
                        "generate_args": {"turns_p": cfg.agent_turns_p,
                                          "max_turns": cfg.agent_max_turns,
                                          "tool_median_s": cfg.tool_median_s,
                                          "tool_sigma": cfg.tool_sigma,
                                          "time_scale": cfg.time_scale, "seed": cfg.seed}},
            "tools": {"timeout_s": 600.0}}


def p_solve_of(cfg: LabConfig, n: int) -> list[float]:
    """The rows' difficulty (``difficulty_task``): ``never_solved_share`` at 0,
    ``always_solved_share`` at 1, the rest uniform in (0, 1), in a seeded shuffle."""
    rng = random.Random(cfg.seed + 11)  # its own stream: the prompts stay the same
    zero = round(cfg.never_solved_share * n)
    one = round(cfg.always_solved_share * n)
    out = [0.0] * zero + [1.0] * one + [rng.uniform(0.01, 0.99) for _ in range(n - zero - one)]
    rng.shuffle(out)
    return out


def _write_dataset(path: str, n: int, cfg: LabConfig) -> None:
    rng = random.Random(cfg.seed)
    p_solve = p_solve_of(cfg, n) if cfg.reward == "difficulty" else None
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            prompt = [rng.randint(3, 31999) for _ in range(cfg.prompt_len)]
            count = max(1, round(cfg.len_median * math.exp(rng.gauss(0, cfg.len_sigma))))
            row: dict[str, Any] = {"prompt": prompt, "count": count, "eos": 2}
            if p_solve is not None:
                row["p_solve"] = p_solve[i]
            f.write(json.dumps(row) + "\n")


def _write_mixture(work: str, rows: int, cfg: LabConfig) -> str:
    """The mixture case's datasets (``rows`` each, a seed and a never-solved share of their
    own) and the mixture file naming them; returns its path."""
    sources = []
    for k, name in enumerate(cfg.mixture_sources):
        never = cfg.mixture_never_solved[k] if cfg.mixture_never_solved else \
            cfg.never_solved_share
        _write_dataset(os.path.join(work, f"prompts-{name}.jsonl"), rows,
                       replace(cfg, seed=cfg.seed + 1000 * (k + 1), never_solved_share=never))
        src: dict[str, Any] = {"name": name, "path": f"prompts-{name}.jsonl",
                               "weight": cfg.mixture_weights[k]}
        if cfg.mixture_filters and cfg.mixture_filters[k]:
            src["filter"] = cfg.mixture_filters[k]
        sources.append(src)
    path = os.path.join(work, "prompts.mixture.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"sources": sources}, f, indent=2)
    return path


def mixture_figures(collector: Any) -> dict[str, dict[str, Any]]:
    """Per mixture source, over the whole run: weight, trained group and token shares,
    filtered and stale groups, and whether the collector called it starved (and why)."""
    book = collector.mixing
    m = book.metrics()
    return {s: {"weight": m[f"dataset/{s}/weight"],
                "group_share": round(m[f"dataset/{s}/group_share_total"], 4),
                "token_share": round(m[f"dataset/{s}/token_share_total"], 4),
                "trained_groups": m[f"dataset/{s}/trained_groups_total"],
                "filtered": m[f"dataset/{s}/filtered_total"],
                "stale": m[f"dataset/{s}/stale_total"],
                "starved": m[f"dataset/{s}/starved_reason"] or None}
            for s in book.names}


def schedule_config(cfg: LabConfig, mode: str) -> Any:
    from strawq.demo.schedule import ScheduleConfig

    return ScheduleConfig(mode=mode, batch_groups=cfg.batch_groups, steps=cfg.steps,
                          max_staleness=cfg.max_staleness, eta_mode=cfg.eta_mode,
                          oversample=cfg.oversample, slots=cfg.group_slots,
                          micro_batches=cfg.flow_micro_batches if mode == "flow"
                          else cfg.micro_batches,
                          admission_batches=cfg.admission_batches, timeout_s=600.0)


def _rolling_options(cfg: LabConfig, mode: str, urls: list[str]) -> dict[str, Any]:
    """The bracket's options of the rolling update (publish once; engines load in waves,
    lag <= η), with ``publish_dir`` copied there whole or as deltas; {}: the bracket."""
    if cfg.weight_update != "rolling":
        return {}
    out: dict[str, Any] = {"weight_update": "rolling", "wave": cfg.rolling_wave,
                           "max_lag": cfg.max_staleness, "engine_urls": tuple(urls)}
    if cfg.publish_dir:
        out.update(publish_dir=os.path.join(os.path.abspath(cfg.publish_dir), mode),
                   max_delta_chain=cfg.max_delta_chain)
    return out


def run_mode(cfg: LabConfig, mode: str) -> ModeResult:
    """One schedule, from a fresh queue to the audit of what it left."""
    from strawq.collector.core import Collector
    from strawq.config import QueueConfig
    from strawq.data.mixture import open_dataset
    from strawq.demo.assembly import BracketOptions, RunAssembly, producer_plan
    from strawq.demo.run import Sampler
    from strawq.demo.schedule import collector_config, run_schedule
    from strawq.demo.trainer import SleepTrainer
    from strawq.storage import PosixStorage

    work = os.path.join(os.path.abspath(cfg.workdir), mode)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    run_dir = os.path.join(work, "run")
    dataset_path = os.path.join(work, "prompts.jsonl")
    sched = schedule_config(cfg, mode)
    admitted = max(sched.slots, math.ceil(cfg.oversample * cfg.batch_groups),
                   (cfg.max_staleness + 1) * cfg.batch_groups)
    rows = cfg.dataset_rows or (cfg.steps + 4) * admitted + 64
    if cfg.mixture_sources:
        dataset_path = _write_mixture(work, rows, cfg)
    else:
        _write_dataset(dataset_path, rows, cfg)
    lease_timeout = 30.0
    qcfg = QueueConfig(group_size=cfg.group_size, lease_timeout_s=lease_timeout,
                       heartbeat_interval_s=lease_timeout / 6, release_batch=64,
                       fsync=cfg.fsync, num_epochs=cfg.num_epochs,
                       skip_zero_variance=cfg.skip_zero_variance,
                       zero_variance_revisit_epochs=cfg.zero_variance_revisit_epochs,
                       longest_first=cfg.longest_first)
    ccfg = collector_config(sched, poll_interval_s=0.02, metrics_interval_s=5.0,
                            metrics_jsonl=os.path.join(work, "collector.jsonl"))
    plan = producer_plan(cfg.concurrency, cfg.engines, cfg.group_size, cfg.producers)
    with RunAssembly(run_dir) as run:
        run.create(PosixStorage(run_dir, writer_id="lab", fsync=cfg.fsync), qcfg,
                   meta={"lab": cfg.to_dict(), "mode": mode})
        engines = run.engines
        urls = run.start_engines("sim", cfg.sim_processes, **cfg.sim_options())
        # a delta version is built on the producer's disk (here: under the mode's folder)
        cache = {"weights_cache_dir": os.path.join(work, "weights-cache")} \
            if cfg.weight_update == "rolling" and cfg.publish_dir else {}
        pconfigs = [merge({"run_dir": run_dir, "producer_id": pid,
                           "engine": {"workers": urls, **cache},
                           "plugins": {"reward": REWARDS[cfg.reward],
                                       **({"filter": cfg.group_filter}
                                          if cfg.group_filter else {})},
                           "budget": {"slots": slots},
                           "sampling": {"max_new_tokens": cfg.len_cap, "seed": cfg.seed},
                           "timing": {"control_poll_s": cfg.poll_s, "idle_poll_s": cfg.poll_s,
                                      "abort_poll_s": 0.05},
                           "threads": {"io": 4, "reward": 1}}, _agent_keys(cfg))
                    for pid, slots in plan.producers(lambda i: f"lab-{mode}-{i}")]
        collector = Collector.open(run_dir, open_dataset(dataset_path), ccfg, queue_config=qcfg,
                                   owner="lab-collector", fsync=cfg.fsync)
        run.add("collector", collector.close)
        # the lab's trainer never restores a checkpoint: an acked batch is trained
        reader = run.open_reader(BracketOptions(lease_timeout_s=lease_timeout,
                                                poll_interval_s=0.01,
                                                **_rolling_options(cfg, mode, urls)),
                                 checkpointed=False)
        bracket = reader.bracket
        # one step = per_step trainer calls (stream: micro-batches of one step's time each)
        trainer = SleepTrainer(cfg.train_step_s * cfg.time_scale / sched.per_step, urls,
                               weights_dir=os.path.join(work, "weights"))
        producers = run.start_producer_processes(pconfigs)
        producers.wait_started(bracket)
        cpu0 = {"engines": sum(_cpu_s(e.pid) for e in engines),
                "producers": sum(_cpu_s(p.pid) for p in producers.procs),
                "driver": time.process_time()}
        sampler = Sampler(urls, period_s=cfg.sample_period_s)
        run.add("sampler", sampler.stop_event.set)
        sampler.start()
        # exactly the batches the schedule trains: a collector left free publishes up to
        # max_prefetch_batches more at the end, and the run's figures (the mixture's trained
        # groups among them) would count groups no trainer took
        collector.batch_budget = sched.steps * sched.per_step
        # the first group is released now: the clock starts here
        loop = run.start_collector(collector, name="strawq-lab-collector", close=False)
        bar = _progress(cfg, mode)
        res = run_schedule(sched, reader, bracket, trainer,
                           on_step=(lambda rec: bar.update(1)) if bar is not None else None,
                           should_stop=lambda: loop.error is not None)
        if bar is not None:
            bar.close()
        cpu = {"engines": sum(_cpu_s(e.pid) for e in engines) - cpu0["engines"],
               "producers": sum(_cpu_s(p.pid) for p in producers.procs)
               - cpu0["producers"],
               "driver": time.process_time() - cpu0["driver"]}
        sampler.stop_event.set()
        loop.stop()
        if loop.error is not None:
            raise RuntimeError(f"the lab's collector failed: {loop.error!r}") from loop.error
        stats = producers.finish()
        if cfg.reward == "difficulty":
            collector.batches.gc()  # the last acked batches into the history
        problems = audit(run_dir, [r.indices for r in res.records])
        row = row_of(cfg, mode, res, sampler.samples, stats, cpu, loop, collector)
        row["bias"] = length_bias(cfg, res.records)
        if collector.mixing is not None:
            row["mixture"] = mixture_figures(collector)
        elif cfg.reward == "difficulty":
            row["history"] = history_figures(cfg, run_dir, _p_solve_in(dataset_path),
                                             row["model_s"])
        result = ModeResult(mode, row, {"lab": cfg.to_dict(), "schedule": asdict(sched),
                                        "collector": asdict(ccfg),
                                        "sim_process": cfg.sim_options(),
                                        "producer": merge(pconfigs[0], {"budget": {
                                            "slots": list(plan.budget.slots)}}),
                                        "queue": asdict(qcfg)},
                            [s for r in res.records for s in r.staleness],
                            [r.indices for r in res.records], problems)
        _write_mode_files(cfg, mode, work, res, sampler.samples, result)
        return result


def _write_mode_files(cfg: LabConfig, mode: str, work: str, res: Any, samples: Any,
                      result: ModeResult) -> None:
    """The mode's timeline and bias plots and its row.json, into ``result.files``."""
    from strawq.demo import plots

    result.files["timeline"] = plots.timeline(
        os.path.join(work, "timeline.png"), res, samples,
        title=f"strawq lab ({mode}): E={cfg.engines} engines x C={cfg.concurrency} in "
              f"{cfg.sim_processes} sim processes, B={cfg.batch_groups} G={cfg.group_size}"
              f" (wall s; model s = wall / {cfg.time_scale:g})")
    result.files["bias"] = plot_bias(os.path.join(work, "bias.png"), cfg, mode,
                                     result.row["bias"])
    path = os.path.join(work, "row.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"row": result.row, "config": result.config, "problems": result.problems,
                   "steps": [asdict(r) for r in res.records]}, f, indent=2, default=str)
    result.files["row"] = path


def _p_solve_in(path: str) -> list[float]:
    with open(path, encoding="utf-8") as f:
        return [float(json.loads(line)["p_solve"]) for line in f if line.strip()]


def _progress(cfg: LabConfig, mode: str) -> Any:
    if not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.steps, desc=f"strawq lab [{mode}]", unit="step", dynamic_ncols=True,
                leave=False)


def audit(run_dir: str, trained_per_step: list[list[int]]) -> list[str]:
    """Invariant 1 at the end of a mode, from the queue state and the trained batches.

    Every released dataset index is in exactly one place: trained once (by the steps'
    ``sample_index``/summaries, each in an acked manifest unless GC removed it), dropped
    with a recorded reason, or still queued (pending, partial or ready). The collector
    publishes exactly the schedule's batches, so none stays unacknowledged, and nothing may
    stay leased once the producers stopped. Empty = consistent.
    """
    from collections import Counter

    from strawq.ondisk.names import dataset_task_id
    from strawq.storage import PosixStorage
    from strawq.testing.audit import audit_run

    a = audit_run(PosixStorage(run_dir, writer_id="lab-audit"))
    released = {dataset_task_id(i) for i in range(a.cursor_next)}
    counts = Counter(i for step in trained_per_step for i in step)
    problems = [f"index {i} trained {n} times" for i, n in sorted(counts.items()) if n > 1]
    trained = {dataset_task_id(i) for i in counts}
    problems += [f"trained index {t} was never released" for t in sorted(trained - released)]
    acked = {t for seq in a.acked for t in a.manifests.get(seq, [])}
    unacked = {t for seq, ids in a.manifests.items() if seq not in a.acked for t in ids}
    problems += [f"trained {t} is in an unacknowledged batch" for t in sorted(trained & unacked)]
    problems += [f"batch {seq} was published but never trained" for seq in sorted(a.manifests)
                 if seq not in a.acked]
    problems += [f"{t} is in an acked batch but the trainer never saw it"
                 for t in sorted(acked - trained)]
    problems += [f"{t} is still leased after the producers stopped"
                 for t in sorted(a.ids("leased"))]
    problems += a.check(released, trained=trained)
    return problems


def run_lab(cfg: LabConfig) -> LabResult:
    """Every mode of ``cfg.modes`` one after the other, on fresh queues; writes lab.json."""
    os.makedirs(cfg.workdir, exist_ok=True)
    result = LabResult(cfg)
    for mode in cfg.modes:
        log.info("lab: running %s", mode)
        result.modes[mode] = run_mode(cfg, mode)
    path = os.path.join(os.path.abspath(cfg.workdir), "lab.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"config": cfg.to_dict(), "ratios": result.ratios(),
                   "rows": {m: r.row for m, r in result.modes.items()},
                   "configs": {m: r.config for m, r in result.modes.items()},
                   "problems": {m: r.problems for m, r in result.modes.items()}},
                  f, indent=2, default=str)
    result.files["json"] = path
    result.files.update({f"timeline_{m}": r.files["timeline"] for m, r in result.modes.items()})
    return result


#: the history case's rows: the rules each turns on (``QueueConfig.skip_zero_variance``,
#: ``QueueConfig.longest_first``)
HISTORY_RULES: dict[str, tuple[bool, bool]] = {
    "off": (False, False), "on": (True, True), "skip": (True, False), "longest": (False, True)}


def run_history_case(cfg: LabConfig, mode: str = "stream",
                     rules: tuple[str, ...] = ("off", "on")) -> LabResult:
    """``mode`` once per entry of ``rules`` on the same case (``HISTORY_RULES``: ``off``,
    ``on`` = both rules, ``skip`` = the zero-variance skip alone, ``longest`` =
    longest-first alone); rows ``<mode> history <rule>``; writes history.json. ``cfg``
    should be a case of several passes with the difficulty reward (``HISTORY_CASE``).
    """
    if cfg.reward != "difficulty":
        raise ValueError("the history case needs reward='difficulty' (see HISTORY_CASE)")
    unknown = [r for r in rules if r not in HISTORY_RULES]
    if unknown or "off" not in rules:
        raise ValueError(f"history rules must include 'off' (the anchor) and be some of "
                         f"{list(HISTORY_RULES)}, got {list(rules)}")
    os.makedirs(cfg.workdir, exist_ok=True)
    result = LabResult(cfg)
    for rule in rules:
        skip, longest = HISTORY_RULES[rule]
        row_cfg = replace(cfg, workdir=os.path.join(cfg.workdir, rule),
                          skip_zero_variance=skip, longest_first=longest)
        result.modes[f"{mode} history {rule}"] = run_mode(row_cfg, mode)
    path = os.path.join(os.path.abspath(cfg.workdir), "history.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"config": cfg.to_dict(), "gain": history_gain(result),
                   "rows": {m: r.row for m, r in result.modes.items()},
                   "problems": {m: r.problems for m, r in result.modes.items()}},
                  f, indent=2, default=str)
    result.files["json"] = path
    return result
