"""Hypothesis profiles of the decoder fuzz tests (docs/security.md).

``ci`` (the default) keeps the whole folder to well under a minute; ``STRAWQ_FUZZ_PROFILE=
long`` runs many more inputs per decoder for a bench run (``STRAWQ_FUZZ_EXAMPLES`` per
test, default 5000). Failures found are kept as
``@example`` cases on the tests, so they run under every profile.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, derandomize=False, database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=100, **_COMMON)  # type: ignore[arg-type]
settings.register_profile("long", max_examples=int(os.environ.get("STRAWQ_FUZZ_EXAMPLES", 5000)),
                          **_COMMON)  # type: ignore[arg-type]
settings.load_profile(os.environ.get("STRAWQ_FUZZ_PROFILE", "ci"))
