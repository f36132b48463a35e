"""``bench/queue_ops.py --quick`` on the Redis-backed JuiceFS volume, the production engine.

``tests/bench/test_quick.py`` runs the quick form on local disk only; here it runs as a user
runs it (its own process) with ``--juicefs-redis`` on the session's Redis-backed volume
(``juicefs_redis_mounts``) and ``--redis-sock`` on that volume's server, and what must hold
whatever the machine's load is checked: exit 0, the summary lines parse, a ``jfs-redis`` row
(the engine the mount's own client names, so a run that fell back to local disk fails), the
limit measured in the same run, the metadata operations per group by kind and the Redis
server's own command count. No timings are asserted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from strawq.doctor import find_mount, juicefs_settings
from tests.conftest import BENCH_QUICK_TIMEOUT_S

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "queue_ops.py"

pytestmark = pytest.mark.slow

NUM = r"(\d+(?:\.\d+)?)"
LOCATION = re.compile(
    rf"^jfs-redis: strawq/limit = {NUM}, strawq/straw = {NUM}, meta ops/group = {NUM} "
    rf"\(the limit's: {NUM}\), Redis commands/group = {NUM} \(the limit's: {NUM}\) "
    r"\(geometric means\)$", re.M)
LAST = re.compile(rf"^queue_ops: strawq/limit = {NUM}, strawq/straw = {NUM}, "
                  rf"meta ops/group = {NUM}, release_chunk = 1, chunk leases = \d+$")


def redis_socket(mount: str) -> str:
    """The unix socket of the Redis server behind ``mount``, from its client's meta URL."""
    url = juicefs_settings(find_mount(mount).mount_point)[0].meta_url or ""
    if not url.startswith("unix://"):
        why = (f"the Redis-backed volume at {mount} has metadata URL {url or '(unseen)'}, "
               "not a unix socket this test can ask for INFO commandstats")
        if os.environ.get("STRAWQ_REQUIRE_REDIS") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return url[len("unix://"):].partition("?")[0]


@pytest.mark.juicefs
@pytest.mark.timeout(BENCH_QUICK_TIMEOUT_S + 30)
def test_queue_ops_quick_on_redis_backed_juicefs(juicefs_redis_mounts: tuple[str, str],
                                                 tmp_path: Path) -> None:
    if importlib.util.find_spec("straw") is None:
        pytest.skip("bench/queue_ops.py compares against straw-queue 0.1.6, not installed "
                    "(pip install -e '.[bench]')")
    mount = juicefs_redis_mounts[0]
    sock = redis_socket(mount)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    for var in ("STRAWQ_JUICEFS_A", "STRAWQ_JUICEFS_REDIS_A"):  # this volume only
        env.pop(var, None)
    out_json = tmp_path / "queue_ops.json"
    # one producer count and no flatness run (local only, test_quick.py runs it): small
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--producers", "4", "--flat", "0",
         "--juicefs-redis", mount, "--redis-sock", sock, "--json", str(out_json)],
        cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=BENCH_QUICK_TIMEOUT_S, check=False)
    said = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"queue_ops --quick exited {proc.returncode}\n{said}"

    # the summary of the Redis-backed location, named by the engine its client reports
    found = LOCATION.search(proc.stdout)
    assert found, f"no 'jfs-redis: ...' summary line (did it run on the volume?)\n{said}"
    of_limit, of_straw, ops, limit_ops, cmds, limit_cmds = map(float, found.groups())
    assert of_limit > 0 and of_straw > 0, said
    assert ops > 0 and limit_ops > 0, said
    assert cmds > 0 and limit_cmds > 0, said
    last = proc.stdout.strip().splitlines()[-1]
    assert LAST.match(last), f"queue_ops did not end on its summary line: {last!r}"
    assert float(LAST.match(last).group(3)) > 0, last  # type: ignore[union-attr]

    cases = [c for c in json.loads(out_json.read_text(encoding="utf-8"))["cases"]
             if c["fs"] == "jfs-redis"]
    assert cases, f"no jfs-redis case in the JSON results\n{said}"
    for case in cases:
        # the limit, measured in the same run on the same volume
        assert case["limit"]["groups_s"] > 0 and case["of_limit"] > 0, case
        for system in ("strawq", "straw", "limit"):
            res = case[system]
            assert res["meta_ops_per_group"] > 0, (system, res)
            assert res["redis_cmds_per_group"] > 0, (system, res)
        for system in ("strawq", "limit"):
            by_kind = case[system]["meta_ops_by_kind"]
            assert by_kind and all(v > 0 for v in by_kind.values()), (system, by_kind)
            # every group is written and renamed into place, on the volume's engine
            assert {"Rename", "Write"} <= set(by_kind), (system, by_kind)


@pytest.mark.parametrize(("args", "said"), [
    # (no JuiceFS volume needed: a directory stands in where the check comes before use)
    (["--redis-sock", "{tmp}/no.sock"], "--redis-sock needs --juicefs-redis"),
    (["--redis-sock", "{tmp}/no.sock", "--up"], "--up counts the server it brings up"),
    (["--redis-sock", "{tmp}/no.sock", "--juicefs-redis", "{tmp}/absent"], "not a directory"),
    (["--redis-sock", "{tmp}/no.sock", "--juicefs-redis", "{tmp}"],
     "no Redis server answers there"),
])
def test_redis_sock_bad_input_is_a_usage_error(tmp_path: Path, args: list[str],
                                               said: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRAWQ_JUICEFS")}
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", *(a.format(tmp=tmp_path) for a in args)],
        cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=120, check=False)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
