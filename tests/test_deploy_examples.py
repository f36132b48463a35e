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

from strawq.app.run_config import RunConfig
from strawq.collector.config import CollectorConfig
from strawq.config import QueueConfig, from_dict
from strawq.errors import ConfigError
from strawq.producers.plugins import load_filter, load_reward
from strawq.producers.producer_config import ProducerConfig

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
    assert producer.engine.generation.context_length is not None
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


def test_the_printed_producer_section_has_no_silent_one_slot_default(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """run.json gives no producer.budget.slots: the printed section leaves the key out, so
    'strawq producer --config producer.json' derives the slots (--concurrency) or asks for
    them instead of running one slot; a value the config does give is kept."""
    spec = importlib.util.spec_from_file_location("run_config", DEPLOY / "examples" /
                                                  "run_config.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "run_config", mod)
    spec.loader.exec_module(mod)
    assert "slots" not in (_run_json()["producer"].get("budget") or {})
    assert mod.main([str(RUN_JSON), "--section", "producer"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert "slots" not in printed["budget"]
    assert ProducerConfig.from_dict({**printed, "run_dir": "r"}).budget.slots == 1  # the class
    assert mod.main([str(RUN_JSON), "--section", "producer", "--set",
                     "producer.budget.slots=6"]) == 0
    assert json.loads(capsys.readouterr().out)["budget"]["slots"] == 6


def test_declaration_example_loads_through_the_doctor() -> None:
    from strawq.doctor.declaration import load_declaration

    decl = load_declaration(str(DEPLOY / "juicefs" / "declaration.example.json"))
    assert decl["profile"] == "juicefs" and decl["writeback"] is False
    assert decl["open_cache"] == 0 and decl["readdir_cache"] is False


@pytest.mark.process
@needs_bash
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_shell_script_parses(script: Path) -> None:
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def _mount_sh(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    return subprocess.run(["bash", str(DEPLOY / "juicefs" / "mount.sh"), *args],
                          env=base | env, capture_output=True, text=True, timeout=30)


@pytest.mark.process
@needs_bash
def test_mount_script_refuses_to_run_without_meta_url() -> None:
    res = _mount_sh({}, "mount")
    assert res.returncode == 1 and "META_URL is not set" in res.stderr


@needs_bash
@pytest.mark.parametrize("opts, why", [("--writeback", "writeback"),
                                       ("--open-cache 5", "close-to-open"),
                                       ("--readdir-cache", "attr TTL"),
                                       ("--no-bgjob", "background job")])
@pytest.mark.process
def test_mount_script_refuses_options_that_break_the_contract(tmp_path: Path, opts: str,
                                                              why: str) -> None:
    res = _mount_sh({"META_URL": f"sqlite3://{tmp_path}/meta.db", "ALLOW_SQLITE": "1",
                     "JUICEFS": shutil.which("true") or "/bin/true",
                     "MOUNT_POINT": str(tmp_path / "mnt"), "CACHE_DIR": str(tmp_path / "c"),
                     "EXTRA_MOUNT_OPTS": opts}, "mount")
    assert res.returncode == 1 and why in res.stderr, res.stderr


@pytest.mark.process
@needs_bash
def test_mount_script_refuses_sqlite_for_a_cluster(tmp_path: Path) -> None:
    res = _mount_sh({"META_URL": f"sqlite3://{tmp_path}/meta.db"}, "mount")
    assert res.returncode == 1 and "only one host" in res.stderr


@pytest.mark.process
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
@pytest.mark.process
def test_run_config_check_reports_a_typo_without_a_traceback(override: str) -> None:
    res = subprocess.run([sys.executable, str(DEPLOY / "examples" / "run_config.py"),
                          str(DEPLOY / "examples" / "run.json"), "--set", override, "--check"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 1
    assert res.stderr.startswith("error: ") and "Traceback" not in res.stderr


# -- the trainer examples, run as a user runs them ---------------------------------------------
# A real run directory (``strawq init``), local sim engines (``strawq engine serve --kind
# sim``, optionally behind the mini router ``--kind router``), the collector and one producer
# as processes (``strawq collector``, ``strawq producer``: no Ray), then the example by its
# documented command line.

REPO = DEPLOY.parent
EXAMPLES = DEPLOY / "examples"
#: trained batches per example run; the Megatron run trains more than the placeholder push
#: allowed (the producers' engines stayed on version 0: every reply after the first update
#: was discarded, and the backlog ran out after a few steps)
STEPS = 3
MEGATRON_STEPS = 6


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}


def _strawq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "strawq", *args], capture_output=True,
                          text=True, timeout=120, env=_env(), cwd=str(REPO), check=False)


def _model_info(url: str) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(url + "/model_info", timeout=30) as resp:
        info: dict[str, Any] = json.loads(resp.read())
    return info


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


class LiveRun:
    """A run with producers live: engines (and a router), the collector, one producer.

    The collector collects nothing itself (``gc_interval_s`` is huge), so what is collected
    after the run is what ``strawq gc`` collects."""

    def __init__(self, tmp: Path, *, router: bool, engines: int = 2) -> None:
        from strawq.producers.engines.testing import EngineProcess

        self.tmp = tmp
        self.run_dir = str(tmp / "run")
        self.weights = str(tmp / "weights")
        self.use_router = router
        self.n_engines = engines
        self.engines: list[EngineProcess] = []
        self.router: EngineProcess | None = None
        self.procs: dict[str, subprocess.Popen[str]] = {}

    def __enter__(self) -> LiveRun:
        from strawq.producers.engines.testing import start_engine_subprocess

        try:
            self._start(start_engine_subprocess)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, start_engine: Any) -> None:
        data = self.tmp / "data.jsonl"
        data.write_text("".join(json.dumps({"prompt": [5 + i % 7, 6, 7], "count": 3 + i % 5,
                                            "eos": 2}) + "\n" for i in range(200)))
        res = _strawq("init", self.run_dir, "--set", "group_size=2", "--set", "fsync=false",
                      "--set", "lease_timeout_s=10", "--set", "heartbeat_interval_s=0.2",
                      "--set", "release_batch=8")
        assert res.returncode == 0, res.stderr
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.n_engines) as pool:  # they start side by side
            starts = [pool.submit(start_engine, "sim", time_scale=0.01, len_median=8,
                                  len_cap=24, max_running_requests=16)
                      for _ in range(self.n_engines)]
            errors: list[BaseException] = []
            for f in starts:  # every started one is kept, to be stopped
                try:
                    self.engines.append(f.result())
                except Exception as exc:  # noqa: BLE001 - raised below, after the others
                    errors.append(exc)
        if errors:
            raise errors[0]
        if self.use_router:
            self.router = start_engine("router", worker_urls=",".join(self.engine_urls))
        self._spawn("collector", "collector", self.run_dir, str(data),
                    "--set", "batch_groups=2", "--set", "max_running=4",
                    "--set", "max_ready=2", "--set", "max_prefetch_batches=1",
                    "--set", "poll_interval_s=0.02", "--set", "gc_interval_s=1e9")
        where = (["--router", self.router.url] if self.router is not None else
                 [a for u in self.engine_urls for a in ("--engine", u)])
        self._spawn("producer", "producer", self.run_dir, *where, "--reward",
                    "strawq.producers.rewards.count_task", "--slots", "4",
                    "--set", "sampling.max_new_tokens=16", "--set", "timing.idle_poll_s=0.02")

    @property
    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def endpoints(self) -> list[str]:
        """The example's flags naming where the weights go."""
        if self.router is not None:
            return ["--router-url", self.router.url]
        return [a for u in self.engine_urls for a in ("--engine-url", u)]

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.tmp / f"{name}.log", "w", encoding="utf-8")  # noqa: SIM115
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "strawq", *args], stdout=log, stderr=subprocess.STDOUT,
            text=True, env=_env(), cwd=str(REPO))
        log.close()

    def logs(self) -> str:
        return "\n".join(f"--- {n}.log ---\n{(self.tmp / f'{n}.log').read_text()[-3000:]}"
                         for n in self.procs)

    def example(self, script: str, *args: str, timeout: float = 240,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """``python deploy/examples/<script> RUN_DIR ARGS...`` (the producers must live on)."""
        res = subprocess.run([sys.executable, str(EXAMPLES / script), self.run_dir, *args],
                             capture_output=True, text=True, timeout=timeout,
                             env={**_env(), **(env or {})}, cwd=str(self.tmp), check=False)
        for name, proc in self.procs.items():
            assert proc.poll() is None, f"{name} exited {proc.returncode}\n{self.logs()}"
        return res

    def stop_producers(self) -> None:
        """SIGTERM, as systemd or Slurm stop them: each stops cleanly."""
        import signal

        for name in ("producer", "collector"):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def stop(self) -> None:
        self.stop_producers()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for eng in ([self.router] if self.router else []) + self.engines:
            eng.stop()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _batch_seqs(run_dir: str) -> tuple[list[int], set[int]]:
    from strawq.delivery.batches import BatchStore
    from strawq.storage import open_storage
    from strawq.tasks.queue import RunQueue

    seqs, acked = BatchStore(RunQueue.open(open_storage(run_dir, writer_id="test"))).batch_seqs()
    return sorted(seqs), set(acked)


def _assert_engines_on(live: LiveRun, version: int) -> None:
    for url in live.engine_urls:
        info = _model_info(url)
        assert info["weight_version"] == str(version), (url, info)
        assert info["model_path"] == os.path.join(live.weights, f"v{version:06d}"), (url, info)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_loop_through_the_router_commits_and_gc_collects_the_trained_batches(
        tmp_path: Path) -> None:
    from strawq.delivery.commits import committed_seq
    from strawq.storage import open_storage

    ckpt = tmp_path / "trainer_state.json"
    with LiveRun(tmp_path, router=True) as live:
        res = live.example("trainer_loop.py", *live.endpoints(), "--weights-dir",
                           live.weights, "--steps", str(STEPS), "--checkpoint", str(ckpt))
        assert res.returncode == 0, res.stderr[-3000:] + live.logs()
        _assert_engines_on(live, STEPS)  # every worker the router lists got each version
        live.stop_producers()
        assert json.loads(ckpt.read_text())["batch_seq"] == STEPS
        assert committed_seq(open_storage(live.run_dir, writer_id="test")) == STEPS
        seqs, acked = _batch_seqs(live.run_dir)
        assert set(range(1, STEPS + 1)) <= set(seqs) and acked == set(range(1, STEPS + 1))
        gc = _strawq("gc", live.run_dir, "--json")
        assert gc.returncode == 0, gc.stderr
        rep = json.loads(gc.stdout)
        # every trained batch goes, with its groups' payloads; a prefetched one stays
        assert rep["batches"] == STEPS and rep["group_payloads"] == 2 * STEPS, rep
        seqs, acked = _batch_seqs(live.run_dir)
        assert all(s > STEPS for s in seqs) and not acked


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_loop_pushes_to_a_list_of_engine_urls_without_a_router(tmp_path: Path) -> None:
    ckpt = tmp_path / "trainer_state.json"
    with LiveRun(tmp_path, router=False) as live:
        res = live.example("trainer_loop.py", *live.endpoints(), "--weights-dir",
                           live.weights, "--steps", str(STEPS), "--checkpoint", str(ckpt))
        assert res.returncode == 0, res.stderr[-3000:] + live.logs()
        _assert_engines_on(live, STEPS)
        assert json.loads(ckpt.read_text())["batch_seq"] == STEPS
        assert f"step {STEPS - 1}: batch {STEPS} " in res.stderr
        # restarted from its checkpoint: the restored weights go out first, as a new version
        res = live.example("trainer_loop.py", *live.endpoints(), "--weights-dir",
                           live.weights, "--steps", "1", "--checkpoint", str(ckpt))
        assert res.returncode == 0, res.stderr[-3000:] + live.logs()
        assert f"restored weights pushed to the engines as version {STEPS + 1}" in res.stderr
        assert f"step 0: batch {STEPS + 1} " in res.stderr
        _assert_engines_on(live, STEPS + 2)


@pytest.mark.process
def test_trainer_loop_needs_to_know_where_the_weights_go(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, str(EXAMPLES / "trainer_loop.py"), str(tmp_path),
                          "--weights-dir", str(tmp_path / "w")], capture_output=True,
                         text=True, timeout=120, env=_env(), cwd=str(tmp_path), check=False)
    assert res.returncode == 2 and "--router-url" in res.stderr and "--engine-url" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
@pytest.mark.megatron
@pytest.mark.timeout(400)
def test_megatron_toy_loop_pushes_real_weights_and_keeps_a_live_run_going(
        tmp_path: Path) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    torch = pytest.importorskip("torch")
    ckpt = tmp_path / "trainer_state.json"
    with LiveRun(tmp_path, router=False) as live:
        res = live.example("megatron_trainer_loop.py", "--toy", *live.endpoints(),
                           "--weights-dir", live.weights, "--steps", str(MEGATRON_STEPS),
                           "--max-tokens-per-gpu", "256", "--checkpoint", str(ckpt),
                           timeout=300, env={"MASTER_PORT": str(_free_port())})
        assert res.returncode == 0, res.stderr[-3000:] + live.logs()
        assert f"step {MEGATRON_STEPS - 1} batch {MEGATRON_STEPS}:" in res.stderr
        # the engines hold the loop's last version: the toy model's own weights
        _assert_engines_on(live, MEGATRON_STEPS)
        saved = torch.load(os.path.join(live.weights, f"v{MEGATRON_STEPS:06d}", "model.pt"),
                           weights_only=True)
        assert sorted(saved) == ["emb.weight", "out.bias", "out.weight"]
        assert json.loads(ckpt.read_text())["batch_seq"] == MEGATRON_STEPS

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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_verl_strawq_trainer_trains_what_the_producers_generate(tmp_path: Path) -> None:
    """strawq generates, verl trains: verl's ``fit`` with the shipped trainer class (its GPU
    parts CPU stand-ins) on the batches the producers generate on sim engines; each weight
    push goes to the engines with strawq's version, which the producers check."""
    pytest.importorskip("verl")
    from strawq.delivery.commits import committed_seq
    from strawq.storage import open_storage

    with LiveRun(tmp_path, router=False) as live:
        urls = [a for u in live.engine_urls for a in ("--engine-url", u)]
        res = live.example("verl_strawq_trainer.py", *urls, "--weights-dir", live.weights,
                           "--ckpt-dir", str(tmp_path / "ckpt"), "--steps", str(STEPS),
                           "--batch-groups", "2", "--group-size", "2", "--cpu-stand-ins")
        assert res.returncode == 0, res.stderr[-3000:] + live.logs()
        got = json.loads(res.stdout.strip().splitlines()[-1])
        assert got["steps"] == STEPS and got["samples"] == 2 * 2 * STEPS, got
        assert got["batches"] == list(range(1, STEPS + 1)) and got["version"] == STEPS
        _assert_engines_on(live, STEPS)  # every push told the engines strawq's version
        live.stop_producers()
        assert committed_seq(open_storage(live.run_dir, writer_id="test")) == STEPS
        _, acked = _batch_seqs(live.run_dir)
        assert set(range(1, STEPS + 1)) <= acked


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_slime_strawq_trainer_trains_what_the_producers_generate(tmp_path: Path) -> None:
    """strawq generates, slime trains: slime's loop with mode 2's flags (its Megatron and
    Ray parts CPU stand-ins) on the batches the producers generate on sim engines; each of
    slime's weight updates (one before the loop, one per rollout) reaches the engines with
    strawq's version, which the next rollout's ``generate_rollout`` announces."""
    pytest.importorskip("slime")
    from strawq.delivery.commits import committed_seq
    from strawq.storage import open_storage

    with LiveRun(tmp_path, router=False) as live:
        urls = [a for u in live.engine_urls for a in ("--engine-url", u)]
        res = live.example("slime_strawq_trainer.py", *urls, "--weights-dir", live.weights,
                           "--ckpt-dir", str(tmp_path / "ckpt"), "--steps", str(STEPS),
                           "--batch-groups", "2", "--group-size", "2", "--timeout", "120",
                           "--cpu-stand-ins")
        assert res.returncode == 0, res.stderr[-3000:] + live.logs()
        got = json.loads(res.stdout.strip().splitlines()[-1])
        assert got["steps"] == STEPS and got["samples"] == 2 * 2 * STEPS, got
        assert got["batches"] == list(range(1, STEPS + 1)), got
        assert got["version"] == STEPS + 1, got  # slime updates before its loop, then per rollout
        _assert_engines_on(live, STEPS + 1)
        assert committed_seq(open_storage(live.run_dir, writer_id="test")) == STEPS
        # a second job resumes from slime's checkpoint: the next batches, none again
        res = live.example("slime_strawq_trainer.py", *urls, "--weights-dir", live.weights,
                           "--ckpt-dir", str(tmp_path / "ckpt"), "--steps", str(STEPS + 1),
                           "--batch-groups", "2", "--group-size", "2", "--timeout", "120",
                           "--cpu-stand-ins")
        assert res.returncode == 0, res.stderr[-3000:] + live.logs()
        got = json.loads(res.stdout.strip().splitlines()[-1])
        assert got == {"steps": 1, "samples": 4, "batches": [STEPS + 1],
                       "version": STEPS + 3}, got
        _assert_engines_on(live, STEPS + 3)
        live.stop_producers()
        assert committed_seq(open_storage(live.run_dir, writer_id="test")) == STEPS + 1
        _, acked = _batch_seqs(live.run_dir)
        assert set(range(1, STEPS + 2)) <= acked
