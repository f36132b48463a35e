"""Soak of what the feeder releases: random combinations of the data-side features, each run
through the real collector, trainer reader and queue, every row checked against the
release model (``strawq.testing.release_model``).

    python bench/planner.py              # 300 combinations, sources of up to 40 rows
    python bench/planner.py --quick      # 12 combinations of the CI test's size (seconds)
    python bench/planner.py --seed 7 --combinations 500 --verbose

A combination is what ``tests/collector/test_release_combinations.py`` draws (its driver,
``tests/collector/release_driver.py``): 1-3 sources (a plain dataset or a mixture with
weights, bad rows and a filter on some), either stopping strategy, 1-4 passes, the
zero-variance skip and its revisit window, longest-first, the producers' zero-variance
drop, the group size, each row's rewards pass by pass, the collector's sizing (lockstep, for
exact skip sets, or several groups ahead of training), and one crash or none: a new
collector on the same run directory, or a resume from the trainer's checkpoint on a deleted
one. Here they are drawn from ``random.Random(seed)``, larger and more of them.

Anchor, measured in the same run: the plain case (one dataset, one pass, no crash) of as
many rows as the longest run, as wall time per row (best of 3); the longest run and the
whole soak are given as a ratio to it (what the combinations cost per row beyond the plain
case: passes, lockstep sizing, crashes, resumes, the history).

The last line is ``planner: combinations = N, rows checked = R, mismatches with the model =
M``; the exit code is 1 when M > 0 (the mismatches are listed by kind above it).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.collector.release_driver import (RandomDraw, RunResult, Scenario,  # noqa: E402
                                            anchor_scenario, draw_scenario, report,
                                            run_scenario)


def _run(scn: Scenario, root: Path) -> RunResult:
    with tempfile.TemporaryDirectory(prefix="strawq-bench-planner-", dir=root) as d:
        return run_scenario(scn, Path(d))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--combinations", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-rows", type=int, default=None, help="rows per source, at most")
    ap.add_argument("--max-total", type=int, default=None, help="rows per run, at most")
    ap.add_argument("--verbose", action="store_true", help="one line per combination")
    args = ap.parse_args()
    logging.basicConfig(level=logging.CRITICAL)  # resumes warn by design
    n = args.combinations or (12 if args.quick else 300)
    max_rows = args.max_rows or (15 if args.quick else 40)
    max_total = args.max_total or (60 if args.quick else 240)
    root = Path(tempfile.gettempdir())
    print(f"setup: {n} combinations from seed {args.seed}, sources of 1-{max_rows} rows, "
          f"runs of at most {max_total} rows; cores={os.cpu_count()}")

    t0 = time.perf_counter()
    results = []
    for i in range(n):
        scn = draw_scenario(RandomDraw(random.Random(args.seed * 1_000_003 + i)),
                            max_rows=max_rows, max_total=max_total)
        res = _run(scn, root)
        results.append(res)
        if args.verbose:
            print(f"{i:4d} {res.wall_s:6.2f}s {res.rows:4d} rows {len(res.mismatches):4d} "
                  f"mismatches | {scn.describe()}")
    soak_s = time.perf_counter() - t0
    longest = max(results, key=lambda r: r.wall_s)
    anchor = min((_run(anchor_scenario(max(longest.rows, 1)), root) for _ in range(3)),
                 key=lambda r: r.wall_s)  # best of 3
    if anchor.mismatches:
        print(report(anchor))
    per_row = anchor.wall_s / anchor.rows

    failed = [r for r in results if r.mismatches]
    kinds: Counter[str] = Counter()
    combos: Counter[str] = Counter()
    for r in failed:
        seen = {m.split("]", 1)[0] + "]" for m in r.mismatches}
        combos.update(seen)
        kinds.update(m.split("]", 1)[0] + "]" for m in r.mismatches)
    for r in failed[:5]:
        print(report(r, per_kind=2))
    if failed:
        print(f"failing combinations: {len(failed)} of {n}; by kind (combinations, "
              f"mismatches): " + ", ".join(f"{k} {combos[k]}, {kinds[k]}"
                                           for k in sorted(combos)))
    rows = sum(r.rows for r in results)
    mismatches = sum(len(r.mismatches) for r in results) + len(anchor.mismatches)
    crashes = Counter(r.crashed or "none" for r in results)
    print(f"crashes: {dict(sorted(crashes.items()))}; lockstep runs "
          f"{sum(r.scenario.lockstep for r in results)}; mixtures "
          f"{sum(not r.scenario.plain for r in results)}")
    print(f"anchor: one dataset, one pass, {anchor.rows} rows: {anchor.wall_s:.2f} s = "
          f"{1e3 * per_row:.1f} ms/row")
    print(f"longest run: {longest.rows} rows, {longest.steps} loop passes, "
          f"{longest.wall_s:.2f} s = {1e3 * longest.wall_s / longest.rows:.1f} ms/row = "
          f"{longest.wall_s / longest.rows / per_row:.2f}x the anchor | "
          f"{longest.scenario.describe()}")
    print(f"soak: {soak_s:.1f} s for {rows} rows = {1e3 * soak_s / max(rows, 1):.1f} ms/row = "
          f"{soak_s / max(rows, 1) / per_row:.2f}x the anchor")
    print(f"planner: combinations = {n}, rows checked = {rows}, mismatches with the model = "
          f"{mismatches}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
