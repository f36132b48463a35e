"""Trainer-side adapters for other systems: ``megatron`` (Megatron-core) and ``slime``.

Both modules import torch; Megatron-core and slime are imported lazily, where they are
needed, and a missing package is an ``ImportError`` that names the extra to install
(``pip install 'strawq[megatron]'``; slime from its source, see ``docs/slime.md``).
"""

from __future__ import annotations
