"""The umbrella command line: every command is listed, and a missing extra is named."""

from __future__ import annotations

import subprocess
import sys

import pytest

from strawq import cli


def test_every_registered_command_is_listed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ["init", "release", "status", "inspect", "gc"] + [
            e.name for e in cli.SUBCOMMANDS]:
        assert f"    {name} " in out, name


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


def test_python_dash_m_strawq_runs_the_cli() -> None:
    res = subprocess.run([sys.executable, "-m", "strawq", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "usage: strawq" in res.stdout
    assert "collector" in res.stdout
