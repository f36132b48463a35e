"""A long release is not silent: the feeder reports staged rows, ``Progress`` shows them
(a line redrawn on a terminal, a plain line every few seconds elsewhere)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from strawq.app.progress import Progress
from strawq.data.dataset import Dataset
from strawq.data.feeder import PROGRESS_EVERY, Feeder
from tests.collector.helpers import make_run


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_release_reports_its_staged_rows(tmp_path: Path) -> None:
    q = make_run(str(tmp_path / "run"), release_batch=4)
    n = 2 * PROGRESS_EVERY + 10
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": [1, 2, i % 50 + 3]}) + "\n"
                            for i in range(n)))
    feeder = Feeder(q, Dataset(str(data)))
    seen: list[tuple[int, int]] = []
    feeder.on_progress = lambda done, total: seen.append((done, total))
    assert feeder.release(n) == n
    assert seen == [(0, n), (PROGRESS_EVERY, n), (2 * PROGRESS_EVERY, n)]


def test_progress_writes_a_line_every_few_seconds_to_a_log() -> None:
    clock, out = _Clock(), io.StringIO()
    p = Progress("releasing", out, clock=clock, log_every_s=5.0)
    for done in range(0, 20_000, 500):
        clock.t += 1.0  # one second per 500 rows
        p(done, 20_000)
    p.done()
    lines = out.getvalue().splitlines()
    assert len(lines) == 8  # 40 s: one line per 5 s
    assert lines[0] == "releasing: 2,000 / 20,000 rows (10 %), 5 s"
    assert "\r" not in out.getvalue()


def test_progress_redraws_one_line_on_a_terminal_and_clears_it() -> None:
    clock, out = _Clock(), _Tty()
    p = Progress("releasing", out, clock=clock)
    clock.t = 1.0
    p(500, 1000)
    assert out.getvalue() == "\rreleasing: 500 / 1,000 rows (50 %), 1 s\033[K"
    p.done()
    assert out.getvalue().endswith("\r\033[K") and "\n" not in out.getvalue()
