"""docs/slime.md against what ships: its command lines are the launcher's
(``deploy/examples/slime_job.py``, ``strawq.collector.integrations.slime.flags.MODES``), the
strawq commands it names exist, and the installed slime is the pinned source (the content
digest the page documents)."""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from strawq.collector.integrations.slime.flags import MODES, flags_to_args

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "slime.md"


def _blocks() -> list[list[list[str]]]:
    """The command lines of each of the page's ``bash`` blocks (continuations joined,
    comments dropped), split as a shell would."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S):
        text = re.sub(r"\\\n", " ", block)
        cmds = []
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                cmds.append(shlex.split(line.replace("...", "")))
        out.append(cmds)
    return out


def _commands() -> list[list[str]]:
    """Every command line of the page's ``bash`` blocks."""
    return [c for block in _blocks() for c in block]


def _train_flags(cmd: list[str]) -> dict[str, object]:
    flags = cmd[cmd.index("train.py") + 1:]
    return flags_to_args([f for f in flags if f.startswith("--") or not f.isupper()])


def test_the_pages_train_commands_carry_the_launchers_flags() -> None:
    trains = [c for c in _commands() if "train.py" in c]
    by_mode = {}
    for cmd in trains:
        flags = _train_flags(cmd)
        mode = "data-source" if str(flags.get("data_source_path", "")).endswith(
            "StrawqDataSource") else "collector"
        by_mode[mode] = flags
    assert set(by_mode) == set(MODES)
    for mode, flags in by_mode.items():
        want = flags_to_args(MODES[mode])
        assert {k: flags.get(k) for k in want} == want, mode
        extra = set(flags) - set(want) - {"custom_config_path"}
        assert not extra, f"{mode}: the page sets {sorted(extra)}, the launcher does not"


def _strawq_commands() -> set[str]:
    from strawq.app.cli import build_parser

    parser = build_parser([])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices)


def test_the_strawq_commands_the_page_names_exist() -> None:
    named = {c[1] for c in _commands() if c and c[0] == "strawq" and len(c) > 1}
    assert {"collector", "producer"} <= named
    assert named <= _strawq_commands(), named - _strawq_commands()


def test_the_launcher_prints_the_pages_generation_side(tmp_path: Path) -> None:
    from tests.collector.integrations.test_examples import load_example

    job = load_example("slime_job")
    gen = job.generation_commands("RUN", "DATASET", "http://ROUTER_IP:ROUTER_PORT")
    (block,) = [b for b in _blocks() if any("train.py" in c and any(
        a.endswith("StrawqBatchSource") for a in c) for c in b)]  # mode 2's slime job
    assert gen == [c for c in block if c and c[0] == "strawq"]


def _option(cmd: list[str], flag: str) -> list[str]:
    return [cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a == flag]


def _set(cmd: list[str], key: str) -> int:
    (val,) = [v.split("=", 1)[1] for v in _option(cmd, "--set") if v.startswith(key + "=")]
    return int(val)


def test_the_pages_cpu_launcher_block_parses_and_agrees_with_its_run() -> None:
    """Mode 2's processes: the launcher's command line parses with the launcher's own
    parser, its engines are the producers' and its batch shape the run's and collector's."""
    from tests.collector.integrations.test_examples import load_example

    script = "deploy/examples/slime_strawq_trainer.py"
    (block,) = [b for b in _blocks() if any(script in c for c in b)]
    by_name = {c[1]: c for c in block}
    assert ["strawq", "strawq", "strawq", "python"] == [c[0] for c in block]
    launcher = by_name[script]
    args = load_example("slime_strawq_trainer").build_parser().parse_args(launcher[2:])
    assert args.run_dir == by_name["init"][2] == by_name["collector"][2]
    assert args.engine_url == _option(by_name["producer"], "--engine")
    assert args.group_size == _set(by_name["init"], "group_size")
    assert args.batch_groups == _set(by_name["collector"], "batch_groups")
    assert args.cpu_stand_ins


def _digest_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("slime_digest",
                                                  ROOT / "deploy" / "slime_digest.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_installed_slime_is_the_pinned_source() -> None:
    pytest.importorskip("slime.utils.types", reason="slime not installed")
    mod = _digest_module()
    documented = re.search(r"commit 624b824: ([0-9a-f]{64})", PAGE.read_text(encoding="utf-8"))
    assert documented is not None, "docs/slime.md states no digest for the pinned commit"
    assert mod.PINNED == documented.group(1)
    assert mod.slime_digest() == mod.PINNED


def test_the_digest_tells_another_source(tmp_path: Path) -> None:
    pkg = tmp_path / "slime"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("x = 1\n")
    mod = _digest_module()
    first = mod.slime_digest(str(pkg))
    (pkg / "__init__.py").write_text("x = 2\n")
    assert mod.slime_digest(str(pkg)) != first
