"""Cross-client visibility: how long another client of the volume sees an old view.

Caches on a second client (JuiceFS metadata TTLs, NFS attribute caches) decide how soon
a new task is found and a claimed one disappears there. These windows are reported, not
judged harshly: above ``STALE_WARN_S`` is a warning, only "never" fails.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from strawq.doctor.primitives import _exists, _frame, _fsync_dir, _poll, _publish
from strawq.doctor.report import Check, Status

#: A visibility/staleness window above this is a warning: the queue is designed for <= 1 s
#: (JuiceFS default TTLs); longer caches mean slower hand-offs, not lost work.
STALE_WARN_S = 2.0


def _percentiles(prefix: str, xs: Sequence[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)

    def rank(q: float) -> float:
        return s[max(0, math.ceil(q * len(s)) - 1)]

    return {f"{prefix}_p50_s": rank(0.5), f"{prefix}_p99_s": rank(0.99), f"{prefix}_max_s": s[-1]}


def _window_check(name: str, what: str, delays: Mapping[str, float], missing: Sequence[str],
                  prefix: str, deadline_s: float) -> Check:
    measured = _percentiles(prefix, list(delays.values()))
    if missing:
        return Check(name, Status.FAIL, f"{what}: {len(missing)} of {len(delays) + len(missing)}"
                     f" still not seen after {deadline_s:g}s (e.g. {missing[0]})", measured)
    worst = measured.get(f"{prefix}_max_s", 0.0)
    text = (f"{what}: p50 {measured[f'{prefix}_p50_s'] * 1e3:.1f} ms, p99 "
            f"{measured[f'{prefix}_p99_s'] * 1e3:.1f} ms, max {worst * 1e3:.1f} ms over "
            f"{len(delays)} files")
    if worst > STALE_WARN_S:
        return Check(name, Status.WARN, text + f" (above {STALE_WARN_S:g}s: longer metadata "
                     "caches than the queue is tuned for)", measured)
    return Check(name, Status.PASS, text, measured)


def _reads_in(directory: str, expected: bytes, name: str) -> bool:
    return _reads(os.path.join(directory, name), expected)


def _reads(path: str, expected: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read() == expected
    except OSError:
        return False


def _visibility_checks(a: str, b: str, samples: int, deadline_s: float) -> list[Check]:
    """New, deleted and replaced files on client A as seen from client B."""
    checks: list[Check] = []
    os.makedirs(os.path.join(a, "vis"))
    _fsync_dir(a)
    vis_b = os.path.join(b, "vis")
    _, missing = _poll({"vis": time.perf_counter()}, lambda _: os.path.isdir(vis_b), deadline_s)
    if missing:
        return [Check("visibility_new", Status.FAIL, f"directory made on {a} not visible on "
                      f"the peer after {deadline_s:g}s")]

    # New files: B has listed the directory and looked the name up (negative) beforehand.
    listed: dict[str, float] = {}
    read: dict[str, float] = {}
    late: list[str] = []
    for i in range(samples):
        name, data = f"new.{i}", _frame(os.urandom(512))
        os.listdir(vis_b)
        _exists(os.path.join(vis_b, name))
        _publish(a, f"vis/{name}", data)
        t0 = time.perf_counter()
        got_l, miss_l = _poll({name: t0}, lambda n: n in os.listdir(vis_b), deadline_s)
        got_r, miss_r = _poll({name: t0}, functools.partial(_reads_in, vis_b, data),
                              deadline_s)
        listed.update(got_l)
        read.update(got_r)
        late += miss_l + miss_r
    check = _window_check("visibility_new", "a file published on the mount, listed and read "
                          "intact on the peer", read, sorted(set(late)), "visible_new",
                          deadline_s)
    check.measured.update({f"visible_new_list_{k[len('visible_new_'):]}": v
                           for k, v in _percentiles("visible_new", list(listed.values())).items()})
    checks.append(check)

    # Deleted names: B reads each file (warm entry and attribute caches) right before A
    # deletes it; a watcher thread polls B while A works through the batch.
    vis_a = os.path.join(a, "vis")

    def delete(name: str) -> None:
        _reads(os.path.join(vis_b, name), b"")
        os.unlink(os.path.join(vis_a, name))

    gone, missing = _mutate_and_watch([f"new.{i}" for i in range(samples)], delete,
                                      lambda n: not _exists(os.path.join(vis_b, n)), deadline_s)
    still_listed = sorted(set(gone) & set(os.listdir(vis_b)))
    check = _window_check("visibility_delete", "a name deleted on the mount, gone on the "
                          "peer", gone, missing, "visible_delete", deadline_s)
    if still_listed:
        check = Check(check.name, Status.FAIL, f"{check.detail}; but still listed on the peer "
                      f"after stat said gone: {still_listed[:3]}", check.measured)
    checks.append(check)

    # Replaced files (the queue never does this; it measures the metadata-cache staleness).
    old = _frame(b"old" * 100)
    new_data = {f"rep.{i}": _frame(os.urandom(300)) for i in range(samples)}
    for name in new_data:
        _publish(a, f"vis/{name}", old)
    _poll(dict.fromkeys(new_data, 0.0), lambda n: _reads(os.path.join(vis_b, n), old),
          deadline_s)

    def replace(name: str) -> None:
        _reads(os.path.join(vis_b, name), b"")  # B warms its caches right before the swap
        _publish(a, f"vis/{name}", new_data[name])

    fresh, missing = _mutate_and_watch(list(new_data), replace,
                                       lambda n: _reads(os.path.join(vis_b, n), new_data[n]),
                                       deadline_s)
    checks.append(_window_check("visibility_replace", "a file replaced by rename on the mount: "
                                "stale window on the peer (metadata-cache staleness)", fresh,
                                missing, "stale_replace", deadline_s))
    return checks


def _mutate_and_watch(names: Sequence[str], mutate: Callable[[str], None],
                      probe: Callable[[str], bool], deadline_s: float
                      ) -> tuple[dict[str, float], list[str]]:
    """Apply ``mutate`` to each name in turn while a thread polls ``probe`` for each one
    already mutated; the delay of a name runs from the end of its mutation.

    Watching concurrently keeps a batch of samples from adding its own length to every
    window (sequential samples would cost a full cache TTL each).
    """
    lock = threading.Lock()
    started: dict[str, float] = {}
    done: dict[str, float] = {}
    mutated = threading.Event()

    def watch() -> None:
        end = None
        while end is None or time.perf_counter() < end:
            if end is None and mutated.is_set():
                end = time.perf_counter() + deadline_s
            with lock:
                todo = [(n, t) for n, t in started.items() if n not in done]
            if mutated.is_set() and not todo:
                return
            for name, t0 in todo:
                if probe(name):
                    done[name] = max(0.0, time.perf_counter() - t0)
            time.sleep(0.0002)

    watcher = threading.Thread(target=watch, name="strawq-doctor-watch", daemon=True)
    watcher.start()
    try:
        for name in names:
            mutate(name)
            with lock:
                started[name] = time.perf_counter()
    finally:
        mutated.set()
        watcher.join(deadline_s + 5)
    return dict(done), sorted(set(names) - set(done))


def _peer_volume(scratch: str, peer_scratch: str, deadline_s: float
                 ) -> tuple[Check, str | None]:
    """Whether the scratch directory shows up through the peer, and how soon.

    Returns the ``peer_volume`` check and ``peer_scratch``, or None when it never appeared
    (the peer is not the same directory of the same volume: nothing cross-client can run).
    """
    seen, _ = _poll({"scratch": time.perf_counter()},
                    lambda _: os.path.isdir(peer_scratch), deadline_s)
    if not seen:
        return Check("peer_volume", Status.FAIL, f"{peer_scratch} did not appear within "
                     f"{deadline_s:g}s after creating {scratch}: the peer is not the same "
                     "directory of the same volume"), None
    same = os.stat(scratch).st_dev == os.stat(peer_scratch).st_dev
    return Check(
        "peer_volume", Status.WARN if same else Status.PASS,
        ("the peer is the same mount as the path (same device): cross-client numbers "
         "describe one client only" if same else "the peer is a second client of the "
         "same volume") + f"; scratch dir seen there after "
        f"{seen['scratch'] * 1e3:.1f} ms", {"peer_first_visible_s": seen["scratch"]}), peer_scratch
