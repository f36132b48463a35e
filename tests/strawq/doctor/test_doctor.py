"""``strawq doctor``: measured checks on a local disk, on a real JuiceFS pair, on broken mounts.

Numbers are measured and reported (``-s`` shows them), never asserted against a speed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

from strawq import doctor
from strawq.doctor import (
    DECLARATION_KEYS,
    MountInfo,
    Status,
    check_declaration,
    declaration_from_report,
    find_mount,
    judge_race,
    load_declaration,
    require_healthy,
    run_doctor,
    write_declaration,
)
from strawq.errors import ConfigError, DoctorFailed
from tests.juicefs_fixtures import find_juicefs_binary

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
RACES = ("atomic_rename", "exclusive_create", "noreplace_publish")


def _status(report: doctor.DoctorReport) -> dict[str, Status]:
    return {c.name: c.status for c in report.checks}


def _no_scratch_left(directory: str) -> bool:
    return not [n for n in os.listdir(directory) if n.startswith(doctor.SCRATCH_PREFIX)]


def _show(report: doctor.DoctorReport) -> None:
    from strawq.app.doctor_cli import render

    sys.stdout.write("\n" + render(report, width=100) + "\n")


#: doctor's checks are races of real processes (its probes)
pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def local_report() -> Iterator[doctor.DoctorReport]:
    with tempfile.TemporaryDirectory(prefix="strawq-doctor-test-") as d:
        report = run_doctor(d, rounds=5, processes=4)
        assert _no_scratch_left(d)
        yield report


def _tmpfs(tmp_path: str, options: str) -> Iterator[str]:
    """A real tmpfs mount (root ignores permission bits, so chmod cannot fake a bad mount)."""
    mnt = os.path.join(str(tmp_path), "mnt")
    os.mkdir(mnt)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", mnt],
                          check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root/CAP_SYS_ADMIN): "
                    f"{proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", mnt], check=False, capture_output=True)


@pytest.fixture
def readonly_tmpfs(tmp_path: str) -> Iterator[str]:
    yield from _tmpfs(tmp_path, "ro,size=1m")


@pytest.fixture
def tiny_tmpfs(tmp_path: str) -> Iterator[str]:
    yield from _tmpfs(tmp_path, "size=128k")


# -- local disk ----------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_local_dir_passes_every_check(local_report: doctor.DoctorReport) -> None:
    _show(local_report)
    st = _status(local_report)
    assert local_report.ok, [c for c in local_report.checks if c.status is Status.FAIL]
    assert local_report.profile == "local"
    for name in ("scratch", "fsync_file", "fsync_dir", "rename_noreplace",
                 "atomic_rename", "exclusive_create", "noreplace_publish", "publish_no_torn"):
        assert st[name] is Status.PASS, local_report.check(name)
    assert st["visibility"] is Status.SKIP  # no peer: nothing cross-client was claimed
    m = local_report.measured()
    assert m["atomic_rename_rounds"] == 5 and m["atomic_rename_racers"] == 4
    assert m["publish_torn_reads"] == 0 and m["rename_noreplace"] == 1


@pytest.mark.timeout(60)
def test_require_healthy_passes_on_local_dir(tmp_path: str) -> None:
    report = require_healthy(str(tmp_path))
    assert report.quick and report.ok
    assert report.measured()["atomic_rename_rounds"] == 3
    assert _no_scratch_left(str(tmp_path))


@pytest.mark.timeout(60)
def test_require_healthy_refuses_a_read_only_mount(readonly_tmpfs: str) -> None:
    report = run_doctor(readonly_tmpfs, quick=True)
    assert not report.ok
    assert report.check("scratch").status is Status.FAIL
    assert "EROFS" in report.check("scratch").detail
    with pytest.raises(DoctorFailed) as info:
        require_healthy(readonly_tmpfs)
    msg = str(info.value)
    assert "scratch" in msg and "EROFS" in msg and "strawq doctor" in msg


@pytest.mark.timeout(60)
def test_require_healthy_refuses_a_full_mount(tiny_tmpfs: str) -> None:
    with pytest.raises(DoctorFailed, match="ENOSPC") as info:
        require_healthy(tiny_tmpfs)
    assert "measurement" in str(info.value)
    assert _no_scratch_left(tiny_tmpfs)


def test_missing_path_is_a_config_error(tmp_path: str) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        run_doctor(os.path.join(str(tmp_path), "absent"))


# -- judging races and reading mounts (the logic that turns observations into verdicts) ----

def test_judge_race_needs_exactly_one_winner_and_expected_losers() -> None:
    good = [["won", "ENOENT", "ENOENT"], ["ENOENT", "ENOENT", "won"]]
    assert judge_race("r", "rename", good, ["ENOENT"]).status is Status.PASS
    two = judge_race("r", "rename", [["won", "won", "ENOENT"]], ["ENOENT"])
    assert two.status is Status.FAIL and "2 winners" in two.detail
    none = judge_race("r", "rename", [["ENOENT", "ENOENT"]], ["ENOENT"])
    assert none.status is Status.FAIL and "0 winners" in none.detail
    odd = judge_race("r", "rename", [["won", "EIO"]], ["ENOENT"])
    assert odd.status is Status.FAIL and "EIO" in odd.detail
    post = judge_race("r", "rename", good, ["ENOENT"], ["round 0: source still exists"])
    assert post.status is Status.FAIL and "source still exists" in post.detail


def test_torn_frames_are_detected() -> None:
    whole = doctor._frame(os.urandom(4096))
    assert doctor._intact(whole)
    assert not doctor._intact(whole[:-1])
    assert not doctor._intact(b"")
    assert not doctor._intact(whole[:40] + bytes(len(whole) - 40))


def test_find_mount_reads_mountinfo(tmp_path: str) -> None:
    info = os.path.join(str(tmp_path), "mountinfo")
    with open(info, "w") as f:
        f.write("22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
                "40 22 0:39 / /mnt/my\\040jfs rw,nosuid - fuse.juicefs JuiceFS:v rw,user_id=0\n"
                "41 22 0:40 / /mnt/nfs rw - nfs4 srv:/x rw,nocto,vers=4.2\n")
    assert find_mount("/mnt/my jfs/q/x", info).fs_type == "fuse.juicefs"
    assert find_mount("/mnt/my jfs/q/x", info).mount_point == "/mnt/my jfs"
    assert find_mount("/mnt/nfsother", info).fs_type == "ext4"  # prefix, not a parent
    nfs = find_mount("/mnt/nfs/queue", info)
    assert nfs.fs_type == "nfs4" and "nocto" in nfs.super_options
    assert doctor._fs_check(nfs).status is Status.FAIL
    s3 = MountInfo(mount_point="/mnt/s3", fs_type="fuse.s3fs", source="s3fs")
    assert doctor._fs_check(s3).status is Status.FAIL


def test_juicefs_cmdline_parsing_and_redaction() -> None:
    argv = ["/usr/bin/juicefs", "mount", "-d", "--cache-dir", "/c", "--writeback",
            "--open-cache=2s", "redis://u:secret@h:6379/1", "/mnt/jfs"]
    pos, opts = doctor.parse_juicefs_cmdline(argv)
    assert pos == ["mount", "redis://u:secret@h:6379/1", "/mnt/jfs"]
    assert opts["--writeback"] is True and opts["--open-cache"] == "2s"
    assert doctor._parse_duration("2s") == 2.0 and doctor._parse_duration("500ms") == 0.5
    assert "secret" not in doctor.redact_url(pos[1])
    checks, durability = doctor._juicefs_checks(
        doctor.JuiceFSSettings(source="cmdline", writeback=True, open_cache_s=2.0,
                               readdir_cache=False, meta_scheme="redis",
                               meta_url=doctor.redact_url(pos[1])), None)
    st = {c.name: c.status for c in checks}
    assert st["juicefs_writeback"] is Status.FAIL and st["juicefs_open_cache"] is Status.FAIL
    assert st["juicefs_durability"] is Status.WARN and "appendfsync always" in durability
    assert all("secret" not in c.detail for c in checks)


def test_meta_engine_is_named_from_the_metadata_url() -> None:
    cases = {"redis://u:secret@h:6379/1": "redis", "rediss://h/2": "redis",
             "unix:///run/redis.sock?db=1": "redis", "h:6379/1": "redis",
             "sqlite3:///var/jfs/meta.db": "sqlite3", "tikv://pd1:2379,pd2:2379/jfs": "tikv",
             "postgres://u@h/db": "postgres", "mysql://u@(h:3306)/db": "mysql",
             "badger:///d": "badger"}
    assert {url: doctor.meta_engine(url) for url in cases} == cases
    checks, _ = doctor._juicefs_checks(doctor.JuiceFSSettings(source="none"), None)
    assert {c.name: c.status for c in checks}["juicefs_meta_engine"] is Status.WARN


@pytest.mark.juicefs
@pytest.mark.timeout(60)
def test_doctor_names_the_metadata_engine_of_a_real_mount(
        juicefs_engine_dirs: tuple[str, str], request: pytest.FixtureRequest) -> None:
    """Read from the live client: its ``.config`` names its pid; a daemonised ``juicefs mount``
    truncates its own command line (long paths lose the metadata URL), so the URL comes from
    the client's log line ``juicefs[PID] ... Meta address: URL``. The Redis-backed test
    volume is ``redis``, the SQLite one ``sqlite3``."""
    expected = {"sqlite": "sqlite3", "redis": "redis"}[
        request.node.callspec.params["juicefs_engine_dirs"]]
    a, _ = juicefs_engine_dirs
    settings, argv = doctor.juicefs_settings(doctor.find_mount(a).mount_point)
    assert argv is not None and settings.meta_engine == expected, settings
    checks, _ = doctor._juicefs_checks(settings, None)
    engine = {c.name: c for c in checks}["juicefs_meta_engine"]
    assert engine.status is Status.PASS and f"metadata engine {expected} " in engine.detail
    from strawq.app.doctor_cli import render
    report = doctor.DoctorReport(
        path=a, peer=None, mount=doctor.find_mount(a), profile="juicefs", checks=checks,
        juicefs=settings, client_version=None, durability_description="", direct_mount=True,
        started_at="")
    assert f"metadata    {expected} engine" in render(report)
    assert json.loads(json.dumps(report.to_dict()))["juicefs"]["meta_engine"] == expected


# -- storage declarations ------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_declaration_round_trips(local_report: doctor.DoctorReport, tmp_path: str) -> None:
    path = os.path.join(str(tmp_path), "decl.json")
    written = write_declaration(local_report, path)
    assert sorted(written) == sorted(DECLARATION_KEYS)
    assert load_declaration(path) == json.loads(json.dumps(declaration_from_report(local_report)))
    assert check_declaration(path, local_report) == []
    # ... and a fresh quick measurement of the same kind of mount still matches it.
    fresh = run_doctor(os.path.dirname(path), quick=True, declaration=load_declaration(path))
    assert fresh.check("declaration").status is Status.PASS, fresh.check("declaration")


def test_declaration_with_unknown_or_missing_key_is_refused(
        local_report: doctor.DoctorReport, tmp_path: str) -> None:
    path = os.path.join(str(tmp_path), "decl.json")
    decl = write_declaration(local_report, path)
    with open(path, "w") as f:
        json.dump(dict(decl, colour="blue"), f)
    with pytest.raises(ConfigError, match="colour"):
        load_declaration(path)
    del decl["writeback"]
    with open(path, "w") as f:
        json.dump(decl, f)
    with pytest.raises(ConfigError, match="missing key.*writeback"):
        check_declaration(path, local_report)


@pytest.mark.timeout(60)
def test_declaration_mismatches_are_listed_and_refused(
        local_report: doctor.DoctorReport, tmp_path: str) -> None:
    path = os.path.join(str(tmp_path), "decl.json")
    decl = write_declaration(local_report, path)
    decl.update(writeback=True, profile="nfs")
    decl["measured"] = dict(decl["measured"], rename_noreplace=0.0, fsync_file_s=1e-9)
    with open(path, "w") as f:
        json.dump(decl, f)
    mismatches = check_declaration(path, local_report)
    joined = "\n".join(mismatches)
    assert len(mismatches) == 3, mismatches  # fsync_file_s within 4x + 0.5 s: not a mismatch
    assert "writeback: declared True, found None" in joined
    assert "profile: declared 'nfs', found 'local'" in joined
    assert "rename_noreplace" in joined
    with pytest.raises(DoctorFailed, match="writeback"):
        require_healthy(str(tmp_path), path)


def test_failed_report_cannot_be_declared(readonly_tmpfs: str, tmp_path: str) -> None:
    report = run_doctor(readonly_tmpfs, quick=True)
    with pytest.raises(DoctorFailed, match="scratch"):
        write_declaration(report, os.path.join(str(tmp_path), "decl.json"))


# -- the CLI -------------------------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "strawq.app.doctor_cli", *args], cwd=REPO,
                          check=False, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(120)
def test_cli_table_json_and_exit_status(tmp_path: str) -> None:
    d = str(tmp_path)
    decl = os.path.join(d, "decl.json")
    proc = _cli(d, "--rounds", "3", "--processes", "2", "--write-declaration", decl)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "atomic_rename" in proc.stdout and "PASS" in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-2].endswith("OK")
    assert "declaration written" in proc.stdout and os.path.exists(decl)

    proc = _cli(d, "--quick", "--json", "--check-declaration", decl)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    assert data["ok"] is True and data["profile"] == "local"
    assert {c["name"]: c["status"] for c in data["checks"]}["declaration"] == "pass"

    with open(decl) as f:
        bad = dict(json.load(f), fs_type="xfs")
    with open(decl, "w") as f:
        json.dump(bad, f)
    proc = _cli(d, "--quick", "--check-declaration", decl)
    assert proc.returncode == 1 and "fs_type: declared 'xfs'" in proc.stdout

    with open(decl, "w") as f:
        json.dump(dict(bad, surprise=1), f)
    proc = _cli(d, "--quick", "--check-declaration", decl)
    assert proc.returncode == 2 and "surprise" in proc.stderr

    proc = _cli(os.path.join(d, "absent"))
    assert proc.returncode == 2 and "not a directory" in proc.stderr


@pytest.mark.timeout(60)
def test_cli_fails_on_read_only_mount(readonly_tmpfs: str) -> None:
    proc = _cli(readonly_tmpfs, "--quick")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout and "EROFS" in proc.stdout


def test_cli_help_explains_the_checks() -> None:
    proc = _cli("--help")
    assert proc.returncode == 0
    for word in ("atomic_rename", "exclusive_create", "publish_no_torn", "--peer",
                 "--write-declaration", "--check-declaration", "writeback", "exit status"):
        assert word in proc.stdout, word


def test_add_doctor_parser_wires_into_a_main_cli() -> None:
    import argparse

    from strawq.app.doctor_cli import add_doctor_parser, run_doctor_command

    parser = argparse.ArgumentParser(prog="strawq")
    add_doctor_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["doctor", "/x", "--peer", "/y", "--rounds", "4", "--json"])
    assert (args.path, args.peer, args.rounds, args.json) == ("/x", "/y", 4, True)
    assert args.func is run_doctor_command


# -- a real JuiceFS pair -------------------------------------------------------------------

@pytest.mark.juicefs
@pytest.mark.timeout(120)
def test_juicefs_pair_passes_and_measures_visibility(juicefs_dirs: tuple[str, str],
                                                     tmp_path: str) -> None:
    a, b = juicefs_dirs
    report = run_doctor(a, peer=b, rounds=8, processes=8)
    _show(report)
    st = _status(report)
    assert report.ok, [c for c in report.checks if c.status is Status.FAIL]
    assert report.profile == "juicefs" and report.mount.fs_type == "fuse.juicefs"
    assert report.client_version  # read from the running client
    for name in ("juicefs_direct_mount", "juicefs_writeback", "juicefs_open_cache",
                 "peer_volume", *RACES, "publish_no_torn", "visibility_new",
                 "visibility_delete"):
        assert st[name] is Status.PASS, report.check(name)
    for name in RACES:
        assert "across two clients" in report.check(name).detail
    m = report.measured()
    for key in ("visible_new_p50_s", "visible_new_p99_s", "visible_new_max_s",
                "visible_delete_max_s", "stale_replace_max_s"):
        assert 0.0 <= m[key] < 60.0, key
    assert m["visible_new_p50_s"] <= m["visible_new_p99_s"] <= m["visible_new_max_s"]
    assert _no_scratch_left(a) and _no_scratch_left(b)
    decl = os.path.join(str(tmp_path), "jfs.json")
    write_declaration(report, decl)
    assert check_declaration(decl, report) == []
    assert load_declaration(decl)["writeback"] is False


@contextlib.contextmanager
def _own_juicefs_client(directory: str, *options: str) -> Iterator[str]:
    """A separate small volume mounted once with ``options`` (skips without FUSE)."""
    binary = find_juicefs_binary()
    if binary is None or not os.path.exists("/dev/fuse"):
        pytest.skip("needs the juicefs binary and /dev/fuse")
    meta, mnt = f"sqlite3://{directory}/meta.db", os.path.join(directory, "mnt")
    fmt = subprocess.run([binary, "format", "--storage", "file", "--bucket",
                          f"{directory}/store", "--trash-days", "0", meta, "own"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert fmt.returncode == 0, fmt.stderr[-2000:]
    mounted = subprocess.run([binary, "mount", "-d", "--log", f"{directory}/mnt.log",
                              "--cache-dir", f"{directory}/cache", "--no-usage-report",
                              "--backup-meta", "0", *options, meta, mnt],
                             check=False, capture_output=True, text=True, timeout=60)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a JuiceFS client here: {mounted.stderr[-1000:]}")
    try:
        yield mnt
    finally:
        if subprocess.run([binary, "umount", mnt], check=False, capture_output=True,
                          timeout=60).returncode != 0:
            subprocess.run(["umount", "-l", mnt], check=False, capture_output=True, timeout=60)


@pytest.mark.juicefs
@pytest.mark.timeout(120)
def test_juicefs_mount_with_unsafe_options_fails(tmp_path: str) -> None:
    """A real client mounted with --writeback and --open-cache: doctor must refuse it."""
    with _own_juicefs_client(str(tmp_path), "--writeback", "--open-cache", "5",
                             "--readdir-cache") as mnt:
        report = run_doctor(mnt, quick=True)
        st = _status(report)
        assert st["juicefs_writeback"] is Status.FAIL
        assert st["juicefs_open_cache"] is Status.FAIL
        assert st["juicefs_readdir_cache"] is Status.WARN
        assert not report.ok
        with pytest.raises(DoctorFailed, match="writeback") as info:
            require_healthy(mnt)
        assert "open-cache" in str(info.value)


@pytest.mark.juicefs
@pytest.mark.timeout(120)
def test_dead_juicefs_client_is_refused(tmp_path: str) -> None:
    """The FUSE daemon of our own mount is killed: the mount point answers ENOTCONN."""
    with _own_juicefs_client(str(tmp_path)) as mnt:
        with open(os.path.join(mnt, ".config")) as f:
            cfg = json.load(f)
        for pid in (cfg["Pid"], cfg["PPid"]):  # the daemon we just started, and its supervisor
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):  # the supervisor's socket, left behind by SIGKILL
            os.unlink(cfg["CommPath"])
        deadline = time.monotonic() + 30
        while doctor._unreachable(mnt) is None:
            assert time.monotonic() < deadline, "the mount still answers after SIGKILL"
            time.sleep(0.05)
        with pytest.raises(DoctorFailed, match="ENOTCONN"):
            require_healthy(mnt)
