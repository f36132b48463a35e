"""``strawq status`` in words: a ``Glance`` as lines, and the runs found under a folder."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from strawq.views.glance import Glance, duration, size

#: How deep ``find_runs`` looks under a folder that is not a run.
FIND_DEPTH = 2
#: At most this many runs are listed.
FIND_LIMIT = 200


def _pairs(d: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items())


def _cursor(c: dict[str, Any]) -> str:
    if not c:
        return "none (nothing released yet)"
    bits = [f"next index {c.get('next_index', '?')}"]
    if "pass" in c:
        bits.append(f"pass {c['pass']}")
    bits.append("dataset exhausted" if c.get("exhausted") else "dataset not exhausted")
    if c.get("error"):
        bits.append(f"error: {c['error']}")
    if c.get("unread"):
        bits.append(f"{len(c['unread'])} dataset(s) with unread rows")
    return ", ".join(bits)


def render(g: Glance) -> str:
    """The lines of ``strawq status`` (no Python structures: words and numbers)."""
    st = g.status
    out = [f"run {g.path}  (weight version {st.current_version})"]
    if g.finished is not None:
        out.append(f"  finished: the run drained (last batch {g.finished.get('last_seq', '?')});"
                   " its parts stop by themselves")
    if g.stalls:
        out += [f"  STALLED: {s}" for s in g.stalls]
    elif g.finished is None:
        out.append("  ok: nothing stalled")
    b = g.bracket
    if b is not None and b.open:
        since = f" for {duration(b.open_s)} (by the trainer's clock)" if b.open_s is not None \
            else ""
        out.append(f"  bracket:   open for version {b.version}{since}; acked by "
                   f"{', '.join(b.acked) or 'nobody'}")
        if b.waiting:
            out.append("             waiting for " + ", ".join(
                f"{p} ({why})" for p, why in b.waiting.items()))
    else:
        out.append(f"  bracket:   none open (last resumed version {b.resume_version if b else 0})")
    col = g.collector
    out.append(f"  collector: {col.why() if col else 'none has run'}"
               + (f", epoch {g.collector_epoch}" if g.collector_epoch else ""))
    t = g.trainer
    out.append("  trainer:   unknown" if t is None else
               f"  trainer:   {t.get('state', 'unknown')}"
               + (f" ({t['detail']})" if t.get("detail") else ""))
    states = [p.state for p in g.producers]
    tally = ", ".join(f"{states.count(s)} {s}" for s in dict.fromkeys(
        ("live", "idle", "silent", "unknown", "dead")) if states.count(s))
    out.append(f"  producers: {len(g.producers)}" + (f" ({tally})" if tally else ""))
    if g.producers:
        width = max(len(p.name) for p in g.producers)
        for p in g.producers:
            out.append(f"    {p.name:<{width}}  {p.why()}, {p.leases} lease"
                       + ("" if p.leases == 1 else "s"))
    out.append(f"  tasks:     {_pairs(st.counts)}")
    if st.dropped_by_reason:
        out.append(f"  dropped:   {_pairs(st.dropped_by_reason)}")
    if st.staleness:
        out.append("  staleness of ready groups: mean "
                   f"{st.staleness['ready/mean']:.2f}, max {st.staleness['ready/max']:.0f}")
    if st.oldest:
        out.append(f"  oldest:    {_pairs(st.oldest)}")
    out.append(f"  cursor:    {_cursor(st.cursor)}")
    out.append(f"  batches:   {st.batches_unacked} published and not acknowledged")
    d = st.disk
    if d:
        ratio = d.get("free_ratio")
        share = f" ({ratio * 100:.0f}% of the volume)" if isinstance(ratio, float) else ""
        out.append(f"  disk:      {size(int(d['free_bytes']))} free{share}")
    out.append(f"  quarantined: {st.quarantined} record" + ("" if st.quarantined == 1 else "s")
               + (" (strawq inspect RUN quarantine/NAME shows one)" if st.quarantined else ""))
    if st.stray_files:
        out.append(f"  stray files (not tasks, ignored): {', '.join(st.stray_files[:5])}"
                   + (" ..." if len(st.stray_files) > 5 else ""))
    if d.get("full"):
        from strawq.views.status import full_message

        out.append(f"  disk full: {d['free_bytes']} bytes free; {full_message(g.path)}")
    elif d.get("low"):
        from strawq.views.status import low_message

        out.append(f"  disk low: {low_message(g.path, d)}")
    if st.engines_needing_weights:
        out.append("  engines needing weights (out of rotation until the trainer pushes "
                   f"version {st.current_version}; docs/troubleshooting.md):")
        for url, n in st.engines_needing_weights.items():
            have = "unreadable" if n["engine_version"] is None else n["engine_version"]
            out.append(f"    {url}  reports version {have} (noted by {n['writer']}: "
                       f"{n['reason']})")
        out.append(f"  (an engine removed for good: strawq forget-engine {g.path} URL)")
    if g.watched_s >= 0.05:
        out.append(f"  (heartbeats watched for {duration(g.watched_s)})")
    return "\n".join(out)


def find_runs(path: str, depth: int = FIND_DEPTH, limit: int = FIND_LIMIT) -> list[str]:
    """Run directories (holding ``run.meta``) under ``path``, ``depth`` levels at most."""
    found: list[str] = []
    level = [path]
    for _ in range(depth):
        nxt: list[str] = []
        for d in level:
            try:
                entries = sorted(os.scandir(d), key=lambda e: e.name)
            except OSError:
                continue
            for e in entries:
                if not e.is_dir(follow_symlinks=False) or e.name.startswith("."):
                    continue
                if os.path.isfile(os.path.join(e.path, "run.meta")):
                    found.append(e.path)
                    if len(found) >= limit:
                        return found
                else:
                    nxt.append(e.path)
        level = nxt
    return found


def list_runs(path: str, runs: list[str]) -> tuple[dict[str, Any], str]:
    """(payload, text) of the runs found under a folder that is not a run: each one's weight
    version, task counts, open bracket and quarantine, read without watching."""
    from strawq.storage import open_storage
    from strawq.tasks.queue import RunQueue
    from strawq.views.status import run_status
    from strawq.weights.control import read_state

    rows: list[dict[str, Any]] = []
    lines = [f"{path} is not a run; {len(runs)} run(s) under it "
             f"(strawq status {os.path.join(path, 'NAME')} shows one):"]
    for r in runs:
        name = os.path.relpath(r, path)
        try:
            q = RunQueue.open(open_storage(r, writer_id="cli", read_only=True))
            st = run_status(q)
            bracket = read_state(q.storage)
        except Exception as exc:  # noqa: BLE001 - one unreadable run must not hide the others
            rows.append({"path": r, "error": str(exc)})
            lines.append(f"  {name}  unreadable: {exc}")
            continue
        rows.append({"path": r, "version": st.current_version, "counts": st.counts,
                     "bracket_open": bracket.paused, "quarantined": st.quarantined})
        c = st.counts
        extra = (f"; bracket open for version {bracket.pause_version}" if bracket.paused
                 else "") + (f"; {st.quarantined} quarantined" if st.quarantined else "")
        lines.append(f"  {name}  weight version {st.current_version}; pending "
                     f"{c.get('pending', 0)}, leased {c.get('leased', 0)}, ready "
                     f"{c.get('ready', 0)}, batched {c.get('batched', 0)}{extra}")
    return {"path": path, "runs": rows}, "\n".join(lines)


def watch(look: Callable[[], Glance], show: Callable[[Glance], None], interval_s: float,
          *, sleep: Callable[[float], None] | None = None) -> None:
    """Show a fresh look every ``interval_s`` until interrupted (Ctrl-C ends it quietly)."""
    try:
        while True:
            show(look())
            (sleep or time.sleep)(interval_s)
    except KeyboardInterrupt:
        return
