"""The configuration base (``strawq.config.Config``) and the root ``RunConfig``.

One validation path for every config class: annotations checked (nested sections, ``X |
None``, tuples, ``Literal``), then ``validate``; ``from_dict`` refuses unknown keys by name;
``to_dict`` / ``from_dict`` round-trip; G is held once in a run config.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import pytest

from strawq.collector.config import CollectorConfig
from strawq.config import Config, QueueConfig, load_config
from strawq.errors import ConfigError
from strawq.app.run_config import RunConfig

RUN_JSON = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "run.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inner(Config):
    depth: int = 1

    def validate(self) -> None:
        if self.depth < 0:
            raise ValueError(f"depth must be >= 0, got {self.depth}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outer(Config):
    name: str
    ratio: float = 0.5
    limit: int | None = None
    ids: tuple[int, ...] = ()
    mode: Literal["a", "b"] = "a"
    inner: Inner = dataclasses.field(default_factory=Inner)
    maybe: Inner | None = None


def _run_json() -> dict[str, Any]:
    with open(RUN_JSON, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


# -- the base --------------------------------------------------------------------------------

def test_unknown_key_is_refused_by_name_listing_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"Outer: unknown key\(s\) \['nme'\]; known keys are "
                                          r"\['ids', 'inner', 'limit', 'maybe', 'mode', "
                                          r"'name', 'ratio'\]"):
        Outer.from_dict({"nme": "x"})
    with pytest.raises(ConfigError, match=r"Outer: expected a mapping, found list"):
        Outer.from_dict([1])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"Outer: missing required key\(s\) \['name'\]"):
        Outer.from_dict({})


@pytest.mark.parametrize("data, message", [
    ({"name": 3}, r"Outer\.name: expected str, found int 3"),
    ({"name": "x", "ratio": "0.5"}, r"Outer\.ratio: expected float, found str '0.5'"),
    ({"name": "x", "ratio": True}, r"Outer\.ratio: expected float, found bool True"),
    ({"name": "x", "limit": 2.5}, r"Outer\.limit: expected int or None, found float 2.5"),
    ({"name": "x", "ids": [1, "2"]}, r"Outer\.ids\[1\]: expected int, found str '2'"),
    ({"name": "x", "ids": 5}, r"Outer\.ids: expected a list, found int 5"),
    ({"name": "x", "mode": "c"}, r"Outer\.mode: expected one of \['a', 'b'\], found 'c'"),
])
def test_type_errors_name_the_field_the_expected_type_and_the_value(
        data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Outer.from_dict(data)


def test_types_are_checked_on_direct_construction_too() -> None:
    with pytest.raises(ConfigError, match=r"Outer\.limit: expected int or None"):
        Outer(name="x", limit="3")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"Outer\.inner: expected Inner"):
        Outer(name="x", inner={"depth": 2})  # type: ignore[arg-type]
    cfg = Outer(name="x", ids=[1, 2])  # type: ignore[arg-type]
    assert cfg.ids == (1, 2)  # a list (as JSON gives) is kept as a tuple
    with pytest.raises(ConfigError, match=r"Outer\.limit"):
        dataclasses.replace(cfg, limit="no")  # replace goes through the same path


def test_nested_section_errors_carry_the_path() -> None:
    with pytest.raises(ConfigError, match=r"Outer\.inner: unknown key\(s\) \['deep'\]"):
        Outer.from_dict({"name": "x", "inner": {"deep": 1}})
    with pytest.raises(ConfigError, match=r"Outer\.maybe\.depth: expected int, found str"):
        Outer.from_dict({"name": "x", "maybe": {"depth": "1"}})
    # a value rule of a section (a ValueError in validate) becomes a ConfigError with its place
    with pytest.raises(ConfigError, match=r"Outer\.inner: depth must be >= 0, got -1"):
        Outer.from_dict({"name": "x", "inner": {"depth": -1}})
    assert Outer.from_dict({"name": "x", "maybe": None}).maybe is None


def test_to_dict_round_trips_through_json() -> None:
    cfg = Outer(name="x", ratio=2, limit=3, ids=(4, 5), mode="b", maybe=Inner(depth=0))
    data = cfg.to_dict()
    assert data["ids"] == [4, 5] and data["inner"] == {"depth": 1}
    assert Outer.from_dict(json.loads(json.dumps(data))) == cfg


def _config_classes_in_the_source() -> list[tuple[str, str]]:
    """``(module, class)`` of every class in the package that names ``Config`` as a base."""
    import ast

    import os

    root = Path(__file__).resolve().parents[2] / "strawq"
    paths = sorted(Path(d) / f for d, _, files in os.walk(root, followlinks=True)
                   for f in files if f.endswith(".py"))  # producers/ etc. are links
    found = []
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module = ".".join(("strawq", *path.relative_to(root).with_suffix("").parts))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and b.id == "Config" for b in node.bases):
                found.append((module.removesuffix(".__init__"), node.name))
    return found


@pytest.mark.slow
def test_every_config_class_of_the_project_is_a_config() -> None:
    """Each class declared with the ``Config`` base follows its rules: frozen, keyword-only,
    no ``__post_init__`` or ``from_dict`` of its own (the run config's adds one check)."""
    import importlib

    found = _config_classes_in_the_source()
    names = {name for _, name in found}
    assert {"QueueConfig", "CollectorConfig", "ProducerConfig", "ClientConfig",
            "PlacementConfig", "SamplerParams", "RunConfig"} <= names, names
    for module, name in found:
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, Config), cls
        params = getattr(cls, "__dataclass_params__", None)
        assert params is not None and params.frozen, f"{name} is not a frozen dataclass"
        assert all(f.kw_only for f in dataclasses.fields(cls)), f"{name} is not keyword-only"
        assert "from_dict" not in vars(cls) or cls is RunConfig, cls
        assert "__post_init__" not in vars(cls), cls


def test_the_per_class_configs_use_the_one_message() -> None:
    from strawq.producers.engines.sim_backend import SimConfig
    from strawq.producers.sglang_client import ClientConfig

    with pytest.raises(ConfigError, match=r"ClientConfig: unknown key\(s\) \['retries'\]"):
        ClientConfig.from_dict({"retries": 1})
    with pytest.raises(ConfigError, match=r"SimConfig\.len_cap: expected int, found str"):
        SimConfig.from_dict({"len_cap": "9"})
    with pytest.raises(ConfigError, match=r"cap_prob must be in \[0, 1\]"):
        SimConfig(cap_prob=2.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Documented(Config):
    """A class documented both ways.

    Fields:
        old_style: from the docstring's block,
            continued on the next line.
        a / b: one text for two fields.
    """

    #: From the comment above it,
    #: over two lines.
    new_style: int = 1
    old_style: str = "x"
    a: float = 0.5
    b: tuple[int, ...] = ()
    #: Both: the comment wins.
    inner: Inner | None = None
    undocumented: bool = False


def test_field_docs_read_comments_and_docstring_blocks() -> None:
    from strawq.config import field_docs

    docs = field_docs(Documented)
    assert docs == {"new_style": "From the comment above it, over two lines.",
                    "old_style": "from the docstring's block, continued on the next line.",
                    "a": "one text for two fields.", "b": "one text for two fields.",
                    "inner": "Both: the comment wins."}


def test_keys_help_flattens_sections_and_shows_type_default_and_doc() -> None:
    from strawq.config import config_keys, keys_help

    keys = {k: (t, d) for k, t, d, _ in config_keys(Outer)}
    assert keys["inner.depth"] == ("int", "1") and keys["maybe.depth"] == ("int", "1")
    assert keys["mode"] == ("a|b", '"a"') and keys["ids"] == ("list of int", "[]")
    assert keys["limit"] == ("int or null", "null") and keys["name"] == ("str", "required")
    text = keys_help(Documented)
    assert "  new_style: int = 1\n      From the comment above it, over two lines.\n" in text
    assert text.endswith("\n  undocumented: bool = false")


def test_every_key_a_command_line_accepts_is_documented() -> None:
    """Every config rule says each field is documented where it is declared; for the keys
    of the run config (and the queue and collector configs the CLIs read) it is checked."""
    from strawq.config import config_keys
    from strawq.producers.producer_config import ProducerConfig

    undocumented = [f"{cls.__name__}: {key}"
                    for cls in (RunConfig, QueueConfig, CollectorConfig, ProducerConfig)
                    for key, _, _, doc in config_keys(cls) if not doc]
    assert not undocumented, undocumented


def test_load_config_reads_a_file_and_dotted_overrides(tmp_path: Path) -> None:
    path = tmp_path / "q.json"
    path.write_text(json.dumps({"max_attempts": 5}))
    cfg = load_config(QueueConfig, str(path), ["release_batch=7", "prompt_key=text"])
    assert (cfg.max_attempts, cfg.release_batch, cfg.prompt_key) == (5, 7, "text")
    with pytest.raises(ConfigError, match=r"queue config: unknown key\(s\) \['release'\]"):
        load_config(QueueConfig, str(path), ["release=7"], where="queue config")
    with pytest.raises(ConfigError, match="--set takes KEY=VALUE"):
        load_config(QueueConfig, None, ["release_batch"])
    run = load_config(RunConfig, None, ["queue.group_size=4", "collector.max_staleness=1"])
    assert run.group_size == 4 and run.collector.max_staleness == 1


# -- the run config --------------------------------------------------------------------------

def test_run_json_validates_and_round_trips() -> None:
    raw = _run_json()
    run = RunConfig.from_dict(raw)
    assert run.placement is not None and run.producer is not None
    assert run.group_size == raw["queue"]["group_size"]
    assert RunConfig.from_dict(json.loads(json.dumps(run.to_dict()))) == run
    assert "group_size" not in run.to_dict()["placement"]


def test_g_is_held_once_a_second_g_in_a_section_is_an_error_naming_both() -> None:
    """The old hazard: G = 8 for the queue, G = 16 for placement, and 16 silently won."""
    raw = _run_json()
    raw["placement"]["group_size"] = 16
    with pytest.raises(ConfigError, match=r"placement\.group_size = 16 restates "
                                          r"queue\.group_size = 8"):
        RunConfig.from_dict(raw)
    raw["placement"]["group_size"] = 8  # even an agreeing restatement: G is held once
    with pytest.raises(ConfigError, match=r"placement\.group_size .*queue\.group_size"):
        RunConfig.from_dict(raw)
    raw = _run_json()
    raw["producer"]["group_size"] = 16
    with pytest.raises(ConfigError, match=r"producer\.group_size = 16 restates "
                                          r"queue\.group_size = 8"):
        RunConfig.from_dict(raw)
    # built in Python: a second G cannot even be written down
    from strawq.producers.placement_config import PlacementConfig
    from strawq.producers.producer_config import ProducerConfig

    run = RunConfig.from_dict(_run_json())
    assert run.placement is not None and run.producer is not None
    for section in (run.placement, run.producer):
        with pytest.raises(TypeError, match="group_size"):
            dataclasses.replace(section, group_size=16)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['group_size'\]"):
        PlacementConfig.from_dict(_run_json()["placement"] | {"group_size": 16})
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['group_size'\]"):
        ProducerConfig.from_dict(_run_json()["producer"] | {"group_size": 16})
    run4 = RunConfig.from_dict(copy.deepcopy(_run_json()) | {
        "queue": _run_json()["queue"] | {"group_size": 4}})
    assert run4.group_size == 4


def test_run_config_errors_name_the_section() -> None:
    raw = _run_json()
    raw["producer"]["engine"]["client"]["max_retry"] = 1
    with pytest.raises(ConfigError, match=r"run config\.producer\.engine\.client: unknown key\(s\) "
                                          r"\['max_retry'\]; known keys are \[.*'max_retries'"):
        RunConfig.from_dict(raw)
    raw = _run_json()
    raw["queue"]["group_size"] = "8"
    with pytest.raises(ConfigError, match=r"run config\.queue\.group_size: expected int, "
                                          r"found str '8'"):
        RunConfig.from_dict(raw)
    with pytest.raises(ConfigError, match=r"run config: unknown key\(s\) \['trainer'\]"):
        RunConfig.from_dict(_run_json() | {"trainer": {}})
    raw = _run_json()
    raw["producer"]["timing"]["lease_margin_s"] = 90.0
    with pytest.raises(ConfigError, match=r"producer\.timing\.lease_margin_s \(90\.0\) must be "
                                          r"below queue\.lease_timeout_s"):
        RunConfig.from_dict(raw)


@pytest.mark.process
def test_run_config_module_imports_no_ray_torch_or_http() -> None:
    code = ("import sys, strawq.app.run_config as r; "
            "r.RunConfig.from_dict({'queue': {'group_size': 4}, 'collector': {}}); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'ray', 'torch', 'aiohttp', 'requests', 'httpx'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.process
def test_a_run_config_with_placement_loads_without_ray() -> None:
    """The placement section is checked on any host: with Ray unimportable, run.json (all
    four sections) loads, and a wrong placement value is still refused by name."""
    code = ("import json, sys; sys.modules['ray'] = None\n"
            "from strawq.app.run_config import RunConfig\n"
            "from strawq.errors import ConfigError\n"
            f"raw = json.load(open({str(RUN_JSON)!r}))\n"
            "run = RunConfig.from_dict(raw)\n"
            "print(run.placement.concurrency, run.placement.engines)\n"
            "raw['placement']['engines'] = 0\n"
            "try:\n"
            "    RunConfig.from_dict(raw)\n"
            "except ConfigError as exc:\n"
            "    print(exc)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    placement = _run_json()["placement"]
    first, second = res.stdout.strip().splitlines()
    assert first == f"{placement['concurrency']} {placement['engines']}"
    assert "run config.placement: PlacementConfig.engines must be >= 1, got 0" in second


@pytest.mark.process
def test_run_config_cli_check_gives_one_line_errors(tmp_path: Path) -> None:
    script = RUN_JSON.parent / "run_config.py"
    ok = subprocess.run([sys.executable, str(script), str(RUN_JSON), "--check"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "OK" in ok.stderr, ok.stderr
    bad = tmp_path / "bad.json"
    raw = _run_json()
    raw["collector"]["eta_mode"] = "dorp"
    bad.write_text(json.dumps(raw))
    res = subprocess.run([sys.executable, str(script), str(bad), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1
    assert res.stderr.strip().count("\n") == 0 and "Traceback" not in res.stderr
    assert "run config.collector.eta_mode: expected one of" in res.stderr
    res = subprocess.run([sys.executable, str(script), str(RUN_JSON), "--check",
                          "--set", "placement.group_size=16"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "queue.group_size" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_number_must_be_finite(value: float) -> None:
    """JSON's 1e400 parses as inf and NaN passes every range check: both are refused where
    the field is declared a float, by name, in one line."""
    with pytest.raises(ConfigError, match=r"^q\.lease_timeout_s: expected a finite number"):
        QueueConfig.from_dict({"lease_timeout_s": value}, where="q")
    with pytest.raises(ConfigError, match="expected a finite number"):
        load_config(QueueConfig, None, [f"heartbeat_interval_s={json.dumps(value)}"])


def test_a_duration_beyond_a_year_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"lease_timeout_s must be > 0 and at most 31536000"):
        QueueConfig(lease_timeout_s=1e20)


@pytest.mark.parametrize("share", [-0.1, 5.0])
def test_a_bad_row_share_outside_0_to_1_is_refused_at_init(share: float) -> None:
    with pytest.raises(ConfigError, match="max_bad_row_share must be a share between 0 and 1"):
        QueueConfig(max_bad_row_share=share)
