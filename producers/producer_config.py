"""Configuration of one producer: a frozen, keyword-only, validated dataclass.

``ProducerConfig.from_dict`` (``strawq.config.Config``) rejects unknown keys by name and
builds the nested ``client`` section (``strawq.producers.sglang_client.ClientConfig``).
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from strawq.config import Config
from strawq.errors import ConfigError
from strawq.extras import TEACHER_LOGPROBS, ExtraError, check_names
from strawq.names import validate_id

from strawq.producers.extras_protocol import GENERATED
from strawq.producers.sample import SamplerParams
from strawq.producers.sglang_client import ClientConfig

#: SamplerParams fields a producer config sets and a task row may override
SAMPLER_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
                "ignore_eos")


@dataclass(frozen=True, kw_only=True)
class ProducerConfig(Config):
    #: The run's directory on the shared filesystem (``<root>/<run_id>``, made by
    #: ``strawq init`` / ``RunQueue.create``); the same path on every node.
    run_dir: str
    #: Reward function, dotted path ``reward(task, response_ids, sample_meta) -> float``.
    reward: str
    #: Group filter, dotted path ``filter(task, rewards) -> reason | None`` (None: keep all).
    filter: str | None = None
    #: Keyword arguments for a reward *factory*: with them, ``reward`` names a function that
    #: is called once with these and returns the reward function (remote reward model,
    #: slime / verl adapters: ``docs/rewards.md``). None: ``reward`` is the function.
    reward_args: dict[str, Any] | None = None
    #: Tokenizer for text and chat prompts, and for decoding responses for rewards:
    #: ``hf:<model dir or hub name>`` (a Hugging Face tokenizer and its chat template), or a
    #: dotted path to a ``(text) -> list[int]`` function (text only) or a tokenizer object
    #: (``strawq.tokenize``). Without one a text or chat prompt fails its task
    #: (non-retryable) with a message saying so.
    tokenizer: str | None = None
    #: Keyword arguments for the tokenizer (``hf:``: ``gguf_file``, ``chat_template``,
    #: ``add_generation_prompt``, ``template_kwargs``, ...; see ``docs/datasets.md``).
    tokenizer_args: dict[str, Any] | None = None
    #: Engine URLs; ``/generate`` goes round-robin over them (unless ``router_url``).
    workers: tuple[str, ...] = ()
    #: sglang-router URL: ``/generate`` goes there; control calls go to its ``/workers``.
    router_url: str | None = None
    #: Group slots of this producer (its share of K = floor(C*E/G)); ``set_slots`` changes it.
    #: At most ``slots * G`` samples generate at once (the engine-concurrency budget).
    slots: int = 1
    #: Claim a new group as soon as one trajectory is free (its samples start as slots
    #: free up; at most one group per producer waits like that). False: claim only when a
    #: whole group's G trajectories are free (leaves up to G-1 trajectories idle).
    eager_claim: bool = True
    #: Sampling defaults (``SamplerParams``); a task row's ``sampling_params`` overrides
    #: them. Response budget per sample.
    max_new_tokens: int = 1024
    #: Sampling temperature (>= 0; below 1e-6 greedy).
    temperature: float = 1.0
    #: Nucleus sampling mass, in (0, 1].
    top_p: float = 1.0
    #: Most likely tokens sampled from: -1 (all) or >= 1.
    top_k: int = -1
    #: Token ids that end a response.
    stop_token_ids: tuple[int, ...] = ()
    #: Keep generating past EOS (and past ``stop_token_ids``, as SGLang does).
    ignore_eos: bool = False
    #: Base seed: sample i of task index j gets a seed derived from (seed, j, i), the same
    #: on every attempt and resume. None: engine randomness.
    seed: int | None = None
    #: Zero the loss mask of tokens older than the sample's newest version (slime's
    #: ``--mask-offpolicy-in-partial-rollout``).
    mask_offpolicy_in_partial_rollout: bool = False
    #: Generate plugin, dotted path ``async def generate(ctx) -> None`` that owns each
    #: sample's trajectory (turns, tool calls; ``docs/agentic.md``). None: the built-in
    #: single turn (``strawq.producers.generate.single_turn``).
    generate: str | None = None
    #: Keyword arguments for a generate plugin *factory* (then ``generate`` names it).
    generate_args: dict[str, Any] | None = None
    #: Most generated turns per sample (0: unlimited); past it the sample ends truncated.
    max_turns: int = 0
    #: A tool call's time limit.
    tool_timeout_s: float = 60.0
    #: A tool call's extra tries after a timeout or an error.
    tool_retries: int = 1
    #: After a tool's last try: ``fail_sample`` (recorded failed, never trained),
    #: ``drop_group`` (dropped as ``tool_error``) or ``restart`` (a fresh environment,
    #: at most ``tool_retries`` times, then fail_sample).
    tool_failure: str = "fail_sample"
    #: Per-token extras to record with every sample (``strawq.extras``, docs/slime.md):
    #: ``routed_experts`` (asks ``return_routed_experts``; the server needs
    #: ``--enable-return-routed-experts`` and an MoE model), ``top_p_token_ids`` (asks
    #: ``return_sampling_mask``), ``teacher_logprobs`` (a ``teacher_url`` scores each
    #: final sample). Empty: none (the records are as before).
    extras: tuple[str, ...] = ()
    #: The teacher engine (SGLang ``/generate``) that scores each final sample for
    #: ``teacher_logprobs`` (``strawq.producers.teacher``); the ``client`` settings apply.
    teacher_url: str | None = None
    #: Row shape of ``routed_experts``, ``[num_layers, moe_router_topk]`` (slime's
    #: ``rollout_routed_experts``); empty: one flat row per position.
    routed_experts_shape: tuple[int, ...] = ()
    #: HTTP client settings (timeouts, retries, context length).
    client: ClientConfig = field(default_factory=ClientConfig)
    #: Extra tries of a failed segment (after the client's own retries) before the group
    #: is handed back (engine unreachable: yield as partial; rejected: ``fail``).
    sample_retries: int = 2
    #: How often the loop reads ``control/`` (the weight-update bracket).
    control_poll_s: float = 0.1
    #: Sleep when the queue had nothing to claim.
    idle_poll_s: float = 0.1
    #: Bracket/stop: how long to wait for aborted requests to return before cancelling them.
    abort_deadline_s: float = 30.0
    #: Re-send the rid-prefix abort at this cadence while waiting.
    abort_poll_s: float = 0.5
    #: Stop work on leases once no heartbeat succeeded for ``lease_timeout_s - margin``
    #: (None: one heartbeat interval).
    lease_margin_s: float | None = None
    #: Pause before claiming again after a group was handed back for an engine fault
    #: (doubles per consecutive fault, capped at 16x).
    engine_backoff_s: float = 0.5
    #: Threads for queue I/O (claim, complete, yield: fsync-bound).
    io_threads: int = 4
    #: Threads for reward calls.
    reward_threads: int = 2
    #: Fixed producer id (tests); None: ``new_producer_id()``.
    producer_id: str | None = None

    def validate(self) -> None:
        if not self.run_dir:
            raise ConfigError("ProducerConfig.run_dir must name the run directory")
        if not self.workers and self.router_url is None:
            raise ConfigError("ProducerConfig needs engine 'workers' URLs or a 'router_url'")
        if self.slots < 0:
            raise ConfigError(f"ProducerConfig.slots must be >= 0, got {self.slots}")
        for name in ("control_poll_s", "idle_poll_s", "abort_deadline_s", "abort_poll_s",
                     "engine_backoff_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"ProducerConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.sample_retries < 0:
            raise ConfigError(f"ProducerConfig.sample_retries must be >= 0, got "
                              f"{self.sample_retries}")
        if self.io_threads < 1 or self.reward_threads < 1:
            raise ConfigError("ProducerConfig.io_threads and reward_threads must be >= 1")
        if self.lease_margin_s is not None and self.lease_margin_s < 0:
            raise ConfigError(f"ProducerConfig.lease_margin_s must be >= 0, got "
                              f"{self.lease_margin_s}")
        if self.producer_id is not None:
            validate_id(self.producer_id, "producer id")
        if self.max_turns < 0 or self.tool_retries < 0 or not self.tool_timeout_s > 0:
            raise ConfigError("ProducerConfig.max_turns and tool_retries must be >= 0 and "
                              f"tool_timeout_s > 0, got {self.max_turns}, {self.tool_retries}, "
                              f"{self.tool_timeout_s}")
        if self.tool_failure not in ("fail_sample", "drop_group", "restart"):
            raise ConfigError(f"ProducerConfig.tool_failure must be fail_sample, drop_group or "
                              f"restart, got {self.tool_failure!r}")
        self.sampler_params()  # validates the sampling defaults
        try:
            names = check_names(self.extras)
        except ExtraError as exc:
            raise ConfigError(f"ProducerConfig.extras: {exc}") from None
        bad = [n for n in names if n not in (*GENERATED, TEACHER_LOGPROBS)]
        if bad:
            raise ConfigError(f"ProducerConfig.extras: a producer records "
                              f"{[*GENERATED, TEACHER_LOGPROBS]}, not {bad}")
        if (TEACHER_LOGPROBS in names) != (self.teacher_url is not None):
            raise ConfigError("ProducerConfig: teacher_logprobs in extras needs a teacher_url "
                              "(the engine that scores each sample), and a teacher_url needs "
                              "teacher_logprobs in extras")
        if any(d < 1 for d in self.routed_experts_shape):
            raise ConfigError("ProducerConfig.routed_experts_shape must be positive sizes, "
                              f"got {list(self.routed_experts_shape)}")

    def sampler_params(self, overrides: Mapping[str, Any] | None = None,
                       seed: int | None = None) -> SamplerParams:
        """The sampling parameters of one sample: defaults, then the row's overrides."""
        data: dict[str, Any] = {k: getattr(self, k) for k in SAMPLER_KEYS}
        if overrides:
            unknown = sorted(set(overrides) - set(SAMPLER_KEYS) - {"seed"})
            if unknown:
                raise ConfigError(f"task sampling_params has unknown key(s) {unknown}; known "
                                  f"keys are {sorted(SAMPLER_KEYS)}")
            data.update(overrides)
        if seed is not None and "seed" not in data:
            data["seed"] = seed
        try:
            return SamplerParams.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"invalid sampling parameters {data}: {exc}") from exc


def new_producer_id(prefix: str | None = None) -> str:
    """``p-<host>-<random>``: unique per incarnation, so a restart never reuses an id."""
    host = prefix or socket.gethostname().split(".")[0]
    host = "".join(c if c.isalnum() or c in "_-" else "-" for c in host)[:40] or "host"
    return validate_id(f"p-{host}-{secrets.token_hex(4)}", "producer id")
