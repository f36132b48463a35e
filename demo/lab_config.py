"""The lab's configuration (``strawq lab``, ``strawq.demo.lab``): the standard case, a 64-GPU
job with 48 GPUs of rollout, its schedules, and the history and mixture cases
(``docs/lab.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from strawq.config import Config

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
    #: async, stream: staleness bound η of admission
    max_staleness: int = 1
    #: what η means (``CollectorConfig.eta_mode``): ``hard`` (the default: a batch waits for
    #: the groups due by its version; the trainer pays the tail) or ``train`` (soft: over-η
    #: groups trained with their correction and counted)
    eta_mode: str = "hard"
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
    #: (``QueueConfig``; ``strawq.data.prompt_policy``)
    num_epochs: int = 1
    skip_zero_variance: bool = False
    zero_variance_revisit_epochs: int = 2
    longest_first: bool = False
    #: the producers' group filter (``plugins.filter``, a dotted path; "" for none), e.g.
    #: the DAPO rule ``strawq.producers.rewards.zero_variance``: the history case with it
    #: on checks that the skip sees the groups the filter drops
    group_filter: str = ""
    # -- the mixture case (``MIXTURE_CASE``; empty: one dataset) ------------------------------
    #: the mixture's datasets (``strawq.data.mixture``), each of ``dataset_rows`` rows (or the
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
    #: the weight update: ``bracket`` (pause every producer, push every engine) or
    #: ``rolling`` (publish once, engines load it ``rolling_wave`` at a time, lag ≤ η)
    weight_update: str = "bracket"
    #: rolling: engines that load at once (>= 1 a count, below 1 a share of the fleet)
    rolling_wave: float = 0.25
    #: rolling: a directory every engine reads, where each version is copied whole or as a
    #: delta against the one before (``<publish_dir>/<mode>``; the producers build a delta
    #: under ``<mode>/weights-cache``); "": the trainer's own directory is published, full
    publish_dir: str = ""
    #: rolling with ``publish_dir``: deltas in a row before a full version (0: always full)
    max_delta_chain: int = 3

    def validate(self) -> None:
        if self.weight_update not in ("bracket", "rolling"):
            raise ValueError(f"weight_update must be bracket or rolling, got "
                             f"{self.weight_update!r}")
        if self.max_delta_chain < 0:
            raise ValueError(f"max_delta_chain must be >= 0, got {self.max_delta_chain}")
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
        if self.eta_mode not in ("hard", "train"):
            raise ValueError(f"eta_mode must be hard or train, got {self.eta_mode!r}")
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
