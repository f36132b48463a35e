"""Pictures a person looks at after a run: timeline, reward curve, staleness histogram."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from strawq.demo.schedule import ScheduleResult  # noqa: E402


@dataclass
class Samples:
    """Busy fractions sampled over time: name -> [(t, busy in 0..1)]."""

    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def add(self, name: str, t: float, busy: float) -> None:
        self.series.setdefault(name, []).append((t, busy))


#: queue events drawn as ticks on the timeline's "queue" row, bottom to top
MARKS = ("release", "claim", "ready", "batch", "ack", "pause", "resume")
MARK_COLORS = {"release": "#756bb1", "claim": "#9e9ac8", "ready": "#31a354",
               "batch": "#2b8cbe", "ack": "#636363", "pause": "#e34a33", "resume": "#fdae6b"}


def timeline(path: str, res: ScheduleResult, samples: Samples, *, title: str,
             marks: dict[str, list[float]] | None = None,
             gaps: Sequence[tuple[float, float]] | None = None) -> str:
    """Who is busy over time; with ``marks``, a row of queue events (one tick per
    release, claim, ready group, batch, ack, pause, resume); ``gaps`` (dead time: the
    trainer waits and no engine runs) are shaded red across every row."""
    t0 = res.started
    rows = sorted(samples.series)
    top = len(rows) + (1 if marks else 0)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.6 * (top + 1)))
    for gs, ge in gaps or ():
        ax.axvspan(gs - t0, ge - t0, color="#fb6a4a", alpha=0.35, lw=0)
    if marks:
        lane = 0.8 / len(MARKS)
        base = len(rows) + 1.1
        for k, what in enumerate(MARKS):
            ts = [t - t0 for t in marks.get(what, [])]
            if ts:
                ax.vlines(ts, base + k * lane, base + (k + 1) * lane,
                          color=MARK_COLORS[what], lw=0.6)
    colors = {"wait": "#d9d9d9", "train": "#2b8cbe", "update": "#e34a33"}
    for iv in res.intervals:
        ax.broken_barh([(iv.start - t0, iv.end - iv.start)], (0.1, 0.8),
                       color=colors.get(iv.what, "grey"))
    for i, name in enumerate(rows, start=1):
        pts = samples.series[name]
        if len(pts) < 2:
            continue
        for (ta, busy), (tb, _) in zip(pts, pts[1:], strict=False):
            if busy > 0:
                ax.broken_barh([(ta - t0, tb - ta)], (i + 0.1, 0.8), color="#31a354",
                               alpha=min(1.0, 0.15 + 0.85 * busy))
    for rec_iv in (iv for iv in res.intervals if iv.what == "update"):
        ax.axvline(rec_iv.start - t0, color="#e34a33", lw=0.8, ls="--")
    ax.set_yticks([0.5] + [i + 0.5 for i in range(1, top + 1)])
    ax.set_yticklabels(["trainer"] + rows + (["queue events"] if marks else []))
    ax.set_xlabel("seconds (trainer: grey wait, blue train, red weight update; green: busy"
                  + ("; red shade: nobody works" if gaps else "") + ")"
                  + ("\nqueue ticks, bottom-up: " + ", ".join(MARKS) if marks else ""))
    ax.set_title(title)
    ax.set_xlim(0, max(res.wall_s, 1e-3))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def reward_curve(path: str, curves: dict[str, Sequence[float]], *, title: str) -> str:
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, marker="o", ms=3, label=name)
    ax.set_xlabel("training step")
    ax.set_ylabel("mean reward of the batch")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def staleness_hist(path: str, staleness: dict[str, Sequence[int]], *, title: str) -> str:
    fig, ax = plt.subplots(figsize=(7, 4))
    top = max((max(v) for v in staleness.values() if len(v)), default=0)
    bins = [x - 0.5 for x in range(0, top + 2)]
    for name, values in staleness.items():
        ax.hist(list(values), bins=bins, alpha=0.6, label=name)
    ax.set_xlabel("staleness of a sample (current version - its oldest token's version)")
    ax.set_ylabel("samples")
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
