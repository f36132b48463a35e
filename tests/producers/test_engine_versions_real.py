"""Engines on the right weights against the real SGLang 0.5.23 server: the server holds an
older version than the run (as after a restart with an old ``--weight-version``); the
producer keeps it out of rotation and generates nothing, notes it in engines/; the trainer's
repair push (``push_weights``: pause, ``update_weights_from_disk``, continue) brings it back
and every token is stamped with the run's version.

Real tier (marker ``sglang_real``): skipped with the reason without the CPU fixture."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from strawq.testing.real_sglang import RealServer, stale_engine_scenario

pytestmark = [pytest.mark.sglang_real, pytest.mark.slow, pytest.mark.timeout(420)]


def test_real_server_on_an_old_version_is_kept_out_and_repaired(
        sglang_real: RealServer, tmp_path: Path) -> None:
    res = stale_engine_scenario(sglang_real, tmp_path, groups=2, group_size=2, max_new=16)
    assert res.noted and res.waited
    assert res.ready_while_stale == 0, "tokens were generated on the stale engine"
    assert res.repaired == [sglang_real.url]
    assert len(res.groups) == 2
    for grp in res.groups.values():
        for i in range(len(grp.sample_lens)):
            vers = np.asarray(grp.sample(i)["versions"])
            assert len(vers) and set(vers.tolist()) == {res.run_version}
