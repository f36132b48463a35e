"""The deployment examples in ``deploy/`` stay true to the code.

Every example config is built by the real config class (``from_dict`` refuses unknown keys),
so an example with a renamed or misspelt key fails here; the storage declaration example
loads through the doctor's own loader; every shell script parses (``bash -n``) and refuses
what it documents refusing; the Ray cluster config validates against Ray's own schema.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from strawq.collector.config import CollectorConfig
from strawq.producers.plugins import load_filter, load_reward
from strawq.producers.producer_config import ProducerConfig
from strawq.config import QueueConfig, from_dict
from strawq.errors import ConfigError
from strawq.app.run_config import RunConfig

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
RUN_JSON = DEPLOY / "examples" / "run.json"
SCRIPTS = sorted(DEPLOY.rglob("*.sh"))

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")


def _run_json() -> dict[str, Any]:
    with open(RUN_JSON, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def _placement_config() -> Any:
    from strawq.producers.placement_config import PlacementConfig

    return PlacementConfig


def test_run_json_sections_build_through_the_real_config_classes() -> None:
    raw = _run_json()
    assert sorted(raw) == ["collector", "placement", "producer", "queue"]
    _placement_config()
    run = RunConfig.from_dict(raw)
    queue, collector, producer, placement = run.queue, run.collector, run.producer, run.placement
    assert producer is not None and placement is not None
    # the sections describe one run: G is held once (queue); K = floor(C*E/G) fits the bound
    assert "group_size" not in raw["placement"] and "group_size" not in raw["producer"]
    assert queue.group_size == run.group_size
    k = placement.concurrency * placement.engines // run.group_size
    assert collector.max_running >= k
    assert producer.engine.client.context_length is not None
    assert isinstance(from_dict(QueueConfig, raw["queue"]), QueueConfig)
    assert isinstance(from_dict(CollectorConfig, raw["collector"]), CollectorConfig)
    assert isinstance(ProducerConfig.from_dict(raw["producer"]), ProducerConfig)


@pytest.mark.parametrize("section", ["queue", "collector", "producer", "placement"])
def test_a_misspelt_key_in_the_example_fails(section: str) -> None:
    if section == "placement":
        _placement_config()
    raw = copy.deepcopy(_run_json())
    raw[section]["no_such_key"] = 1
    with pytest.raises(ConfigError, match=rf"run config\.{section}: unknown key.*no_such_key"):
        RunConfig.from_dict(raw)


def test_the_example_plugins_resolve() -> None:
    producer = _run_json()["producer"]
    load_reward(producer["plugins"]["reward"])
    load_filter(producer["plugins"]["filter"])


def test_run_config_helper_loads_and_prints_sections(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("run_config", DEPLOY / "examples" /
                                                  "run_config.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "run_config", mod)  # its dataclass looks itself up there
    spec.loader.exec_module(mod)
    cfg = mod.load(str(RUN_JSON))
    assert cfg.collector.batch_groups == _run_json()["collector"]["batch_groups"]
    assert mod.main([str(RUN_JSON), "--section", "queue"]) == 0
    assert json.loads(capsys.readouterr().out) == _run_json()["queue"]


def test_declaration_example_loads_through_the_doctor() -> None:
    from strawq.doctor.declaration import load_declaration

    decl = load_declaration(str(DEPLOY / "juicefs" / "declaration.example.json"))
    assert decl["profile"] == "juicefs" and decl["writeback"] is False
    assert decl["open_cache"] == 0 and decl["readdir_cache"] is False


@needs_bash
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_shell_script_parses(script: Path) -> None:
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def _mount_sh(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    return subprocess.run(["bash", str(DEPLOY / "juicefs" / "mount.sh"), *args],
                          env=base | env, capture_output=True, text=True, timeout=30)


@needs_bash
def test_mount_script_refuses_to_run_without_meta_url() -> None:
    res = _mount_sh({}, "mount")
    assert res.returncode == 1 and "META_URL is not set" in res.stderr


@needs_bash
@pytest.mark.parametrize("opts, why", [("--writeback", "writeback"),
                                       ("--open-cache 5", "close-to-open"),
                                       ("--readdir-cache", "attr TTL"),
                                       ("--no-bgjob", "background job")])
def test_mount_script_refuses_options_that_break_the_contract(tmp_path: Path, opts: str,
                                                              why: str) -> None:
    res = _mount_sh({"META_URL": f"sqlite3://{tmp_path}/meta.db", "ALLOW_SQLITE": "1",
                     "JUICEFS": shutil.which("true") or "/bin/true",
                     "MOUNT_POINT": str(tmp_path / "mnt"), "CACHE_DIR": str(tmp_path / "c"),
                     "EXTRA_MOUNT_OPTS": opts}, "mount")
    assert res.returncode == 1 and why in res.stderr, res.stderr


@needs_bash
def test_mount_script_refuses_sqlite_for_a_cluster(tmp_path: Path) -> None:
    res = _mount_sh({"META_URL": f"sqlite3://{tmp_path}/meta.db"}, "mount")
    assert res.returncode == 1 and "only one host" in res.stderr


@needs_bash
@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_launch_engines_needs_a_model_path(tmp_path: Path) -> None:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "NUM_ENGINES": "1",
           "LOG_DIR": str(tmp_path)}
    res = subprocess.run(["bash", str(DEPLOY / "sglang" / "launch_engines.sh")], env=env,
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 1 and "MODEL_PATH is not set" in res.stderr


def test_ray_cluster_config_matches_rays_schema() -> None:
    yaml = pytest.importorskip("yaml")
    jsonschema = pytest.importorskip("jsonschema")
    autoscaler = pytest.importorskip("ray.autoscaler")
    with open(DEPLOY / "ray" / "cluster.yaml", encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    with open(os.path.join(os.path.dirname(autoscaler.__file__), "ray-schema.json"),
              encoding="utf-8") as f:
        schema = json.load(f)
    jsonschema.validate(cfg, schema)
    assert cfg["provider"]["type"] == "local"
    assert any("mount.sh mount" in c for c in cfg["initialization_commands"])


@pytest.mark.parametrize("override", ["producer.budget.slots=\"x\"", "queue.group_size=-1",
                                      "placement.foo=1", "collector=3",
                                      "producer.engine.client.timeoutz=1",
                                      "producer.engine.workers=5", "producer.slots=2"])
def test_run_config_check_reports_a_typo_without_a_traceback(override: str) -> None:
    res = subprocess.run([sys.executable, str(DEPLOY / "examples" / "run_config.py"),
                          str(DEPLOY / "examples" / "run.json"), "--set", override, "--check"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 1
    assert res.stderr.startswith("error: ") and "Traceback" not in res.stderr


def _launch_producers() -> Any:
    spec = importlib.util.spec_from_file_location(
        "launch_producers_example", DEPLOY / "examples" / "launch_producers.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_launch_producers_never_guesses_between_ray_clusters() -> None:
    """A second Ray instance on the host makes 'auto' ambiguous: the launcher refuses and
    lists both instead of joining whichever started last."""
    choose = _launch_producers().choose_address
    two = ["10.0.0.1:6379", "10.0.0.1:6380"]
    with pytest.raises(ConfigError, match=r"2 Ray clusters run on this host \(10\.0\.0\.1:6379, "
                       r"10\.0\.0\.1:6380\); pass --address"):
        choose(None, None, two)
    with pytest.raises(ConfigError, match="no Ray cluster runs on this host"):
        choose(None, None, [])
    assert choose("h:1", "h:2", two) == "h:1"  # --address wins, then RAY_ADDRESS
    assert choose(None, "h:2", two) == "h:2"
    assert choose(None, None, ["h:3"]) == "h:3"
