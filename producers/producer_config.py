"""Configuration of one producer, in sections: frozen, keyword-only, validated dataclasses.

``ProducerConfig.from_dict`` (``strawq.config.Config``) rejects unknown keys by name and
builds the sections from nested mappings; ``--set section.key=value`` reaches one key.

    ProducerConfig   run_dir, producer_id
      engine         where samples are generated: workers, router_url, client (the HTTP
                     client, ``ClientConfig``), generation (the sample step:
                     ``GenerationConfig``), sample_retries, backoff_s
      sampling       the sampling defaults (``SamplerParams``); a task row's
                     ``sampling_params`` overrides any of them
      budget         slots (this producer's share of K), eager_claim
      plugins        reward, filter, tokenizer, generate (dotted paths) and their arguments
      tools          multi-turn trajectories: max_turns, timeout_s, retries, on_failure
      record         what each sample records besides its tokens: extras, teacher_url,
                     routed_experts_shape, mask_offpolicy_in_partial_rollout
      timing         the loop's polls and deadlines
      threads        the I/O and reward thread pools
"""

from __future__ import annotations

import dataclasses
import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from strawq.argtypes import url_problem
from strawq.config import Config
from strawq.errors import ConfigError
from strawq.ondisk.extras import TEACHER_LOGPROBS, ExtraError, check_names
from strawq.ondisk.names import validate_id
from strawq.producers.extras_protocol import GENERATED
from strawq.producers.sample import SamplerParams
from strawq.producers.sample_step import GenerationConfig
from strawq.producers.sglang_client import ClientConfig

__all__ = ["BudgetConfig", "EngineConfig", "GenerationConfig", "PluginsConfig", "ProducerConfig",
           "RecordConfig", "SAMPLER_KEYS", "SamplerParams", "TOOL_FAILURES", "ThreadsConfig",
           "TimingConfig", "ToolFailure", "ToolsConfig", "new_producer_id"]

#: What happens to a sample after a tool's last try (``ToolsConfig.on_failure``).
ToolFailure = Literal["fail_sample", "drop_group", "restart"]
TOOL_FAILURES: tuple[str, ...] = get_args(ToolFailure)

#: The keys a task row's ``sampling_params`` may set: every ``SamplerParams`` field.
SAMPLER_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SamplerParams))


def _positive(where: str, **values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ConfigError(f"{where}.{name} must be > 0, got {value}")


@dataclass(frozen=True, kw_only=True)
class EngineConfig(Config):
    """The engines a producer generates on, and how it treats their faults."""

    #: Engine URLs; ``/generate`` goes round-robin over them (unless ``router_url``).
    workers: tuple[str, ...] = ()
    #: sglang-router URL: ``/generate`` goes there; control calls go to its ``/workers``.
    router_url: str | None = None
    #: HTTP client settings (timeouts, retries, pool, API keys, routing).
    client: ClientConfig = field(default_factory=ClientConfig)
    #: The sample step's settings (context length, EOS ids, prefix warm-up).
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    #: Extra tries of a failed segment (after the client's own retries) before the group
    #: is handed back (engine unreachable: yield as partial; rejected: ``fail``).
    sample_retries: int = 2
    #: Pause before claiming again after a group was handed back for an engine fault
    #: (doubles per consecutive fault, capped at 16x).
    backoff_s: float = 0.5
    #: A directory on this node's local disk (which the engines read) where the rolling
    #: mode builds the versions published as a delta against a base
    #: (``strawq.weights.delta``), each producer in ``strawq-weights-<producer id>`` under
    #: it; None: the system's temporary directory.
    weights_cache_dir: str | None = None

    def validate(self) -> None:
        if not self.workers and self.router_url is None:
            raise ConfigError("ProducerConfig.engine needs 'workers' URLs or a 'router_url'")
        for name, url in [*((f"workers[{i}]", w) for i, w in enumerate(self.workers)),
                          *([("router_url", self.router_url)] if self.router_url is not None
                            else [])]:
            problem = url_problem(url)
            if problem is not None:
                raise ConfigError(f"ProducerConfig.engine.{name}: {problem}")
        if self.sample_retries < 0:
            raise ConfigError(f"ProducerConfig.engine.sample_retries must be >= 0, got "
                              f"{self.sample_retries}")
        _positive("ProducerConfig.engine", backoff_s=self.backoff_s)


@dataclass(frozen=True, kw_only=True)
class BudgetConfig(Config):
    """This producer's share of the engines' concurrency."""

    #: Group slots of this producer (its share of K = floor(C*E/G)); ``set_slots`` changes it.
    #: At most ``slots * G`` samples generate at once (the engine-concurrency budget).
    slots: int = 1
    #: Claim a new group as soon as one trajectory is free (its samples start as slots
    #: free up; at most one group per producer waits like that). False: claim only when a
    #: whole group's G trajectories are free (leaves up to G-1 trajectories idle).
    eager_claim: bool = True

    def validate(self) -> None:
        if self.slots < 0:
            raise ConfigError(f"ProducerConfig.budget.slots must be >= 0, got {self.slots}")


@dataclass(frozen=True, kw_only=True)
class PluginsConfig(Config):
    """The user code a producer calls, by dotted path (``strawq.producers.plugins``)."""

    #: Reward function, dotted path ``reward(task, response_ids, sample_meta) -> float``.
    reward: str
    #: Keyword arguments for a reward *factory*: with them, ``reward`` names a function that
    #: is called once with these and returns the reward function (remote reward model,
    #: slime / verl adapters: ``docs/rewards.md``). None: ``reward`` is the function.
    reward_args: dict[str, Any] | None = None
    #: Group filter, dotted path ``filter(task, rewards) -> reason | None`` (None: keep all).
    filter: str | None = None
    #: Tokenizer for text and chat prompts, and for decoding responses for rewards:
    #: ``hf:<model dir or hub name>`` (a Hugging Face tokenizer and its chat template), or a
    #: dotted path to a ``(text) -> list[int]`` function (text only) or a tokenizer object
    #: (``strawq.data.tokenize``). Without one a text or chat prompt fails its task
    #: (non-retryable) with a message saying so.
    tokenizer: str | None = None
    #: Keyword arguments for the tokenizer (``hf:``: ``gguf_file``, ``chat_template``,
    #: ``add_generation_prompt``, ``template_kwargs``, ...; see ``docs/datasets.md``).
    tokenizer_args: dict[str, Any] | None = None
    #: Generate plugin, dotted path ``async def generate(ctx) -> None`` that owns each
    #: sample's trajectory (turns, tool calls; ``docs/agentic.md``). None: the built-in
    #: single turn (``strawq.producers.generate.single_turn``).
    generate: str | None = None
    #: Keyword arguments for a generate plugin *factory* (then ``generate`` names it).
    generate_args: dict[str, Any] | None = None

    def validate(self) -> None:
        if not self.reward:
            raise ConfigError("ProducerConfig.plugins.reward must name a reward function "
                              "(e.g. strawq.producers.rewards.math_answer)")


@dataclass(frozen=True, kw_only=True)
class ToolsConfig(Config):
    """Multi-turn trajectories: turns and tool calls (``docs/agentic.md``)."""

    #: Most generated turns per sample (0: unlimited); past it the sample ends truncated.
    max_turns: int = 0
    #: A tool call's time limit, in seconds.
    timeout_s: float = 60.0
    #: A tool call's extra tries after a timeout or an error.
    retries: int = 1
    #: After a tool's last try: ``fail_sample`` (recorded failed, never trained),
    #: ``drop_group`` (dropped as ``tool_error``) or ``restart`` (a fresh environment,
    #: at most ``retries`` times, then fail_sample).
    on_failure: ToolFailure = "fail_sample"
    #: Most tokens one generated turn may hold (0: only the response budget bounds it);
    #: a turn at the cap ends with finish ``length`` and the plugin decides what follows.
    max_turn_tokens: int = 0
    #: Turn checkpoints (``strawq.tasks.turns``, the lease kept): at a turn boundary followed by
    #: more work, the group is saved once this many boundaries passed since its last save
    #: (1: every turn; 0: off, unless a token or time cadence below is set). Measured
    #: (docs/agentic.md): one save is one publish and one delete, a few KB for G = 4.
    checkpoint_every_turns: int = 1
    #: ... or once this many tokens were generated or appended since the last save (0: off).
    checkpoint_every_tokens: int = 0
    #: ... or once this many seconds passed since the last save (0: off).
    checkpoint_every_s: float = 0.0

    def validate(self) -> None:
        if self.max_turns < 0 or self.retries < 0:
            raise ConfigError(f"ProducerConfig.tools.max_turns and retries must be >= 0, got "
                              f"{self.max_turns}, {self.retries}")
        if min(self.max_turn_tokens, self.checkpoint_every_turns,
               self.checkpoint_every_tokens) < 0 or not self.checkpoint_every_s >= 0:
            raise ConfigError(
                "ProducerConfig.tools.max_turn_tokens, checkpoint_every_turns, "
                "checkpoint_every_tokens and checkpoint_every_s must be >= 0, got "
                f"{self.max_turn_tokens}, {self.checkpoint_every_turns}, "
                f"{self.checkpoint_every_tokens}, {self.checkpoint_every_s}")
        _positive("ProducerConfig.tools", timeout_s=self.timeout_s)

    @property
    def checkpointing(self) -> bool:
        """Whether turn checkpoints are saved at all."""
        return bool(self.checkpoint_every_turns or self.checkpoint_every_tokens
                    or self.checkpoint_every_s)


@dataclass(frozen=True, kw_only=True)
class RecordConfig(Config):
    """What each sample records besides its tokens, log-probs and versions."""

    #: Per-token extras to record with every sample (``strawq.ondisk.extras``, docs/slime.md):
    #: ``routed_experts`` (asks ``return_routed_experts``; the server needs
    #: ``--enable-return-routed-experts`` and an MoE model), ``top_p_token_ids`` (asks
    #: ``return_sampling_mask``), ``teacher_logprobs`` (a ``teacher_url`` scores each
    #: final sample). Empty: none (the records carry no extras).
    extras: tuple[str, ...] = ()
    #: The teacher engine (SGLang ``/generate``) that scores each final sample for
    #: ``teacher_logprobs`` (``strawq.producers.teacher``); ``engine.client`` applies.
    teacher_url: str | None = None
    #: Row shape of ``routed_experts``, ``[num_layers, moe_router_topk]`` (slime's
    #: ``rollout_routed_experts``); empty: one flat row per position.
    routed_experts_shape: tuple[int, ...] = ()
    #: Zero the loss mask of tokens older than the sample's newest version (slime's
    #: ``--mask-offpolicy-in-partial-rollout``).
    mask_offpolicy_in_partial_rollout: bool = False

    def validate(self) -> None:
        try:
            names = check_names(self.extras)
        except ExtraError as exc:
            raise ConfigError(f"ProducerConfig.record.extras: {exc}") from None
        bad = [n for n in names if n not in (*GENERATED, TEACHER_LOGPROBS)]
        if bad:
            raise ConfigError(f"ProducerConfig.record.extras: a producer records "
                              f"{[*GENERATED, TEACHER_LOGPROBS]}, not {bad}")
        if (TEACHER_LOGPROBS in names) != (self.teacher_url is not None):
            raise ConfigError("ProducerConfig.record: teacher_logprobs in extras needs a "
                              "teacher_url (the engine that scores each sample), and a "
                              "teacher_url needs teacher_logprobs in extras")
        if any(d < 1 for d in self.routed_experts_shape):
            raise ConfigError("ProducerConfig.record.routed_experts_shape must be positive "
                              f"sizes, got {list(self.routed_experts_shape)}")


@dataclass(frozen=True, kw_only=True)
class TimingConfig(Config):
    """The producer loop's polls and deadlines."""

    #: How often the loop reads ``control/`` (the weight-update bracket), in seconds.
    control_poll_s: float = 0.1
    #: Sleep when the queue had nothing to claim, in seconds.
    idle_poll_s: float = 0.1
    #: Idle (nothing to claim, no lease held) this long, the producer marks its heartbeat
    #: idle (a bracket no longer waits for it), beats once per lease timeout only, stops
    #: reading ``control/``, and looks at ``pending/`` every ``idle_probe_s`` instead of
    #: every ``idle_poll_s`` (a change on this host wakes it at once: inotify).
    idle_after_s: float = 2.0
    #: How often an idle producer stats ``pending/`` for another host's release, seconds.
    idle_probe_s: float = 5.0
    #: Bracket/stop: how long to wait for aborted requests to return before cancelling them.
    abort_deadline_s: float = 30.0
    #: Re-send the rid-prefix abort at this cadence while waiting, in seconds.
    abort_poll_s: float = 0.5
    #: Stop (SIGTERM, SIGINT, ``--max-seconds``): the whole drain — abort the requests in
    #: flight, apply their partial outputs, hand back every held group — ends within this
    #: many seconds (Kubernetes' ``terminationGracePeriodSeconds``, kubectl's
    #: ``--grace-period``); the aborted requests get at most half of it. A process drain
    #: past it exits 3 (``strawq.producers.drain``). Keep the orchestrator's own grace above
    #: it.
    grace_period_s: float = 30.0
    #: Stop work on leases once no heartbeat succeeded for ``lease_timeout_s - margin``
    #: (None: one heartbeat interval).
    lease_margin_s: float | None = None
    #: The in-flight journal (``strawq.producers.journal_flush``): every held sequence's
    #: received tokens are made durable in one record per producer once this many new
    #: tokens arrived since the last record (0, the default: no token trigger) ...
    journal_every_tokens: int = 0
    #: ... or once this many seconds passed with new tokens (0: no time trigger). The
    #: default, 4 s and no token trigger, is at most one record per producer per 4 s
    #: whatever the decode speed: what fits the control plane's metadata budget at 10,000
    #: GPUs (docs/benchmarks.md, "The in-flight journal"). Both 0: no journal; a crash
    #: loses what arrived since the last save.
    journal_every_s: float = 4.0
    #: Bracket weight updates: keep every held group's lease through the pause instead of
    #: parking it. At ``pause-<v>`` the producer aborts its requests until they came back
    #: with their tokens, completes the groups whose samples are all final, makes the
    #: others' received state durable in ONE journal record, and acks; at ``resume-<v>``
    #: each held group continues its unfinished samples from their prefixes (the η bound
    #: applied as at a claim). None (the default): hold whenever the producer keeps the
    #: in-flight journal (the held state is durable only there), park otherwise (journal
    #: off, or turn checkpoints on). True: hold, and refuse a producer without the journal.
    #: False: park every held group at each pause (one record and a rename per group;
    #: docs/producers.md, "Holding through a pause").
    hold_through_pause: bool | None = None

    @property
    def journaling(self) -> bool:
        """Whether the producer keeps an in-flight journal."""
        return bool(self.journal_every_tokens or self.journal_every_s)

    def validate(self) -> None:
        if self.journal_every_tokens < 0 or not self.journal_every_s >= 0:
            raise ConfigError("ProducerConfig.timing.journal_every_tokens and journal_every_s "
                              f"must be >= 0 (0: off), got {self.journal_every_tokens}, "
                              f"{self.journal_every_s}")
        if self.hold_through_pause is True and not self.journaling:
            raise ConfigError("ProducerConfig.timing.hold_through_pause needs the in-flight "
                              "journal (timing.journal_every_s or journal_every_tokens > 0): "
                              "a group held through a pause is durable only there")
        _positive("ProducerConfig.timing", control_poll_s=self.control_poll_s,
                  idle_poll_s=self.idle_poll_s, idle_after_s=self.idle_after_s,
                  idle_probe_s=self.idle_probe_s, abort_deadline_s=self.abort_deadline_s,
                  abort_poll_s=self.abort_poll_s, grace_period_s=self.grace_period_s)
        if self.lease_margin_s is not None and self.lease_margin_s < 0:
            raise ConfigError(f"ProducerConfig.timing.lease_margin_s must be >= 0, got "
                              f"{self.lease_margin_s}")


@dataclass(frozen=True, kw_only=True)
class ThreadsConfig(Config):
    """The producer's thread pools (its event loop never blocks on them)."""

    #: Threads for queue I/O (claim, complete, yield: fsync-bound).
    io: int = 4
    #: Threads for reward calls.
    reward: int = 2

    def validate(self) -> None:
        if self.io < 1 or self.reward < 1:
            raise ConfigError(f"ProducerConfig.threads.io and reward must be >= 1, got "
                              f"{self.io}, {self.reward}")


@dataclass(frozen=True, kw_only=True)
class ProducerConfig(Config):
    """One producer: the run it joins, and its sections (the module docstring lists them)."""

    #: The run's directory on the shared filesystem (``<root>/<run_id>``, made by
    #: ``strawq init`` / ``RunQueue.create``); the same path on every node.
    run_dir: str
    #: The engines, their HTTP client and the fault handling.
    engine: EngineConfig
    #: The user code: reward, filter, tokenizer, generate.
    plugins: PluginsConfig
    #: Sampling defaults; a task row's ``sampling_params`` overrides any of them, and each
    #: sample's seed is derived from ``sampling.seed`` (None: engine randomness).
    sampling: SamplerParams = field(default_factory=SamplerParams)
    #: This producer's group slots.
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    #: Multi-turn trajectories and their tools.
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    #: What each sample records besides its tokens.
    record: RecordConfig = field(default_factory=RecordConfig)
    #: Polls and deadlines of the loop.
    timing: TimingConfig = field(default_factory=TimingConfig)
    #: Thread pools.
    threads: ThreadsConfig = field(default_factory=ThreadsConfig)
    #: Fixed producer id (tests); None: ``new_producer_id()``.
    producer_id: str | None = None

    def validate(self) -> None:
        if not self.run_dir:
            raise ConfigError("ProducerConfig.run_dir must name the run directory")
        if self.producer_id is not None:
            validate_id(self.producer_id, "producer id")

    def sampler_params(self, overrides: Mapping[str, Any] | None = None,
                       seed: int | None = None) -> SamplerParams:
        """The sampling parameters of one sample: the defaults, then the row's overrides;
        ``seed`` (the sample's derived seed) unless the row names one."""
        data = self.sampling.to_dict()
        data["seed"] = seed
        if overrides:
            unknown = sorted(set(overrides) - set(SAMPLER_KEYS))
            if unknown:
                raise ConfigError(f"task sampling_params has unknown key(s) {unknown}; known "
                                  f"keys are {sorted(SAMPLER_KEYS)}")
            data.update(overrides)
        try:
            return SamplerParams.from_dict(data, where="task sampling_params")
        except ConfigError as exc:
            raise ConfigError(f"invalid sampling parameters {data}: {exc}") from exc


def new_producer_id(prefix: str | None = None) -> str:
    """``p-<host>-<random>``: unique per incarnation, so a restart never reuses an id."""
    host = prefix or socket.gethostname().split(".")[0]
    host = "".join(c if c.isalnum() or c in "_-" else "-" for c in host)[:40] or "host"
    return validate_id(f"p-{host}-{secrets.token_hex(4)}", "producer id")
