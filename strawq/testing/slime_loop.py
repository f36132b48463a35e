"""slime's own training loop on strawq, on one CPU process, in both modes (test harness).

``run_slime_loop(mode, workdir)`` runs the control flow of slime's ``train.py`` (pinned
source 0.3.1): the trainer's start rollout from its checkpoint (``loaded_rollout_id + 1``),
``rollout_manager.load(start − 1)``, a first ``update_weights()``, then per rollout
``generate`` → ``train`` → every ``--save-interval`` the model checkpoint then the data
source's ``save`` → ``update_weights``. The rollout side is slime's: the data source and
rollout function loaded with slime's ``load_function`` from the launcher's flags
(``deploy/examples/slime_job.py``'s ``MODES``), called through ``call_rollout_fn``,
``validate_rollout_id_annotated``, and ``RolloutManager._post_process_rewards`` /
``_convert_samples_to_train_data`` compiled from slime's source
(``strawq.testing.slime_train``); the steps are slime's ``build_dp_schedule``; each step
is slime's ``compute_advantages_and_returns`` and ``loss_function``
(``slime_train.train_step``). What needs a GPU, Megatron or Ray is stood in for: the model
(``TinyPolicy``, plain SGD, a ``torch.save`` checkpoint), the placement groups and Ray
actors (direct calls), and in mode 1 the SGLang engines (slime's ``sglang_rollout`` runs
with ``--custom-generate-function-path`` set to a generator sampling from ``TinyPolicy``;
its router calls answer an empty worker list).

The job is killed once, after training rollout ``kill_after`` and before its checkpoint
(the worst place: the trained rollout is not in any checkpoint), then restarted through
slime's load path. What a killed job trained after its last checkpoint is not in the model,
so it does not count; every surviving step's samples are counted by sample id.

Mode 2 (``"collector"``): the batches are published by strawq's collector beforehand
(``strawq.testing.reference.publish_batch``, ``batch_groups`` per batch), with a failed
reward, a tool-failed sample (tool tokens masked, then a failed status), a group of one
and a group whose record is corrupted on disk (the reader skips it); each step's gradient
is compared with ``reference_gradients`` on that step's batch (the corrupt group counted,
``skip``). Mode 1 (``"data-source"``): slime's own ``sglang_rollout`` hands out from
``StrawqDataSource``, its engine calls answered by ``slime_loop_modes.tiny_generate``; it
has no gradient check (no manifest: slime computes the advantages itself).
"""

from __future__ import annotations

import copy
import functools
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from strawq.testing.slime_train import RolloutManager, _manager_methods, slime_args, train_step

MODES = ("collector", "data-source")
VOCAB = 48


class _Trainer:
    """Stands in for slime's Megatron train actor: the model, its optimizer step and its
    checkpoint (``latest_checkpointed_iteration.txt`` + the state), loaded at start."""

    def __init__(self, args: Any, ckpt: str, seed: int, *, vocab: int = VOCAB) -> None:
        from strawq.testing.reference import TinyPolicy

        torch.manual_seed(seed)
        self.args, self.ckpt = args, ckpt
        self.model = TinyPolicy(vocab=vocab)
        latest = os.path.join(ckpt, "latest_checkpointed_iteration.txt")
        loaded = -1
        if os.path.exists(latest):
            with open(latest, encoding="utf-8") as f:
                loaded = int(f.read())
            self.model.load_state_dict(torch.load(os.path.join(ckpt, f"iter_{loaded}.pt")))
        self.start_rollout_id = loaded + 1

    def train(self, data: dict[str, Any],
              on_step: Callable[[list[int], Any, Any], None]) -> int:
        dp = _slime_mod("slime.utils.dp_schedule")
        gbs = int(self.args.global_batch_size)
        parts, _, _, _ = dp.build_dp_schedule(
            self.args, {"dp_size": 1, "cp_size": 1, "vpp_size": 1,
                        "microbatch_group_size_per_vp_stage": 1},
            data["total_lengths"], global_batch_size=gbs,
            rollout_indices=data["rollout_ids"])
        order = parts[0]
        steps = 0
        temps = [float(self.args.rollout_temperature)] * len(data["tokens"])
        for start in range(0, len(order), gbs):
            idx = [int(i) for i in order[start:start + gbs]]
            before = copy.deepcopy(self.model)
            train_step(data, idx, temps, self.model, objective=self.args.strawq_objective,
                       global_batch_size=gbs)
            on_step(idx, before, self.model)
            with torch.no_grad():
                for q in self.model.parameters():
                    if q.grad is not None:
                        q.sub_(0.05 * q.grad)
            steps += 1
        return steps

    def save_model(self, rollout_id: int) -> None:
        os.makedirs(self.ckpt, exist_ok=True)
        torch.save(self.model.state_dict(), os.path.join(self.ckpt, f"iter_{rollout_id}.pt"))
        with open(os.path.join(self.ckpt, "latest_checkpointed_iteration.txt"), "w",
                  encoding="utf-8") as f:
            f.write(str(rollout_id))


def _slime_mod(name: str) -> Any:
    from strawq.collector.integrations.slime.samples import _slime

    return _slime(name)


class _Manager(RolloutManager):
    """slime's ``RolloutManager`` without engines: its data source and rollout function
    from the flags, ``generate`` = ``_get_rollout_data`` then ``_convert_samples_to_
    train_data`` (slime's own methods), ``save``/``load`` to the data source."""

    def __init__(self, args: Any) -> None:
        super().__init__(args)
        load_function = _slime_mod("slime.utils.misc").load_function
        self.data_source = load_function(args.data_source_path)(args)
        self.generate_rollout = load_function(args.rollout_function_path)
        self._get = _manager_methods()["_get_rollout_data"]

    def generate(self, rollout_id: int) -> tuple[dict[str, Any], list[Any]]:
        samples, _metrics = self._get(self, rollout_id)
        data = self._convert_samples_to_train_data(samples)
        _slime_mod("slime.observability.rollout_data_utils"
                   ).tensorize_rollout_data_for_training(data)
        data["total_lengths"] = [len(t) for t in data["tokens"]]
        return data, samples

    def save(self, rollout_id: int) -> None:
        self.data_source.save(rollout_id)

    def load(self, rollout_id: int | None = None) -> None:
        self.data_source.load(rollout_id)


def _sample_id(s: Any) -> str | None:
    meta = (s.metadata or {}).get("strawq", {}) if isinstance(s.metadata, dict) else {}
    if meta.get("padding"):
        return None
    return f"{s.group_index}:{int(s.index)}"


def _max_rel(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    from strawq.testing.reference import max_relative_error

    return max_relative_error(grads, ref)


def _check(env: Any, samples: list[Any], ids: list[str | None], objective: Any,
           errs: list[float], idx: list[int], before: Any, model: Any) -> None:
    """A step's gradient (in ``model``) against the reference on the step's batch, scored
    with the model as it was before the step (``before``)."""
    ref = env.reference(samples, [ids[i] for i in idx], before, objective)
    if ref is not None:
        grads = {n: (q.grad.detach().clone() if q.grad is not None else torch.zeros_like(q))
                 for n, q in model.named_parameters()}
        errs.append(_max_rel(grads, ref))


def run_slime_loop(mode: str, workdir: str, *, rollouts: int = 4, kill_after: int = 1,
                   groups_per_rollout: int = 3, group_size: int = 4, seed: int = 0,
                   objective: Any = None) -> dict[str, Any]:
    """Run slime's loop in ``mode`` (``"collector"``: strawq generates, slime trains;
    ``"data-source"``: slime generates with ``StrawqDataSource``) for ``rollouts``
    rollouts, killed once after training rollout ``kill_after`` and restarted.

    Returns ``steps`` (training steps that survive in the final model), ``trained_twice``
    and ``missing`` (sample ids trained more than once / never, the corrupt group's
    excepted), ``max_rel_grad_err`` (worst step, against the reference; mode 2), ``restarts``,
    ``start_rollout_ids``, ``index_collisions`` (samples of a rollout sharing a
    ``Sample.index``, which slime's schedule takes as the rollout id) and ``trained``
    (sample ids per rollout, ``group_index:index``).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    from strawq.testing import slime_loop_modes

    setup = slime_loop_modes.SETUPS[mode]
    os.makedirs(workdir, exist_ok=True)
    env = setup(workdir, rollouts=rollouts, groups=groups_per_rollout, group_size=group_size,
                seed=seed)
    args = slime_args(objective, **env.slime_overrides)
    args.strawq_objective = objective
    ckpt = os.path.join(workdir, "ckpt")
    args.save = args.load = ckpt
    survived: dict[int, list[str]] = {}
    errors: list[float] = []
    steps: dict[int, int] = {}
    starts: list[int] = []
    collisions = 0  # samples of one rollout sharing a Sample.index (slime's rollout id)
    for attempt in range(2):
        env.fresh_process()
        trainer = _Trainer(args, ckpt, seed)
        args.start_rollout_id = trainer.start_rollout_id
        starts.append(trainer.start_rollout_id)
        manager = _Manager(args)
        manager.load(args.start_rollout_id - 1)  # train.py: rollout_global_dataset
        env.update_weights(args)
        killed = False
        for rollout_id in range(args.start_rollout_id, rollouts):
            data, samples = manager.generate(rollout_id)
            ids = [_sample_id(s) for s in samples]
            real = [i for i in ids if i is not None]
            collisions += len(real) - len({i.split(":")[1] for i in real})
            errs: list[float] = []

            steps[rollout_id] = trainer.train(data, functools.partial(
                _check, env, samples, ids, objective, errs))
            trained = [i for i in ids if i is not None]
            if attempt == 0 and rollout_id == kill_after:
                killed = True  # killed before the checkpoint: this rollout is not in it
                break
            survived[rollout_id] = trained
            errors += errs
            trainer.save_model(rollout_id)  # --save-interval 1
            manager.save(rollout_id)
            env.update_weights(args)
        if not killed:
            break
    counts = Counter(i for ids in survived.values() for i in ids)
    expected = env.expected_ids()
    return {"steps": sum(steps[r] for r in survived), "trained_twice":
            sum(1 for c in counts.values() if c > 1),
            "missing": len(expected - set(counts)), "unexpected": len(set(counts) - expected),
            "max_rel_grad_err": max(errors) if errors else float("nan"),
            "grad_checks": len(errors), "index_collisions": collisions, "restarts": len(starts) - 1,
            "start_rollout_ids": starts, "trained": {r: sorted(v) for r, v in survived.items()}}


__all__ = ["MODES", "run_slime_loop"]
