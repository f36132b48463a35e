"""Trainer-side adapters for other systems, one package each: ``megatron`` (Megatron-core),
``slime`` and ``verl`` (verl's fully-async queue, its resuming rollout client and a verl
trainer reading strawq batches).

They sit on the trainer library (``strawq.collector.trainer``) and the core, never on the
collector process nor on the test harness (``strawq.testing``, where their gradient paths
for the reference-equivalence check live). Megatron-core, slime and verl are imported
lazily, where they are needed (verl's rollout client, ``verl.client``, at its top), and a
missing package is an ``ImportError`` that names the extra to install (``pip install
'strawq[megatron]'``; slime from its source, see ``docs/slime.md``; verl, ``docs/verl.md``).
"""

from __future__ import annotations
