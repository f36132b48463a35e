"""slime (THUDM) on strawq: strawq as slime's data source, or as slime's rollout.

slime is given dotted paths into this package (``--data-source-path
strawq.collector.integrations.slime.StrawqDataSource``, ``--rollout-function-path
strawq.collector.integrations.slime.generate_rollout``, ...; ``docs/slime.md``), so it
re-exports every name those flags and the docs use. The modules:

* ``samples`` — slime's ``Sample`` and strawq's records, both ways;
* ``source`` — mode 1, slime generates and strawq keeps the data (``StrawqDataSource``,
  ``slime_rollout``);
* ``adapter`` — mode 2, strawq's producers generate and slime trains
  (``generate_rollout``, ``StrawqBatchSource``, ``begin_weight_update_hook``,
  ``reward_post_process``, ``pad_steps``, ``seq_mean_token_sum_reducer``).

slime's gradient path for the reference-equivalence check is test harness:
``strawq.testing.slime_train``.
"""

from __future__ import annotations

from strawq.collector.integrations.slime.adapter import (ADVANTAGE_ESTIMATORS,
                                                         REWARD_POST_PROCESS,
                                                         SEQ_MEAN_TOKEN_SUM,
                                                         StrawqBatchSource,
                                                         begin_weight_update_hook,
                                                         check_temperature, check_train_args,
                                                         generate_rollout, pad_steps,
                                                         reward_post_process,
                                                         seq_mean_token_sum_reducer)
from strawq.collector.integrations.slime.samples import (EXTRA_FIELDS, META, apply_extras,
                                                         batch_extras, batch_to_samples,
                                                         group_to_samples, run_dir,
                                                         run_versions, samples_to_group)
from strawq.collector.integrations.slime.source import (FILTERED, PRODUCER_PREFIX, TRAINED,
                                                        StrawqDataSource, slime_rollout)

__all__ = ["ADVANTAGE_ESTIMATORS", "EXTRA_FIELDS", "FILTERED", "META", "PRODUCER_PREFIX",
           "REWARD_POST_PROCESS", "SEQ_MEAN_TOKEN_SUM", "TRAINED", "StrawqBatchSource",
           "StrawqDataSource", "apply_extras", "batch_extras", "batch_to_samples",
           "begin_weight_update_hook", "check_temperature", "check_train_args",
           "generate_rollout", "group_to_samples", "pad_steps", "reward_post_process",
           "run_dir", "run_versions", "samples_to_group", "seq_mean_token_sum_reducer",
           "slime_rollout"]
