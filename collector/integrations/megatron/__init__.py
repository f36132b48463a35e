"""Megatron-core on strawq: a reader ``Batch`` → THD micro-batches for one rank.

The adapter is ``strawq.collector.integrations.megatron.adapter`` (``docs/megatron.md``);
its public names are re-exported here, so ``from strawq.collector.integrations.megatron
import MegatronBatcher`` works. Megatron-core is imported lazily, where it is needed.
"""

from __future__ import annotations

from strawq.collector.integrations.megatron.adapter import (COLUMN_NAMES, Align,
                                                            MegatronBatcher, MicroBatch,
                                                            ParallelLayout,
                                                            plan_micro_batches,
                                                            sync_num_micro_batches)

__all__ = ["Align", "COLUMN_NAMES", "MegatronBatcher", "MicroBatch", "ParallelLayout",
           "plan_micro_batches", "sync_num_micro_batches"]
