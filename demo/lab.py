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
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from strawq.config import Config, merge
from strawq.demo.lab_report import format_table, generated_lengths, history_figures, \
    history_gain, length_bias, length_buckets, plot_bias, row_of

__all__ = ["HISTORY_CASE", "HISTORY_RULES", "MIXTURE_CASE", "MODES", "REWARDS", "LabConfig",
           "LabResult", "ModeResult", "format_table", "generated_lengths", "history_figures",
           "history_gain", "length_bias", "length_buckets", "mixture_figures", "p_solve_of",
           "plot_bias", "row_of", "run_history_case", "run_lab", "run_mode"]

log = logging.getLogger(__name__)

MODES = ("sync", "partial", "async", "stream", "flow")
#: ``LabConfig.reward`` -> the producers' reward plugin
REWARDS = {"count": "strawq.producers.rewards.count_task",
           "difficulty": "strawq.producers.rewards.difficulty_task"}
#: the history case (``run_history_case``, ``bench/pipeline.py --cases history``): the
#: standard job on a small dataset trained for many passes, 40 % of its rows never or always
#: solved, a few prompts answering several times longer than the rest
#: the mixture case (``run_mode`` with ``mixture_sources``; ``bench/pipeline.py --cases
#: mixture``): two datasets in equal weights, the second hard (60 % of its rows never
#: solved) and filtered by the DAPO rule, so its share of what is trained falls under its
#: weight and the collector says why
MIXTURE_CASE: dict[str, Any] = {
    "reward": "difficulty", "never_solved_share": 0.1, "always_solved_share": 0.1,
    "mixture_sources": ("easy", "hard"), "mixture_weights": (0.5, 0.5),
    "mixture_never_solved": (0.1, 0.6),
    "mixture_filters": ("", "strawq.producers.rewards.zero_variance"),
}
HISTORY_CASE: dict[str, Any] = {
    "reward": "difficulty", "never_solved_share": 0.15, "always_solved_share": 0.25,
    "prompt_scale_sigma": 0.8, "dataset_rows": 384, "num_epochs": 14,
    "zero_variance_revisit_epochs": 14, "steps": 28,
}


@dataclass(frozen=True, kw_only=True)
class LabConfig(Config):
    """The lab's standard case: a 64-GPU job, 48 GPUs of rollout (see ``docs/lab.md``)."""

    #: where each mode's run/, timeline PNG and config JSON go (workdir/<mode>/)
    workdir: str = "runs/lab"
    #: modes to run, side by side; ratios are against ``sync`` when it is among them
    modes: tuple[str, ...] = MODES
    # -- the emulated job --------------------------------------------------------------------
    #: E: rollout engines (one per rollout GPU)
    engines: int = 48
    #: C: concurrent requests per engine
    concurrency: int = 16
    #: P: sim processes that serve the E engines (E must be a multiple of P)
    sim_processes: int = 2
    #: W: producer processes (emulated nodes); K = floor(C·E/G) group slots split over them
    producers: int = 2
    #: G: samples per prompt group
    group_size: int = 16
    #: B: groups per training step
    batch_groups: int = 96
    #: training steps per mode
    steps: int = 8
    #: trainer step time, model seconds
    train_step_s: float = 4.0
    #: async, stream: staleness bound η of admission (over-η groups are trained and counted)
    max_staleness: int = 1
    #: stream: micro-batches per step (B/m complete groups each, trained as they are ready)
    micro_batches: int = 8
    #: partial: groups admitted per step ÷ B
    oversample: float = 1.5
    #: flow: micro-batches per step (acked as trained)
    flow_micro_batches: int = 8
    #: async, stream, flow: admission window in micro-batches (None: the mode's own)
    admission_batches: float | None = None
    # -- the engine timing model (model time) ---------------------------------------------------
    step_base_ms: float = 20.0
    step_per_req_ms: float = 0.25
    prefill_ms_per_token: float = 0.01
    prompt_len: int = 32
    len_median: float = 40.0
    len_sigma: float = 0.5
    #: response cap (max_new_tokens); ``cap_prob`` of responses run to it
    len_cap: int = 256
    cap_prob: float = 0.03
    #: wall seconds per model second
    time_scale: float = 1.3
    # -- the multi-turn case (``strawq.demo.agentic_sim``; 0: single turn) ---------------------
    #: P(another turn): turns ~ 1 + Geometric, capped at ``agent_max_turns``
    agent_turns_p: float = 0.0
    agent_max_turns: int = 6
    #: tool latency between turns ~ LogNormal(log median, sigma), model seconds
    tool_median_s: float = 1.0
    tool_sigma: float = 1.0
    # -- the history case (``run_history_case``; the defaults leave every other case as it was)
    #: the reward: ``count`` (``count_task``) or ``difficulty`` (``difficulty_task``: each
    #: row has a ``p_solve``, ``never_solved_share`` of the rows at 0, ``always_solved_share``
    #: at 1, the rest uniform in (0, 1))
    reward: str = "count"
    never_solved_share: float = 0.2
    always_solved_share: float = 0.2
    #: per-prompt length scale of the sim engines (lognormal of mean 1; 0: off)
    prompt_scale_sigma: float = 0.0
    #: dataset rows (0: enough for every step in one pass)
    dataset_rows: int = 0
    #: the queue's passes over the dataset and the history's admission rules
    #: (``QueueConfig``; ``strawq.prompt_policy``)
    num_epochs: int = 1
    skip_zero_variance: bool = False
    zero_variance_revisit_epochs: int = 2
    longest_first: bool = False
    #: the producers' group filter (``plugins.filter``, a dotted path; "" for none), e.g.
    #: the DAPO rule ``strawq.producers.rewards.zero_variance``: the history case with it
    #: on checks that the skip sees the groups the filter drops
    group_filter: str = ""
    # -- the mixture case (``MIXTURE_CASE``; empty: one dataset) ------------------------------
    #: the mixture's datasets (``strawq.mixture``), each of ``dataset_rows`` rows (or the
    #: run's) with its own seed
    mixture_sources: tuple[str, ...] = ()
    #: their weights (one per source)
    mixture_weights: tuple[float, ...] = ()
    #: per source, the share of its rows never solved (``difficulty_task``; the
    #: always-solved share is ``always_solved_share`` for every source)
    mixture_never_solved: tuple[float, ...] = ()
    #: per source, the collector's filter of its groups ("" for none)
    mixture_filters: tuple[str, ...] = ()
    # -- plumbing ----------------------------------------------------------------------------
    seed: int = 0
    #: fsync queue writes (the production setting; a local disk makes them cheap)
    fsync: bool = True
    #: producer control/claim poll, wall seconds
    poll_s: float = 0.02
    #: engine load sampling period, wall seconds
    sample_period_s: float = 0.1
    progress: bool = True

    def validate(self) -> None:
        for m in self.modes:
            if m not in MODES:
                raise ValueError(f"unknown mode {m!r}; expected some of {MODES}")
        if not self.modes:
            raise ValueError(f"modes must name at least one of {MODES}")
        for name in ("engines", "concurrency", "sim_processes", "producers", "group_size",
                     "batch_groups", "steps", "prompt_len", "len_cap"):
            if getattr(self, name) < 1:
                raise ValueError(f"LabConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.engines % self.sim_processes:
            raise ValueError(f"engines ({self.engines}) must be a multiple of sim_processes "
                             f"({self.sim_processes}): each process emulates the same number")
        if self.concurrency * self.engines < self.producers * self.group_size:
            raise ValueError(f"C·E = {self.concurrency * self.engines} slots cannot give each of "
                             f"{self.producers} producers one group of G = {self.group_size}")
        if self.train_step_s <= 0 or self.time_scale <= 0:
            raise ValueError("train_step_s and time_scale must be > 0")
        if self.max_staleness < 0 or self.oversample < 1:
            raise ValueError("max_staleness must be >= 0 and oversample >= 1")
        per_step: dict[str, int] = {"stream": self.micro_batches,
                                    "flow": self.flow_micro_batches}
        for mode, k in per_step.items():
            if mode in self.modes and (k < 1 or self.batch_groups % k):
                raise ValueError(f"{mode}: micro-batches ({k}) must be >= 1 and divide "
                                 f"batch_groups ({self.batch_groups})")
        if self.admission_batches is not None and not 1 <= self.admission_batches < math.inf:
            raise ValueError(f"admission_batches must be >= 1 or None, got "
                             f"{self.admission_batches}")
        self._validate_history()

    def _validate_history(self) -> None:
        if self.reward not in REWARDS:
            raise ValueError(f"reward must be one of {sorted(REWARDS)}, got {self.reward!r}")
        a, b = self.never_solved_share, self.always_solved_share
        if not (0 <= a <= 1 and 0 <= b <= 1 and a + b <= 1):
            raise ValueError(f"never_solved_share ({a}) and always_solved_share ({b}) must be "
                             f"shares that sum to at most 1")
        if self.prompt_scale_sigma < 0 or self.dataset_rows < 0 or self.num_epochs < 1:
            raise ValueError("prompt_scale_sigma and dataset_rows must be >= 0, num_epochs >= 1")
        k = len(self.mixture_sources)
        if any(len(t) not in (0, k) for t in (self.mixture_weights, self.mixture_never_solved,
                                               self.mixture_filters)) or (
                k and len(self.mixture_weights) != k):
            raise ValueError(f"mixture_weights needs one weight per mixture source ({k}), and "
                             f"mixture_never_solved and mixture_filters one entry each or none")
        if self.zero_variance_revisit_epochs < 2:
            raise ValueError("zero_variance_revisit_epochs must be >= 2")
        if self.dataset_rows and self.expected_supply() < self.steps * self.batch_groups:
            raise ValueError(
                f"{self.dataset_rows} rows x {self.num_epochs} passes may supply only "
                f"~{self.expected_supply():.0f} groups (with the zero-variance skip), fewer than "
                f"the {self.steps} steps x B = {self.steps * self.batch_groups} the run trains:"
                f" its last step would wait for groups that never come")

    def expected_supply(self) -> float:
        """Groups the dataset's passes release: every row in the first pass; with the
        zero-variance skip, after it only the rows expected to give differing rewards
        (a row between 0 and 1, uniform, agrees by chance with probability 2/(G+1))."""
        rows = self.dataset_rows or 0
        if not self.skip_zero_variance or self.reward != "difficulty":
            return float(rows * self.num_epochs)
        between = 1.0 - self.never_solved_share - self.always_solved_share
        kept = between * (1.0 - 2.0 / (self.group_size + 1))
        return rows * (1.0 + (self.num_epochs - 1) * kept)

    @property
    def engines_per_process(self) -> int:
        return self.engines // self.sim_processes

    @property
    def slots(self) -> int:
        """Trajectory slots C·E."""
        return self.concurrency * self.engines

    @property
    def group_slots(self) -> int:
        """K = floor(C·E / G)."""
        return self.slots // self.group_size

    def sim_options(self) -> dict[str, Any]:
        """The flags of one sim process (the per-engine timing model, see the module doc)."""
        k = self.engines_per_process
        opts: dict[str, Any] = dict(
            max_running_requests=k * self.concurrency, step_base_ms=self.step_base_ms,
            step_per_req_ms=self.step_per_req_ms / k,
            prefill_ms_per_token=self.prefill_ms_per_token / k, len_median=self.len_median,
            len_sigma=self.len_sigma, len_cap=self.len_cap, cap_prob=self.cap_prob,
            time_scale=self.time_scale)
        if self.prompt_scale_sigma > 0:
            opts["prompt_scale_sigma"] = self.prompt_scale_sigma
        return opts

    def model_step_s(self, batch: int | None = None) -> float:
        """Modelled decode step of one engine with ``batch`` running (default C), model s."""
        b = self.concurrency if batch is None else batch
        return (self.step_base_ms + self.step_per_req_ms * b) / 1000.0

    def expected_response_len(self) -> float:
        """Mean response length of the timing model (lognormal, capped, spike at the cap)."""
        mu, s = math.log(self.len_median), self.len_sigma
        # E[min(X, cap)] for lognormal X
        z = (math.log(self.len_cap) - mu) / s if s > 0 else math.inf
        phi = 0.5 * (1 + math.erf((z - s) / math.sqrt(2))) if s > 0 else 1.0
        tail = 0.5 * math.erfc(z / math.sqrt(2)) if s > 0 else 0.0
        body = math.exp(mu + s * s / 2) * phi + self.len_cap * tail
        return (1 - self.cap_prob) * body + self.cap_prob * self.len_cap


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


# -- producers: one process per emulated node ---------------------------------------------------
STATS_PREFIX = "STRAWQ_LAB_STATS "


def producer_child() -> None:
    """Child process (``python -c``): one ``Producer`` on its own event loop.

    Reads its ``ProducerConfig`` as one JSON line on stdin; stops when stdin closes; prints
    its final stats as one line ``STRAWQ_LAB_STATS {json}``.
    """
    import asyncio
    import sys

    from strawq.producers.producer import Producer
    from strawq.producers.producer_config import ProducerConfig

    logging.basicConfig(level=logging.WARNING)
    config = json.loads(sys.stdin.readline())
    producer = Producer(ProducerConfig.from_dict(config), node_id=config.get("producer_id"))
    stop = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()

    async def main() -> None:
        task = asyncio.create_task(producer.run())
        while not stop.is_set() and not task.done():
            await asyncio.sleep(0.05)
        producer.request_stop()
        await task

    try:
        asyncio.run(main())
    finally:
        print(STATS_PREFIX + json.dumps(producer.stats().to_dict()), flush=True)


class _Producers:
    """The producer processes of one mode (plain subprocesses: no Ray, no fork)."""

    def __init__(self, configs: list[dict[str, Any]]) -> None:
        import subprocess
        import sys

        code = "from strawq.demo.lab import producer_child; producer_child()"
        self.procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True) for _ in configs]
        for p, c in zip(self.procs, configs, strict=True):
            assert p.stdin is not None
            p.stdin.write(json.dumps(c) + "\n")
            p.stdin.flush()

    def check_alive(self) -> None:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"lab producer process {p.pid} exited with {p.returncode}; "
                                   "see its output above")

    def finish(self, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Stop every producer (it parks its groups) and collect its stats."""
        import subprocess

        for p in self.procs:
            if p.stdin is not None and not p.stdin.closed:
                p.stdin.close()
            p.stdin = None  # communicate() must not flush the closed pipe
        stats = []
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            # read while waiting: the stats line (with its hop samples) can exceed the
            # pipe's 64 KiB, and a child blocked on a full pipe never exits
            try:
                out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # hung: kill it, its leases expire
                p.kill()
                out, _ = p.communicate()
            for line in (out or "").splitlines():
                if line.startswith(STATS_PREFIX):
                    try:
                        stats.append(json.loads(line[len(STATS_PREFIX):]))
                    except json.JSONDecodeError as exc:
                        log.error("lab producer %d: unreadable stats line (%s)", p.pid, exc)
        return stats


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


# -- the collector loop, counting what it re-queues ----------------------------------------------
class _CollectorLoop(threading.Thread):
    def __init__(self, collector: Any) -> None:
        super().__init__(daemon=True, name="strawq-lab-collector")
        self.collector = collector
        self.stop_event = threading.Event()
        self.requeued = 0
        self.dropped_stale = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                rep = self.collector.step()
                self.requeued += len(rep.requeued_stale)
                self.dropped_stale += len(rep.dropped_stale)
                self.stop_event.wait(self.collector.config.poll_interval_s)
        except BaseException as exc:  # noqa: BLE001 - reported by run_mode
            self.error = exc
            log.exception("lab collector failed")


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
                          max_staleness=cfg.max_staleness, oversample=cfg.oversample,
                          slots=cfg.group_slots,
                          micro_batches=cfg.flow_micro_batches if mode == "flow"
                          else cfg.micro_batches,
                          admission_batches=cfg.admission_batches, timeout_s=600.0)


def run_mode(cfg: LabConfig, mode: str) -> ModeResult:
    """One schedule, from a fresh queue to the audit of what it left."""
    from strawq.collector.trainer.bracket import WeightUpdateBracket
    from strawq.collector.core import Collector
    from strawq.collector.trainer.reader import BatchReader
    from strawq.demo import plots
    from strawq.demo.run import Sampler
    from strawq.demo.schedule import collector_config, run_schedule
    from strawq.demo.trainer import SleepTrainer
    from strawq.producers.budget import split_budget
    from strawq.producers.engines.testing import EngineProcess, start_engine_subprocess
    from strawq.config import QueueConfig
    from strawq.mixture import open_dataset
    from strawq.queue import RunQueue
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
    RunQueue.create(PosixStorage(run_dir, writer_id="lab", fsync=cfg.fsync), qcfg,
                    meta={"lab": cfg.to_dict(), "mode": mode})
    ccfg = collector_config(sched, poll_interval_s=0.02, metrics_interval_s=5.0,
                            metrics_jsonl=os.path.join(work, "collector.jsonl"))
    budget = split_budget(cfg.concurrency, cfg.engines, cfg.group_size, cfg.producers)

    engines: list[EngineProcess] = []
    producers: _Producers | None = None
    loop: _CollectorLoop | None = None
    sampler: Sampler | None = None
    try:
        for _ in range(cfg.sim_processes):
            engines.append(start_engine_subprocess("sim", **cfg.sim_options()))
        urls = [e.url for e in engines]
        pconfigs = [merge({"run_dir": run_dir, "producer_id": f"lab-{mode}-{i}",
                           "engine": {"workers": urls},
                           "plugins": {"reward": REWARDS[cfg.reward],
                                       **({"filter": cfg.group_filter}
                                          if cfg.group_filter else {})},
                           "budget": {"slots": budget.slots[i]},
                           "sampling": {"max_new_tokens": cfg.len_cap, "seed": cfg.seed},
                           "timing": {"control_poll_s": cfg.poll_s, "idle_poll_s": cfg.poll_s,
                                      "abort_poll_s": 0.05},
                           "threads": {"io": 4, "reward": 1}}, _agent_keys(cfg))
                    for i in range(cfg.producers)]
        collector = Collector.open(run_dir, open_dataset(dataset_path), ccfg, queue_config=qcfg,
                                   owner="lab-collector", fsync=cfg.fsync)
        # the lab's trainer never restores a checkpoint: an acked batch is trained
        reader = BatchReader.open(run_dir, checkpointed=False)
        bracket = WeightUpdateBracket(reader.queue, lease_timeout_s=lease_timeout,
                                      poll_interval_s=0.01)
        # one step = per_step trainer calls (stream: micro-batches of one step's time each)
        trainer = SleepTrainer(cfg.train_step_s * cfg.time_scale / sched.per_step, urls)
        producers = _Producers(pconfigs)
        _wait_producers(bracket, producers)
        cpu0 = {"engines": sum(_cpu_s(e.pid) for e in engines),
                "producers": sum(_cpu_s(p.pid) for p in producers.procs),
                "driver": time.process_time()}
        sampler = Sampler(urls, period_s=cfg.sample_period_s)
        sampler.start()
        # exactly the batches the schedule trains: a collector left free publishes up to
        # max_prefetch_batches more at the end, and the run's figures (the mixture's trained
        # groups among them) would count groups no trainer took
        collector.batch_budget = sched.steps * sched.per_step
        loop = _CollectorLoop(collector)
        loop.start()  # the first group is released now: the clock starts here
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
        loop.stop_event.set()
        loop.join(30)
        if loop.error is not None:
            raise RuntimeError(f"the lab's collector failed: {loop.error!r}") from loop.error
        stats = producers.finish()
        producers = None
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
                                            "slots": list(budget.slots)}}),
                                        "queue": asdict(qcfg)},
                            [s for r in res.records for s in r.staleness],
                            [r.indices for r in res.records], problems)
        result.files["timeline"] = plots.timeline(
            os.path.join(work, "timeline.png"), res, sampler.samples,
            title=f"strawq lab ({mode}): E={cfg.engines} engines x C={cfg.concurrency} in "
                  f"{cfg.sim_processes} sim processes, B={cfg.batch_groups} G={cfg.group_size}"
                  f" (wall s; model s = wall / {cfg.time_scale:g})")
        result.files["bias"] = plot_bias(os.path.join(work, "bias.png"), cfg, mode,
                                         row["bias"])
        path = os.path.join(work, "row.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"row": row, "config": result.config, "problems": problems,
                       "steps": [asdict(r) for r in res.records]}, f, indent=2, default=str)
        result.files["row"] = path
        collector.close()
        reader.close()
        return result
    finally:
        if sampler is not None:
            sampler.stop_event.set()
        if loop is not None:
            loop.stop_event.set()
            loop.join(30)
        if producers is not None:
            producers.finish(10.0)
        for e in engines:
            e.stop()


def _p_solve_in(path: str) -> list[float]:
    with open(path, encoding="utf-8") as f:
        return [float(json.loads(line)["p_solve"]) for line in f if line.strip()]


def _wait_producers(bracket: Any, producers: _Producers, timeout_s: float = 120.0) -> None:
    """Until every producer process has beaten once (its loop is up)."""
    deadline = time.monotonic() + timeout_s
    n = len(producers.procs)
    while len(bracket.live_producers()) < n:
        producers.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(bracket.live_producers())} of {n} lab producers "
                               f"started within {timeout_s:.0f}s")
        time.sleep(0.05)


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

    from strawq.names import dataset_task_id
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
