"""The umbrella command line: every command is listed, and a missing extra is named."""

from __future__ import annotations

import subprocess
import sys

import pytest

from strawq.app import cli, parser


def test_every_registered_command_is_listed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ["init", "release", "status", "inspect", "gc"] + [
            e.name for e in cli.SUBCOMMANDS]:
        assert f"    {name} " in out, name


@pytest.mark.parametrize("command, target", [
    ("init", "strawq.config:QueueConfig"),
    ("collector", "strawq.collector.config:CollectorConfig"),
    ("producer", "strawq.producers.producer_config:ProducerConfig"),
])
def test_set_help_lists_every_config_key_with_its_doc(
        command: str, target: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The keys ``--set`` accepts are generated from the config class: none is left out
    (a hand-written list drifts), and each comes with its type, default and doc."""
    import importlib

    from strawq.config import config_keys

    module, _, name = target.partition(":")
    keys = config_keys(getattr(importlib.import_module(module), name))
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    assert exc.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    for key, type_name, default, doc in keys:
        header = f"  {key}: {type_name} = {default}"
        assert header in lines, header
        assert doc, f"{target}: {key} has no documentation"
        follow = lines[lines.index(header) + 1]
        assert follow.startswith("      ") and follow.split()[0] in doc, (key, follow)


def test_a_missing_extra_is_a_clear_error_not_a_missing_command(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    broken = cli.Subcommand("collector", "strawq._no_such_module_", "add_parsers",
                            "run the global batch collector", extra="torch")
    monkeypatch.setattr(cli, "SUBCOMMANDS", (broken,))
    rc = cli.main(["collector", "/tmp/x", "--anything"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "strawq collector is unavailable" in err
    assert "pip install 'strawq[torch]'" in err
    assert "Traceback" not in err


@pytest.mark.process
def test_python_dash_m_strawq_runs_the_cli() -> None:
    res = subprocess.run([sys.executable, "-m", "strawq", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "usage: strawq" in res.stdout
    assert "collector" in res.stdout


# -- conventions and errors: no traceback reaches a user ----------------------------------

import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

from strawq.config import QueueConfig  # noqa: E402
from strawq.storage import PosixStorage  # noqa: E402
from strawq.tasks.queue import RunQueue  # noqa: E402
from strawq.weights.control import Control  # noqa: E402


def _cli(*argv: str, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "strawq", *argv], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=120, check=False)


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def _run(tmp_path: Path, name: str = "run", **kw: object) -> str:
    path = tmp_path / name
    RunQueue.create(PosixStorage(str(path), writer_id="setup", fsync=False),
                    QueueConfig(fsync=False, **kw))  # type: ignore[arg-type]
    return str(path)


@pytest.mark.process
def test_version_flag() -> None:
    res = _cli("--version")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("strawq ")


def test_help_documents_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "Exit status: 0" in out and "2 a usage error" in out


def test_init_on_a_file_is_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "afile"
    f.write_text("x")
    assert cli.main(["init", str(f)]) == 1
    err = capsys.readouterr().err
    assert "is a file" in err and "Traceback" not in err


def test_init_on_an_unwritable_directory_is_a_message(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    def denied(path: str, *a: object, **k: object) -> None:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(os, "makedirs", denied)
    monkeypatch.setattr(os, "mkdir", denied)  # the run directory is made level by level
    assert cli.main(["init", str(tmp_path / "new")]) == 1
    err = capsys.readouterr().err
    assert "Permission denied" in err and "writable" in err


def test_init_refuses_a_non_empty_unrelated_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "home"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    before = _tree(d)
    assert cli.main(["init", str(d)]) == 1
    assert "not empty" in capsys.readouterr().err
    assert _tree(d) == before


def test_init_reopens_its_own_run_and_accepts_an_empty_directory(tmp_path: Path) -> None:
    d = tmp_path / "empty"
    d.mkdir()
    assert cli.main(["init", str(d)]) == 0
    assert cli.main(["init", str(d)]) == 0


@pytest.mark.process
def test_release_of_a_directory_without_datasets_is_a_message(tmp_path: Path) -> None:
    run = _run(tmp_path)
    (tmp_path / "shards").mkdir()
    res = _cli("release", run, str(tmp_path / "shards"))
    assert res.returncode == 1
    assert "error" in res.stderr and "Traceback" not in res.stderr


def test_release_counts_dropped_rows_and_refuses_a_negative_count(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    ds = tmp_path / "ds.jsonl"
    good = [json.dumps({"prompt": [1, 2]})] * 3
    bad = ["{not json", json.dumps({"other": 1})] * 3
    ds.write_text("\n".join(good + bad) + "\n")
    assert cli.main(["release", run, str(ds), "--count", "9", "--json",
                     "--max-bad-row-share", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"] == 9 and out["released"] == 3 and out["dropped_bad_rows"] == 6
    with pytest.raises(SystemExit) as exc:
        cli.main(["release", run, str(ds), "--count", "-5"])
    assert exc.value.code == 2


@pytest.mark.process
def test_status_into_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    run = _run(tmp_path)
    r, w = os.pipe()
    os.close(r)  # like `| head` that has already exited
    try:
        res = _cli("status", run, stdout=w)
    finally:
        os.close(w)
    assert res.returncode == 0
    assert "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr


def test_read_only_commands_write_nothing(tmp_path: Path) -> None:
    run = Path(_run(tmp_path))
    ds = tmp_path / "ds.jsonl"
    ds.write_text(json.dumps({"prompt": [1, 2]}) + "\n")
    assert cli.main(["release", str(run), str(ds)]) == 0
    q = RunQueue.open(PosixStorage(str(run), writer_id="p", fsync=False))
    (lease,) = q.claim("p")  # its release directory is now drained (listings tidy it)
    Control(q.storage).pause(1)
    if (run / "tmp").exists():
        (run / "tmp").rmdir()  # empty: every publish renamed its temporary file away
    before = _tree(run)
    assert any(p.startswith("pending/r-") for p in before)
    assert cli.main(["status", str(run)]) == 0
    assert cli.main(["status", str(run), "--json"]) == 0
    assert cli.main(["inspect", str(run), lease.task_id]) == 0
    assert cli.main(["bracket", "status", str(run)]) == 0
    assert _tree(run) == before


def test_stray_files_are_named_by_status_and_not_counted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = Path(_run(tmp_path))
    (run / "pending" / "junk.txt").write_text("x")
    (run / "leased" / "junk.txt").write_text("x")
    assert cli.main(["status", str(run), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["counts"]["pending"] == 0 and st["counts"]["leased"] == 0
    assert st["stray_files"] == ["pending/junk.txt", "leased/junk.txt"]


def test_inspect_of_a_corrupt_record_exits_1(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    run = Path(_run(tmp_path))
    (run / "data" / "t~g0.group").write_bytes(b"garbage, not a record")
    assert cli.main(["inspect", str(run), "data/t~g0.group", "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["error"]
    assert "fails its checks" in captured.err


@pytest.mark.parametrize("argv", [["-q", "status"], ["status", "-q"], ["-v", "status"],
                                  ["status", "-v"], ["status", "--quiet", "--json"]])
def test_quiet_and_verbose_anywhere(tmp_path: Path, argv: list[str]) -> None:
    run = _run(tmp_path)
    assert cli.main([*argv, run]) == 0
    args = cli.build_parser().parse_args([*argv, run])
    assert args.verbose == ("-v" in argv)
    assert args.quiet == ("-q" in argv or "--quiet" in argv)


def test_every_state_command_speaks_json(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    run = str(tmp_path / "run")
    ds = tmp_path / "ds.jsonl"
    ds.write_text(json.dumps({"prompt": [1, 2]}) + "\n")
    for argv in (["init", run], ["release", run, str(ds)], ["status", run], ["gc", run],
                 ["bracket", "status", run], ["inspect", run, "i000000000000"]):
        assert cli.main([*argv, "--json"]) == 0, argv
        json.loads(capsys.readouterr().out)


def test_an_unexpected_exception_is_a_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    def boom(_args: object) -> int:
        raise RuntimeError("boom")

    monkeypatch.setattr(parser, "cmd_status", boom)  # what the parser dispatches to
    assert cli.main(["status", _run(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "internal error: RuntimeError: boom" in err and "Traceback" not in err


def test_bracket_abort_releases_a_stuck_weight_update(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    control = Control(PosixStorage(run, fsync=False))
    control.pause(1)
    control.ack(1, "p1")
    assert cli.main(["bracket", "status", run, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["open"] and st["pause_version"] == 1 and st["acked"] == ["p1"]
    assert cli.main(["bracket", "abort", run]) == 0
    assert not control.state().paused
    assert RunQueue.open(PosixStorage(run)).current_version() == 0  # no new version
    capsys.readouterr()
    assert cli.main(["bracket", "abort", run]) == 1
    assert "nothing to abort" in capsys.readouterr().err


@pytest.mark.process
def test_producer_command_is_registered_and_runs_without_ray(tmp_path: Path) -> None:
    run = _run(tmp_path)
    code = ("import sys; sys.modules['ray'] = None; from strawq.app.cli import main; "
            f"sys.exit(main(['producer', {run!r}, '--engine', 'http://127.0.0.1:9', "
            "'--reward', 'strawq.producers.rewards.math_answer', '--max-seconds', '0.5', "
            "'--set', 'engine.generation.eos_token_ids=[2]', '--slots', '1', '--json']))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["producer_id"].startswith("p-")


@pytest.mark.process
def test_producer_command_refuses_to_start_without_eos_ids(tmp_path: Path) -> None:
    # no engine answers, no tokenizer, no configured ids: an abort landing on EOS could not
    # be told from one mid-response, so the producer refuses with the ways to fix it
    run = _run(tmp_path)
    res = subprocess.run(
        [sys.executable, "-m", "strawq", "producer", run, "--engine", "http://127.0.0.1:9",
         "--reward", "strawq.producers.rewards.math_answer", "--max-seconds", "0.5",
         "--slots", "1"],
        capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 1, res.stderr
    assert "cannot find the model's EOS ids" in res.stderr
    assert "engine.generation.eos_token_ids" in res.stderr and "Traceback" not in res.stderr


def test_producer_command_refuses_a_directory_without_a_run(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    assert cli.main(["producer", str(tmp_path), "--engine", "http://127.0.0.1:9",
                     "--reward", "a.b"]) == 1
    assert "no strawq run" in capsys.readouterr().err


def test_status_names_the_engines_needing_weights(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from strawq.weights.engine_weights import EngineWeights

    run = Path(_run(tmp_path))
    assert cli.main(["status", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["engines_needing_weights"] == {}
    q = RunQueue.open(PosixStorage(str(run), writer_id="p", fsync=False))
    EngineWeights(q.storage).mark("http://10.0.0.7:30000/", writer="producer-3",
                                  engine_version=2, run_version=5, reason="restarted")
    assert cli.main(["status", str(run), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["engines_needing_weights"] == {"http://10.0.0.7:30000": {
        "engine_version": 2, "run_version": 5, "writer": "producer-3", "reason": "restarted"}}
    assert cli.main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "engines needing weights" in out and "http://10.0.0.7:30000  reports version 2" in out


def test_forget_engine_drops_the_notes_of_a_retired_engine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from strawq.weights.engine_weights import EngineWeights

    run = Path(_run(tmp_path))
    q = RunQueue.open(PosixStorage(str(run), writer_id="p", fsync=False))
    notes = EngineWeights(q.storage)
    for writer in ("producer-1", "producer-2"):
        notes.mark("http://10.0.0.7:30000", writer=writer, engine_version=2, run_version=5,
                   reason="restarted")
    notes.mark("http://10.0.0.8:30000", writer="producer-1", engine_version=None,
               run_version=5, reason="unreachable")
    assert cli.main(["status", str(run)]) == 0
    assert "strawq forget-engine" in capsys.readouterr().out
    assert cli.main(["forget-engine", str(run), "http://10.0.0.9:30000"]) == 1
    err = capsys.readouterr().err
    assert "no note says http://10.0.0.9:30000" in err and "http://10.0.0.8:30000" in err
    assert "Traceback" not in err
    assert cli.main(["forget-engine", str(run), "http://10.0.0.7:30000/", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"url": "http://10.0.0.7:30000",
                                                   "notes_deleted": 2}
    assert sorted(notes.needing()) == ["http://10.0.0.8:30000"]  # the other engine's kept


# -- global options anywhere, quiet summaries, usage errors --------------------------------


def test_json_before_or_after_the_command(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    run = str(tmp_path / "run")
    ds = tmp_path / "ds.jsonl"
    ds.write_text(json.dumps({"prompt": [1, 2]}) + "\n")
    for argv in (["init", run], ["release", run, str(ds)], ["status", run], ["gc", run],
                 ["bracket", "status", run], ["-q", "status", run]):
        for full in (["--json", *argv], [*argv, "--json"]):
            assert cli.main(full) == 0, full
            json.loads(capsys.readouterr().out)
    with pytest.raises(SystemExit) as exc:  # a command that prints no state: a usage error
        cli.main(["--json", "demo", "--steps", "1"])
    assert exc.value.code == 2
    assert "--json: strawq demo prints no state" in capsys.readouterr().err


@pytest.mark.parametrize("quiet", [["-q"], ["--quiet"]])
def test_quiet_release_and_gc_print_nothing(tmp_path: Path, quiet: list[str],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    ds = tmp_path / "ds.jsonl"
    ds.write_text(json.dumps({"prompt": [1, 2]}) + "\n")
    assert cli.main(["release", run, str(ds), *quiet]) == 0
    assert cli.main([*quiet, "gc", run]) == 0
    assert capsys.readouterr().out == ""
    assert cli.main(["status", run, "--json", *quiet]) == 0  # a report: printed with -q
    assert json.loads(capsys.readouterr().out)["counts"]["pending"] == 1  # it did release


@pytest.mark.parametrize("argv", [["engine", "serve", "--kind", "sim", "--port", "99999"],
                                  ["engine", "serve", "--kind", "sim", "--port", "-1"],
                                  ["engine", "serve", "--kind", "sim", "--port", "http"]])
def test_an_engine_port_out_of_range_is_a_usage_error(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "expected a TCP port 0-65535" in err and "internal error" not in err


@pytest.mark.parametrize("value", ["1e400", "NaN", "-Infinity"])
def test_a_non_finite_config_value_is_one_line(tmp_path: Path, value: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert cli.main(["init", str(run), "--set", f"lease_timeout_s={value}"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "lease_timeout_s: expected a finite number" in err
    assert not (run / "run.meta").exists()


def test_an_unreadable_config_file_is_said_in_words(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.json"
    assert cli.main(["init", str(tmp_path / "run"), "--config", str(missing)]) == 1
    err = capsys.readouterr().err
    assert f"cannot read {missing}: no such file or directory (check the path)" in err
    assert "Errno" not in err
    broken = tmp_path / "broken.json"
    broken.write_text("{\"max_attempts\": 3,,}")
    assert cli.main(["init", str(tmp_path / "run"), "--config", str(broken)]) == 1
    err = capsys.readouterr().err
    assert f"{broken} is not valid JSON" in err and "line 1, column" in err
    assert cli.main(["init", str(tmp_path / "run"), "--config", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "expected a file, found a directory" in err and "Errno" not in err


# -- what a command imports: only what it uses ---------------------------------------------

#: Modules a CLI call that neither generates nor trains must not load.
HEAVY = ("aiohttp", "numpy", "torch", "pyarrow", "fsspec", "ray", "transformers",
         "strawq.producers", "strawq.collector", "strawq.demo", "producers", "collector",
         "demo")


def _modules_after(*argvs: list[str]) -> set[str]:
    code = ("import json, sys\nfrom strawq.app.cli import main\nfor argv in json.loads("
            "sys.argv[1]):\n    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "sys.stderr.write('MODULES ' + json.dumps(sorted(sys.modules)))\n")
    res = subprocess.run([sys.executable, "-c", code, json.dumps(list(argvs))],
                         capture_output=True, text=True, timeout=120, check=False)
    line = res.stderr.rpartition("MODULES ")[2]
    assert line, res.stderr
    return set(json.loads(line))


@pytest.mark.parametrize("argv", [["--version"], ["status", "RUN"], ["status", "RUN", "--json"],
                                  ["--help"]])
@pytest.mark.process
def test_a_plain_command_imports_no_engine_trainer_or_array_code(tmp_path: Path,
                                                                 argv: list[str]) -> None:
    run = _run(tmp_path)
    loaded = _modules_after([run if a == "RUN" else a for a in argv])
    heavy = sorted(m for m in loaded if m.split(".")[0] in HEAVY
                   or m.startswith(tuple(f"{h}." for h in HEAVY)))
    assert heavy == [], heavy
    assert "strawq.app.cli" in loaded
    if argv == ["--version"]:
        assert "strawq.tasks.queue" not in loaded


@pytest.mark.process
def test_the_named_command_alone_is_imported() -> None:
    loaded = _modules_after(["producer", "--help"])
    assert "strawq.producers.cli" in loaded
    assert not {"strawq.collector.cli", "strawq.demo.cli", "strawq.producers.engines.cli",
                "strawq.app.cluster"} & loaded


@pytest.mark.parametrize("command, actions", [("engine", "serve, init-tiny"), ("cluster", "up")])
def test_a_command_group_alone_names_its_commands(command: str, actions: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([command]) == 2
    assert f"strawq {command}: error: name a command: {actions}" in capsys.readouterr().err
