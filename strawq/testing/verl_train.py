"""verl's actor on strawq's batches, on one process or on gloo ranks: the verl path of the
reference-equivalence check (docs/design.md, invariant 11).

``actor_step`` is what one verl actor rank does with its shard of the ``DataProto``
``strawq.collector.integrations.verl.reader.batch_to_dataproto`` makes (verl's
``left_right_2_no_padding``, ``prepare_micro_batches``, the FSDP engine's
``prepare_model_inputs`` / ``prepare_model_outputs`` and ``ppo_loss``), around a
packed-sequence model in place of the FSDP-wrapped transformer, with the actor
configuration of ``verl_actor_config``; ``driver_dataproto`` is the verl driver's side;
``verl_path_gradients`` / ``verl_distributed_gradients`` are this path's loss and
gradients, compared with ``strawq.testing.reference``'s.

This is test harness, not adapter: ``strawq.collector.integrations.verl`` never imports it.
verl is imported lazily; a missing verl is an ``ImportError`` saying what to install.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from types import SimpleNamespace
from typing import Any

import torch

from strawq.collector.integrations.verl.reader import (
    MODES,
    _verl,
    batch_to_dataproto,
    check_objective,
    compute_verl_advantages,
    rollout_correction,
    verl_actor_config,
)
from strawq.collector.trainer.reader import Batch, BatchReader


# -- one verl actor rank ---------------------------------------------------------------------
class _LMHeadOutput(SimpleNamespace):
    logits: torch.Tensor


def _engine() -> Any:
    """verl's FSDP LM-head engine as far as its input and output preparation goes (no
    Ulysses, no static padding): ``prepare_model_inputs`` / ``prepare_model_outputs``."""
    impl = _verl("verl.workers.engine.fsdp.transformer_impl")
    eng = object.__new__(impl.FSDPEngineWithLMHead)
    eng.use_ulysses_sp = False
    eng.ulysses_sequence_parallel_size = 1
    eng.pad_to_length = False
    eng.engine_config = SimpleNamespace(entropy_checkpointing=False,
                                        entropy_from_logits_with_chunking=False)
    return eng


def actor_step(model: torch.nn.Module, data: Any, config: Any, *, dp_size: int = 1,
               dp_group: Any = None, batch_num_tokens: int | None = None,
               max_token_len_per_gpu: int | None = None) -> tuple[torch.Tensor, int]:
    """One verl actor rank's forward and backward over its ``DataProto`` shard (one
    mini-batch, as ``train_mini_batch`` runs it with one mini-batch per step); returns the
    summed loss (detached) and the number of micro-batches.

    The steps are verl's: ``to_tensordict`` and ``left_right_2_no_padding`` (the trainer's
    ``_update_actor``), ``global_batch_size`` = ``config.ppo_mini_batch_size × rollout_n``,
    the data-parallel group's token count (``batch_num_tokens``: all-reduced over
    ``dp_group``, or given) and ``dp_size`` (``FSDPEngine.forward_backward_batch``),
    ``prepare_micro_batches`` (dynamic batch size at ``max_token_len_per_gpu``), and per
    micro-batch the FSDP engine's ``prepare_model_inputs``, the model, its
    ``prepare_model_outputs`` (labels rolled, logits ÷ temperature, ``logprobs_from_logits``)
    and ``ppo_loss`` (the policy loss of ``config``), then ``backward``. ``model`` is the
    packed-sequence interface of ``strawq.testing.reference``:
    ``model(tokens [N], positions [N], cu_seqlens [S + 1]) -> logits [N, V]``, standing in
    for the FSDP-wrapped transformer (varlen attention over the packed row). Gradients
    accumulate in the model; averaging them over ranks (FSDP / DDP) is the caller's.
    """
    padding = _verl("verl.workers.utils.padding")
    td = padding.left_right_2_no_padding(data.to_tensordict())
    return actor_td_step(model, td, config, dp_size=dp_size, dp_group=dp_group,
                         batch_num_tokens=batch_num_tokens,
                         max_token_len_per_gpu=max_token_len_per_gpu,
                         global_batch_size=int(config.ppo_mini_batch_size * config.rollout_n))


def actor_td_step(model: torch.nn.Module, td: Any, config: Any, *, dp_size: int = 1,
                  dp_group: Any = None, batch_num_tokens: int | None = None,
                  max_token_len_per_gpu: int | None = None,
                  global_batch_size: int | None = None) -> tuple[torch.Tensor, int]:
    """``actor_step`` from the no-padding tensordict verl's trainer sends its actor worker
    group (``_update_actor``: ``left_right_2_no_padding``, ``global_batch_size`` set):
    ``global_batch_size`` is the tensordict's unless given."""
    import torch.distributed as dist

    tu = _verl("verl.utils.tensordict_utils")
    eutils = _verl("verl.workers.engine.utils")
    losses = _verl("verl.workers.utils.losses")
    dev = next((q.device for q in model.parameters()), torch.device("cpu"))
    budget = int(max_token_len_per_gpu or config.ppo_max_token_len_per_gpu)
    if global_batch_size is None:
        global_batch_size = int(tu.get(td, "global_batch_size"))
    tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=True,
                         global_batch_size=int(global_batch_size),
                         use_remove_padding=True, use_dynamic_bsz=bool(config.use_dynamic_bsz),
                         max_token_len_per_gpu=budget,
                         micro_batch_size_per_gpu=config.ppo_micro_batch_size_per_gpu,
                         use_fused_kernels=False)
    if batch_num_tokens is None:
        count = td["loss_mask"].sum().reshape(1).to(torch.int64)
        if dp_group is not None:
            dist.all_reduce(count, op=dist.ReduceOp.SUM, group=dp_group)
        batch_num_tokens = int(count.item())
    tu.assign_non_tensor(td, batch_num_tokens=int(batch_num_tokens), dp_size=int(dp_size))
    # verl makes the micro-batch counts equal across the group (its FSDP collectives need
    # it) with a tensor on its accelerator platform; on CPU ranks the counts may differ,
    # which changes no gradient (each micro-batch's loss is its share of the batch's)
    sync = dp_group if dev.type != "cpu" else None
    micro, _ = eutils.prepare_micro_batches(data=td, dp_group=sync, same_micro_num_in_dp=True)
    eng = _engine()
    total = torch.zeros((), dtype=torch.float64)
    for mb in micro:
        mb = mb.to(dev)
        inputs, out_args = eng.prepare_model_inputs(micro_batch=mb)
        ids = inputs["input_ids"][0]
        cu = mb["input_ids"].offsets().to(torch.int64)
        logits = model(ids, inputs["position_ids"][0], cu)
        outputs = eng.prepare_model_outputs(output=_LMHeadOutput(logits=logits.unsqueeze(0)),
                                            output_args=out_args, micro_batch=mb,
                                            logits_processor_func=None)
        loss, _metrics = losses.ppo_loss(config, outputs, mb)
        loss.backward()
        total = total + loss.detach().double().cpu()
    return total, len(micro)


def actor_log_probs(model: torch.nn.Module, data: Any) -> torch.Tensor:
    """float32 [S, R]: the actor's log-probs of the response tokens, as verl's
    ``compute_log_prob`` returns them for ``old_log_probs`` (forward only; the FSDP engine's
    input/output preparation, ``no_padding_2_padding``)."""
    padding = _verl("verl.workers.utils.padding")
    tu = _verl("verl.utils.tensordict_utils")
    dev = next((q.device for q in model.parameters()), torch.device("cpu"))
    td = padding.left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=False, use_remove_padding=True,
                         use_fused_kernels=False)
    td = td.to(dev)
    eng = _engine()
    with torch.no_grad():
        inputs, out_args = eng.prepare_model_inputs(micro_batch=td)
        cu = td["input_ids"].offsets().to(torch.int64)
        logits = model(inputs["input_ids"][0], inputs["position_ids"][0], cu)
        outputs = eng.prepare_model_outputs(output=_LMHeadOutput(logits=logits.unsqueeze(0)),
                                            output_args=out_args, micro_batch=td,
                                            logits_processor_func=None)
        out: torch.Tensor = padding.no_padding_2_padding(outputs["log_probs"], td)
    return out.float().cpu()


def _read_batch(run_dir: str, seq: int) -> Batch:
    from strawq.storage import open_storage
    from strawq.tasks.queue import RunQueue

    queue = RunQueue.open(open_storage(run_dir, writer_id="verl-path"))
    reader = BatchReader(queue, rank=0, world_size=1, checkpointed=False, watch=None,
                         sleep=lambda _s: None)
    try:
        return reader.load(reader.batches.read_manifest(int(seq)))
    finally:
        reader.close()


def driver_dataproto(run_dir: str, seq: int, *, advantages: str = "manifest",
                     balance_dp: int | None = None, objective: Any = None,
                     mode: str = "bypass", model: torch.nn.Module | None = None) -> Any:
    """The verl driver's side: batch ``seq`` read whole and converted; ``advantages=
    "verl"`` recomputes them with ``compute_verl_advantages``; ``balance_dp`` reorders the
    rows the way the trainer's ``_balance_batch`` does for that many ranks (verl's
    ``get_seqlen_balanced_partitions``). ``mode="decoupled"``: ``old_log_probs`` from
    ``model`` (``actor_log_probs``, the weights before the step) and verl's
    ``compute_rollout_correction_and_add_to_batch`` for ``objective``'s weight."""
    if advantages not in ("manifest", "verl"):
        raise ValueError(f"advantages must be 'manifest' or 'verl', got {advantages!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    data = batch_to_dataproto(_read_batch(run_dir, seq), advantages=advantages == "manifest",
                              old_log_probs=mode == "bypass")
    if mode == "decoupled":
        if model is None:
            raise ValueError("the decoupled mode recomputes old_log_probs: pass the model")
        data.batch["old_log_probs"] = actor_log_probs(model, data)
        helper = _verl("verl.trainer.ppo.rollout_corr_helper")
        rc = _verl("verl.trainer.config").RolloutCorrectionConfig(
            **rollout_correction(objective, mode="decoupled"))
        data, _metrics = helper.compute_rollout_correction_and_add_to_batch(data, rc)
    if advantages == "verl":
        data = compute_verl_advantages(data)
    if balance_dp and balance_dp > 1 and len(data) % balance_dp == 0:
        sb = _verl("verl.utils.seqlen_balancing")
        lens = data.batch["attention_mask"].sum(-1).tolist()
        parts = sb.get_seqlen_balanced_partitions(lens, k_partitions=balance_dp,
                                                  equal_size=True)
        order = torch.tensor([j for p in parts for j in sorted(p)])
        data.reorder(order)
    return data


def verl_path_gradients(run_dir: str, seq: int, model: torch.nn.Module, *,
                        objective: Any = None, dp_size: int = 1,
                        max_token_len_per_gpu: int | None = None,
                        advantages: str = "manifest", mode: str = "bypass"
                        ) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, {parameter: gradient}) of batch ``seq`` as a verl actor trains it, on one
    process: the driver's ``DataProto`` (``driver_dataproto``), split over ``dp_size``
    ranks the way verl's dispatch splits it (``DataProto.chunk``), each rank's
    ``actor_step`` with ``verl_actor_config(objective, mode=mode)`` and the whole batch's
    token count, and the ranks' gradients averaged (FSDP's mean), as one backward of their
    mean loss. The model's gradients are cleared first and hold the result afterwards.
    (In the decoupled mode the loss is PPO's surrogate −w·A·ρ at ρ = 1, not the
    reference's −w·A·log π; the gradients agree.)"""
    check_objective(objective, mode=mode)
    data = driver_dataproto(run_dir, seq, advantages=advantages, balance_dp=dp_size,
                            objective=objective, mode=mode, model=model)
    n = len(data)
    if n % dp_size:
        raise ValueError(f"batch {seq} has {n} samples, not a multiple of dp_size={dp_size}: "
                         "verl's dispatch splits a batch evenly")
    config = verl_actor_config(objective, batch_samples=n, mode=mode)
    tokens = int(data.batch["response_mask"].sum())
    model.zero_grad(set_to_none=True)
    total = 0.0
    for shard in data.chunk(dp_size):
        loss, _ = actor_step(model, shard, config, dp_size=dp_size, batch_num_tokens=tokens,
                             max_token_len_per_gpu=max_token_len_per_gpu)
        total += float(loss)
    grads = {k: (q.grad.detach().clone() / dp_size if q.grad is not None
                 else torch.zeros_like(q)) for k, q in model.named_parameters()}
    return total / dp_size, grads


# -- real data-parallel ranks ----------------------------------------------------------------
def _rank_main(rank: int, run_dir: str, seq: int, world_sizes: Sequence[int],
               objectives: Sequence[dict[str, Any]], model_kw: dict[str, Any], init: str,
               size: int, out_dir: str, budget: int | None, advantages: str,
               mode: str) -> None:
    """One gloo process, a verl actor rank: for each world size w (ranks < w take part) and
    objective, its shard's ``actor_step`` (token count all-reduced over the group), then the
    gradients all-reduced and divided by w."""
    import torch.distributed as dist

    from strawq.testing.reference import Objective, TinyPolicy, gradients

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        results: dict[str, Any] = {}
        for w in world_sizes:
            group = dist.new_group(list(range(w)))  # every process creates every group
            if rank >= w:
                continue
            data = driver_dataproto(run_dir, seq, advantages=advantages, balance_dp=w)
            for k, obj in enumerate(objectives):
                model = TinyPolicy(**model_kw)
                if mode == "decoupled":  # old_log_probs and IS weights on the driver
                    data = driver_dataproto(run_dir, seq, advantages=advantages, balance_dp=w,
                                            objective=Objective(**obj), mode=mode, model=model)
                shard = data.chunk(w)[rank]
                config = verl_actor_config(Objective(**obj), batch_samples=len(data),
                                           mode=mode)
                loss, _ = actor_step(model, shard, config, dp_size=w, dp_group=group,
                                     max_token_len_per_gpu=budget)
                lt = loss.to(torch.float64).reshape(1).clone()
                dist.all_reduce(lt, group=group)
                for q in model.parameters():
                    if q.grad is None:
                        q.grad = torch.zeros_like(q)
                    dist.all_reduce(q.grad, group=group)
                    q.grad /= w
                if rank == 0:
                    results[f"{w}/{k}"] = (float(lt) / w, gradients(model))
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "grads.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def verl_distributed_gradients(run_dir: str, seq: int, *,
                               world_sizes: Iterable[int] = (1, 2, 4),
                               objectives: Iterable[Any] = (),
                               model_kw: Mapping[str, Any] | None = None,
                               max_token_len_per_gpu: int | None = None,
                               advantages: str = "manifest", mode: str = "bypass",
                               start_method: str = "spawn"
                               ) -> dict[tuple[int, Any], tuple[float, dict[str, torch.Tensor]]]:
    """The verl path on real ``torch.distributed`` ranks (gloo, CPU): one job of
    ``max(world_sizes)`` processes runs every world size on a subgroup of the first w ranks
    and every objective; returns {(w, objective): (loss, averaged gradients of
    ``TinyPolicy(**model_kw)``)} (``strawq.testing.reference.distributed_gradients`` for
    the reader path)."""
    import torch.multiprocessing as mp

    from strawq.testing.reference import Objective

    sizes = sorted(set(int(w) for w in world_sizes))
    objs = list(objectives) or [Objective()]
    if not sizes or sizes[0] < 1:
        raise ValueError(f"world sizes must be >= 1, got {sizes}")
    for o in objs:
        check_objective(o, mode=mode)
    with tempfile.TemporaryDirectory(prefix="strawq-verl-") as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        args = (run_dir, seq, sizes, [asdict(o) for o in objs], dict(model_kw or {}), init,
                sizes[-1], tmp, max_token_len_per_gpu, advantages, mode)
        mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
            _rank_main, args=args, nprocs=sizes[-1], join=True, start_method=start_method)
        raw = torch.load(os.path.join(tmp, "grads.pt"))
    return {(w, o): (raw[f"{w}/{k}"][0], raw[f"{w}/{k}"][1])
            for w in sizes for k, o in enumerate(objs)}


__all__ = ["actor_log_probs", "actor_step", "actor_td_step", "driver_dataproto",
           "verl_distributed_gradients", "verl_path_gradients"]
