"""``strawq demo`` and ``strawq lab``: a bad value on the command line is a usage error (exit 2),
said in one line, before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from strawq.app.cli import main


@pytest.mark.parametrize("flags, says", [
    (["--steps", "0"], "--steps: expected a positive integer"),
    (["--batch-groups", "-3"], "--batch-groups: expected a positive integer"),
    (["--group-size", "x"], "--group-size: expected a positive integer"),
    (["--max-staleness", "-1"], "--max-staleness: expected an integer >= 0"),
    (["--oversample", "0.5"], "--oversample: expected a number >= 1"),
    (["--oversample", "nan"], "--oversample: expected a finite number"),
])
def test_a_bad_demo_value_exits_2(tmp_path: Path, flags: list[str], says: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--workdir", str(tmp_path / "demo"), *flags])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()  # nothing started


@pytest.mark.parametrize("flags, says", [
    (["--engines", "0"], "LabConfig.engines must be >= 1, got 0"),
    (["--modes", "sync,bogus"], "unknown mode 'bogus'"),
    (["--engines", "3", "--sim-processes", "2"], "must be a multiple of sim_processes"),
])
def test_a_bad_lab_value_exits_2(tmp_path: Path, flags: list[str], says: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lab", "--workdir", str(tmp_path / "lab"), *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "lab").exists()


def test_a_missing_lab_config_is_said_in_words(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "lab.json"
    assert main(["lab", "--config", str(missing)]) == 1
    err = capsys.readouterr().err
    assert f"cannot read {missing}: no such file or directory" in err and "Errno" not in err
