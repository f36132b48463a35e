"""The shipped Megatron example loop (``deploy/examples/megatron_trainer_loop.py``) run end
to end on one CPU process (test harness): its own ``main`` with ``--toy`` (gloo, TP = CP =
1), several steps, a kill inside a step (after the optimizer step, before the ack), a
restart from its checkpoint, more steps. Each step's gradient is compared with
``strawq.testing.reference.reference_gradients`` on that step's batch, scored with the model
as it was before the step; the batches are ``strawq.testing.slime_loop_modes``'s (a failed
reward, a tool-failed sample, a group of one, a corrupt group counted in the totals).
"""

from __future__ import annotations

import copy
import importlib.util
import os
from collections import Counter
from pathlib import Path
from typing import Any

import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "megatron_trainer_loop.py"


class _Killed(Exception):
    """The job dies inside a step (after the optimizer step, before the ack)."""


class _Packed(torch.nn.Module):
    """The example's model behind the reference's packed interface
    ``(tokens [N], positions [N], cu_seqlens) -> logits [N, V]`` (its model sees one
    token at a time: no attention across positions)."""

    def __init__(self, m: torch.nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                cu_seqlens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.m(tokens.unsqueeze(0)).squeeze(1)
        return out


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("megatron_trainer_loop", EXAMPLE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {EXAMPLE}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_megatron_loop(workdir: str, *, steps: int = 4, kill_at: int = 2, groups: int = 3,
                      group_size: int = 4, seed: int = 0) -> dict[str, Any]:
    """Run the example for ``steps`` batches, killed once in step ``kill_at`` (0-based) and
    restarted. Returns ``steps`` (steps that survive), ``trained_twice``, ``missing``,
    ``max_rel_grad_err``, ``grad_checks``, ``restarts`` and ``model_restored`` (whether the
    restarted job's model was the checkpointed one)."""
    from strawq.testing.reference import Objective, max_relative_error, reference_gradients
    from strawq.testing.slime_loop_modes import collector_setup

    env = collector_setup(workdir, rollouts=steps, groups=groups, group_size=group_size,
                          seed=seed)
    mod = _example()
    original = mod.train_step
    ckpt = os.path.join(workdir, "trainer_state.json")
    trained: list[tuple[int, list[str]]] = []
    errors: list[float] = []
    calls = {"n": 0, "killed": False}
    saved: dict[str, torch.Tensor] = {}
    at_kill: dict[str, torch.Tensor] = {}
    first_after_restart: dict[str, Any] = {}

    def step(model: torch.nn.Module, opt: Any, batcher: Any, batch: Any,
             loss_agg: str = "seq_mean_token_mean") -> float:
        if calls["killed"] and not first_after_restart:
            first_after_restart.update({k: v.clone() for k, v in model.state_dict().items()})
        before = _Packed(copy.deepcopy(model))
        loss: float = original(model, opt, batcher, batch, loss_agg)
        grads = {f"m.{n}": (q.grad.detach().clone() if q.grad is not None
                            else torch.zeros_like(q)) for n, q in model.named_parameters()}
        _, ref = reference_gradients(env.run_dir, batch.seq, before,
                                     objective=Objective(aggregation=loss_agg),
                                     skip=env.corrupt)
        errors.append(max_relative_error(grads, ref))
        ids = [f"{s['index']}:{int(s['index']) * group_size + k}"
               for s in batch.summaries for k in range(len(s["status"]))]
        calls["n"] += 1
        if calls["n"] == kill_at + 1 and not calls["killed"]:
            calls["killed"] = True
            at_kill.update(saved)  # the model of the last step that finished
            raise _Killed()
        trained.append((batch.seq, ids))
        saved.clear()
        saved.update({k: v.clone() for k, v in model.state_dict().items()})
        return loss

    mod.train_step = step
    argv = [env.run_dir, "--toy", "--steps", str(steps), "--max-tokens-per-gpu", "64",
            "--checkpoint", ckpt]
    restarts = 0
    try:
        try:
            mod.main(argv)
        except _Killed:
            restarts += 1
            _reset_distributed()
            done = len(trained)
            mod.main([*argv[:2], "--steps", str(steps - done), *argv[4:]])
    finally:
        mod.train_step = original
        _reset_distributed()
    counts = Counter(i for _, ids in trained for i in ids)
    restored = bool(first_after_restart) and all(
        torch.equal(first_after_restart[k], v) for k, v in at_kill.items()
        if k in first_after_restart) if restarts else True
    return {"steps": len(trained), "trained_twice": sum(1 for c in counts.values() if c > 1),
            "missing": len(env.expected_ids() - set(counts)),
            "max_rel_grad_err": max(errors) if errors else float("nan"),
            "grad_checks": len(errors), "restarts": restarts, "model_restored": restored}


def _reset_distributed() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["run_megatron_loop"]
