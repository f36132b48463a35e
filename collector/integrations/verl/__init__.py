"""verl on strawq (``docs/verl.md``): modules over the trainer library and the core.

* ``queue`` — ``StrawqMessageQueue``: verl's fully-async ``MessageQueue``, durable
  (``install`` is the one-line switch in verl's Ray workers);
* ``samples`` — ``DurableSampleQueue``: the durable FIFO under ``StrawqMessageQueue`` (its
  records and moves declared in the core's table, ``strawq.tasks.states.VERL_SAMPLES``);
* ``partial`` — ``PartialStore``: verl's partial rollout, durable (saved prefixes);
* ``client`` — ``StrawqFullyAsyncLLMServerClient``: verl's resuming rollout client over
  ``PartialStore`` (imports verl at its top);
* ``reader`` — a verl trainer reading strawq batches (``batch_to_dataproto``,
  ``verl_actor_config``, ``hook_parameter_sync``);
* ``config`` — where verl's config names the queue directory (``queue_dir``).

Nothing is imported here: verl is imported lazily, by the module that needs it. verl's
gradient paths for the reference-equivalence check are test harness:
``strawq.testing.verl_train``.
"""

from __future__ import annotations
