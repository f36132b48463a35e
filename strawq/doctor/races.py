"""Races between processes: ``rename``, ``O_EXCL`` and ``RENAME_NOREPLACE`` onto one name.

Claims and exclusive publishes are decided by these operations, so each round starts
several *processes* (threads share one client's caches) on a barrier, alternating
between the path and the peer mount when one is given, and exactly one must win. The
racers are ``multiprocessing`` 'spawn' targets: they stay top-level functions here.
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Mapping, Sequence
from typing import Any

from strawq.doctor.primitives import (
    _errname,
    _exists,
    _fsync_dir,
    _poll,
    _read_small,
    _renameat2_noreplace,
    _write_synced,
)
from strawq.doctor.report import Check, Status


def _race_once(kind: str, base: str, rnd: int, index: int) -> str:
    try:
        if kind == "rename":
            os.rename(os.path.join(base, f"ren.{rnd}"), os.path.join(base, f"ren.{rnd}.w{index}"))
        elif kind == "excl":
            fd = os.open(os.path.join(base, f"excl.{rnd}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                         0o644)
            try:
                os.write(fd, str(index).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        else:
            src = os.path.join(base, f"nr.{rnd}.src{index}")
            try:
                _renameat2_noreplace(src, os.path.join(base, f"nr.{rnd}"))
            except OSError:
                os.unlink(src)
                raise
    except OSError as exc:
        return _errname(exc)
    return "won"


def _race_worker(index: int, base: str, rounds: int, kinds: Sequence[str], barrier: Any,
                 results: Any) -> None:
    """One racer: for every round and kind, wait on the barrier, then try to win."""
    out: dict[str, list[str]] = {k: [] for k in kinds}
    error = None
    try:
        for rnd in range(rounds):
            for kind in kinds:
                if kind == "noreplace":  # each racer publishes its own record
                    _write_synced(os.path.join(base, f"nr.{rnd}.src{index}"),
                                  str(index).encode())
                barrier.wait()
                out[kind].append(_race_once(kind, base, rnd, index))
    except Exception as exc:  # noqa: BLE001 - report anything; never leave the parent waiting
        error = f"{type(exc).__name__}: {exc}"
    results.put((index, out, error))


def judge_race(name: str, what: str, outcomes: Sequence[Sequence[str]],
               losers_may: Sequence[str], problems: Sequence[str] = ()) -> Check:
    """A race check from per-round outcomes (``outcomes[round][racer]``).

    Passes when every round has exactly one ``"won"`` and every loser failed with one of
    ``losers_may`` (errno names); ``problems`` are extra findings (e.g. post-conditions).
    """
    found = list(problems)
    for rnd, row in enumerate(outcomes):
        winners = [i for i, o in enumerate(row) if o == "won"]
        if len(winners) != 1:
            found.append(f"round {rnd}: {len(winners)} winners (racers {winners}), expected 1")
        odd = sorted({o for o in row if o != "won" and o not in losers_may})
        if odd:
            found.append(f"round {rnd}: losers failed with {odd}, expected {list(losers_may)}")
    racers = max((len(r) for r in outcomes), default=0)
    measured = {f"{name}_rounds": float(len(outcomes)), f"{name}_racers": float(racers)}
    if found:
        more = f" (+{len(found) - 5} more)" if len(found) > 5 else ""
        return Check(name, Status.FAIL, f"{what}: " + "; ".join(found[:5]) + more, measured)
    return Check(name, Status.PASS, f"{what}: exactly one winner in each of {len(outcomes)} "
                 f"rounds of {racers} racing processes", measured)


def _run_races(dirs: Sequence[str], rounds: int, processes: int, kinds: Sequence[str],
               ctx: Any, deadline_s: float) -> tuple[dict[str, list[list[str]]], list[str]]:
    """Start ``processes`` racers (alternating over ``dirs``); outcomes per kind and round."""
    barrier = ctx.Barrier(processes, timeout=deadline_s)
    results = ctx.Queue()
    procs = [ctx.Process(target=_race_worker, name=f"strawq-doctor-racer-{i}",
                         args=(i, dirs[i % len(dirs)], rounds, list(kinds), barrier, results),
                         daemon=True) for i in range(processes)]
    for p in procs:
        p.start()
    per_racer: dict[int, dict[str, list[str]]] = {}
    errors: list[str] = []
    end = time.monotonic() + 2 * deadline_s + rounds * len(kinds)  # ~1 s per race, max
    try:
        while len(per_racer) + len(errors) < processes:
            left = end - time.monotonic()
            if left <= 0:
                errors.append(f"only {len(per_racer)} of {processes} racers reported in time")
                break
            try:
                index, out, error = results.get(timeout=min(left, 1.0))
            except queue.Empty:  # check for dead racers, then wait again
                dead = [p.name for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    errors.append(f"racer processes died: {dead}")
                    break
                continue
            if error:
                errors.append(f"racer {index}: {error}")
            per_racer[index] = out
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    table: dict[str, list[list[str]]] = {}
    for kind in kinds:
        table[kind] = [[per_racer[i][kind][r] if i in per_racer and r < len(per_racer[i][kind])
                        else "missing" for i in range(processes)] for r in range(rounds)]
    return table, errors


def _race_postconditions(scratch: str, table: Mapping[str, list[list[str]]]
                         ) -> dict[str, list[str]]:
    """The file system after the race must agree with who was told they won."""
    found: dict[str, list[str]] = {k: [] for k in table}
    for kind, rows in table.items():
        for rnd, row in enumerate(rows):
            winners = [i for i, o in enumerate(row) if o == "won"]
            if kind == "rename":
                if os.path.lexists(os.path.join(scratch, f"ren.{rnd}")):
                    found[kind].append(f"round {rnd}: the source still exists after the race")
                dsts = sorted(n for n in os.listdir(scratch) if n.startswith(f"ren.{rnd}.w"))
                if dsts != [f"ren.{rnd}.w{i}" for i in winners]:
                    found[kind].append(f"round {rnd}: destinations {dsts} but winners {winners}")
            else:
                target = os.path.join(scratch, f"{'excl' if kind == 'excl' else 'nr'}.{rnd}")
                content = _read_small(target)
                if len(winners) == 1 and content != str(winners[0]):
                    found[kind].append(f"round {rnd}: target holds {content!r}, winner was "
                                       f"racer {winners[0]}")
    return found


#: race kind -> (check name, what is raced, the errnos a loser may fail with)
_RACE_CHECKS = {
    "rename": ("atomic_rename", "rename(src -> own dst)", ["ENOENT"]),
    "excl": ("exclusive_create", "open(O_CREAT|O_EXCL)", ["EEXIST"]),
    "noreplace": ("noreplace_publish", "renameat2(RENAME_NOREPLACE) onto one name",
                  ["EEXIST", "ENOENT"]),
}


def _race_checks(dirs: Sequence[str], rounds: int, processes: int, kinds: Sequence[str],
                 ctx: Any, deadline: float) -> list[Check]:
    """Race ``kinds`` in ``dirs[0]`` (and through the peer ``dirs[1]`` when given); one
    check per kind, judged on the outcomes and on what the directory holds afterwards."""
    scratch = dirs[0]
    checks: list[Check] = []
    for rnd in range(rounds):
        _write_synced(os.path.join(scratch, f"ren.{rnd}"), b"claim me")
    _fsync_dir(scratch)
    if len(dirs) > 1:  # racers on the peer must see the sources before racing
        _poll({f"ren.{r}": 0.0 for r in range(rounds)},
              lambda n: _exists(os.path.join(dirs[1], n)), deadline)
    where = " across two clients" if len(dirs) > 1 else ""
    try:
        table, errors = _run_races(dirs, rounds, processes, kinds, ctx, deadline_s=60.0)
    except OSError as exc:  # e.g. cannot start processes
        checks.append(Check("races", Status.FAIL, f"could not run the racing processes: {exc}"))
        table, errors = {}, []
    post = _race_postconditions(scratch, table)
    for kind, rows in table.items():
        name, what, losers = _RACE_CHECKS[kind]
        checks.append(judge_race(name, what + where, rows, losers, errors + post[kind]))
    return checks
