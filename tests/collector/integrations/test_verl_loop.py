"""verl's own training loop (``FullyAsyncTrainer.fit_step``, ``load_checkpoint``, ``fit``)
with the shipped ``strawq_trainer`` class over strawq batches holding a failed reward, a
tool-failed sample, a group of one and a corrupt (skipped) group: every sample trained
once across a kill and a restart, each step's gradient the single-process reference's
(``strawq.testing.verl_loop``). The class docs/verl.md showed before fails both."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl", reason="verl not installed: pip install 'verl==0.9.1' "
                                   "(docs/verl.md)")

from strawq.collector.integrations.verl.reader import batch_to_dataproto, check_temperature  # noqa: E402
from strawq.collector.integrations.verl.trainer import STATE_FILE  # noqa: E402
from strawq.collector.trainer.reader import BatchReader  # noqa: E402
from strawq.testing.verl_loop import run_verl_loop  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
TOL = 1e-5


def _old_documented_class() -> type:
    """The ``StrawqTrainer`` docs/verl.md showed before (without its ``ray.remote``): it
    overrode ``_fit_generate`` and ``_fit_update_actor`` only."""
    from verl.experimental.fully_async_policy.fully_async_trainer import FullyAsyncTrainer
    from verl.utils.debug import marked_timer

    base: Any = FullyAsyncTrainer.__ray_actor_class__

    class OldStrawqTrainer(base):  # type: ignore[misc,valid-type]
        def attach_strawq(self, run_dir: Any, **_kw: Any) -> None:
            self.strawq = run_dir if isinstance(run_dir, BatchReader) else \
                BatchReader.open(run_dir)
            self.strawq_batch = None

        async def _fit_generate(self, batch: Any = None) -> Any:
            if self.current_param_version * self.trigger_parameter_sync_step + \
                    self.local_trigger_step - 1 >= self.total_train_steps:
                from verl.experimental.fully_async_policy.fully_async_trainer import (
                    TrainingStopException,
                )
                raise TrainingStopException("done")  # the test's end of the stream
            with marked_timer("gen", self.timing_raw):
                self.strawq_batch = await asyncio.to_thread(self.strawq.next_batch, 30.0)
            data = batch_to_dataproto(self.strawq_batch, temperature="meta")
            check_temperature(data, self.config.actor_rollout_ref.rollout.temperature)
            return data

        def _fit_update_actor(self, batch: Any) -> Any:
            batch = super()._fit_update_actor(batch)
            self.strawq.ack(self.strawq_batch)
            return batch

    return OldStrawqTrainer


def test_verls_loop_trains_every_sample_once_at_the_reference_gradient(tmp_path: Path) -> None:
    """Three steps through verl's ``fit_step`` (a checkpoint at version 1, trigger 2), a
    kill after the third, verl's ``load_checkpoint``, verl's ``fit`` to the sixth batch and
    its forced final checkpoint."""
    got = run_verl_loop(str(tmp_path), batches=6, before_kill=3)
    assert got["seqs"] == [1, 2, 3, 4, 5, 6]  # batch 3, trained before the kill, replayed
    assert got["steps"] == 6 and got["trained_twice"] == 0 and got["missing"] == 0
    assert got["skipped"] == [got["corrupt"]]
    assert got["max_rel_grad_err"] < TOL, got["errors"]
    assert 9 in got["denominators"]  # the batch with the group of one: 4 + 4 + 1 samples
    assert got["committed"] == got["last_batch"]  # the forced final checkpoint, committed
    assert (tmp_path / "ckpt" / "global_step_3" / STATE_FILE).exists()


def test_the_old_documented_class_trains_verls_advantages(tmp_path: Path) -> None:
    """The earlier class (no kill here): verl's GRPO re-run over ``uid`` replaces the
    manifest's advantages (a failed reward read as 0, a group of one given its reward), and
    the configured mini-batch divides the batch holding a group of one."""
    got = run_verl_loop(str(tmp_path), trainer_cls=_old_documented_class(), batches=4,
                        kill=False)
    assert got["steps"] == 4
    assert got["max_rel_grad_err"] > 1e-2, got["errors"]
    assert set(got["denominators"]) == {12}


def test_the_old_documented_class_trains_twice_after_a_restart(tmp_path: Path) -> None:
    """It saved no reader state: restored by verl, its reader replays every batch since
    the run's first commit (none), so the steps the checkpoint holds are trained again."""
    got = run_verl_loop(str(tmp_path), trainer_cls=_old_documented_class(), batches=4,
                        before_kill=3)
    assert got["trained_twice"] > 0


def _one_trainer(tmp_path: Path, **trainer: Any) -> tuple[Any, Any, Any]:
    from verl.experimental.fully_async_policy import fully_async_trainer as fat

    from strawq.collector.integrations.verl.reader import verl_actor_config
    from strawq.collector.integrations.verl.trainer import strawq_trainer
    from strawq.testing.reference import Objective, TinyPolicy
    from strawq.testing.verl_loop import ActorGroup, make_trainer, publish_run, verl_config

    run_dir, _info = publish_run(str(tmp_path), batches=3)
    config = verl_config(str(tmp_path / "ckpt"), trigger=1, save_freq=1, batch_groups=3,
                         group_size=4)
    config.trainer.update(trainer)
    group = ActorGroup(TinyPolicy(), verl_actor_config(Objective(), batch_samples=12,
                                                       rollout_n=4), 0.0, lambda: None)
    return fat, make_trainer(strawq_trainer(fat.FullyAsyncTrainer), config, run_dir, group), \
        group


def test_a_batch_verl_does_not_train_is_not_acked(tmp_path: Path) -> None:
    """During ``trainer.critic_warmup`` verl skips the actor update: the batch stays
    unacked (a restart delivers it again)."""
    from unittest import mock

    from strawq.delivery.batches import BatchStore
    from strawq.testing.verl_loop import _ray_get

    fat, t, group = _one_trainer(tmp_path, critic_warmup=5)
    with mock.patch.object(fat, "ray", mock.Mock(get=_ray_get)):
        t.set_total_train_steps(3)
        t.global_steps = 1
        asyncio.run(t.fit_step())
    assert group.steps == [] and t.strawq_batch.seq == 1
    assert 1 not in BatchStore(t.strawq.queue).batch_seqs()[1]
    t.strawq.close()


def test_a_verl_checkpoint_without_the_readers_state_is_refused(tmp_path: Path) -> None:
    """A checkpoint this trainer did not save says nothing about which batches it holds."""
    fat, t, _group = _one_trainer(tmp_path)
    step = tmp_path / "ckpt" / "global_step_1" / "actor"
    step.mkdir(parents=True)
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("1")
    import torch

    torch.save({"model": _group.model.state_dict(), "trained": 0}, step / "model.pt")
    with pytest.raises(ValueError, match="strawq_reader.json"):
        asyncio.run(t.load_checkpoint())
    t.strawq.close()


def test_the_end_of_the_run_ends_verls_fit(tmp_path: Path) -> None:
    """Once the run has finished (the collector's ``finished`` record, every batch read),
    ``_fit_generate`` raises verl's ``TrainingStopException``: verl's ``fit`` ends as at
    its own end of data, not with an error after the reader's timeout."""
    from strawq.tasks.finished import mark_finished

    fat, t, _group = _one_trainer(tmp_path)
    for _ in range(3):  # every batch the run published, read and acked
        t.strawq.ack(t.strawq.next_batch(5.0))
    mark_finished(t.strawq.queue.storage, 3, 1)
    t.timing_raw = {}
    with pytest.raises(fat.TrainingStopException, match="finished"):
        asyncio.run(t._fit_generate())
    t.strawq.close()
