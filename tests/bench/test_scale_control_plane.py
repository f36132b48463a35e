"""``bench/scale.py --control-plane --quick``: the control plane counted at a Redis server.

The bench brings its own Redis-backed JuiceFS volume up (``deploy/juicefs/testvol.sh``,
``META=redis``), so it needs the juicefs client, ``/dev/fuse``, and ``redis-server``,
``redis-cli`` and ``redis-benchmark``. Without them the test skips saying which; with
``STRAWQ_REQUIRE_REDIS=1`` or ``STRAWQ_REQUIRE_JUICEFS=1`` it fails instead.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.juicefs_fixtures import find_juicefs_binary

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.juicefs]

LINE = re.compile(
    r"^scale: (?P<gpus>\w+)-GPU control plane = (?P<a>[\d.]+) ops/s steady, (?P<b>[\d.]+) ops per "
    r"update burst; metadata server capacity = (?P<c>[\d.]+) ops/s; share = (?P<share>[\d.]+) "
    r"\(burst (?P<burst>[\d.]+) over (?P<d>[\d.]+) s\)$")


def _lacking() -> str | None:
    if find_juicefs_binary() is None:
        return "no juicefs binary"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    for tool in ("redis-server", "redis-cli", "redis-benchmark"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


def _run_quick(tmp_path: Path, *flags: str) -> list[str]:
    """``bench/scale.py --control-plane --quick FLAGS``'s output lines (a skip without a
    Redis-backed JuiceFS volume, a failure where CI requires one); asserts exit 0."""
    why = _lacking()
    if why:
        if "1" in (os.environ.get("STRAWQ_REQUIRE_REDIS"),
                   os.environ.get("STRAWQ_REQUIRE_JUICEFS")):
            pytest.fail(f"a Redis-backed JuiceFS volume is required but {why}")
        pytest.skip(f"bench/scale.py --control-plane needs a Redis-backed JuiceFS volume: "
                    f"{why}")
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "scale.py"), "--control-plane",
                           "--quick", *flags], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    out = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-3000:]}"
    return out


REFILL_LINE = re.compile(
    r"^refill: release_chunk = (?P<k>\d+), start fill = (?P<fill>[\d.]+) Redis commands a task, "
    r"update refill = (?P<refill>[\d.]+) a task \(claims of one: (?P<single>[\d.]+)\); update "
    r"burst (?P<burst>\d+) ops \(claims of one: (?P<burst_single>\d+)\)$")
FILLED = re.compile(r"^  refill: (?P<chunked>\d+) of (?P<tasks>\d+) tasks at the start fill "
                    r"leased inside a whole chunk, (?P<again>\d+) at the update's refill")


def refill_lines(out: list[str]) -> tuple[re.Match[str], re.Match[str]]:
    """The refill summary line and the count of chunk leases at the refills (issue 40)."""
    summary = [m for m in map(REFILL_LINE.match, out) if m]
    filled = [m for m in map(FILLED.match, out) if m]
    assert summary and filled, f"no refill lines: {out[-8:]}"
    return summary[0], filled[0]


def test_the_line_has_its_shape_and_positive_figures(tmp_path: Path) -> None:
    """The defaults are a run's: rank 0 watches, the journal every 4 s, the bracket held."""
    out = _run_quick(tmp_path)
    m = LINE.match(out[-1]) if out else None
    assert m, f"not the control-plane line: {out[-3:]}"
    assert m["gpus"] == "80", "--quick counts an 80-GPU run's clients"
    a, b, c = float(m["a"]), float(m["b"]), float(m["c"])
    assert a > 0 and b > 0 and c > 0, out[-1]
    assert float(m["share"]) == pytest.approx(a / c, rel=0.01, abs=0.001)
    assert any(line.startswith("journal: 4 s window") for line in out), "the journal is on"
    assert any("now rank0:" in line for line in out), "rank 0 watches"
    # the bracket held (one window record per producer): the line's burst; a parked one's
    # refills, each one claim of its slot budget, are printed beside
    pause = pause_line(out)
    assert pause["this"] == "hold" and b == pytest.approx(int(pause["held"]), abs=1)
    r, filled = refill_lines(out)
    assert int(r["k"]) == 1 and int(filled["chunked"]) == 0 and int(filled["again"]) == 0
    assert int(filled["tasks"]) == 10 * 24, "10 producers fill 24 slots each"
    assert float(r["fill"]) > 0 and float(r["refill"]) > 0 and float(r["single"]) > 0
    assert int(r["burst"]) == int(pause["parked"]) > b, "the refills are a parked update's"
    assert int(r["burst_single"]) > 0


def test_the_capacity_forms_never_increment_a_field_another_form_sets_to_text() -> None:
    """``redis-benchmark`` runs the forms one after another on one database: HINCRBY on the
    field HSET wrote "v" into fails ("hash value is not an integer") whenever the observed
    mix holds both."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from redis_meta import FORMS

    text_fields = {tuple(f[1:3]) for f in FORMS.values() if f[0] == "HSET"}
    counters = {tuple(f[1:3]) for f in FORMS.values() if f[0] == "HINCRBY"}
    assert counters and not counters & text_fields, (counters, text_fields)


JOURNAL_LINE = re.compile(
    r"^journal: (?P<w>[\d.]+) s window \((?P<fmt>\w+)\) = (?P<cmds>[\d.]+) Redis commands a "
    r"window per producer, (?P<per_s>[\d.]+) per producer-second; steady share "
    r"(?P<off>[\d.]+) without, (?P<on>[\d.]+) with$")


def test_the_journal_line_has_its_shape_and_adds_to_the_steady_share(tmp_path: Path) -> None:
    out = _run_quick(tmp_path, "--journal-every-s", "2")
    assert LINE.match(out[-1]), out[-3:]
    m = next((m for line in out if (m := JOURNAL_LINE.match(line))), None)
    assert m, f"no journal line: {out[-4:]}"
    assert m["fmt"] == "segments" and float(m["w"]) == 2
    assert float(m["cmds"]) > 0
    assert float(m["per_s"]) == pytest.approx(float(m["cmds"]) / 2, rel=0.01, abs=0.05)
    assert float(m["on"]) > float(m["off"]) > 0
    # with the journal the producers hold their groups through the pause (their default):
    # the line's burst is the held one, one window record per producer
    b, pause = float(LINE.match(out[-1])["b"]), pause_line(out)
    assert pause["this"] == "hold" and b == pytest.approx(int(pause["held"]), abs=1)
    assert 0 < int(pause["held"]) * 10 < int(pause["parked"]), pause.group(0)


PAUSE_LINE = re.compile(r"^  bracket pause: parked (?P<parked>\d+) ops, held (?P<held>\d+) ops "
                        r"\(one window record per producer\); this run's producers "
                        r"(?P<this>hold|park) ")


def pause_line(out: list[str]) -> re.Match[str]:
    m = next((m for line in out if (m := PAUSE_LINE.match(re.sub(r"(?<=\d),(?=\d)", "", line)))),
             None)
    assert m, f"no bracket pause line: {out[-8:]}"
    return m


def test_park_counts_a_parked_bracket_with_the_journal_on(tmp_path: Path) -> None:
    """``--park`` (``timing.hold_through_pause=false``): the line's burst is the park's."""
    out = _run_quick(tmp_path, "--journal-every-s", "2", "--park")
    m, pause = LINE.match(out[-1]), pause_line(out)
    assert m, out[-3:]
    assert pause["this"] == "park" and float(m["b"]) == pytest.approx(int(pause["parked"]), abs=1)
    assert int(pause["parked"]) > int(pause["held"]) > 0, pause.group(0)


ROLLING_LINE = re.compile(
    r"^rolling: (?P<engines>\d+) engines, wave (?P<wave>\d+), (?P<s>\d+) s = (?P<ops>\d+) ops a "
    r"rolling update \((?P<before>\d+) with a full step at every poll\); share "
    r"(?P<share>[\d.]+) over the update \((?P<share0>[\d.]+) before\)$")


def rolling_line(out: list[str]) -> re.Match[str]:
    m = next((m for line in out if (m := ROLLING_LINE.match(line))), None)
    assert m, f"no rolling line: {out[-4:]}"
    return m


def test_a_rolling_update_is_counted_and_its_waiting_producers_no_longer_poll_in_full(
        tmp_path: Path) -> None:
    """``--update rolling``: the last line's burst is the rolling update's operations over
    its length. Producers behind waiting for a wave slot once made a full step at every
    0.1 s poll, reading every held slot's record; they look for a slot every 2 s now."""
    out = _run_quick(tmp_path, "--update", "rolling", "--trainer-watch", "rank0")
    m, r = LINE.match(out[-1]), rolling_line(out)
    assert m, out[-3:]
    # 10 producers x 8 engines, a wave of a quarter of them, 4 waves of 30 s loads
    assert (int(r["engines"]), int(r["wave"]), int(r["s"])) == (80, 20, 120), r.group(0)
    assert int(m["b"]) == int(r["ops"]) and float(m["d"]) == 120
    assert 0 < int(r["ops"]) * 10 < int(r["before"]), r.group(0)
    assert 0 < float(r["share"]) < float(r["share0"])


CHUNK_LINE = re.compile(r"^  release_chunk = (?P<k>\d+): (?P<staged>\d+) chunk directories staged")


def test_release_chunk_stages_chunks_and_still_prints_the_line(tmp_path: Path) -> None:
    """``--release-chunk 4``: the collector's releases stage chunk directories (issue 40);
    here without the journal and with every rank watching: the bracket parks, and the
    line's burst is the refills'."""
    out = _run_quick(tmp_path, "--release-chunk", "4", "--journal-every-s", "0",
                     "--trainer-watch", "per-rank")
    shown = LINE.match(out[-1])
    assert shown, out[-3:]
    m = next((m for line in out if (m := CHUNK_LINE.match(line))), None)
    assert m, f"no release_chunk line: {out[:8]}"
    assert int(m["k"]) == 4 and int(m["staged"]) > 0, m.group(0)
    # the start's fill (24 tasks a claim) takes whole chunks
    r, filled = refill_lines(out)
    assert int(r["k"]) == 4 and int(filled["chunked"]) > 0, filled.group(0)
    assert int(r["burst"]) == pytest.approx(float(shown["b"]), abs=1), "the line's burst: refills"
    assert not any(line.startswith("journal:") for line in out), "the journal is off"
