"""slime's own trainer-side code run on the samples strawq hands it.

``RolloutManager`` is a stand-in for slime's ray actor of that name that carries slime's
*real* ``_post_process_rewards`` and ``_convert_samples_to_train_data``: their text is read
from the pinned slime source (``slime/ray/rollout.py``) and compiled here, because that
module imports SGLang at its top while these two methods use only torch, ``Sample`` and
slime helpers that import without it. What slime would train from a batch strawq returns
(``generate_rollout``) is computed by slime's code, not by a copy of it.

``slime_path_gradients`` takes a published batch through that conversion and then through
slime's Megatron-side ``compute_advantages_and_returns`` and ``loss_function`` (policy
loss, TIS / IcePop, its reducers and its Megatron scaling) on one process, and returns the
loss and the parameter gradients: the slime path of the reference-equivalence check
(docs/design.md, invariant 11; ``strawq.testing.reference``). ``slime_args`` is the
slime configuration that trains strawq's documented objective.

This is test harness, not adapter: ``strawq.collector.integrations.slime`` never imports it
(what slime runs is there, ``seq_mean_token_sum_reducer`` included).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import itertools
import os
import tempfile
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

from strawq.collector.integrations.slime import REWARD_POST_PROCESS, SEQ_MEAN_TOKEN_SUM
from strawq.collector.integrations.slime.samples import _slime, batch_to_samples

#: the methods of slime's ``RolloutManager`` this stand-in carries
MANAGER_METHODS = ("_post_process_rewards", "_convert_samples_to_train_data",
                   "_get_rollout_data")
_compiled: dict[str, Any] = {}


def _manager_methods() -> dict[str, Any]:
    """slime's ``RolloutManager`` methods (``MANAGER_METHODS``), compiled from its source."""
    if _compiled:
        return _compiled
    _slime("slime.utils.types")  # says how to install slime when it is missing
    spec = importlib.util.find_spec("slime.ray.rollout")
    if spec is None or spec.origin is None:
        raise ImportError("slime.ray.rollout is not in the installed slime source")
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=spec.origin)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef)
                and n.name == "RolloutManager"), None)
    if cls is None:
        raise ImportError(f"{spec.origin} defines no RolloutManager")
    found = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)
             and n.name in MANAGER_METHODS}
    missing = [m for m in MANAGER_METHODS if m not in found]
    if missing:
        raise ImportError(f"slime's RolloutManager ({spec.origin}) has no {missing}")
    data_utils = _slime("slime.observability.rollout_data_utils")
    namespace: dict[str, Any] = {
        "torch": _slime("torch"), "itertools": itertools,
        "Sample": _slime("slime.utils.types").Sample,
        "get_source": _slime("slime.utils.data").get_source,
        "validate_rollout_routed_experts_for_replay":
            data_utils.validate_rollout_routed_experts_for_replay,
        "validate_rollout_id_annotated": data_utils.validate_rollout_id_annotated,
        "load_debug_rollout_data": data_utils.load_debug_rollout_data,
        "call_rollout_fn": _slime("slime.rollout.base_types").call_rollout_fn,
        "__name__": "slime.ray.rollout"}
    module = ast.Module(body=[found[m] for m in MANAGER_METHODS], type_ignores=[])
    exec(compile(module, spec.origin, "exec"), namespace)  # noqa: S102 - slime's own source
    _compiled.update({m: namespace[m] for m in MANAGER_METHODS})
    return _compiled


class RolloutManager:
    """The part of slime's ``RolloutManager`` that turns rollout samples into train data.

    ``args`` is slime's namespace; ``custom_reward_post_process_path`` and
    ``custom_convert_samples_to_train_data_path`` are loaded with slime's own
    ``load_function``, as its ``__init__`` does.
    """

    def __init__(self, args: Any) -> None:
        load_function = _slime("slime.utils.misc").load_function
        self.args = args
        path = getattr(args, "custom_reward_post_process_path", None)
        self.custom_reward_post_process_func = load_function(path) if path else None
        path = getattr(args, "custom_convert_samples_to_train_data_path", None)
        self.custom_convert_samples_to_train_data_func = load_function(path) if path else None
        methods = _manager_methods()
        self._post = methods["_post_process_rewards"]
        self._convert = methods["_convert_samples_to_train_data"]

    def _post_process_rewards(self, samples: Sequence[Any]) -> Any:
        return self._post(self, samples)

    def _convert_samples_to_train_data(self, samples: Sequence[Any]) -> Any:
        return self._convert(self, samples)


def flatten(groups: Sequence[Any]) -> list[Any]:
    """A rollout function's nested groups as the flat sample list slime trains on (what
    ``RolloutManager._get_rollout_data`` does after ``validate_rollout_id_annotated``)."""
    data = list(groups)
    while data and isinstance(data[0], list):
        data = list(itertools.chain.from_iterable(data))
    return data


# -- the slime path of the reference equivalence ----------------------------------------------
_ICEPOP = "slime.backends.megatron_utils.loss.icepop_function"


def slime_args(objective: Any = None, **overrides: Any) -> SimpleNamespace:
    """slime's settings that train strawq's documented objective (``Objective`` of
    ``strawq.testing.reference``: ``aggregation``, ``is_mode``, ``truncated``).

    ``grpo`` with the manifest's advantages (``reward_post_process``), no KL, no entropy
    term, log-probs recomputed by the trainer (not ``--use-rollout-logprobs``), and:

    * ``aggregation``: ``seq_mean_token_mean`` — slime's default per-sample mean;
      ``token_mean`` — ``--calculate-per-token-loss``; ``seq_mean_token_sum`` —
      ``--custom-pg-loss-reducer-function-path`` ``SEQ_MEAN_TOKEN_SUM``;
    * ``is_mode``: ``tis`` — ``--use-tis --tis-clip 2 --tis-clip-low 0``; ``icepop`` —
      ``--use-tis --custom-tis-function-path`` slime's ``icepop_function`` with bounds
      [0.5, 5]; ``none`` — no ``--use-tis``.

    Raises ``ValueError`` for what slime cannot express: ``icepop_mask``, and
    ``truncated`` scoring (slime scores at ``--rollout-temperature`` only; its top-p
    replay masks by the rollout's kept ids, another policy).
    """
    aggregation = getattr(objective, "aggregation", "seq_mean_token_mean")
    is_mode = getattr(objective, "is_mode", "tis")
    if getattr(objective, "truncated", False):
        raise ValueError("slime scores log-probs at --rollout-temperature only: an objective "
                         "scored under the recorded top-k / top-p truncation has no slime "
                         "equivalent")
    if aggregation not in ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum"):
        raise ValueError(f"unknown aggregation {aggregation!r}")
    tis: dict[str, dict[str, Any]] = {"tis": dict(use_tis=True, tis_clip=2.0, tis_clip_low=0.0,
                       custom_tis_function_path=None),
           "icepop": dict(use_tis=True, tis_clip=5.0, tis_clip_low=0.5,
                          custom_tis_function_path=_ICEPOP),
           "none": dict(use_tis=False, tis_clip=2.0, tis_clip_low=0.0,
                        custom_tis_function_path=None)}
    if is_mode not in tis:
        raise ValueError(f"importance weight {is_mode!r} has no slime equivalent "
                         f"(slime offers {sorted(tis)})")
    args = dict(
        advantage_estimator="grpo", rewards_normalization=True, grpo_std_normalization=True,
        reward_key=None, custom_reward_post_process_path=REWARD_POST_PROCESS,
        custom_convert_samples_to_train_data_path=None, normalize_advantages=False,
        kl_coef=0.0, kl_loss_coef=0.0, use_kl_loss=False, kl_loss_type="low_var_kl",
        use_unbiased_kl=False, custom_advantage_function_path=None, use_opd=False,
        use_rollout_logprobs=False, rollout_temperature=1.0, rollout_top_p=1.0,
        log_probs_chunk_size=-1, entropy_coef=0.0, use_opsm=False, eps_clip=0.2,
        eps_clip_high=0.28, eps_clip_c=None, get_mismatch_metrics=False,
        custom_pg_loss_reducer_function_path=(
            SEQ_MEAN_TOKEN_SUM if aggregation == "seq_mean_token_sum" else None),
        calculate_per_token_loss=aggregation == "token_mean", loss_type="policy_loss",
        custom_loss_function_path=None, recompute_loss_function=False, allgather_cp=False,
        global_batch_size=None, n_samples_per_prompt=1, rollout_batch_size=None,
        **tis[is_mode])
    args.update(overrides)
    return SimpleNamespace(**args)


@contextlib.contextmanager
def single_rank(device: Any = "cpu") -> Iterator[None]:
    """torch.distributed (world size 1: NCCL for a CUDA ``device`` where it is available,
    else gloo) and Megatron's parallel state (TP = PP = CP = 1) for slime's training code,
    unless they are initialised already; what it starts it tears down."""
    import torch.distributed as dist

    cuda = str(device).startswith("cuda")
    backend = "nccl" if cuda and dist.is_nccl_available() else "gloo"

    ps = _slime("megatron.core.parallel_state")
    started_dist = started_mp = False
    with tempfile.TemporaryDirectory(prefix="strawq-slime-") as tmp:
        try:
            if not dist.is_initialized():
                dist.init_process_group(backend, rank=0, world_size=1,
                                        init_method=f"file://{os.path.join(tmp, 'pg')}")
                started_dist = True
            if not ps.model_parallel_is_initialized():
                ps.initialize_model_parallel(1, 1)
                started_mp = True
            yield
        finally:
            if started_mp:
                ps.destroy_model_parallel()
            if started_dist:
                dist.destroy_process_group()


def _positions(cu: Any) -> Any:
    import torch

    lens = cu[1:] - cu[:-1]
    return torch.arange(int(cu[-1]), device=cu.device) - torch.repeat_interleave(cu[:-1], lens)


def slime_path_gradients(run_dir: str, seq: int, model: Any, *, objective: Any = None,
                         temperatures: Sequence[float] | None = None
                         ) -> tuple[float, dict[str, Any]]:
    """(loss, {parameter: gradient}) of batch ``seq`` of the run at ``run_dir`` as slime
    trains it from ``generate_rollout``, on one process.

    The batch is read whole (``BatchReader``, one rank), turned into slime ``Sample`` groups
    (``batch_to_samples``), converted by slime's own ``_convert_samples_to_train_data``
    with ``reward_post_process`` (``RolloutManager``), then each micro-batch goes through
    slime's ``compute_advantages_and_returns`` and ``loss_function`` with ``slime_args``
    (``objective``) and one optimizer step for the batch (``--global-batch-size`` = its
    samples): the losses scaled the way Megatron's schedule does (÷ micro-batches, or ÷ the
    step's token count with ``--calculate-per-token-loss``) and summed before one backward.

    slime scores every sample at one ``--rollout-temperature`` (``generate_rollout``
    refuses a batch sampled at another): a batch with several recorded temperatures is
    taken as one micro-batch per temperature, each at its own. ``model`` is the reference's
    packed-sequence interface, ``model(tokens [N], positions [N], cu_seqlens [S + 1]) ->
    logits [N, V]``, each micro-batch one forward. The model's gradients are cleared
    first and hold the result afterwards.
    """
    import torch

    from strawq.collector.trainer.reader import BatchReader
    from strawq.storage import open_storage
    from strawq.tasks.queue import RunQueue

    data_utils = _slime("slime.observability.rollout_data_utils")
    queue = RunQueue.open(open_storage(run_dir, writer_id="slime-path"))
    reader = BatchReader(queue, rank=0, world_size=1, checkpointed=False, watch=None,
                         sleep=lambda _s: None)
    try:
        batch = reader.load(reader.batches.read_manifest(int(seq)))
    finally:
        reader.close()
    from strawq.collector.integrations.slime import pad_steps  # looked up per call

    groups = batch_to_samples(batch)
    n = sum(len(g) for g in groups)
    temps = [float(t) for t in (batch.temperature.tolist() if batch.temperature is not None
                                else [1.0] * n)] if temperatures is None else list(temperatures)
    bt = batch.totals
    gbs = int(bt.total_samples)  # one step: the manifest's samples (skipped groups counted)
    args = slime_args(objective, global_batch_size=gbs)
    pad_steps(groups, args, totals=(bt.total_samples, bt.total_loss_tokens))  # as
    # generate_rollout does: padding only in place of the groups skipped at read time
    samples = flatten(groups)
    temps += [temps[0] if temps else 1.0] * (len(samples) - n)  # padding: no loss token
    data = RolloutManager(args)._convert_samples_to_train_data(samples)
    data_utils.tensorize_rollout_data_for_training(data)
    data["total_lengths"] = [len(t) for t in data["tokens"]]
    total = train_step(data, list(range(len(samples))), temps, model, objective=objective,
                       global_batch_size=gbs)
    grads = {name: (q.grad.detach().clone() if q.grad is not None else torch.zeros_like(q))
             for name, q in model.named_parameters()}
    return total, grads


def train_step(data: dict[str, Any], indices: Sequence[int], temperatures: Sequence[float],
               model: Any, *, objective: Any = None, global_batch_size: int | None = None
               ) -> float:
    """One slime training step on the samples ``indices`` of slime's tensorized train data
    (``_convert_samples_to_train_data`` then ``tensorize_rollout_data_for_training``, with
    ``total_lengths``): slime's ``compute_advantages_and_returns`` and ``loss_function``
    (``slime_args(objective)``), one micro-batch per temperature (``temperatures[i]`` is
    sample i's), the losses scaled the way Megatron's schedule does (÷ micro-batches, or ÷
    the step's token count with ``--calculate-per-token-loss``), summed before one
    backward. Returns the loss; the model's gradients are cleared first and hold the
    step's afterwards."""
    import torch

    loss_mod = _slime("slime.backends.megatron_utils.loss")
    gbs = int(global_batch_size or len(indices))
    dev = next((q.device for q in model.parameters()), torch.device("cpu"))
    by_temp: dict[float, list[int]] = {}
    for i in indices:
        by_temp.setdefault(float(temperatures[i]), []).append(i)
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), device=dev)
    tokens_seen = torch.zeros((), device=dev)
    per_token = False
    with single_rank(dev):
        for temp, idx in by_temp.items():
            a = slime_args(objective, global_batch_size=gbs, rollout_temperature=temp)
            per_token = bool(a.calculate_per_token_loss)
            toks = [data["tokens"][i].to(dev) for i in idx]
            mb: dict[str, Any] = {
                "tokens": toks, "unconcat_tokens": toks,
                "loss_masks": [data["loss_masks"][i].to(dev) for i in idx],
                "rollout_log_probs": [data["rollout_log_probs"][i].to(dev) for i in idx],
                "rewards": [data["rewards"][i] for i in idx],
                "response_lengths": [data["response_lengths"][i] for i in idx],
                "total_lengths": [data["total_lengths"][i] for i in idx],
                "rollout_mask_sums": data["rollout_mask_sums"][idx].to(dev)}
            cu = torch.zeros(len(idx) + 1, dtype=torch.int64, device=dev)
            cu[1:] = torch.tensor(mb["total_lengths"], device=dev).cumsum(0)
            flat = torch.cat(toks)
            logits = model(flat, _positions(cu), cu).float().unsqueeze(0)
            with torch.no_grad():  # slime's compute_log_prob before the step: old = current
                _, old = loss_mod.get_log_probs_and_entropy(
                    logits.detach(), args=a, unconcat_tokens=toks,
                    total_lengths=mb["total_lengths"], response_lengths=mb["response_lengths"])
            mb["log_probs"] = old["log_probs"]
            loss_mod.compute_advantages_and_returns(a, mb)
            loss, normalizer, _ = loss_mod.loss_function(
                a, mb, num_microbatches=len(by_temp), step_global_batch_size=gbs,
                logits=logits)
            if per_token:
                total = total + loss
                tokens_seen = tokens_seen + normalizer
            else:
                total = total + loss / len(by_temp)  # Megatron's schedule: ÷ micro-batches
    if per_token:
        total = total / tokens_seen  # Megatron scales the gradients by the step's tokens
    total.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    return float(total.detach())


__all__ = ["MANAGER_METHODS", "RolloutManager", "SEQ_MEAN_TOKEN_SUM", "flatten",
           "single_rank", "slime_args", "slime_path_gradients", "train_step"]
