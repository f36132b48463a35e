"""verl's fully-async trainer fed by strawq's collector: ``strawq_trainer(FullyAsyncTrainer)``.

The user's change is a handful of lines (docs/verl.md, "A verl trainer reading strawq
batches")::

    StrawqTrainer = ray.remote(num_cpus=10)(strawq_trainer(FullyAsyncTrainer))
    trainer = StrawqTrainer.remote(...)              # verl's arguments, unchanged
    ray.get(trainer.attach_strawq.remote(run_dir))   # before set_rollouter / load_checkpoint

``StrawqTrainerMixin`` goes first in the bases and overrides the steps of verl's
``fit_step`` where a strawq batch differs from verl's own:

* ``_fit_generate``: the collector's next batch (``BatchReader`` on the driver, world size
  1: verl dispatches the rows), as verl's ``DataProto`` (``batch_to_dataproto``); past
  ``total_train_steps``, or once the run has finished (``RunFinished``), verl's
  ``TrainingStopException`` ends ``fit`` (its last sync and forced checkpoint follow);
* ``_fit_compute_advantage``: verl's (token-level scores, rollout correction, metrics),
  then the manifest's advantages put back: verl's GRPO over ``uid`` would count a failed
  reward as 0 and give a group of one its reward, where the collector leaves a missing
  reward out and gives a lone sample 0 (``CollectorConfig.advantages`` is the one source);
* ``_update_actor``: the loss denominator of the batch is the manifest's
  ``total_samples`` (a short last batch, a group of one), not the configured mini-batch;
* ``_fit_update_actor``: the batch is acked only when verl trained it (not during
  ``trainer.critic_warmup``);
* ``_save_checkpoint``: ``reader.state_dict()`` is written into verl's checkpoint folder of
  that step (``global_step_<v>/strawq_reader.json``) before verl's tracker file, and
  ``reader.commit()`` follows the tracker (the one order: step, ack, checkpoint, commit);
* ``load_checkpoint``: the reader resumes from the state of the checkpoint verl restores;
* ``set_rollouter``: strawq's weight-update bracket around verl's parameter sync
  (``hook_parameter_sync``: the producers' engines report strawq's version).

verl is not imported here; the base class is the caller's (a Ray actor class is unwrapped
through its ``__ray_actor_class__``). No Ray import either: ``ray.remote`` is the caller's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from typing import Any

from strawq.collector.integrations.verl.reader import (_verl, batch_to_dataproto,
                                                       check_temperature, hook_parameter_sync)
from strawq.collector.trainer.reader import Batch, BatchReader
from strawq.errors import RunFinished

log = logging.getLogger(__name__)

#: the reader's state in verl's checkpoint folder of a step
STATE_FILE = "strawq_reader.json"


def _base_steps(trainer: Any) -> int | None:
    total = getattr(trainer, "total_train_steps", None)
    return int(total) if total else None


def _steps_done(trainer: Any) -> int:
    """Steps in the weights, as verl counts them (a restore resumes at a version's start)."""
    return int(trainer.current_param_version) * int(trainer.trigger_parameter_sync_step) + \
        int(trainer.local_trigger_step) - 1


class StrawqTrainerMixin:
    """The strawq side of a verl fully-async trainer; first in the bases (see the module)."""

    # verl's trainer attributes this mixin reads (set by verl's ``__init__``)
    config: Any
    global_steps: int
    timing_raw: dict[str, Any]
    current_param_version: int
    actor_rollout_wg: Any

    strawq: BatchReader | None = None
    strawq_batch: Batch | None = None
    strawq_after_push: Callable[[int], Any] | None = None
    strawq_fingerprint: Callable[[int], Any] | None = None
    #: seconds ``_fit_generate`` waits for a batch (``BatchTimeout`` after)
    strawq_timeout: float = 3600.0

    # -- wiring ----------------------------------------------------------------------------
    def attach_strawq(self, run_dir: str | BatchReader, *, timeout: float | None = None,
                      after_push: Callable[[int], Any] | None = None,
                      fingerprint: Callable[[int], Any] | None = None,
                      **reader_kwargs: Any) -> None:
        """Read batches of the run at ``run_dir`` (rank 0 of strawq, world size 1). Call it
        before ``set_rollouter`` and ``load_checkpoint``. ``after_push(version)``: runs
        inside strawq's bracket after each verl push; ``fingerprint(version)``: the pushed
        weights' fingerprint, published for attestation (both ``StrawqParameterSync``)."""
        self.strawq_after_push = after_push
        self.strawq_fingerprint = fingerprint
        self.strawq = run_dir if isinstance(run_dir, BatchReader) else \
            BatchReader.open(run_dir, **reader_kwargs)
        self.strawq_batch = None
        if timeout is not None:
            self.strawq_timeout = float(timeout)
        if getattr(self, "checkpoint_manager", None) is not None:
            hook_parameter_sync(self, self.strawq, after_push=after_push,
                                fingerprint=fingerprint)

    def _reader(self) -> BatchReader:
        if self.strawq is None:
            raise RuntimeError("no strawq reader: call attach_strawq(run_dir) on the trainer "
                               "before fit()")
        return self.strawq

    async def set_rollouter(self, rollouter: Any) -> None:
        await super().set_rollouter(rollouter)  # type: ignore[misc]  # builds the manager
        hook_parameter_sync(self, self._reader(), after_push=self.strawq_after_push,
                            fingerprint=self.strawq_fingerprint)

    # -- one step ----------------------------------------------------------------------------
    async def _fit_generate(self, batch: Any = None) -> Any:
        reader = self._reader()
        total = _base_steps(self)
        if total is not None and _steps_done(self) >= total:
            fat = _verl("verl.experimental.fully_async_policy.fully_async_trainer")
            raise fat.TrainingStopException(f"trained the {total} steps asked for")
        marked_timer = _verl("verl.utils.debug").marked_timer
        with marked_timer("gen", self.timing_raw):
            try:
                self.strawq_batch = await asyncio.to_thread(reader.next_batch,
                                                            self.strawq_timeout)
            except RunFinished as end:
                # the run's data is trained: verl's own end of fit (its last weight sync
                # and forced checkpoint, which commits)
                fat = _verl("verl.experimental.fully_async_policy.fully_async_trainer")
                raise fat.TrainingStopException(f"strawq: {end}") from end
        data = batch_to_dataproto(self.strawq_batch, temperature="meta")
        check_temperature(data, self.config.actor_rollout_ref.rollout.temperature)
        return data

    def _fit_compute_advantage(self, batch: Any) -> Any:
        """verl's step (scores, rollout correction, its metrics), the manifest's advantages
        kept: they are the collector's (``CollectorConfig.advantages``), not verl's GRPO."""
        adv = batch.batch["advantages"].clone()
        ret = batch.batch["returns"].clone()
        batch = super()._fit_compute_advantage(batch)  # type: ignore[misc]
        batch.batch["advantages"] = adv
        batch.batch["returns"] = ret
        return batch

    def _update_actor(self, batch: Any) -> Any:
        """verl's update with the batch's own sample count as the loss denominator."""
        totals = batch.meta_info.get("strawq", {})
        samples = totals.get("total_samples")
        wg = self.actor_rollout_wg
        if samples is None:
            return super()._update_actor(batch)  # type: ignore[misc]
        self.actor_rollout_wg = _Denominator(wg, int(samples))
        try:
            return super()._update_actor(batch)  # type: ignore[misc]
        finally:
            self.actor_rollout_wg = wg

    def _fit_update_actor(self, batch: Any) -> Any:
        batch = super()._fit_update_actor(batch)  # type: ignore[misc]
        trained = self.config.trainer.critic_warmup <= self.global_steps
        if trained and self.strawq_batch is not None:
            self._reader().ack(self.strawq_batch)  # the step is taken: ack it
        elif self.strawq_batch is not None:
            log.info("batch %d not trained (critic warmup, step %s): not acked",
                     self.strawq_batch.seq, self.global_steps)
        return batch

    # -- checkpoints ---------------------------------------------------------------------------
    def _checkpoint_folder(self, version: int) -> str:
        return os.path.join(str(self.config.trainer.default_local_dir),
                            f"global_step_{version}")

    def _save_checkpoint(self) -> None:
        reader = self._reader()
        state = reader.state_dict()
        folder = self._checkpoint_folder(int(self.current_param_version))
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, STATE_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(folder, STATE_FILE))
        super()._save_checkpoint()  # type: ignore[misc]  # the model, then verl's tracker
        reader.commit(state)

    async def load_checkpoint(self) -> Any:
        version = await super().load_checkpoint()  # type: ignore[misc]
        if not version:
            return version
        cfg = self.config.trainer
        folder = str(cfg.resume_from_path) if cfg.resume_mode == "resume_path" else \
            self._checkpoint_folder(int(version))
        if not os.path.isabs(folder):
            folder = os.path.join(os.getcwd(), folder)
        path = os.path.join(folder, STATE_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                state = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"verl's checkpoint {folder} holds no {STATE_FILE}: it was not "
                             "saved by a strawq-fed trainer, so which batches it trained is "
                             "unknown; resume from a checkpoint this trainer saved") from None
        self._reader().load_state_dict(state)
        return version


class _Denominator:
    """The actor worker group with the batch's sample count as verl's ``global_batch_size``
    and ``mini_batch_size`` (one optimizer step over the whole strawq batch)."""

    def __init__(self, wg: Any, samples: int) -> None:
        self._wg = wg
        self._samples = samples

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wg, name)

    def update_actor(self, td: Any, *args: Any, **kwargs: Any) -> Any:
        tu = _verl("verl.utils.tensordict_utils")
        tu.assign_non_tensor(td, global_batch_size=self._samples,
                             mini_batch_size=self._samples)
        return self._wg.update_actor(td, *args, **kwargs)


def strawq_trainer(base: Any, name: str = "StrawqTrainer") -> type:
    """``StrawqTrainerMixin`` over ``base`` (verl's ``FullyAsyncTrainer``; a Ray actor class
    is unwrapped through ``__ray_actor_class__``). Wrap the result with ``ray.remote``."""
    cls = getattr(base, "__ray_actor_class__", base)
    return type(name, (StrawqTrainerMixin, cls), {"__module__": __name__})


__all__ = ["STATE_FILE", "StrawqTrainerMixin", "strawq_trainer"]
