"""The release model: which rows a run releases, pass by pass, written out plainly.

This module is the executable statement of what the feeder releases from a dataset over
several passes (``QueueConfig.num_epochs``), from a mixture (``strawq.data.mixture``), with the
zero-variance skip (``QueueConfig.skip_zero_variance``) and after a resume
(docs/datasets.md, "What is released: the model"). It is an oracle: it computes the answer
the slow, obvious way and never imports the feeder, so a run can be checked row by row
against it (``tests/collector/test_release_combinations.py``, ``bench/planner.py``).

**The passes.** A dataset is K sources (a plain dataset: one source, weight 1). Source k
has ``L_k`` rows and an integer weight ``w_k`` (``strawq.data.mixture.integer_weights``); the
interleave is ``strawq.data.mixture.Layout`` (the pattern is the spec, reused here). Pass e
starts each source at its own offset ``o_k(e)``, ``o_k(0) = 0``: mixture row r of the pass
is source ``k, j = layout.locate(r)``, that source's row ``(o_k(e) + j) mod L_k``, task
index ``base_e + r``. The pass holds ``N_e`` rows:

* ``first_exhausted``: ``N_e = min_k layout.position(k, L_k - o_k(e))``, the first mixture
  row a source could only give by wrapping around;
* ``all_exhausted``: ``N_e = max_k layout.position(k, L_k - 1) + 1``: every source gives
  at least ``L_k`` rows, one that runs out first wraps (repeats rows in the pass).

Then ``o_k(e+1) = (o_k(e) + layout.count(N_e, k)) mod L_k`` and ``base_{e+1} = base_e +
N_e``: a source's rows not reached in one pass come first in the next. After the last
pass, source k gave ``C_k`` rows in all; when ``C_k < L_k`` its rows ``[C_k, L_k)`` were
never reached and the final cursor names them (``unread``).

**What happens to a released row** (``Behaviour``): its group gets the rewards the test
chose for it; a producer's zero-variance drop or its source's filter may drop it
(``outcome``), else it is trained. A bad row (malformed JSON, no prompt) is never released.

**The zero-variance skip.** At the release of pass ``e >= 1`` a row (source k, row j) is
skipped when the newest earlier attempt of the same (k, j) that has rewards (trained, or
dropped by a filter or a zero-variance drop) had two or more samples, every reward valid
and all equal, and was fewer than ``revisit`` appearances of the row ago. An appearance is
a pass in which the row came up, released or skipped, the previous one being 1 ago;
"earlier" means of an earlier pass (a row that comes up twice in one ``all_exhausted``
pass is judged by the passes before it both times). A skipped row is not replaced.
Whether the history holds an attempt when a release is planned depends on timing (gc
records attempts as it retires them), so ``check_skips`` checks every skip is justified
and, only for a run that trains each row before the next is released (``exact``), that
no row was released that the rule skips.

**A resume from a checkpoint's cursor** (``Resume``): the rows in flight at the checkpoint
are released again under their task indexes, nothing the checkpoint trained is released
again, passes keep counting, and the history (in the deleted queue state) is forgotten:
skips after the resume are judged by attempts made after it.

Each ``check_*`` function returns readable mismatches (an empty list: the run agrees);
each starts with a bracketed kind (``[row]``, ``[cursor]``, ``[skip]`` ...); ``check_run``
runs them all.

The model lives in three modules, each exported here: the passes
(``strawq.testing.release_passes``), what happens to a released row
(``strawq.testing.release_outcomes``) and the checks of a run
(``strawq.testing.release_checks``).
"""

from __future__ import annotations

from strawq.testing.release_checks import (Observed, Resume, Seen, check_bad_rows, check_cursor,
                                           check_outcomes, check_passes, check_resume,
                                           check_rows, check_run, check_shares, check_skips,
                                           check_unread, ideal_run)
from strawq.testing.release_outcomes import (TRAINED, ZERO_VARIANCE, Behaviour, agreeing,
                                             outcome, skip_reason, valid)
from strawq.testing.release_passes import (STOPPING_STRATEGIES, FilterFn, ModelPass, ModelRow,
                                           ReleaseModel, Source)

__all__ = ["STOPPING_STRATEGIES", "TRAINED", "ZERO_VARIANCE", "Behaviour", "FilterFn",
           "ModelPass", "ModelRow", "Observed", "ReleaseModel", "Resume", "Seen", "Source",
           "agreeing", "check_bad_rows", "check_cursor", "check_outcomes", "check_passes",
           "check_resume", "check_rows", "check_run", "check_shares", "check_skips",
           "check_unread", "ideal_run", "outcome", "skip_reason", "valid"]
