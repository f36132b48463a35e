"""Test helpers shipped with strawq, so that backends and deployments can check themselves.

* ``strawq.testing.conformance`` — ``StorageConformance``: subclass it, implement
  ``make_storage(tmp_path)``, and a backend gets the whole storage contract as tests.
* ``strawq.testing.audit`` — an auditor that reads a run directory and checks the queue
  invariants of docs/design.md (every released index in exactly one state, no torn record visible,
  nothing duplicated), and a Jepsen-style total-queue checker.
* ``strawq.testing.factories`` — small builders: datasets, groups.
* ``strawq.testing.crash`` — storage wrappers that ``SIGKILL`` the process at a chosen
  mutating operation (also *inside* ``publish``), and a worker script for kill tests.
* ``strawq.testing.reference`` — the trainer side's oracle: a published batch's loss and
  gradients in one process (docs/design.md, invariant 11); ``strawq.testing.slime_train``
  and ``strawq.testing.verl_train`` — the slime and verl adapters' gradient paths checked
  against it.

These modules may import pytest; the oracle modules import torch (slime and verl lazily);
this package imports only ``audit`` and ``factories``, neither of which imports Ray, torch or
HTTP clients.
"""

from __future__ import annotations

from strawq.testing.audit import Audit, QueueCheck, audit_run, check_total_queue
from strawq.testing.factories import make_group, write_jsonl

__all__ = ["Audit", "QueueCheck", "audit_run", "check_total_queue", "make_group",
           "write_jsonl"]
